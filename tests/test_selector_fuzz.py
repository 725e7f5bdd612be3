"""Every number of an exported selector's files set to 0, a negative, NaN, inf, 1e308 and a
non-number, one at a time: ``selector.json`` (an export with every rule section) and
``layers.json`` (precompiled tables). Each case either loads, where the table below
accepts that value (and then decides legally, with no error on the way), or is refused at
load with one warning of one line that names the file and the field (a heuristic-only
selector for selector.json; no precompiled tables for layers.json). Never a traceback.

What is accepted, and why (docs/runtime.md, "selector.json, field by field"):
- a range's low end of 0 or below, or a high end of 1e308: a range wider than any value;
- a margin of 0 (``abstention``'s: always trust the model; ``gpu_no_harm``'s: any predicted
  gain stands) and an abstention ``min_margin`` of 1e308 (never trust the model);
- a ``range_slack`` of 1e308 (any m, n, k; a table stops at the largest m a scenario takes);
- a ``gpu_no_harm.split_us`` of 0 or 1e308 (one regime);
- provenance the runtime never reads, anything: ``feature_schema_version``,
  ``gpu_no_harm.quantile`` and ``.points*``, layers.json's ``grid_steps_per_octave``;
- a layer table's confidence of 0 (a heuristic's or a fallback's);
- a machine in ``hardware_specs``: what the spec file rules accept (their own fuzz:
  tests/test_hardware_spec_fuzz.py); here only: loads, or is refused naming the field.
"""

import copy
import json
import logging
import math
import re
from pathlib import Path

import pytest

from ficco_select.features import FEATURE_SCHEMA_HASH
from ficco_select.hardware import load_hardware
from ficco_select.heuristic import backend_for
from ficco_select.runtime.loading import RULES_VERSION
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import OPS, Scenario
from ficco_select.schedule import legal_candidates
from helpers.exports import PRESETS, preference_model, spec_dict

VALUES = {"zero": 0, "negative": -1, "nan": math.nan, "inf": math.inf, "1e308": 1e308, "text": "many"}
"""What each numeric field is set to, one at a time."""

MACHINE = "node-fuzz"
"""The export's own machine (hardware_specs)."""


def full_meta() -> dict:
    """selector.json with every section a ``ficco pipeline`` export writes, in its layout."""
    return {
        "rules_version": RULES_VERSION, "selector": "xgb-regressor", "feature_schema_version": 2,
        "feature_schema_hash": FEATURE_SCHEMA_HASH, "target": "log(time / baseline time)",
        "training_ranges": {"m": [2, 65536], "n": [128, 106496], "k": [64, 57344], "world_size": [2, 8],
                            "hardware": [*PRESETS, "cpu", MACHINE],
                            "dtype": ["bfloat16", "float16", "float32", "float8_e4m3fn"], "op": list(OPS)},
        "unseen_dtype": {"dtype_bytes": [1, 4], "peak_tflops": {"cpu": [0.1, 0.2], "gpu": [21.3, 6853.2]}},
        "hardware_specs": {MACHINE: spec_dict(MACHINE, devices=4)},
        "gpu_no_harm": {"split_us": 1000.0, "small_margin": 0.175, "large_margin": 0.0083, "quantile": 0.5,
                        "points": 23, "points_small": 14, "points_large": 9, "fitted_on": "gpu-calibration.csv",
                        "measured": []},
        "abstention": {
            "min_margin": 0.0, "fallback": "heuristic",
            "by_kind": {"cpu": {"min_margin": 0.054, "fallback": "shard.ring.sm"},
                        "gpu": {"min_margin": 0.0, "fallback": "heuristic"}},
            "by_op": {"gpu.gemm_ar": {"min_margin": 0.0016, "fallback": "heuristic"},
                      "cpu.gemm_ar": {"min_margin": 0.17, "fallback": "gated:ficco.d2.ring.gemm_per_piece.n.sm"}},
            "range_slack": {"gpu": {"m": 4.0, "n": 4.0, "k": 4.0}},
            "by_reason": {"shape_range": {"gpu": "cost_model"},
                          "unseen_machine": {"cpu": "heuristic", "gpu": "cost_model"}}},
        "unseen_hardware": {"decide": "model", "kinds": {"gpu": {
            "topologies": ["fully_connected", "ring", "switch"], "any_topology": True,
            "spec_ranges": {"compute_units": [14.0, 3081.8], "link_bw_gbps": [6.7, 2712.9],
                            "dma_bw_gbps": [3.1, 3845.2], "peak_tflops.bfloat16": [41.2, 7092.4]}}}},
    }


