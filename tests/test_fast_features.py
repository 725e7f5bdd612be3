"""The runtime's feature builder gives pair_features' rows bit for bit (NaN where it has NaN)."""

import dataclasses

import numpy as np
import pytest

from ficco_select.data.catalog import catalog
from ficco_select import Scenario, candidates
from ficco_select.scenario import A2A_OPS, MAX_EXTENT, OPS, ScenarioError
from ficco_select.features import FEATURE_NAMES, candidate_features, grid_features, pair_features
from ficco_select.hardware import load_hardware, preset_names
from ficco_select.heuristic import backend_for


def reference(s: Scenario, schedules, hw) -> np.ndarray:
    with np.errstate(all="ignore"):  # absurd shapes: inf / inf, on purpose
        return pair_features([s.as_record()] * len(schedules), schedules, {s.hardware: hw})


def catalog_scenarios() -> list[tuple[Scenario, str]]:
    """Every op, every preset, world sizes 2, 3, 4, 8, float32 and bfloat16 (a sample of rows)."""
    out = []
    for name in preset_names():
        scale = "cpu" if name == "cpu" else "full"
        for dtype in ("float32", "bfloat16"):
            out += [(Scenario.from_record(r), name)
                    for r in catalog(scale, hardware=name, dtype=dtype)[::5]]
    return out


SCENARIOS = catalog_scenarios()


def test_the_sample_covers_ops_hardware_and_world_sizes():
    assert {s.op for s, _ in SCENARIOS} == set(OPS)
    assert {hw for _, hw in SCENARIOS} == set(preset_names())
    assert {2, 3, 4, 8} <= {s.world_size for s, _ in SCENARIOS}
    assert any(s.imbalance > 1 for s, _ in SCENARIOS)


@pytest.mark.parametrize("hardware", preset_names())
def test_equal_to_pair_features_on_catalog_scenarios(hardware):
    hw = load_hardware(hardware)
    rows = [s for s, name in SCENARIOS if name == hardware]
    assert rows
    for s in rows:
        cands = candidates(s, backend_for(hw))
        np.testing.assert_array_equal(candidate_features(s, cands, hw), reference(s, cands, hw),
                                      err_msg=f"{s} on {hardware}")


@pytest.mark.parametrize("hardware", ["mi300x-8", "l40s-pcie-8", "h100-nvswitch"])
def test_equal_on_the_largest_and_smallest_shapes_a_scenario_takes(hardware):
    # A scenario's m, n and k stop at 2**31 - 1 (scenario.MAX_EXTENT): at that edge the
    # estimates are at their largest, and the runtime must see what training saw.
    hw = load_hardware(hardware)
    for op in OPS:
        for P in (2, 3, 8, 64):
            edge = MAX_EXTENT // P * P
            for m, n, k in [(P, P, P), (edge, edge, edge), (edge, P, P), (P, edge, edge), (edge, 7 * P, P)]:
                s = Scenario(group="g", op=op, m=m, n=n, k=k, dtype="bfloat16", world_size=P, hardware=hardware,
                             imbalance=float(P) if op in A2A_OPS else 1.0)
                cands = candidates(s, "sim")
                got, want = candidate_features(s, cands, hw), reference(s, cands, hw)
                np.testing.assert_array_equal(got, want, err_msg=f"{s}")


def test_a_scenario_past_the_largest_extent_is_refused():
    with pytest.raises(ScenarioError, match="column 'm'"):
        Scenario(group="g", op="ag_gemm", m=2 * 2 ** 300, n=2, k=2, dtype="bfloat16", world_size=2,
                 hardware="h100-nvswitch")


def test_schedule_names_and_repeated_calls_give_the_same_rows():
    hw = load_hardware("h200-nvswitch")
    s = next(s for s, name in SCENARIOS if name == "h200-nvswitch" and s.op == "gemm_rs")
    cands = candidates(s, "sim")
    first = candidate_features(s, cands, hw)
    np.testing.assert_array_equal(candidate_features(s, [c.name for c in cands], hw), first)
    np.testing.assert_array_equal(candidate_features(s, cands[::-1], hw), first[::-1])
    np.testing.assert_array_equal(candidate_features(s, cands, hw), first)  # cached layout
    assert candidate_features(s, [], hw).shape == (0, len(FEATURE_NAMES))


def test_a_candidate_tuple_reused_at_another_world_size_gets_that_world_sizes_rows():
    # The layout of a tuple is found by the tuple's id; the world size is part of its key.
    hw = load_hardware("mi300x-8")
    s8 = Scenario(group="g", op="ag_gemm", m=4096, n=8192, k=4096, dtype="bfloat16", world_size=8,
                  hardware="mi300x-8")
    s4 = Scenario(group="g", op="ag_gemm", m=4096, n=8192, k=4096, dtype="bfloat16", world_size=4,
                  hardware="mi300x-8")
    cands = tuple(candidates(s8, "sim"))
    for s in (s8, s4, s8, s4):
        np.testing.assert_array_equal(candidate_features(s, cands, hw), reference(s, cands, hw), err_msg=f"{s}")
    np.testing.assert_array_equal(candidate_features(s4, list(cands), hw), reference(s4, cands, hw))


@pytest.mark.parametrize("hardware", preset_names())
def test_equal_on_tiny_odd_and_imbalanced_shapes(hardware):
    # Shards of a row or two, extents that are not multiples of any tile, every world size
    # 2..8, a2a imbalance from balanced to all-on-one-expert.
    hw = load_hardware(hardware)
    rng = np.random.default_rng(preset_names().index(hardware))
    backend = backend_for(hw)
    for op in OPS:
        for P in range(2, 9):
            for rows, cols, inner in [(1, 1, 1), (2, 3, 1), (3, 1, 5), (5, 7, 3), (8, 9, 1)] + \
                    [tuple(int(x) for x in rng.integers(1, 3000, 3)) for _ in range(4)]:
                m, n, k = rows * P, cols * (P if op == "ag_gemm" else 1), inner * (P if op in ("gemm_rs", "gemm_ar") else 1)
                for imb in ((1.0, 1.0 + rng.uniform() * (P - 1), float(P)) if op in A2A_OPS else (1.0,)):
                    for dtype in ("float32", "bfloat16"):
                        s = Scenario(group="g", op=op, m=m, n=n, k=k, dtype=dtype, world_size=P,
                                     hardware=hardware, imbalance=imb)
                        cands = candidates(s, backend)
                        np.testing.assert_array_equal(candidate_features(s, tuple(cands), hw),
                                                      reference(s, cands, hw), err_msg=f"{s}")


@pytest.mark.parametrize("hardware", ["mi300x-8", "l40s-pcie-8", "cpu"])
def test_the_grid_path_gives_each_m_s_rows_bit_for_bit(hardware):
    # Layer tables score a layer on a grid of m at once (grid_features): every block must be
    # the rows the direct decision would score at that m.
    hw = load_hardware(hardware)
    for s in [s for s, name in SCENARIOS if name == hardware][::3]:
        cands = candidates(s, backend_for(hw))
        P = s.world_size
        ms = [P, 3 * P, s.m, 1000 * P, P << 20]
        blocks = grid_features(s, ms, cands, hw)
        assert blocks.shape == (len(ms), len(cands), len(FEATURE_NAMES))
        for m, block in zip(ms, blocks):
            np.testing.assert_array_equal(block, candidate_features(dataclasses.replace(s, m=m), cands, hw),
                                          err_msg=f"{s} at m={m}")
    assert grid_features(s, [], cands, hw).shape == (0, len(cands), len(FEATURE_NAMES))
