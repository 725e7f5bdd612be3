"""The runtime selector never raises and always returns a legal schedule (property test);
its caches; its model decisions equal scoring pair_features with XGBoost itself; an export
that gives a preset machine other numbers is not used."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ficco_select import Scenario, candidates
from ficco_select.features import FEATURE_NAMES, candidate_features
from ficco_select.hardware import load_hardware
from ficco_select.heuristic import backend_for
from ficco_select.runtime import policy as policy_module
from ficco_select.runtime import selector as selector_module
from ficco_select.runtime.selector import Selector
from ficco_select.schedule import BACKENDS, BASELINE, SHARD, legal_candidates
from helpers.exports import FULL_RANGES, PRESETS, RECORD, preference_model, spec_dict, warnings_of, write_selector

SEL = Selector.load("/nonexistent/selector/folder")  # heuristic only, after one warning

sizes = st.one_of(st.integers(-5, 1 << 20), st.sampled_from([0, 1, 2, 3, 7, 8, 4096, 1 << 31]),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.none())
records = st.fixed_dictionaries({
    "group": st.one_of(st.text(max_size=8), st.none()),
    "op": st.one_of(st.sampled_from(["ag_gemm", "gemm_rs", "a2a_gemm"]), st.text(max_size=6)),
    "m": sizes, "n": sizes, "k": sizes,
    "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "float16", "bf16"]), st.text(max_size=5)),
    "world_size": st.one_of(st.integers(-2, 1100), st.sampled_from([2, 3, 4, 8]), st.none()),
    "hardware": st.sampled_from(["cpu", "mi300x-8", "h100-nvswitch", "l40s-pcie-8", "tpu-v9", ""]),
    "imbalance": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.just(1.0)),
})


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(records)
def test_select_never_raises_and_returns_a_legal_schedule(record):
    check_decision(SEL, record)


def check_decision(sel: Selector, record) -> None:
    decision = sel.select(record)
    assert decision.source in ("model", "heuristic", "fallback")
    try:
        scenario = Scenario.from_record(record)
    except Exception:
        assert decision.source == "fallback" and decision.schedule.is_baseline
        return
    if decision.source == "fallback":
        assert decision.schedule.is_baseline
        return
    hw = load_hardware(scenario.hardware)
    legal = candidates(scenario, backend_for(hw))
    if legal:
        assert decision.schedule in legal, (record, decision)
    else:  # no schedule of the backend runs it (e.g. more ranks than the backend has): the plain baseline
        assert decision.schedule.is_baseline, (record, decision)
    assert math.isfinite(decision.confidence)


# -- the cache ------------------------------------------------------------------------------



def test_cache_finds_a_decision_by_object_by_value_and_by_record():
    sel = Selector.load("/nonexistent/selector/folder", layer_tables=False)  # decided directly
    s = Scenario.from_record(RECORD)
    first = sel.select(s)
    assert sel.select(s) is first
    assert sel.select(Scenario.from_record(RECORD)) is first  # an equal scenario, another object
    assert sel.select(dict(RECORD)) == first
    sel.clear_cache()
    again = sel.select(s)
    assert again == first and again is not first


@pytest.mark.parametrize("odd", [None, 3, "ag_gemm", [1, 2], {**RECORD, "m": [4096]}, {**RECORD, "k": {"a": 1}},
                                 {**RECORD, "world_size": float("nan")}, {}])
def test_odd_inputs_fall_back_without_raising(odd):
    sel = Selector.load("/nonexistent/selector/folder")
    for _ in range(2):  # the second call goes through whatever the first one cached
        decision = sel.select(odd)
        assert decision.source == "fallback" and decision.schedule.is_baseline


def test_a_full_cache_starts_over_and_decisions_stay_right(monkeypatch):
    from ficco_select.runtime import layers as layers_module

    monkeypatch.setattr(selector_module, "_TABLES_LIMIT", 2)
    monkeypatch.setattr(layers_module, "MEMO_LIMIT", 3)
    sel = Selector.load("/nonexistent/selector/folder", layer_tables=False)  # every m kept, no grid
    scenarios = [Scenario.from_record({**RECORD, "m": 8 * (i + 1), "n": n}) for n in (4096, 8192, 16384)
                 for i in range(10)]
    want = [Selector.load("/nonexistent/selector/folder").select(s) for s in scenarios]
    for _ in range(3):
        assert [sel.select(s) for s in scenarios] == want
        assert [sel.select(Scenario.from_record(s.as_record())) for s in scenarios] == want
    assert len(sel._tables) <= 2 and all(len(t.decided()) <= 3 for t in sel._tables.values())


def test_cached_candidate_lists_equal_candidates():
    from ficco_select.data.catalog import catalog

    for scale, hw in (("full", "h100-nvswitch"), ("cpu", "cpu")):
        for r in catalog(scale, hardware=hw)[::3]:
            s = Scenario.from_record(r)
            for backend in BACKENDS:
                assert list(legal_candidates(s, backend)) == candidates(s, backend)
    big = Scenario.from_record({**RECORD, "world_size": 2048, "m": 2048, "n": 2048})
    assert legal_candidates(big, "sim") == () and candidates(big, "sim") == []


def test_a_scenario_pickled_in_another_process_is_found_by_value():
    # str hashes differ between processes: a pickled scenario must not bring its hash along,
    # or an equal scenario here would never find it in a dict (nor the selector's cache).
    import copy
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    code = ("import pickle, sys; from ficco_select import Scenario; "
            f"s = Scenario.from_record({RECORD!r}); s.scenario_id; "
            "sys.stdout.buffer.write(pickle.dumps((s, hash(s))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    there, hash_there = pickle.loads(out)
    here = Scenario.from_record(RECORD)
    assert hash_there != hash(here), "same hash seed in both processes: nothing tested"
    assert there == here and hash(there) == hash(here) and there.scenario_id == here.scenario_id
    assert {there: 1}.get(here) == 1 and {here: 1}.get(there) == 1
    assert hash(copy.deepcopy(here)) == hash(copy.copy(here)) == hash(here)
    sel = Selector.load("/nonexistent/selector/folder")
    assert sel.select(there) is sel.select(here)  # found by value in the selector's cache


# -- decisions with a model: the same as scoring pair_features with XGBoost ------------------
def test_model_decisions_match_pair_features_scored_by_xgboost(model_folder):
    import xgboost as xgb

    from ficco_select.data.catalog import catalog
    from ficco_select.features import pair_features

    folder, booster, kind = model_folder
    sel = Selector.load(folder, layer_tables=False)  # the direct decision (tables: test_layer_tables.py)
    sources = set()
    for name in ("mi300x-8", "h100-nvswitch", "l40s-pcie-8"):
        hw = load_hardware(name)
        for r in catalog("full", hardware=name)[1::3]:
            s = Scenario.from_record(r)
            cands = candidates(s, backend_for(hw))
            X = pair_features([s.as_record()] * len(cands), cands, {name: hw})
            scores = booster.predict(xgb.DMatrix(X, missing=np.nan), output_margin=True).astype(float)
            if kind == "xgb-ranker":
                scores = -scores
            order = np.argsort(scores, kind="stable")
            margin = scores[order[1]] - scores[order[0]]
            if abs(margin - sel.rules.margin_rules["min_margin"]) < 1e-4 or margin < 1e-4:
                continue  # a float32 tie: either answer is right
            decision = sel.select(s)
            sources.add(decision.source)
            if margin < sel.rules.margin_rules["min_margin"]:
                assert decision.source == "heuristic"
            else:
                assert decision.source == "model" and decision.schedule == cands[order[0]], f"{s}"
                assert decision.confidence == pytest.approx(min(1.0, margin), abs=1e-4)
    assert "model" in sources


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(records)
def test_select_with_a_model_never_raises_and_returns_a_legal_schedule(model_selector, record):
    check_decision(model_selector, record)


# -- hand-made exported selectors: what load must refuse, where the model must abstain -----------
def test_a_hand_made_selector_decides_with_its_model(tmp_path):
    sel = Selector.load(write_selector(tmp_path / "sel"))
    d = sel.select(RECORD)
    assert d.source == "model" and d.schedule.name == "ficco.d8.a2a.gemm_per_step.m.dma"
    assert d.confidence == 0.125  # ag_gemm splits m only: the next best differs in its engine


def test_a_model_with_another_feature_count_is_refused_at_load(tmp_path, caplog):
    # Today's trees would index past the row with take(mode="wrap") and answer source=model.
    n = len(FEATURE_NAMES)
    folder = write_selector(tmp_path / "sel", preference_model(num_feature=n - 1))
    sel = Selector.load(folder)
    assert sel.model is None and sel.select(RECORD).source == "heuristic"
    [message] = warnings_of(caplog)
    assert f"num_feature is {n - 1}, but the runtime builds {n} features" in message


def test_a_corrupt_tree_is_refused_at_load(tmp_path, caplog):
    model = preference_model()
    n = len(FEATURE_NAMES)
    model["learner"]["gradient_booster"]["model"]["trees"][2]["split_indices"][0] = n
    sel = Selector.load(write_selector(tmp_path / "sel", model))
    assert sel.model is None and sel.select(RECORD).source == "heuristic"
    [message] = warnings_of(caplog)
    assert f"model.json: tree 2, node 0: split index {n} outside [0, num_feature={n})" in message


def test_a_nan_base_score_is_refused_at_load(tmp_path, caplog):
    # Today: every score NaN, the margin NaN, and source=model with confidence 1.0.
    sel = Selector.load(write_selector(tmp_path / "sel", preference_model(base_score="NaN")))
    assert sel.model is None
    [message] = warnings_of(caplog)
    assert "base_score is 'NaN', not a finite number" in message
    d = sel.select(RECORD)
    assert (d.source, d.reason, d.confidence) == ("heuristic", "no model", 0.0)


def test_a_non_finite_prediction_goes_to_the_heuristic(tmp_path):
    sel = Selector.load(write_selector(tmp_path / "sel"))
    sel.model.base_score = float("nan")  # what load refuses; a bug or a hand-edited model in memory
    d = sel.select(RECORD)
    assert d.source == "heuristic" and "non-finite" in d.reason and d.confidence == 0.0
    assert d.schedule == Selector().select(RECORD).schedule


MALFORMED_META = {  # name: (selector.json text, what the one warning must name)
    "invalid JSON": ('{"selector": "xgb-regressor",', "selector.json: not valid JSON"),
    "not an object": ("[1, 2]", "selector.json: expected a JSON object, got list"),
    "unknown selector": ({"selector": "xgb-classifier"}, "field 'selector' is 'xgb-classifier'"),
    "no selector": ({"selector": None}, "field 'selector' is None"),
    "ranges not an object": ({"training_ranges": [1, 2]}, "field 'training_ranges' must be an object"),
    "a range of one number": ({"training_ranges": {**FULL_RANGES, "m": [1]}}, "field 'training_ranges.m'"),
    "a range of strings": ({"training_ranges": {**FULL_RANGES, "k": ["1", "9"]}}, "field 'training_ranges.k'"),
    "a NaN bound": ({"training_ranges": {**FULL_RANGES, "n": [1, float("nan")]}}, "field 'training_ranges.n'"),
    "a bool bound": ({"training_ranges": {**FULL_RANGES, "world_size": [True, 8]}},
                     "field 'training_ranges.world_size'"),
    "low above high": ({"training_ranges": {**FULL_RANGES, "m": [9, 1]}}, "field 'training_ranges.m'"),
    "hardware a string": ({"training_ranges": {**FULL_RANGES, "hardware": "mi300x-8"}},
                          "field 'training_ranges.hardware' must be a non-empty list of strings"),
    "dtype not strings": ({"training_ranges": {**FULL_RANGES, "dtype": [2, 4]}}, "field 'training_ranges.dtype'"),
    "op empty": ({"training_ranges": {**FULL_RANGES, "op": []}}, "field 'training_ranges.op'"),
    "an unknown column": ({"training_ranges": {**FULL_RANGES, "tokens": [1, 2]}}, "field 'training_ranges.tokens'"),
    "a measured gpu that is not a name": ({"gpu_no_harm": {"split_us": 0, "small_margin": 0, "large_margin": 0,
                                                           "measured": [1]}}, "field 'gpu_no_harm.measured'"),
    "hardware_specs a list": ({"hardware_specs": [spec_dict("node-a")]}, "field 'hardware_specs' must be an object"),
    "a spec missing a field": ({"hardware_specs": {"node-a": {k: v for k, v in spec_dict("node-a").items()
                                                              if k != "devices"}}},
                               "hardware_specs['node-a']: field 'devices' is missing"),
    "a spec under another key": ({"hardware_specs": {"node-b": spec_dict("node-a")}},
                                 "hardware_specs['node-b']: field 'name' is 'node-a'"),
    "another feature schema": ({"feature_schema_hash": "0123456789ab"}, "field 'feature_schema_hash'"),
    "a rules file from before its version": ({"rules_version": None}, "field 'rules_version' is missing"),
    "an older rules version": ({"rules_version": 1}, "field 'rules_version' is 1, this runtime reads version"),
    "a rules version as text": ({"rules_version": "2"}, "field 'rules_version' is '2'"),
    "abstention a number": ({"abstention": 0.01}, "field 'abstention' must be an object"),
    "a negative margin": ({"abstention": {"min_margin": -1, "fallback": "heuristic"}}, "field 'abstention.min_margin'"),
    "a string margin": ({"abstention": {"min_margin": "0.1", "fallback": "heuristic"}},
                        "field 'abstention.min_margin'"),
    "an unknown fallback": ({"abstention": {"min_margin": 0.1, "fallback": "oracle"}}, "field 'abstention.fallback'"),
    "a fallback schedule without its engine": ({"abstention": {"min_margin": 0.1, "fallback": "shard.ring"}},
                                               "abstention.fallback' must be one of heuristic, baseline, cost_model or a schedule"),
    "abstention for an unknown kind": ({"abstention": {"min_margin": 0.1, "fallback": "heuristic",
                                                       "by_kind": {"tpu": {"min_margin": 0, "fallback": "heuristic"}}}},
                                       "field 'abstention.by_kind'"),
    "a kind's rule without a fallback": ({"abstention": {"min_margin": 0.1, "fallback": "heuristic",
                                                         "by_kind": {"gpu": {"min_margin": 0}}}},
                                         "field 'abstention.by_kind.gpu.fallback'"),
    "abstention for an unknown operator": ({"abstention": {"min_margin": 0.1, "fallback": "heuristic",
                                                           "by_op": {"gpu.gemm_xx": {"min_margin": 0, "fallback": "heuristic"}}}},
                                           "field 'abstention.by_op' must be an object keyed by '<kind>.<op>'"),
    "an operator's rule without a fallback": ({"abstention": {"min_margin": 0.1, "fallback": "heuristic",
                                                              "by_op": {"cpu.gemm_ar": {"min_margin": 0}}}},
                                              "field 'abstention.by_op.cpu.gemm_ar.fallback'"),
    "unseen hardware decided by nobody": ({"unseen_hardware": {"decide": "oracle"}}, "field 'unseen_hardware'"),
    "unseen hardware without kinds": ({"unseen_hardware": {"decide": "model"}}, "field 'unseen_hardware.kinds'"),
    "unseen hardware of an unknown kind": ({"unseen_hardware": {"decide": "model", "kinds": {"tpu": {}}}},
                                           "field 'unseen_hardware.kinds'"),
    "an unseen hardware range upside down": (
        {"unseen_hardware": {"decide": "model", "kinds": {"gpu": {
            "topologies": ["switch"], "spec_ranges": {"link_bw_gbps": [900, 100]}}}}},
        "field 'unseen_hardware.kinds.gpu.spec_ranges.link_bw_gbps'"),
    "any_topology not a bool": (
        {"unseen_hardware": {"decide": "model", "kinds": {"gpu": {
            "topologies": ["switch"], "any_topology": "yes", "spec_ranges": {}}}}},
        "field 'unseen_hardware.kinds.gpu.any_topology'"),
    "an unseen hardware range of a field not checked": (
        {"unseen_hardware": {"decide": "model", "kinds": {"gpu": {
            "topologies": ["switch"], "spec_ranges": {"tile_m": [1, 2]}}}}},
        "spec_ranges.tile_m' is not a spec field"),
}


@pytest.mark.parametrize("case", list(MALFORMED_META))
def test_a_malformed_selector_json_gives_a_heuristic_only_selector(case, tmp_path, caplog):
    # Today most of these load, and the exception inside the abstention check turns every
    # decision into the baseline (source fallback).
    meta, field = MALFORMED_META[case]
    folder = write_selector(tmp_path / "sel")
    if isinstance(meta, str):
        (folder / "selector.json").write_text(meta)
    else:
        write_selector(folder, **meta)
    sel = Selector.load(folder)
    assert sel.model is None
    [message] = warnings_of(caplog)
    assert field in message and "using the heuristic" in message
    d = sel.select(RECORD)
    assert d.source == "heuristic" and d.schedule == Selector().select(RECORD).schedule


def test_errors_while_checking_or_scoring_give_the_heuristic_not_the_baseline(tmp_path, monkeypatch, caplog):
    record = {"group": "gpt3", "op": "gemm_rs", "m": 16384, "n": 12288, "k": 49152, "dtype": "bfloat16",
              "world_size": 8, "hardware": "h100-nvswitch"}
    heuristic = Selector().select(record).schedule
    assert not heuristic.is_baseline, "the heuristic picks the baseline here: nothing tested"
    sel = Selector.load(write_selector(tmp_path / "sel"))
    monkeypatch.setattr(policy_module, "abstention_reason", lambda scope, s, hw: 1 / 0)
    d = sel.select(record)
    assert (d.schedule, d.source) == (heuristic, "heuristic") and "abstention check failed" in d.reason
    monkeypatch.undo()
    sel = Selector.load(write_selector(tmp_path / "sel"))

    def broken(X):
        raise IndexError("index 99 is out of bounds")

    monkeypatch.setattr(sel.model, "predict", broken)
    for m in (16384, 8192):
        d = sel.select({**record, "m": m})
        assert d.source == "heuristic" and "model failed" in d.reason and "out of bounds" in d.reason
        assert d.schedule == Selector().select({**record, "m": m}).schedule
    assert sum("model failed" in w for w in warnings_of(caplog)) == 1  # once per kind of error


def test_an_op_or_dtype_outside_training_goes_to_the_heuristic(tmp_path):
    # training_ranges records them; today only hardware and the numeric ranges were checked.
    ranges = {**FULL_RANGES, "dtype": ["float32"], "op": ["ag_gemm"]}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges))
    assert sel.select({**RECORD, "dtype": "float32"}).source == "model"
    d = sel.select(RECORD)  # bfloat16
    assert d.source == "heuristic" and d.reason.startswith("dtype bfloat16 not seen in training")
    d = sel.select({**RECORD, "dtype": "float32", "op": "gemm_rs"})
    assert d.source == "heuristic" and d.reason == "op gemm_rs not seen in training"


def test_a_dtype_outside_training_is_decided_where_its_features_lie_inside_the_trained_ranges(tmp_path):
    # Trained on float32 and bfloat16 of GPUs with peaks 150..1000 TFLOP/s: float16 (2 bytes,
    # mi300x-8's 1307 TFLOP/s) is outside the peaks, on h100-nvswitch (989 TFLOP/s) inside.
    ranges = {**FULL_RANGES, "hardware": [*FULL_RANGES["hardware"], "cpu"], "dtype": ["bfloat16", "float32"]}
    dtype_ranges = {"dtype_bytes": [2, 4], "peak_tflops": {"gpu": [150.0, 1000.0]}}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges, unseen_dtype=dtype_ranges))
    h100 = {**RECORD, "hardware": "h100-nvswitch"}
    d = sel.select({**h100, "dtype": "float16"})
    assert d.source == "model" and "dtype float16 not seen in training" in d.reason, d.reason
    d = sel.select({**RECORD, "dtype": "float16"})  # mi300x-8
    assert d.source == "heuristic" and "peak 1307.4 TFLOP/s on mi300x-8, outside" in d.reason, d.reason
    d = sel.select({**h100, "dtype": "float8_e4m3fn"})  # 1 byte per element
    assert d.source == "heuristic" and d.reason == ("dtype float8_e4m3fn not seen in training (1 bytes per "
                                                    "element, outside the trained [2, 4])"), d.reason
    d = sel.select({**h100, "dtype": "float16", "hardware": "cpu", "world_size": 2, "m": 64})
    assert d.source == "heuristic" and "no trained cpu machine" in d.reason, d.reason
    # Without the ranges in selector.json, an unseen dtype stays with the heuristic.
    bare = Selector.load(write_selector(tmp_path / "bare", training_ranges=ranges))
    assert bare.select({**h100, "dtype": "float16"}).source == "heuristic"


def test_a_world_size_above_the_spec_s_devices_runs_the_baseline(tmp_path, caplog):
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges={**FULL_RANGES, "world_size": [2, 64]}))
    for m in (4096, 8192, 16384):
        d = sel.select({**RECORD, "world_size": 16, "m": m})  # mi300x-8: 8 devices in one node
        assert d.schedule.is_baseline and d.source == "fallback"
        assert d.reason == "world_size 16 exceeds the 8 devices of mi300x-8 (a spec describes one node)"
    d = Selector().select({**RECORD, "world_size": 16, "hardware": "h100-nvswitch"})
    assert d.source == "fallback" and "8 devices of h100-nvswitch" in d.reason
    assert sum("exceeds" in w for w in warnings_of(caplog)) == 2  # once per hardware
    assert sel.select(RECORD).source == "model"
    # cpu ranks are processes, not devices (the datasets' rule too: schedule.hardware_problem)
    cpu = {**RECORD, "m": 64, "n": 64, "k": 64, "dtype": "float32", "world_size": 4, "hardware": "cpu"}
    assert load_hardware("cpu").devices < 4 and Selector().select(cpu).source == "heuristic"


def test_a_bool_in_a_record_does_not_share_a_cache_entry_with_the_number():
    # True == 1 == 1.0 as dict keys, but a scenario column refuses True: the two records
    # must not find each other's decision, in either order.
    for first, then in (({**RECORD, "imbalance": True}, RECORD), (RECORD, {**RECORD, "imbalance": True})):
        sel = Selector()
        sel.select(first)
        d = sel.select(then)
        want = "fallback" if then["imbalance"] is True else "heuristic"
        assert d.source == want, d.reason
    sel = Selector()
    a2a = {**RECORD, "op": "a2a_gemm", "m": 1}  # m = 1 is a valid a2a_gemm (no divisibility)
    assert sel.select({**a2a, "m": True}).source == "fallback" and sel.select(a2a).source == "heuristic"


def test_hardware_specs_in_selector_json_name_machines_for_this_selector_only(tmp_path):
    from ficco_select.hardware import HardwareError

    name = f"node-{tmp_path.name[-12:]}"
    ranges = {**FULL_RANGES, "hardware": [name]}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges,
                                       hardware_specs={name: spec_dict(name, devices=4)}))
    assert sel.model is not None
    d = sel.select({**RECORD, "hardware": name, "world_size": 4})
    assert d.source == "model" and d.schedule in candidates(Scenario.from_record({**RECORD, "world_size": 4}), "sim")
    d = sel.select({**RECORD, "hardware": name, "world_size": 8})  # its spec says 4 devices
    assert d.source == "fallback" and "the 4 devices of " + name in d.reason
    with pytest.raises(HardwareError, match="unknown hardware"):
        load_hardware(name)  # not registered for the rest of the process
    assert Selector().select({**RECORD, "hardware": name}).reason == f"unknown hardware {name!r}"


# -- an export that redefines a preset machine -----------------------------------------------
CPU_SCENARIOS = [{"group": "t", "op": op, "m": 256, "n": 256, "k": 256, "dtype": "float32", "world_size": 2,
                  "hardware": "cpu", "imbalance": 1.0}
                 for op in ("ag_gemm", "gemm_rs", "gemm_ar", "a2a_gemm", "gemm_a2a")]


def test_an_export_giving_the_cpu_preset_gpu_numbers_never_makes_select_pick_a_gpu_schedule(tmp_path, caplog):
    ranges = {**FULL_RANGES, "hardware": ["cpu"], "op": sorted({r["op"] for r in CPU_SCENARIOS})}
    folder = write_selector(tmp_path / "sel", training_ranges=ranges,
                            hardware_specs={"cpu": spec_dict("cpu")})  # mi300x-8's numbers, dma engines and all
    sel = Selector.load(folder)
    for record in CPU_SCENARIOS:
        d = sel.select(record)
        legal = candidates(Scenario.from_record(record), "cpu")
        assert d.schedule in legal and d.schedule.engine != "dma", (record["op"], d)
    assert sel.model is None, "the export was used"
    [warning] = warnings_of(caplog)
    assert "hardware_specs['cpu']" in warning and "preset" in warning, warning
    # The preset's own numbers under its name are no contradiction: that export is used.
    same = write_selector(tmp_path / "same", training_ranges=ranges,
                          hardware_specs={"cpu": dataclasses.asdict(load_hardware("cpu"))})
    assert Selector.load(same).model is not None


def test_a_spec_file_is_decided_under_the_machine_s_name(tmp_path):
    import yaml

    name = f"box-{tmp_path.name[-12:]}"
    path = tmp_path / "box.yaml"
    path.write_text(yaml.safe_dump(spec_dict(name)))
    trained = Selector.load(write_selector(tmp_path / "trained", training_ranges={**FULL_RANGES,
                                                                                  "hardware": [*PRESETS, name]}))
    d = trained.select({**RECORD, "hardware": str(path)})
    assert d.source == "model", d.reason  # today: "hardware /.../box.yaml not seen in training"
    from ficco_select.hardware import load_hardware, machines

    with machines([load_hardware(path)], str(path)):  # a job that knows the machine by its name
        assert d == trained.select({**RECORD, "hardware": name})
    other = Selector.load(write_selector(tmp_path / "other"))
    d = other.select(Scenario.from_record({**RECORD, "hardware": str(path)}))
    assert d.source == "heuristic" and d.reason == f"hardware {name} not seen in training"
    # the model carries a spec of that name with other numbers: not the machine it was trained on
    ranges = {**FULL_RANGES, "hardware": [name]}
    differs = Selector.load(write_selector(tmp_path / "differs", training_ranges=ranges,
                                           hardware_specs={name: spec_dict(name, link_bw_gbps=1)}))
    d = differs.select({**RECORD, "hardware": str(path)})
    assert d.source == "heuristic" and "differs from the one seen in training" in d.reason


def test_the_exports_fitted_abstention_rule_decides_where_the_model_abstains(tmp_path):
    # The rule fitted at training (ficco_select.train.shipped.fit_abstention) travels in selector.json.
    trusted = Selector.load(write_selector(tmp_path / "a", abstention={"min_margin": 0.0, "fallback": "baseline"}))
    d = trusted.select(RECORD)
    assert d.source == "model" and trusted.rules.margin_rules["min_margin"] == 0.0
    never = Selector.load(write_selector(tmp_path / "b", abstention={"min_margin": None, "fallback": "baseline"}))
    d = never.select(RECORD)
    assert d.source == "fallback" and d.schedule == BASELINE and "never trusts the model" in d.reason
    high = Selector.load(write_selector(tmp_path / "c", abstention={"min_margin": 1e9, "fallback": "heuristic"}))
    d = high.select(RECORD)
    assert d.source == "heuristic" and "below 1000000000" in d.reason
    # A rule per kind of machine wins over the pooled one for that kind.
    by_kind = {"min_margin": None, "fallback": "baseline",
               "by_kind": {"gpu": {"min_margin": 0.0, "fallback": "heuristic"}}}
    sel = Selector.load(write_selector(tmp_path / "d", abstention=by_kind,
                                       training_ranges={**FULL_RANGES, "hardware": [*PRESETS, "cpu"]}))
    assert sel.select(RECORD).source == "model"  # mi300x-8: a gpu, its own rule trusts the model
    cpu = {**RECORD, "m": 64, "n": 64, "k": 64, "dtype": "float32", "world_size": 2, "hardware": "cpu"}
    d = sel.select(cpu)  # the pooled rule: never trust, run the baseline
    assert d.source == "fallback" and d.schedule == BASELINE and "never trusts the model" in d.reason
    trusting = Selector.load(write_selector(tmp_path / "t", abstention={"min_margin": 0.0, "fallback": "baseline"},
                                            training_ranges={**FULL_RANGES, "hardware": [*PRESETS, "cpu"]}))
    assert trusting.select(cpu).source == "model"
    # A rule per operator on a kind wins over the kind's and the pooled one, for that operator only.
    by_op = {**by_kind, "by_op": {f"gpu.{RECORD['op']}": {"min_margin": None, "fallback": "baseline"}}}
    sel = Selector.load(write_selector(tmp_path / "e", abstention=by_op,
                                       training_ranges={**FULL_RANGES, "hardware": [*PRESETS, "cpu"]}))
    d = sel.select(RECORD)
    assert d.source == "fallback" and d.schedule == BASELINE and "never trusts the model" in d.reason
    other = "gemm_rs" if RECORD["op"] != "gemm_rs" else "ag_gemm"
    assert sel.select({**RECORD, "op": other}).source == "model"  # the gpu rule


def test_a_fixed_rule_fallback_runs_its_schedule_where_legal_else_the_baseline(tmp_path):
    fixed = Selector.load(write_selector(tmp_path / "a", abstention={"min_margin": None, "fallback": "shard.ring.sm"}))
    d = fixed.select(RECORD)
    assert d.source == "fallback" and d.schedule == SHARD and "the fitted fallback for low_margin is shard.ring.sm" in d.reason
    # A schedule the scenario cannot run (degree 16 on 8 ranks): the baseline, saying why.
    absent = "ficco.d16.ring.gemm_per_piece.m.sm"
    d = Selector.load(write_selector(tmp_path / "b", abstention={"min_margin": None, "fallback": absent})).select(RECORD)
    assert d.source == "fallback" and d.schedule == BASELINE and f"{absent}, is not legal here" in d.reason
    # Gated: of the ring and the baseline, the one the model predicts faster.
    gated = Selector.load(write_selector(tmp_path / "g", abstention={"min_margin": None, "fallback": "gated:shard.ring.sm"}))
    s, hw = Scenario.from_record(RECORD), load_hardware(RECORD["hardware"])
    cands = list(candidates(s, backend_for(hw)))
    scores = gated.model.predict(candidate_features(s, cands, hw))
    faster = SHARD if scores[cands.index(SHARD)] < scores[cands.index(BASELINE)] else BASELINE
    d = gated.select(RECORD)
    assert d.source == "fallback" and d.schedule == faster and "gated:shard.ring.sm" in d.reason


def test_an_unseen_machine_inside_the_trained_spec_ranges_is_decided_by_the_model(tmp_path):
    # The export's unseen_hardware rule (ficco_select.train.shipped.fit_unseen_hardware): fitted on
    # machines held out at training; mi300x-8 was not trained on, but its numbers lie
    # inside the trained machines' ranges (here: exactly on them).
    import yaml

    from ficco_select.runtime.scope import SPEC_RANGE_FIELDS, spec_value

    mi300x = load_hardware("mi300x-8")
    ranges = {f: [spec_value(mi300x, f)] * 2 for f in SPEC_RANGE_FIELDS}
    rule = {"decide": "model", "kinds": {"gpu": {"topologies": [mi300x.topology], "spec_ranges": ranges}}}
    trained_on = {**FULL_RANGES, "hardware": ["h100-nvswitch"]}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=trained_on, unseen_hardware=rule))
    d = sel.select(RECORD)
    assert d.source == "model" and "mi300x-8 not seen in training: inside the trained machines' spec ranges" in d.reason
    trusting = Selector.load(write_selector(tmp_path / "t", abstention={"min_margin": 0.0, "fallback": "heuristic"}))
    assert d.schedule == trusting.select(RECORD).schedule
    assert sel.select({**RECORD, "hardware": "h100-nvswitch"}).reason == ""  # a trained machine: no note
    # Outside a range, another topology, another backend: the heuristic, saying which.
    faster = tmp_path / "faster.yaml"
    faster.write_text(yaml.safe_dump(spec_dict(f"fast-{tmp_path.name[-8:]}", link_bw_gbps=2 * mi300x.link_bw_gbps)))
    d = sel.select({**RECORD, "hardware": str(faster)})
    assert d.source == "heuristic" and f"link_bw_gbps={2 * mi300x.link_bw_gbps:g} outside the trained" in d.reason
    switched = tmp_path / "switched.yaml"
    switched.write_text(yaml.safe_dump(spec_dict(f"sw-{tmp_path.name[-8:]}", topology="switch")))
    d = sel.select({**RECORD, "hardware": str(switched)})
    assert d.source == "heuristic" and "not seen in training (topology switch not seen in training)" in d.reason
    # ...unless the validation held out a machine whose topology its training half lacked.
    anywhere = {"decide": "model", "kinds": {"gpu": {**rule["kinds"]["gpu"], "any_topology": True}}}
    sel_any = Selector.load(write_selector(tmp_path / "any", training_ranges=trained_on, unseen_hardware=anywhere))
    assert sel_any.select({**RECORD, "hardware": str(switched)}).source == "model"
    cpu = {**RECORD, "m": 64, "n": 64, "k": 64, "dtype": "float32", "world_size": 2, "hardware": "cpu"}
    d = sel.select(cpu)
    assert d.source == "heuristic" and "no trained cpu machine" in d.reason
    # A rule that keeps unseen machines on the heuristic (the held-out machines did not show the model ahead).
    keep = Selector.load(write_selector(tmp_path / "keep", training_ranges=trained_on,
                                        unseen_hardware={"decide": "heuristic"}))
    d = keep.select(RECORD)
    assert d.source == "heuristic" and d.reason == "hardware mi300x-8 not seen in training"


def test_an_unseen_machine_is_held_to_the_peak_range_of_the_scenarios_dtype_only(tmp_path):
    # The features read one peak, the scenario's dtype's (float32's where the spec has no
    # other): a machine whose fp32 rate lies outside the trained range is still inside for
    # a bfloat16 scenario.
    from ficco_select.runtime.scope import SPEC_RANGE_FIELDS, spec_value

    mi300x = load_hardware("mi300x-8")
    ranges = {f: [spec_value(mi300x, f)] * 2 for f in SPEC_RANGE_FIELDS}
    ranges["peak_tflops.float32"] = [2 * mi300x.peak_tflops["float32"]] * 2
    ranges["peak_tflops.bfloat16"] = [mi300x.peak_tflops["bfloat16"]] * 2
    rule = {"decide": "model", "kinds": {"gpu": {"topologies": [mi300x.topology], "spec_ranges": ranges}}}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges={**FULL_RANGES, "hardware": ["h100-nvswitch"]},
                                       unseen_hardware=rule))
    assert sel.select({**RECORD, "dtype": "bfloat16"}).source == "model"
    d = sel.select({**RECORD, "dtype": "float32"})
    assert d.source == "heuristic" and "peak_tflops.float32=163.4 outside" in d.reason


def test_a_validated_range_slack_lets_the_model_decide_just_outside_the_training_ranges(tmp_path):
    ranges = {**FULL_RANGES, "n": [1024, 8192], "k": [1024, 8192]}
    rule = {"min_margin": 0.0, "fallback": "heuristic", "range_slack": {"gpu": {"n": 2.0}}}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges, abstention=rule))
    inside, twice, beyond = ({**RECORD, "n": n, "k": 4096} for n in (8192, 16384, 32768))
    assert sel.select(inside).source == "model" and sel.select(twice).source == "model"
    d = sel.select(beyond)
    assert d.source == "heuristic" and d.reason == "n=32768 outside the training range [1024, 8192], widened x2 by validation"
    d = sel.select({**RECORD, "n": 4096, "k": 16384})  # k has no slack
    assert d.source == "heuristic" and d.reason == "k=16384 outside the training range [1024, 8192]"
    for bad in ({"gpu": {"n": 0.5}}, {"gpu": {"dtype": 2}}, {"tpu": {"n": 2}}, ["n"]):
        folder = write_selector(tmp_path / "bad", training_ranges=ranges, abstention={**rule, "range_slack": bad})
        assert Selector.load(folder).model is None  # refused at load, naming the field


def test_each_abstention_reason_runs_the_fallback_validation_chose_for_it(tmp_path):
    # abstention.by_reason (ficco_select.train.shipped: fitted on validation folds and held-out machines):
    # per reason and kind of machine (any: every kind without its own), what runs where the
    # model may not decide. Hand-made: each reason sends to a different fallback.
    import yaml

    from ficco_select.heuristic import choose
    from ficco_select.runtime.scope import SPEC_RANGE_FIELDS, spec_value

    mi300x = load_hardware("mi300x-8")
    ranges = {**FULL_RANGES, "m": [1024, 8192], "n": [1024, 16384], "hardware": ["h100-nvswitch"]}
    within = {f: [spec_value(mi300x, f)] * 2 for f in SPEC_RANGE_FIELDS}
    unseen = {"decide": "model", "kinds": {"gpu": {"topologies": [mi300x.topology], "spec_ranges": within}}}
    by_reason = {"shape_range": {"gpu": "baseline", "any": "shard.ring.sm"},
                 "unseen_machine": {"gpu": "shard.ring.dma", "any": "baseline"}}
    rule = {"min_margin": 0.0, "fallback": "heuristic", "by_reason": by_reason}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges, abstention=rule, unseen_hardware=unseen))
    h100 = {**RECORD, "hardware": "h100-nvswitch", "m": 4096, "n": 8192}
    assert sel.select(h100).source == "model" and sel.select(h100).abstained == ""
    for outside in ({"m": 65536}, {"n": 65536}):  # a shape outside: the gpu's own choice, the baseline
        d = sel.select({**h100, **outside})
        assert (d.source, d.schedule, d.abstained) == ("fallback", BASELINE, "shape_range")
        assert "the fitted fallback for shape_range is the baseline" in d.reason
    faster = tmp_path / "faster.yaml"  # an unseen machine outside the trained spec ranges
    faster.write_text(yaml.safe_dump(spec_dict("fast-one", link_bw_gbps=2 * mi300x.link_bw_gbps)))
    d = sel.select({**h100, "hardware": str(faster)})
    assert (d.source, d.schedule.name, d.abstained) == ("fallback", "shard.ring.dma", "unseen_machine")
    cpu = {**RECORD, "m": 64, "n": 64, "k": 64, "dtype": "float32", "world_size": 2, "hardware": "cpu"}
    d = sel.select({**cpu, "m": 2048, "n": 2048, "k": 2048})  # no trained cpu machine: unseen, any kind's choice
    assert (d.source, d.schedule, d.abstained) == ("fallback", BASELINE, "unseen_machine")
    cpu_outside = Selector.load(write_selector(tmp_path / "cpu-out", abstention=rule,
                                               training_ranges={**ranges, "hardware": ["cpu"], "m": [1, 64]}))
    d = cpu_outside.select({**cpu, "m": 4096})  # outside on a kind without its own choice: any kind's, a fixed rule
    assert (d.source, d.schedule, d.abstained) == ("fallback", SHARD, "shape_range")
    # A fixed rule the scenario cannot run: the baseline, saying so (dma on the cpu backend).
    only_dma = {**rule, "by_reason": {"unseen_machine": {"cpu": "shard.ring.dma"}}}
    d = Selector.load(write_selector(tmp_path / "dma", training_ranges=ranges, abstention=only_dma)).select(
        {**cpu, "m": 2048, "n": 2048, "k": 2048})
    assert d.schedule == BASELINE and "shard.ring.dma, is not legal here, so the baseline" in d.reason
    # A reason without an entry for its kind or any: the heuristic (here m outside on a cpu
    # machine the model was trained on).
    gpu_only = {**rule, "by_reason": {"shape_range": {"gpu": "baseline"}}}
    cpu_trained = Selector.load(write_selector(tmp_path / "cpu", abstention=gpu_only,
                                               training_ranges={**ranges, "hardware": ["cpu"], "m": [1, 64]}))
    d = cpu_trained.select({**cpu, "m": 4096})
    s = Scenario.from_record({**cpu, "m": 4096})
    assert (d.source, d.schedule, d.abstained) == ("heuristic", choose(s, load_hardware("cpu")), "shape_range")
    # A low margin keeps its own rules; an op not seen in training is 'other': the heuristic.
    never = Selector.load(write_selector(tmp_path / "never", training_ranges=ranges,
                                         abstention={**rule, "min_margin": None, "fallback": "baseline"}))
    assert never.select(h100).abstained == "low_margin"
    d = sel.select({**h100, "op": "gemm_ar"})
    assert (d.source, d.abstained) == ("heuristic", "other")
    # Checked at load: an unknown reason, kind or fallback (gated fallbacks need the scores
    # the abstention distrusts) refuses the model, naming the field.
    for bad in ({"low_margin": {"any": "baseline"}}, {"m_range": {"gpu": "baseline"}}, {"shape_range": {"tpu": "baseline"}},
                {"shape_range": {"gpu": "gated:shard.ring.sm"}}, {"shape_range": {"gpu": "fastest"}},
                {"shape_range": "baseline"}):
        folder = write_selector(tmp_path / "bad", training_ranges=ranges, abstention={**rule, "by_reason": bad})
        assert Selector.load(folder).model is None


@pytest.mark.parametrize("hostile", ["fifo", "device", "huge"])
def test_a_hostile_selector_json_gives_a_heuristic_only_selector_without_blocking_or_flooding(hostile, tmp_path):
    # A FIFO would block an open-and-read forever; /dev/zero never ends; a sparse file of
    # 600 MiB would be read whole. Each is refused before a byte is read.
    import os
    import threading

    folder = write_selector(tmp_path / "sel")
    meta = folder / "selector.json"
    meta.unlink()
    if hostile == "fifo":
        os.mkfifo(meta)
    elif hostile == "device":
        meta.symlink_to("/dev/zero")
    else:
        with open(meta, "wb") as f:
            f.truncate(600 << 20)
    got = []
    worker = threading.Thread(target=lambda: got.append(Selector.load(folder)), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "Selector.load blocked"
    assert got[0].model is None
    from ficco_select.runtime.trees import read_json
    with pytest.raises(ValueError, match="not a regular file|over the"):
        read_json(meta, "selector")


def test_a_cost_model_fallback_runs_the_simulators_pick_judged_by_the_gpu_rule(tmp_path):
    # abstention.by_reason may name "cost_model": the calibrated simulator's fastest legal
    # schedule on the machine's spec. On a GPU the do-no-harm rule then judges it like any
    # overlap pick; on a cpu machine it stands.
    import numpy as np

    from ficco_select.runtime.no_harm import cost_model_pick, predicted_gains
    from ficco_select.schedule import legal_candidates

    ranges = {**FULL_RANGES, "m": [1024, 8192], "hardware": ["h100-nvswitch", "cpu"]}
    rule = {"min_margin": 0.0, "fallback": "heuristic", "by_reason": {"shape_range": {"any": "cost_model"}}}
    h100 = {**RECORD, "hardware": "h100-nvswitch", "m": 65536, "n": 28672}
    s, hw = Scenario.from_record(h100), load_hardware("h100-nvswitch")
    cands = legal_candidates(s, "cuda")
    expected = cost_model_pick(s, hw, cands)
    _, gains = predicted_gains([s] * len(cands), hw, cands)
    assert expected == cands[int(np.argmax(gains))] and not expected.is_baseline  # overlap pays here
    free = Selector.load(write_selector(tmp_path / "free", training_ranges=ranges, abstention=rule))
    d = free.select(h100)
    assert (d.source, d.schedule, d.abstained) == ("cost_model", expected, "shape_range")
    assert "the fitted fallback for shape_range is the cost model" in d.reason
    # Under a do-no-harm margin no simulated gain reaches, the GPU runs the baseline, still
    # counted under the reason the model abstained for.
    strict = Selector.load(write_selector(tmp_path / "strict", training_ranges=ranges, abstention=rule,
                                          gpu_no_harm={"split_us": 0.0, "small_margin": 0.0, "large_margin": 5.0}))
    d = strict.select(h100)
    assert (d.schedule, d.abstained) == (BASELINE, "shape_range") and "no harm" in d.reason
    # A cpu machine is left alone by the rule: the cost model's pick on the cpu spec stands.
    cpu = {**RECORD, "m": 65536, "n": 64, "k": 64, "dtype": "float32", "world_size": 2, "hardware": "cpu"}
    d = strict.select(cpu)
    c = Scenario.from_record(cpu)
    assert (d.source, d.schedule) == ("cost_model", cost_model_pick(c, load_hardware("cpu"), legal_candidates(c, "cpu")))
    # The low-margin rule may name it too.
    never = Selector.load(write_selector(tmp_path / "never", training_ranges={**ranges, "m": [1, 1 << 40]},
                                         abstention={"min_margin": None, "fallback": "cost_model"}))
    d = never.select(h100)
    assert (d.source, d.schedule, d.abstained) == ("cost_model", expected, "low_margin")


# -- a job's machines: a selector knows one for the job's duration, by its numbers -------------
JOB_RECORD = {**RECORD, "hardware": "node-job"}
JOB_MS = (1024, 2048, 4096, 8192)  # a layer met at several m: decided from its table


def _job_machine(**fields):
    from ficco_select.hardware import spec_from_dict

    return spec_from_dict(spec_dict("node-job", **fields), "a test")


def _every_door(sel: Selector, record: dict) -> list:
    """`record` asked through a fresh dict, a fresh Scenario, the same Scenario twice and its
    layer's m, as a long-lived caller asks."""
    s = Scenario.from_record(record)
    return [sel.select(dict(record)), sel.select(Scenario.from_record(record)), sel.select(s), sel.select(s),
            *(sel.select({**record, "m": m}) for m in JOB_MS),
            *(sel.select(Scenario.from_record({**record, "m": m})) for m in JOB_MS)]


