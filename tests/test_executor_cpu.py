"""The cpu executor on real gloo ranks: every schedule equals the reference, failures are
caught, communication progresses while computing. One job per world size for the module."""

import time

import pytest
import torch

from ficco_select import candidates
from ficco_select.data.measure.gloo import MeasureConfig, MeasureError, background_progress_rank, measure_spawned
from ficco_select.executor import ranks
from ficco_select.executor.operators import TOLERANCE, piece_bounds, relative_error
from helpers.ranks import no_rank_left
from helpers.scenarios import correctness_set

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo

FAST = MeasureConfig(warmup=0, reps=5, timeout_s=60, max_remeasure=0, min_rep_s=0.0)  # one run a repetition


@pytest.fixture(scope="module", params=[2, 3, 4])
def measured(request):
    P = request.param
    scenarios = correctness_set(P)
    rows: list[dict] = []
    measure_spawned(scenarios, FAST, on_scenario=rows.extend)
    return scenarios, rows


def test_every_legal_schedule_runs_and_equals_the_reference(measured):
    scenarios, rows = measured
    for s in scenarios:
        got = {r["schedule"]: r for r in rows if r["scenario_id"] == s.scenario_id}
        assert sorted(got) == sorted(c.name for c in candidates(s, "cpu"))
        bad = {name: r["rel_error"] for name, r in got.items() if not r["verified"]}
        assert not bad, f"{s.op} {s.dtype} P={s.world_size}: wrong results {bad}"
        for r in got.values():
            assert len(r["times_s"]) == FAST.reps and r["time_s"] > 0 and r["time_spread"] >= 0


def test_a_wrong_result_is_caught_and_recorded():
    s = correctness_set(2)[1]
    victim = candidates(s, "cpu")[-1].name
    rows: list[dict] = []
    measure_spawned([s], MeasureConfig(warmup=0, reps=5, min_rep_s=0.0, fault=f"corrupt@{victim}"), on_scenario=rows.extend)
    verdict = {r["schedule"]: r["verified"] for r in rows}
    assert verdict.pop(victim) is False
    assert all(verdict.values())


@pytest.mark.parametrize("fault,needle", [("exit@1", "rank 1 died"), ("hang@0", "no progress")])
def test_a_dead_or_hung_rank_ends_with_an_error_and_no_process_left(fault, needle):
    s = correctness_set(3)[0]
    t0 = time.monotonic()
    with pytest.raises(MeasureError, match=needle):
        measure_spawned([s], MeasureConfig(warmup=0, reps=5, min_rep_s=0.0, timeout_s=4, fault=fault), on_scenario=lambda rows: None)
    assert time.monotonic() - t0 < 60
    assert no_rank_left()


def test_communication_progresses_while_the_caller_computes():
    receiver, _ = ranks.run_ranks(background_progress_rank, 2, (1 << 22,), timeout_s=90)
    assert receiver[2], "the data landed only when wait() was called: no background progress"
    assert receiver[1] >= 1 and receiver[3]


def test_piece_bounds_cover_the_range():
    for total in (1, 7, 16, 33):
        for parts in (1, 2, 3, 4, 8):
            b = piece_bounds(total, parts)
            assert b[0][0] == 0 and b[-1][1] == total and len(b) == parts
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1


def test_relative_error_flags_nan_shape_and_outliers():
    ref = torch.randn(4, 5)
    assert relative_error(ref.clone(), ref) == 0
    assert relative_error(ref.bfloat16(), ref) <= TOLERANCE["bfloat16"]
    bad = ref.clone()
    bad[1, 2] += 1.0
    assert relative_error(bad, ref) > TOLERANCE["float32"]
    bad[1, 2] = float("nan")
    assert relative_error(bad, ref) == float("inf")
    assert relative_error(ref[:3], ref) == float("inf")
