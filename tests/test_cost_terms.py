"""The cost model's terms on hand-made cases: each term does what its spec field says, and
the heuristic, the features and the simulator read one set of estimates."""

import dataclasses

import numpy as np
import pytest

from ficco_select.costs import (
    GB,
    OP_CODES,
    collective_time,
    gemm_time,
    reduction_time,
    scenario_estimates,
    schedule_times,
    transfer_time,
)
from ficco_select.hardware import HardwareError, fields_of, load_hardware, spec_as_dict, spec_from_dict

AG, RS, A2A = OP_CODES["ag_gemm"], OP_CODES["gemm_rs"], OP_CODES["a2a_gemm"]


@pytest.fixture
def hw():
    """h100-nvswitch with the published terms off, then set one by one below."""
    return dataclasses.replace(load_hardware("h100-nvswitch"), gemm_mem_efficiency=1.0, coll_latency_us=0.0,
                               coll_bw_gbps=0.0, step_sync_us=0.0, gemm_launch_us=0.0)


def test_a_memory_bound_gemm_slows_by_the_operand_bandwidth_it_reaches(hw):
    # 8 rows x 8192 x 8192 in bf16: 2 * 8 * 8192^2 FLOPs take ~1 us at 989 TFLOP/s, the
    # weights' 134 MB take ~40 us at 3.35 TB/s: bound by memory.
    M, N, K = 8, 8192, 8192
    full = float(gemm_time(hw, M, N, K, 2, 989.4e12))
    expected = (M * K + K * N + M * N) * 2 / (hw.mem_bw_gbps * GB)
    assert full == pytest.approx(expected, rel=1e-12)
    half = float(gemm_time(dataclasses.replace(hw, gemm_mem_efficiency=0.5), M, N, K, 2, 989.4e12))
    assert half == pytest.approx(2 * full, rel=1e-12)
    # A compute-bound GEMM does not move.
    big = (8192, 8192, 8192)
    assert gemm_time(dataclasses.replace(hw, gemm_mem_efficiency=0.5), *big, 2, 989.4e12) == gemm_time(hw, *big, 2, 989.4e12)


def test_the_collective_library_term_is_latency_plus_shards_over_bus_bandwidth(hw):
    lib = dataclasses.replace(hw, coll_latency_us=10.0, coll_bw_gbps=250.0)
    shard = 1 << 20
    got = float(collective_time(lib, AG, shard, 8))
    assert got == pytest.approx(10e-6 + 7 * shard / 250e9, rel=1e-12)
    assert float(collective_time(lib, AG, 0.0, 8)) == 0.0  # nothing to move costs nothing
    # The library adds as it moves: a reduce-scatter's bus bandwidth holds its additions.
    assert float(collective_time(lib, RS, shard, 8)) == got
    # Without a library's numbers, the additions come on top: read two, write one, per shard.
    assert float(collective_time(hw, RS, shard, 8)) == pytest.approx(
        float(collective_time(hw, AG, shard, 8)) + 7 * 3 * shard / (hw.mem_bw_gbps * GB), rel=1e-12)
    assert float(reduction_time(lib, AG, shard, 8)) == 0.0


def test_without_library_numbers_the_collective_is_the_faster_of_a_ring_and_a_direct_exchange(hw):
    shard = np.array([1e3, 1e6, 1e8])
    ring = 7 * transfer_time(hw, shard, 1, False, 8)
    direct = transfer_time(hw, shard, 7, False, 8)
    for op in (AG, A2A):  # every operator alike: the all-to-all too
        np.testing.assert_array_equal(collective_time(hw, op, shard, 8), np.minimum(ring, direct))
    ringed = dataclasses.replace(hw, topology="ring")
    got = collective_time(ringed, A2A, shard, 8)
    np.testing.assert_array_equal(got, np.minimum(7 * transfer_time(ringed, shard, 1, False, 8),
                                                  transfer_time(ringed, shard, 7, False, 8)))


def _times(hw, gran, **axes):
    base = dict(op=AG, m=8192.0, n=8192.0, k=8192.0, P=8.0, imbalance=1.0, dtype_bytes=2.0, peak=989.4e12,
                degree=1.0, a2a=False, per_step=False, split_n=False, dma=False)
    return schedule_times(hw, gran=gran, **{**base, **axes})["time_s"]