def test_a_long_lived_selector_forgets_a_job_s_machine_when_the_job_ends():
    from ficco_select.hardware import machines

    sel = Selector()
    with machines([_job_machine()], "node-job.yaml"):
        inside = _every_door(sel, JOB_RECORD)
        assert {d.source for d in inside} == {"heuristic"}
        assert sel.layer_table(Scenario.from_record(JOB_RECORD)) is not None
    after = _every_door(sel, JOB_RECORD)
    assert {(d.source, d.reason) for d in after} == {("fallback", "unknown hardware 'node-job'")}
    assert sel.machine("node-job") is None and sel.layer_table(Scenario.from_record(JOB_RECORD)) is None


def test_a_later_job_naming_the_machine_with_other_numbers_gets_a_fresh_selector_s_answers():
    from ficco_select.hardware import machines

    fast = _job_machine()
    slow = _job_machine(link_bw_gbps=fast.link_bw_gbps / 50)
    long_lived = Selector()
    with machines([fast]):
        before = _every_door(long_lived, JOB_RECORD)
    with machines([slow]):
        fresh = _every_door(Selector(), JOB_RECORD)
        assert [d.schedule for d in fresh] != [d.schedule for d in before]  # the links' numbers change the answer
        assert _every_door(long_lived, JOB_RECORD) == fresh
        assert long_lived.machine("node-job") == slow
    with machines([fast]):  # the first machine again: its own answers, not the second's
        assert _every_door(long_lived, JOB_RECORD) == before


