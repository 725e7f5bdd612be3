"""Fixtures several test modules share; builders live in tests/helpers/."""

import json
import os
import tempfile

# Two test processes, and the ranks and commands they start, share the cores: OpenMP's
# threads (XGBoost's, torch's) sleep while they wait instead of spinning, or a fit whose peer
# thread lost its core waits out the other process's time slices (three of test_adapt's
# tests: about 20 s alone, 603 s beside two busy processes, 69 s with passive waits).
# Set before torch or XGBoost loads OpenMP; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The suite never reads nor writes the user's exported selector: ``Selector.load()`` and
# ``ficco export``'s default folder is one of its own (set before the runtime is imported).
os.environ["FICCO_SELECTOR"] = os.path.join(tempfile.mkdtemp(prefix="ficco-tests-"), "selector")

import numpy as np  # noqa: E402
import pytest
import torch

from ficco_select.executor import ranks
from ficco_select.hardware import load_hardware
from ficco_select.heuristic import backend_for
from ficco_select.runtime.loading import RULES_VERSION
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates
from helpers.ranks import PRELOAD

# Ranks talk over loopback; set before any process group starts.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# The suite starts about a hundred short jobs of ranks in its own processes: each forked
# from a server that imported torch once, not a fresh interpreter importing it again (about
# 2 s of CPU a rank). The ``ficco`` commands the tests run, and their ranks, start as users'
# do (``ficco_select.executor.ranks.START_METHOD``: spawn).
ranks.START_METHOD = "forkserver"
torch.multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


# An exported selector of a real XGBoost model, trained on the features of catalog scenarios
# (a regressor and a ranker): what the runtime and the layer tables are checked against.
@pytest.fixture(scope="module", params=["xgb-regressor", "xgb-ranker"])
def model_folder(request, tmp_path_factory):
    import xgboost as xgb

    from ficco_select.data.catalog import catalog
    from ficco_select.features import FEATURE_NAMES, FEATURE_SCHEMA_HASH, pair_features

    recs, scheds, hws = [], [], {}
    for name in ("mi300x-8", "h100-nvswitch", "l40s-pcie-8"):
        hws[name] = load_hardware(name)
        for r in catalog("full", hardware=name)[::4]:
            s = Scenario.from_record(r)
            for c in candidates(s, backend_for(hws[name]), hws[name]):
                recs.append(s.as_record())
                scheds.append(c)
    X = pair_features(recs, scheds, hws)
    col = {name: i for i, name in enumerate(FEATURE_NAMES)}
    y = (X[:, col["log2_piece_comm_est"]] * 0.3 - X[:, col["log2_piece_gemm_est"]] * 0.2
         + np.sin(X[:, col["log2_m"]]) * X[:, col["engine_dma"]] + 0.1 * X[:, col["degree"]])
    if request.param == "xgb-regressor":
        model = xgb.XGBRegressor(n_estimators=40, max_depth=6, random_state=0).fit(X, y)
    else:
        qid = np.cumsum([0] + [recs[i] != recs[i - 1] for i in range(1, len(recs))])
        rank = np.zeros(len(y), int)
        for q in np.unique(qid):  # relevance: 3 for the best quarter of a scenario's schedules, ...
            at = np.flatnonzero(qid == q)
            rank[at] = 3 - np.minimum(3, (4 * np.argsort(np.argsort(y[at]))) // len(at))
        model = xgb.XGBRanker(n_estimators=40, max_depth=6, random_state=0).fit(X, rank, qid=qid)
    folder = tmp_path_factory.mktemp(request.param)
    model.get_booster().save_model(folder / "model.json")
    meta = {"rules_version": RULES_VERSION, "selector": request.param, "feature_schema_hash": FEATURE_SCHEMA_HASH,
            "training_ranges": {"m": [1, 1 << 40], "n": [1, 1 << 40], "k": [1, 1 << 40], "world_size": [2, 64],
                                "hardware": sorted(hws)}}
    (folder / "selector.json").write_text(json.dumps(meta))
    return folder, model.get_booster(), request.param


@pytest.fixture(scope="module")
def model_selector(model_folder):
    sel = Selector.load(model_folder[0])
    assert sel.model is not None
    return sel


def pytest_collection_modifyitems(items):
    """Modules with end-to-end tests first, then those on real ranks, then the rest (each
    module's tests in their order). A worker runs one module at a time (``--dist loadscope``):
    a long module dealt out last would leave the other worker idle at the end."""
    def tier(item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("gloo") else 2

    module_tier: dict = {}
    for item in items:
        module_tier[item.module] = min(module_tier.get(item.module, 2), tier(item))
    items.sort(key=lambda item: module_tier[item.module])  # stable: a module's tests stay together, in order