def test_the_per_step_cost_is_paid_once_per_step_of_a_decomposed_schedule_only(hw):
    synced = dataclasses.replace(hw, step_sync_us=3.0)
    # Baseline: no steps. Shard ring on 8 ranks: 7 steps. ficco d=2 ring: 14 steps.
    assert _times(synced, 0) == _times(hw, 0)
    assert float(_times(synced, 1) - _times(hw, 1)) == pytest.approx(7 * 3e-6, rel=1e-9)
    assert float(_times(synced, 2, degree=2.0) - _times(hw, 2, degree=2.0)) == pytest.approx(14 * 3e-6, rel=1e-9)


def test_copy_engine_contention_slows_only_the_overlapped_gemm(hw):
    calm, busy = dataclasses.replace(hw, dma_mem_contention=0.0), dataclasses.replace(hw, dma_mem_contention=0.5)
    wide = {"n": 65536.0}  # each step's GEMM outlasts its copy: the copies run beside GEMMs
    assert _times(busy, 1, dma=True, **wide) > _times(calm, 1, dma=True, **wide)
    assert _times(busy, 1, dma=False, **wide) == _times(calm, 1, dma=False, **wide)
    assert _times(busy, 0, **wide) == _times(calm, 0, **wide)


def test_the_simulator_s_baseline_is_the_estimates_collective_then_gemm(hw):
    lib = dataclasses.replace(hw, coll_latency_us=13.5, coll_bw_gbps=304.0, gemm_mem_efficiency=0.5)
    for op in (AG, RS, A2A):
        est = scenario_estimates(lib, op=op, m=4096.0, n=8192.0, k=4096.0, P=8.0, imbalance=1.5, dtype_bytes=2.0,
                                 peak=989.4e12)
        base = schedule_times(lib, op=op, m=4096.0, n=8192.0, k=4096.0, P=8.0, imbalance=1.5, dtype_bytes=2.0,
                              peak=989.4e12, gran=0, degree=1.0, a2a=False, per_step=False, split_n=False, dma=False)
        assert float(base["t_comm_s"]) == float(est["t_comm"])
        assert float(base["t_comp_s"]) == float(est["t_comp"])
        assert float(base["time_s"]) == float(est["t_comm"] + est["t_comp"])


def test_the_heuristic_and_the_features_read_the_same_estimates():
    from ficco_select.features import FEATURE_NAMES, pair_features
    from ficco_select.heuristic import estimates
    from ficco_select.scenario import Scenario

    hw = load_hardware("h100-nvswitch")
    s = Scenario(group="t", op="gemm_rs", m=4096, n=8192, k=28672, dtype="bfloat16", world_size=8,
                 hardware=hw.name, imbalance=1.0)
    est = estimates(s, hw)
    row = pair_features([s.as_record()], ["none.sm"], {hw.name: hw})[0]
    at = {name: row[i] for i, name in enumerate(FEATURE_NAMES)}
    assert at["log2_t_comm_est"] == np.log2(est["t_comm"])
    assert at["log2_t_comp_est"] == np.log2(est["t_comp"])
    assert at["dil_d2_est"] == est["dil_2"]


def test_the_new_terms_are_optional_and_zero_turns_them_off(tmp_path):
    spec = spec_as_dict(load_hardware("a100-nvswitch"))
    for field in ("gemm_mem_efficiency", "coll_latency_us", "coll_bw_gbps", "step_sync_us"):
        spec.pop(field)
    old = spec_from_dict(spec, "old.yaml")  # a spec written before the terms existed
    assert (old.gemm_mem_efficiency, old.coll_bw_gbps, old.coll_latency_us, old.step_sync_us) == (1.0, 0.0, 0.0, 0.0)
    with pytest.raises(HardwareError, match="coll_bw_gbps"):
        spec_from_dict({**spec, "coll_bw_gbps": -1.0}, "bad.yaml")
    with pytest.raises(HardwareError, match="gemm_mem_efficiency"):
        spec_from_dict({**spec, "gemm_mem_efficiency": 0.0}, "bad.yaml")
    with pytest.raises(HardwareError, match="gemm_launch_us"):  # a required fixed cost stays positive
        spec_from_dict({**spec, "gemm_launch_us": 0.0}, "bad.yaml")