def test_a_miss_where_the_machine_is_unknown_does_not_stay_for_the_job_that_knows_it():
    import threading

    from ficco_select.hardware import machines

    sel, missed = Selector(), []
    thread = threading.Thread(target=lambda: missed.extend(_every_door(sel, JOB_RECORD)))  # before any job
    thread.start()
    thread.join()
    assert {d.reason for d in missed} == {"unknown hardware 'node-job'"}
    with machines([_job_machine()]):
        assert {d.source for d in _every_door(sel, JOB_RECORD)} == {"heuristic"}


def test_the_runtime_s_plans_and_tables_for_a_job_s_machine_go_with_the_job():
    # The torch ops keep a plan per call shape and a table per layer (dispatch): what they
    # decided for a job's machine goes when its block ends; the cpu's stays.
    from ficco_select.hardware import machines
    from ficco_select.runtime import dispatch
    from ficco_select.runtime.decision import Decision

    dispatch.reset()
    job_call, cpu_call = Scenario.from_record(JOB_RECORD), Scenario.from_record({**JOB_RECORD, "hardware": "cpu"})
    class Group:  # a stand-in group: a context keeps a weak reference to its group
        group_name = "group"

    group = Group()
    ctx = dispatch.context(group)  # a group's context, found by its name
    try:
        with machines([_job_machine()], "node-job.yaml"):
            for scenario in (job_call, cpu_call):
                key = (scenario.scenario_id,)
                ctx.plans.put(key, dispatch.Plan(scenario, Decision(BASELINE, "heuristic", 1.0, ""), True))
                ctx.tables.put(key, (scenario, Selector().layer_table(scenario)))
            assert len(dispatch.plans()) == 2 and len(dispatch.tables()) == 2
        assert [plan.scenario.hardware for _, plan in dispatch.plans()] == ["cpu"]
        assert [first.hardware for first, _ in dispatch.tables().values()] == ["cpu"]
    finally:
        dispatch.reset()