def numeric_paths(value, path=()):
    """Every path to a number (not a bool) in a JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numeric_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from numeric_paths(item, (*path, i))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path


def set_at(doc, path, value):
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


# -- selector.json ------------------------------------------------------------------------------
ACCEPTED = [  # (a path's pattern, the values accepted there): the module's docstring says why
    (r"feature_schema_version|gpu_no_harm\.(quantile|points.*)", set(VALUES)),
    (r"(training_ranges|unseen_dtype|unseen_hardware)\..*\.0", {"zero", "negative"}),
    (r"(training_ranges|unseen_dtype|unseen_hardware)\..*\.1", {"1e308"}),
    (r"abstention\.(.*\.)?min_margin", {"zero", "1e308"}),
    (r"abstention\.range_slack\..*", {"1e308"}),
    (r"gpu_no_harm\.split_us", {"zero", "1e308"}),
    (r"gpu_no_harm\.(small|large)_margin", {"zero"}),
]
META_PATHS = list(numeric_paths(full_meta()))
PROBES = [
    {"group": "g", "op": "ag_gemm", "m": 4096, "n": 28672, "k": 8192, "dtype": "bfloat16", "world_size": 8,
     "hardware": "h100-nvswitch", "imbalance": 1.0},
    {"group": "g", "op": "gemm_rs", "m": 8192, "n": 8192, "k": 28672, "dtype": "bfloat16", "world_size": 8,
     "hardware": "a100-nvswitch", "imbalance": 1.0},  # a machine the model never saw
    {"group": "g", "op": "gemm_ar", "m": 512, "n": 1024, "k": 1024, "dtype": "float32", "world_size": 2,
     "hardware": "cpu", "imbalance": 1.0},
    {"group": "g", "op": "a2a_gemm", "m": 3000, "n": 4096, "k": 1024, "dtype": "bfloat16", "world_size": 4,
     "hardware": MACHINE, "imbalance": 1.5},
]


def dotted(path) -> str:
    return ".".join(map(str, path))


def expected_meta(path, name: str) -> str:
    """``accepted``, ``refused``, or ``either`` (a machine's spec: its own rules)."""
    if path[0] == "hardware_specs":
        return "either"
    for pattern, values in ACCEPTED:
        if re.fullmatch(pattern, dotted(path)):
            return "accepted" if name in values else "refused"
    return "refused"


def field_named(path) -> str:
    """How a refusal names the field at `path`: its keys, without a range's index."""
    if path[0] == "hardware_specs":
        return path[-1] if isinstance(path[-1], str) else path[-2]
    return ".".join(str(key) for key in path if isinstance(key, str))


def write_export(folder: Path, meta: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.json").write_text(json.dumps(preference_model()))
    (folder / "selector.json").write_text(json.dumps(meta))
    return folder


def decides_legally(sel: Selector, caplog) -> None:
    """Every probe, and a second m of its layer (its table), decided legally, with no error."""
    for record in PROBES:
        for m in (record["m"], 2 * record["m"]):
            s = Scenario.from_record({**record, "m": m})
            d = sel.select(s)
            hw = sel.machine(s.hardware)
            assert d.schedule in legal_candidates(s, backend_for(hw)), (record, d)
            assert math.isfinite(d.confidence) and 0 <= d.confidence <= 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, errors


@pytest.mark.parametrize("path", META_PATHS, ids=dotted)
@pytest.mark.parametrize("name", list(VALUES))
def test_every_number_of_selector_json_loads_where_documented_else_is_refused_naming_the_field(
        path, name, tmp_path, caplog):
    folder = write_export(tmp_path / "export", set_at(full_meta(), path, VALUES[name]))
    with caplog.at_level(logging.WARNING):
        sel = Selector.load(folder)
    want = expected_meta(path, name)
    if sel.model is None:
        assert want in ("refused", "either"), f"refused: {caplog.text}"
        [warning] = [r.getMessage() for r in caplog.records]
        assert "selector.json" in warning and field_named(path) in warning, warning
        assert "\n" not in warning and "Traceback" not in warning, warning
    else:
        assert want in ("accepted", "either"), f"{dotted(path)} = {VALUES[name]!r} was accepted"
        decides_legally(sel, caplog)


def test_the_export_the_cases_start_from_loads_and_decides():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sel = Selector.load(write_export(Path(tmp, "export"), full_meta()))
    assert sel.model is not None and sel.rules.gpu_no_harm is not None
    d = sel.select(PROBES[0])
    assert d.source == "model" or d.abstained == "no_harm", d  # the model's pick, or the rule's baseline in its place


# -- layers.json --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tables_export(tmp_path_factory):
    """An export with the precompiled tables of two layers (an all-gather GEMM on h100-nvswitch,
    8 ranks; an MoE dispatch on mi300x-8, imbalanced), and layers.json's contents."""
    from ficco_select.train.export import write_tables

    folder = write_export(tmp_path_factory.mktemp("tables") / "export", full_meta())
    layers = [Scenario.from_record({**PROBES[0], "m": 8}),
              Scenario.from_record({**PROBES[3], "hardware": "mi300x-8", "world_size": 8})]
    path = write_tables(Selector.load(folder), layers, folder)
    doc = json.loads(path.read_text())
    assert len(doc["layers"]) == 2 and len(Selector.load(folder)._tables) == 2
    return folder, doc


def expected_layers(path, name: str) -> str:
    if path == ("grid_steps_per_octave",):  # provenance: never read
        return "accepted"
    if path[-1] == 2 and path[-3] == "decisions" and name == "zero":
        return "accepted"
    return "refused"


def layers_field_named(path) -> str:
    if path[0] != "layers":
        return path[0]
    if path[2] == "grid":
        return f"grid[{path[3]}]"
    if path[2] == "decisions":
        return f"decisions[{path[3]}][2]"
    return f"'{path[2]}'"


LAYER_CASES = [(path, name) for path in [("model_digest",), ("grid_steps_per_octave",),
                                         *[("layers", i, column) for i in (0, 1)
                                           for column in ("n", "k", "world_size", "imbalance", "step")],
                                         *[("layers", i, part, at) for i in (0, 1) for part in ("grid", "decisions")
                                           for at in ("first", "middle", "last")]]
               for name in VALUES]


def _concrete(path, doc):
    """A case's path with its grid point placed (first, middle, last) and a decision's confidence."""
    if len(path) == 4:
        _, i, part, at = path
        n = len(doc["layers"][i]["grid"])
        j = {"first": 0, "middle": n // 2, "last": n - 1}[at]
        return ("layers", i, "grid", j) if part == "grid" else ("layers", i, "decisions", j, 2)
    return path


@pytest.mark.parametrize("path, name", LAYER_CASES, ids=[f"{dotted(p)}={n}" for p, n in LAYER_CASES])
def test_every_number_of_layers_json_loads_where_documented_else_is_refused_naming_the_field(
        tables_export, path, name, tmp_path, caplog):
    import shutil

    source, doc = tables_export
    folder = tmp_path / "export"
    shutil.copytree(source, folder)
    path = _concrete(path, doc)
    (folder / "layers.json").write_text(json.dumps(set_at(doc, path, VALUES[name])))
    with caplog.at_level(logging.WARNING):
        sel = Selector.load(folder)
    assert sel.model is not None  # the model is the export's whatever its tables hold
    if expected_layers(path, name) == "accepted":
        assert len(sel._tables) == 2 and not caplog.records, caplog.text
        decides_legally(sel, caplog)
        return
    assert not sel._tables, f"{dotted(path)} = {VALUES[name]!r} was accepted"
    [warning] = [r.getMessage() for r in caplog.records]
    assert "layers.json" in warning and layers_field_named(path) in warning, warning
    assert "\n" not in warning and "Traceback" not in warning, warning
    for record in PROBES:  # decided as without tables
        s = Scenario.from_record(record)
        assert sel.select(s).schedule in legal_candidates(s, backend_for(sel.machine(s.hardware)))


# -- the GPU do-no-harm rule's margins ----------------------------------------------------------
@pytest.mark.parametrize("margin", [800, 1e308, math.nan, math.inf, -0.1, "0.2", None, True])
@pytest.mark.parametrize("field", ["small_margin", "large_margin"])
def test_a_margin_past_any_gain_or_no_number_is_refused_at_load_naming_the_field(field, margin, tmp_path, caplog):
    meta = full_meta()
    meta["gpu_no_harm"][field] = margin
    with caplog.at_level(logging.WARNING):
        sel = Selector.load(write_export(tmp_path / "export", meta))
    assert sel.model is None
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"selector.json: field 'gpu_no_harm.{field}'" in warning and "\n" not in warning, warning


def test_sim_validate_refuses_an_export_whose_margin_overflows_in_one_line(tmp_path, caplog):
    from click.testing import CliRunner

    from ficco_select.cli.main import main
    from ficco_select.data.published import packaged

    meta = full_meta()
    meta["gpu_no_harm"]["small_margin"] = meta["gpu_no_harm"]["large_margin"] = 800
    folder = write_export(tmp_path / "export", meta)
    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(packaged()), "--model", str(folder),
                                    "--fallback", "cost_model"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert res.output.startswith("Error: --model") and res.output.count("\n") == 1, res.output
    [why] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # the warning it points to
    assert "selector.json: field 'gpu_no_harm.small_margin'" in why and "\n" not in why, why


def test_a_rule_made_in_code_with_a_huge_margin_refuses_overlaps_without_overflowing():
    from ficco_select.runtime.no_harm import NoHarmRule, verdicts
    from ficco_select.schedule import parse

    s = Scenario.from_record(PROBES[0])
    for margin in (800.0, 1e308):
        [why] = verdicts(NoHarmRule(split_us=1000.0, small_margin=margin, large_margin=margin), [s],
                         load_hardware("h100-nvswitch"), [parse("shard.ring.dma")])
        assert "the baseline does no harm" in why


def test_the_fit_never_writes_a_margin_the_loader_refuses():
    from ficco_select.data.no_harm import margins
    from ficco_select.runtime.no_harm import NoHarmRule

    rule = margins([800.0] * 8, [100.0] * 4 + [5000.0] * 4)
    assert NoHarmRule.from_meta(rule, "selector.json").large_margin == rule["large_margin"] == math.log(1000)
    with pytest.raises(ValueError, match="not a finite number"):
        margins([0.1, math.nan, 0.2, 0.1], [100.0] * 4)