def test_every_list_of_spec_fields_derives_from_their_roles():
    from ficco_select.data.calibrate import RECALIBRATED
    from ficco_select.data.machines import _DRAWN
    from ficco_select.runtime.scope import SPEC_RANGE_FIELDS
    from ficco_select.train.adapt import PERTURBED

    rates_and_costs = set(fields_of("rate", "latency"))
    assert {"dma_bw_gbps", "coll_bw_gbps", "step_sync_us"} <= rates_and_costs
    for listed in (RECALIBRATED, _DRAWN, SPEC_RANGE_FIELDS, PERTURBED):
        assert rates_and_costs <= set(listed)
    assert set(fields_of("fraction")) <= set(_DRAWN) & set(PERTURBED)
    # A ceiling (off on every trained machine) is read by the range check, never drawn.
    ceilings = set(fields_of("ceiling"))
    assert ceilings == {"sm_bw_gbps"} and ceilings <= set(SPEC_RANGE_FIELDS)
    assert not ceilings & (set(RECALIBRATED) | set(_DRAWN) | set(PERTURBED))


# -- the terms fitted against the wider published record ----------------------------------
def test_the_realized_overlap_hides_only_its_fraction_of_the_shorter_side(hw):
    from ficco_select.costs import overlapped

    assert overlapped(hw, 2.0, 1.0) == 2.0  # the ideal: the longer alone
    partial = dataclasses.replace(hw, overlap_efficiency=0.75)
    assert float(overlapped(partial, 2.0, 1.0)) == pytest.approx(2.25)
    assert float(overlapped(partial, 1.0, 2.0)) == pytest.approx(2.25)
    # Schedules slow down, the serial baseline does not.
    assert _times(partial, 0) == _times(hw, 0)
    assert _times(partial, 1) > _times(hw, 1) and _times(partial, 2, degree=2.0) > _times(hw, 2, degree=2.0)


def test_an_overlapped_call_pays_its_fixed_cost_once_per_peer(hw):
    handshakes = dataclasses.replace(hw, overlap_call_us=20.0)
    assert _times(handshakes, 0) == _times(hw, 0)
    # 8 ranks: 7 peers, whatever the granularity.
    assert float(_times(handshakes, 1) - _times(hw, 1)) == pytest.approx(7 * 20e-6, rel=1e-9)
    assert float(_times(handshakes, 2, degree=4.0) - _times(hw, 2, degree=4.0)) == pytest.approx(7 * 20e-6, rel=1e-9)


def test_fp8_gemms_scale_by_their_efficiency_and_write_bf16(hw):
    # Compute-bound: 4096^3 in fp8 at the fp8 peak; the term scales the rate of fp8 only.
    big = (4096, 4096, 4096)
    fast, slow = dataclasses.replace(hw, fp8_gemm_efficiency=1.0), dataclasses.replace(hw, fp8_gemm_efficiency=0.5)
    assert float(gemm_time(slow, *big, 1, 1978.9e12)) == pytest.approx(2 * float(gemm_time(fast, *big, 1, 1978.9e12)))
    assert gemm_time(slow, *big, 2, 989.4e12) == gemm_time(fast, *big, 2, 989.4e12)
    # Memory-bound: 1-byte operands, a 2-byte output.
    M, N, K = 8, 8192, 8192
    expected = ((M * K + K * N) * 1 + M * N * 2) / (hw.mem_bw_gbps * GB)
    assert float(gemm_time(hw, M, N, K, 1, 1978.9e12)) == pytest.approx(expected, rel=1e-12)


def test_the_fit_recovers_a_fixed_cost_from_points_made_with_it():
    """Hand-made published points timed by a spec with a known per-peer cost: ``fit`` finds it."""
    from ficco_select.data.published import Point, fit, predict

    truth = dataclasses.replace(load_hardware("h100-nvswitch"), overlap_call_us=25.0)
    points = []
    for i, m in enumerate((1024, 4096, 16384)):
        base = Point(row=i + 1, source="https://example.org", kind="overlap", hardware="h100-nvswitch", grade="A",
                     op="ag_gemm", m=m, n=28672, k=8192, world_size=8, schedule="shard.ring.dma")
        p = predict(base, truth)
        points.append(dataclasses.replace(base, baseline_us=p["time_us"], method_us=p["method_us"]))
    start = dataclasses.replace(truth, overlap_call_us=2.0)
    fitted, report = fit(points, start, fields=("overlap_call_us",), kinds=("overlap",))
    assert fitted.overlap_call_us == pytest.approx(25.0, rel=0.02)
    assert report["after"]["speedup_ape_median"] < 1e-3
