"""Layer tables: a selector's decisions for one layer over m, built in one batch on first
sight; equal to the direct decision at grid points, legal everywhere they answer."""

import dataclasses
import pickle
from bisect import bisect_right

import pytest

from ficco_select.data.catalog import catalog
from ficco_select.heuristic import backend_for
from ficco_select.runtime.decision import Decision
from ficco_select.scenario import MAX_EXTENT
from ficco_select.runtime.layers import GRID_STEPS_PER_OCTAVE, LayerTable, m_grid
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, is_legal
from helpers.exports import write_selector

LAYERS = {s.layer: s for s in (Scenario.from_record(r) for r in catalog(
    "full", world_sizes=(2, 8), hardware="mi300x-8", models=["llama3-8b", "mixtral-8x7b"]))}


@pytest.mark.parametrize("lo, hi, step", [(1, 1 << 20, 1), (4, 65536, 8), (5, 7, 8), (3, 3000, 3), (8, 8, 8)])
def test_the_grid_holds_valid_m_between_the_ends_at_most_an_eighth_octave_apart(lo, hi, step):
    grid = m_grid(lo, hi, step)
    if step * -(-lo // step) > hi:
        assert grid == ()
        return
    assert list(grid) == sorted(set(grid)) and all(m % step == 0 and lo <= m <= hi for m in grid)
    assert grid[0] == step * -(-lo // step) and grid[-1] == step * (hi // step)
    assert all(b <= max(a + step, a * 2 ** (1 / GRID_STEPS_PER_OCTAVE) + step) for a, b in zip(grid, grid[1:]))


DIRECT_STRIDE = 5
"""Grid points a direct decision is compared at: every fifth of a layer's (about 500 a layer)."""


def check_table(sel: Selector, layer: Scenario) -> None:
    table = sel.layer_table(layer)
    assert table is not None and table.layer == layer.layer
    # Each decided alone, with tables off (on, the direct selector would decide from the same
    # table): every DIRECT_STRIDE-th grid point and the last, a stride prime to the grid's
    # points per octave, so that the points checked fall on every step of an octave.
    direct = Selector(sel.model, sel.rules.to_meta(), layer_tables=False) if sel.model is not None else \
        Selector(layer_tables=False)
    last = len(table.grid) - 1
    for i, (m, decision) in enumerate(zip(table.grid, table.decisions)):
        assert table.decide(m) is decision
        if i % DIRECT_STRIDE and i != last:
            continue
        want = direct.select(dataclasses.replace(layer, m=m))
        assert (decision.schedule, decision.source, decision.reason) == (want.schedule, want.source, want.reason)
        assert decision.confidence == pytest.approx(want.confidence, abs=1e-12)
    # Between grid points and beyond them: the direct decision, made on the m's first ask and kept.
    for a, b in zip(table.grid, table.grid[1:]):
        for m in range(a + table.step, b, max(table.step, (b - a) // 3 // table.step * table.step))[:2]:
            got, want = table.decide(m), direct.select(dataclasses.replace(layer, m=m))
            assert (got.schedule, got.source, got.reason) == (want.schedule, want.source, want.reason), m
            assert table.decide(m) is got
    beyond = table.grid[-1] + table.step
    if beyond <= MAX_EXTENT:
        assert table.decide(beyond).schedule == direct.select(dataclasses.replace(layer, m=beyond)).schedule
    # An m the layer cannot have: no answer (the caller decides directly, and says why).
    if table.step > 1:
        assert table.decide(table.grid[0] + 1) is None


def test_a_heuristic_only_selector_tables_equal_its_direct_decisions():
    for layer in list(LAYERS.values())[::2]:
        check_table(Selector(), layer)


def test_a_model_s_tables_equal_its_direct_decisions_at_grid_points(model_folder):
    sel = Selector.load(model_folder[0])
    assert sel.model is not None
    sources = set()
    for layer in list(LAYERS.values())[1::2]:  # the heuristic's test takes the others
        check_table(sel, layer)
        sources |= {d.source for d in sel.layer_table(layer).decisions}
    assert "model" in sources


def test_a_model_s_trained_m_range_bounds_its_tables(tmp_path):
    ranges = {"m": [64, 4096], "n": [1, 1 << 40], "k": [1, 1 << 40], "world_size": [2, 8],
              "hardware": ["mi300x-8"], "dtype": ["float32", "bfloat16", "float16"],
              "op": ["ag_gemm", "gemm_rs", "a2a_gemm"]}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges))
    layer = next(s for s in LAYERS.values() if s.op == "ag_gemm" and s.world_size == 8)
    table = sel.layer_table(layer)
    assert table.grid[0] == 64 and table.grid[-1] == 4096 and {d.source for d in table.decisions} == {"model"}
    assert table.decide(8192).source == "heuristic"  # outside the trained range: decided directly, as ever
    assert sel.select(dataclasses.replace(layer, m=8192)) is table.decide(8192)


def test_layers_without_a_table_say_none_and_never_raise():
    sel = Selector()
    layer = next(iter(LAYERS.values()))
    assert sel.layer_table(dataclasses.replace(layer, hardware="no-such-machine")) is None
    too_many = Scenario.from_record({**layer.as_record(), "world_size": 16, "m": 16 * 64,
                                     "n": 16 * 64 if layer.op != "gemm_rs" else layer.n,
                                     "k": 16 * 64 if layer.op == "gemm_rs" else layer.k})
    assert sel.layer_table(too_many) is None  # 16 ranks on an 8-device spec: the baseline, per call
    assert sel.layer_table(layer) is sel.layer_table(dataclasses.replace(layer, m=layer.m * 2, group="other"))


def test_a_table_answers_its_grid_decides_every_other_m_once_and_sends_its_grid_alone():
    step, asked = 8, []

    def decide_points(ms):
        asked.append(list(ms))
        return [Decision(BASELINE, "heuristic", 0.0, f"m={m}") for m in ms]

    grid = (8, 16, 1000, 1 << 20)
    decisions = tuple(Decision(BASELINE, "heuristic", 0.0, f"point {i}") for i in range(len(grid)))
    layer = next(s for s in LAYERS.values() if s.op == "ag_gemm" and s.world_size == 8)
    table = LayerTable(layer, grid, decisions, step, decide_points)
    for m, decision in zip(grid, decisions):
        assert table.decide(m) is decision and table.on_grid(m) is decision
    assert not asked
    assert table.decide(24).reason == "m=24" and table.decide(24) is table.decide(24) and asked == [[24]]
    assert table.on_grid(24) is None and table.decide(25) is None and table.decide(-8) is None
    table.decide_many([32, 40, 24, 32, 7])
    assert asked[-1] == [32, 40]  # one batch, the new valid m alone
    # With a model a selector decides an m off the grid with its nearest neighbours in its interval, one batch.
    table.neighbours = 4
    assert table.decide(56).reason == "m=56" and asked[-1] == [56, 48, 64]  # 40 was decided before
    assert table.decide(48) is table.known(48) and asked[-1] == [56, 48, 64]
    # The other ranks get the grid (``runtime/dispatch.py``): they answer it and decide nothing.
    copy = pickle.loads(pickle.dumps(table))
    assert copy.decide(1000).reason == "point 2" and copy.decide(24) is None and copy.on_grid(24) is None


def test_every_door_decides_through_the_layer_table(model_folder, tmp_path):
    # Precompiled tables whose every decision is the baseline, a legal answer the model does
    # not give: each door answers from them, so each door reads the table.
    import json
    import shutil

    from click.testing import CliRunner

    from ficco_select.cli.main import main
    from ficco_select.train.export import write_tables
    from ficco_select.runtime.batch import decide_rows

    folder = tmp_path / "export"
    shutil.copytree(model_folder[0], folder)
    layers = [s for s in LAYERS.values() if s.world_size == 8][:3]
    path = write_tables(Selector.load(folder), layers, folder)
    doc = json.loads(path.read_text())
    for entry in doc["layers"]:
        entry["decisions"] = [[BASELINE.name, "model", 0.5, "precompiled"] for _ in entry["decisions"]]
    path.write_text(json.dumps(doc))

    sel, direct = Selector.load(folder), Selector.load(folder, layer_tables=False)
    # At the tables' grid points (any other m is decided on its first ask, as the direct path decides it).
    points = [dataclasses.replace(layer, m=m) for layer in layers for m in sel.layer_table(layer).grid[::7]]
    assert any(direct.select(s).schedule != BASELINE for s in points)  # the model would answer otherwise
    records = [s.as_record() for s in points]
    doors = {
        "select(Scenario)": [sel.select(s) for s in points],
        "select(dict)": [sel.select(dict(r)) for r in records],
        "select(dict), again": [sel.select(dict(r)) for r in records],
        "decide_batch": sel.decide_batch(points),
        "layer_table": [sel.layer_table(s).decide(s.m) for s in points],
        "decide_rows": decide_rows(Selector.load(folder), records),
    }
    for door, decisions in doors.items():
        got = [(d["schedule"], d["reason"]) if isinstance(d, dict) else (d.schedule.name, d.reason) for d in decisions]
        assert got == [(BASELINE.name, "precompiled")] * len(points), door
    table_file = tmp_path / "rows.csv"
    import pandas as pd
    pd.DataFrame(records).to_csv(table_file, index=False)
    res = CliRunner().invoke(main, ["select", "--model", str(folder), "--scenarios", str(table_file), "--json"])
    assert res.exit_code == 0, res.output
    assert {(d["schedule"], d["reason"]) for d in json.loads(res.output)} == {(BASELINE.name, "precompiled")}


def test_the_dict_door_checks_what_the_scenario_door_checks():
    # The dict fast path looks the layer up by the record's raw values: a record the scenario
    # door would refuse (an empty group, a bool, an m the layer cannot have) is not answered there.
    sel = Selector()
    layer = next(s for s in LAYERS.values() if s.op == "ag_gemm" and s.world_size == 8)
    assert sel.layer_table(layer) is not None
    record = {**layer.as_record(), "m": 64}
    assert sel.select(record).source != "fallback"
    for bad in ({**record, "group": ""}, {**record, "m": 60}, {**record, "imbalance": True}, {**record, "m": -8}):
        assert sel.select(bad).source == "fallback", bad
    assert sel.select({**record, "m": 64.0}) == sel.select(record)  # the same m, as a float


def test_a_table_never_raises_and_answers_none_outside():
    table = Selector().layer_table(next(iter(LAYERS.values())))
    for odd in (-1, -table.step, 8.5, "8", None, 1 << 70):
        assert table.decide(odd) is None, odd


def test_precompiled_tables_with_an_illegal_decision_are_refused_at_load(model_folder, tmp_path, caplog):
    import json
    import shutil

    from ficco_select.train.export import write_tables

    folder = tmp_path / "export"
    shutil.copytree(model_folder[0], folder)
    layer = next(s for s in LAYERS.values() if s.op == "ag_gemm" and s.world_size == 2)
    path = write_tables(Selector.load(folder), [layer], folder)
    assert Selector.load(folder)._tables  # as written: read
    doc = json.loads(path.read_text())
    # An a2a schedule needs P >= 3: illegal at P = 2, whatever the digest says.
    doc["layers"][0]["decisions"][0][0] = "ficco.d2.a2a.gemm_per_piece.m.sm"
    path.write_text(json.dumps(doc))
    sel = Selector.load(folder)
    assert not sel._tables
    assert any("is not a legal schedule of this layer" in r.getMessage() for r in caplog.records)
    assert is_legal(sel.select(dataclasses.replace(layer, m=doc["layers"][0]["grid"][0])).schedule,
                    layer, "sim")


# -- the GPU do-no-harm rule between grid points ---------------------------------------------
GPU_RULE = {"split_us": 1000.0, "small_margin": 0.1748, "large_margin": 0.008, "measured": []}
"""The rule as ``ficco pipeline`` fits it (x1.191 below 1 ms of serial time, x1.008 above)."""


def _with_rule(model_folder, folder, **meta):
    """A copy of the fixture's export (a real XGBoost model), trained on m up to 2^20, whose
    selector.json holds `meta` too."""
    import json
    import shutil

    shutil.copytree(model_folder[0], folder)
    doc = json.loads((folder / "selector.json").read_text())
    doc["training_ranges"]["m"] = [1, 1 << 20]
    (folder / "selector.json").write_text(json.dumps({**doc, **meta}))
    return folder


def test_between_grid_points_a_table_never_ships_an_overlap_the_direct_path_s_rule_refuses(model_folder, tmp_path):
    import random

    from ficco_select.hardware import load_hardware, preset_names
    from ficco_select.runtime.no_harm import holds

    folder = _with_rule(model_folder, tmp_path / "export", gpu_no_harm=GPU_RULE)
    sel, direct = Selector.load(folder), Selector.load(folder, layer_tables=False)
    rule = sel.rules.gpu_no_harm
    gpus = [name for name in preset_names() if load_hardware(name).kind == "gpu"]
    layers = [s for hw in gpus for s in list({Scenario.from_record(r).layer: Scenario.from_record(r) for r in catalog(
        "full", world_sizes=(8,), hardware=hw, models=["mixtral-8x7b"])}.values())[::3]]
    # Every overlap pick of every table, between its point and the next: where the rule can refuse it.
    intervals = [(layer, t.grid[i], t.grid[i + 1], t.step) for layer in layers if (t := sel.layer_table(layer))
                 for i, d in enumerate(t.decisions[:-1])
                 if not d.schedule.is_baseline and t.grid[i + 1] - t.grid[i] > t.step]
    assert {layer.hardware for layer, *_ in intervals} == set(gpus)
    rng, calls, shipped_refused, differ = random.Random(0), 3000, [], []
    for _ in range(calls):
        layer, lo, hi, step = rng.choice(intervals)
        s = dataclasses.replace(layer, m=rng.randrange(lo + step, hi, step))
        got, want = sel.select(s), direct.select(s)
        if (got.schedule, got.source) != (want.schedule, want.source):
            differ.append((s.op, s.m, s.hardware, got.schedule.name, want.schedule.name))
        if not got.schedule.is_baseline and not holds(rule, s, load_hardware(s.hardware), got.schedule)[0]:
            shipped_refused.append((s.op, s.m, s.hardware, got.schedule.name, want.schedule.name))
    assert not shipped_refused, f"{len(shipped_refused)} of {calls}: {shipped_refused[:5]}"
    assert not differ, f"{len(differ)} of {calls}: {differ[:5]}"


def test_on_every_preset_a_table_s_pick_is_the_direct_pick_at_random_m(model_folder, tmp_path):
    # The table and the direct path are one policy (runtime/policy.py): between grid points,
    # beyond them and at them, with the GPU do-no-harm rule, on every machine that ships.
    import random

    from ficco_select.hardware import load_hardware, preset_names

    folder = _with_rule(model_folder, tmp_path / "export", gpu_no_harm=GPU_RULE)
    sel, direct = Selector.load(folder), Selector.load(folder, layer_tables=False)
    rng, differ, calls = random.Random(1), [], 0
    for hw in preset_names():
        scale = "cpu" if load_hardware(hw).kind == "cpu" else "full"
        layers = list({s.layer: s for s in map(Scenario.from_record, catalog(scale, hardware=hw))}.values())
        for layer in rng.sample(layers, min(4, len(layers))):
            table = sel.layer_table(layer)
            assert table is not None and table.grid, layer
            for _ in range(40):
                at = rng.randrange(len(table.grid) - 1)
                lo, hi = table.grid[at], table.grid[at + 1]
                m = rng.randrange(lo, hi + 1, table.step) if rng.random() < 0.9 else rng.choice(table.grid)
                s = dataclasses.replace(layer, m=m)
                got, want = sel.select(s), direct.select(s)
                calls += 1
                if (got.schedule, got.source, got.reason) != (want.schedule, want.source, want.reason):
                    differ.append((hw, s.op, m, got.schedule.name, want.schedule.name))
    assert calls >= 40 * 4 * 5 and not differ, f"{len(differ)} of {calls}: {differ[:5]}"


# -- layers.json: trusted for nothing the direct path could not give -------------------------
def _tables_file(model_folder, tmp_path, **meta):
    """An export with real precompiled tables of two ag_gemm layers at P = 8 on h100-nvswitch,
    and the file's contents."""
    import json

    from ficco_select.train.export import write_tables

    folder = _with_rule(model_folder, tmp_path / "export", **meta)
    layers = [s for s in {Scenario.from_record(r).layer: Scenario.from_record(r) for r in catalog(
        "full", world_sizes=(8,), hardware="h100-nvswitch", models=["llama3-70b"])}.values() if s.op == "ag_gemm"][:2]
    path = write_tables(Selector.load(folder), layers, folder)
    assert len(Selector.load(folder)._tables) == 2  # as written: read
    return folder, path, json.loads(path.read_text())


def _refused(folder, path, doc, caplog, *needles):
    import json

    path.write_text(json.dumps(doc))
    caplog.clear()
    sel = Selector.load(folder)
    assert sel.model is not None and not sel._tables
    [warning] = [r.getMessage() for r in caplog.records if "layer tables" in r.getMessage()]
    assert "layers.json" in warning and "\n" not in warning and "Traceback" not in warning, warning
    for needle in needles:
        assert needle in warning, warning
    return sel


def test_a_grid_step_other_than_the_layer_s_is_refused_at_load_naming_the_field(model_folder, tmp_path, caplog):
    folder, path, doc = _tables_file(model_folder, tmp_path)
    doc["layers"][0]["step"] = 1  # m = 12 is no ag_gemm m on 8 ranks: the direct path says so, not the table
    sel = _refused(folder, path, doc, caplog, "layers[0]", "field 'step'", "multiples of 8")
    layer = Scenario.from_record({**dict(zip(("op", "n", "k", "dtype", "world_size", "hardware", "imbalance"),
                                             (doc["layers"][0][c] for c in ("op", "n", "k", "dtype", "world_size",
                                                                            "hardware", "imbalance")))),
                                  "group": "g", "m": 16})
    assert sel.select({**layer.as_record(), "m": 12}).source == "fallback"


def test_a_layer_given_twice_is_refused_at_load_naming_both(model_folder, tmp_path, caplog):
    folder, path, doc = _tables_file(model_folder, tmp_path)
    first = doc["layers"][0]
    doc["layers"].append({**first, "decisions": [["none.sm", "model", 1.0, ""]] * len(first["grid"])})
    _refused(folder, path, doc, caplog, "layers[2]", "layers[0]")


@pytest.mark.parametrize("confidence", [float("nan"), float("inf"), -0.5, 2.0, "high", None, True])
def test_a_confidence_that_is_no_number_in_0_1_is_refused_at_load_naming_the_field(model_folder, tmp_path, caplog,
                                                                                   confidence):
    folder, path, doc = _tables_file(model_folder, tmp_path)
    doc["layers"][1]["decisions"][3][2] = confidence
    _refused(folder, path, doc, caplog, "layers[1]", "decisions[3][2]", "confidence")


def test_a_pick_the_gpu_rule_refuses_at_its_m_is_refused_at_load(model_folder, tmp_path, caplog):
    from ficco_select.hardware import load_hardware
    from ficco_select.runtime.no_harm import predicted_gain
    from ficco_select.schedule import legal_candidates

    folder, path, doc = _tables_file(model_folder, tmp_path, gpu_no_harm=GPU_RULE)
    entry = doc["layers"][0]
    hw = load_hardware("h100-nvswitch")
    layer = Scenario(group="g", m=entry["grid"][0], **{c: entry[c] for c in ("op", "n", "k", "dtype", "world_size",
                                                                             "hardware", "imbalance")})
    # A legal overlap pick the cost model predicts 4x slower than the baseline, as the model's.
    slow = next((i, c) for i, m in enumerate(entry["grid"])
                for c in legal_candidates(dataclasses.replace(layer, m=m), "sim")
                if not c.is_baseline and predicted_gain(dataclasses.replace(layer, m=m), hw, c)[1] < 0.25)
    entry["decisions"][slow[0]] = [slow[1].name, "model", 0.9, ""]
    _refused(folder, path, doc, caplog, "layers[0]", f"m={entry['grid'][slow[0]]}", "do-no-harm")
