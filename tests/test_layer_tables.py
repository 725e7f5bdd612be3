"""Layer tables: a selector's decisions for one layer over m, built in one batch on first
sight; equal to the direct decision at grid points, legal everywhere they answer."""

import dataclasses
import pickle
from bisect import bisect_right

import pytest
from test_selector_runtime import model_folder, write_selector  # noqa: F401 - the fixture, shared

from data.catalog import catalog
from ficco_select.heuristic import backend_for
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.layers import DENSE_M_LIMIT, GRID_STEPS_PER_OCTAVE, LayerTable, m_grid
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, is_legal

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


def check_table(sel: Selector, layer: Scenario) -> None:
    table = sel.layer_table(layer)
    assert table is not None and table.layer == layer.layer
    direct = Selector(sel.model, sel.meta) if sel.model is not None else Selector()
    for m, decision in zip(table.grid, table.decisions):
        want = direct.select(dataclasses.replace(layer, m=m))
        assert (decision.schedule, decision.source, decision.reason) == (want.schedule, want.source, want.reason)
        assert decision.confidence == pytest.approx(want.confidence, abs=1e-12)
        assert table.decide(m) is decision
    # Between grid points: the decision below, legal at m too.
    backend = backend_for(sel._spec(layer.hardware))
    for a, b in zip(table.grid, table.grid[1:]):
        for m in range(a + table.step, b, max(table.step, (b - a) // 3 // table.step * table.step)):
            got = table.decide(m)
            assert got is table.decide(a)
            assert is_legal(got.schedule, dataclasses.replace(layer, m=m), backend), (m, got)
    # Outside the grid, or an m the layer cannot have: no answer (the caller decides directly).
    assert table.decide(table.grid[-1] + table.step) is None and table.decide(table.grid[0] - 1) is None
    if table.step > 1:
        assert table.decide(table.grid[0] + 1) is None


def test_a_heuristic_only_selector_tables_equal_its_direct_decisions():
    for layer in list(LAYERS.values())[::2]:
        check_table(Selector(), layer)


def test_a_model_s_tables_equal_its_direct_decisions_at_grid_points(model_folder):  # noqa: F811
    sel = Selector.load(model_folder[0])
    assert sel.model is not None
    sources = set()
    for layer in LAYERS.values():
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
    assert table.decide(32) is None and table.decide(8192) is None
    assert sel.select(dataclasses.replace(layer, m=8192)).source == "heuristic"  # outside: decided directly


def test_layers_without_a_table_say_none_and_never_raise():
    sel = Selector()
    layer = next(iter(LAYERS.values()))
    assert sel.layer_table(dataclasses.replace(layer, hardware="no-such-machine")) is None
    too_many = Scenario.from_record({**layer.as_record(), "world_size": 16, "m": 16 * 64,
                                     "n": 16 * 64 if layer.op != "gemm_rs" else layer.n,
                                     "k": 16 * 64 if layer.op == "gemm_rs" else layer.k})
    assert sel.layer_table(too_many) is None  # 16 ranks on an 8-device spec: the baseline, per call
    assert sel.layer_table(layer) is sel.layer_table(dataclasses.replace(layer, m=layer.m * 2, group="other"))


def test_every_m_gets_the_decision_of_the_grid_point_below_it_on_both_sides_of_the_dense_index():
    # The lookup indexes every m up to DENSE_M_LIMIT and bisects beyond: both must answer
    # as the grid says, None for an m the layer cannot have or outside the grid.
    step = 8
    grid = (8, 16, 1000, DENSE_M_LIMIT - step, DENSE_M_LIMIT + step, 3 * DENSE_M_LIMIT)
    decisions = tuple(Decision(BASELINE, "heuristic", 0.0, f"point {i}") for i in range(len(grid)))
    table = LayerTable(("layer",), grid, decisions, step)
    ms = [*range(0, 2100), *range(DENSE_M_LIMIT - 40, DENSE_M_LIMIT + 40), 2 * DENSE_M_LIMIT + 4,
          3 * DENSE_M_LIMIT - step, 3 * DENSE_M_LIMIT, 3 * DENSE_M_LIMIT + step, 10 * DENSE_M_LIMIT]
    for m in ms:
        want = None if m % step or not grid[0] <= m <= grid[-1] else decisions[bisect_right(grid, m) - 1]
        assert table.decide(m) is want, m
    assert pickle.loads(pickle.dumps(table)).decide(1000).reason == "point 2"  # broadcast to other ranks
