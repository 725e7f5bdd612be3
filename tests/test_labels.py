"""One labelling rule for every source (``ficco_select.data.labels``): the harness's rows, the
simulator's and telemetry's get their median, spread and best / tie labels from it."""

import math

import numpy as np
import pytest

from ficco_select.data.labels import _median_law, best_labels, failed_label, label_columns, summarize
from ficco_select.data.simulate import simulate
from ficco_select.hardware import load_hardware
from ficco_select.scenario import Scenario


def test_ties_need_evidence_not_the_largest_spread():
    tight_best = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00]
    clearly_slower = [1.06, 1.07, 1.05, 1.06, 1.08, 1.06, 1.05]  # 6% slower, tight: not a tie
    close = [1.01, 1.00, 1.02, 1.01, 0.99, 1.01, 1.00]            # within the 2% floor: a tie
    noisy_slower = [0.80, 1.40, 1.00, 1.30, 0.90, 1.20, 1.05]      # median 1.05 but cannot be told apart
    is_best, near = best_labels([tight_best, clearly_slower, close, noisy_slower], [True] * 4, 0.02)
    assert is_best.tolist() == [True, False, False, False]
    assert near.tolist() == [True, False, True, True]
    is_best, near = best_labels([tight_best, close], [False, True], 0.02)  # an unverified row is never best
    assert is_best.tolist() == [False, True] and near.tolist() == [False, True]
    assert best_labels([tight_best], [False], 0.02)[1].tolist() == [False]


def test_each_scenario_is_labelled_against_its_own_best():
    times = [[1.0] * 5, [1.5] * 5, [3.0] * 5, [3.03] * 5, [3.2] * 5]
    is_best, near = best_labels(times, [True] * 5, 0.02, groups=["a", "a", "b", "b", "b"])
    assert is_best.tolist() == [True, False, True, False, False]
    assert near.tolist() == [True, False, True, True, False]  # equal repetitions: the plain ratio, 1.01 and 1.067


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10, 11, 20])
def test_the_exact_bootstrap_median_law_matches_drawn_resamples(n):
    lower, upper, chance = _median_law(n)
    assert chance.sum() == pytest.approx(1.0) and (chance >= -1e-15).all()
    x = np.sort(np.random.default_rng(n).random(n))
    draws = np.median(x[np.random.default_rng(0).integers(0, n, size=(100_000, n))], axis=1)
    for value in np.unique((x[lower] + x[upper]) / 2)[:6]:
        exact = chance[np.isclose((x[lower] + x[upper]) / 2, value)].sum()
        assert np.isclose(draws, value).mean() == pytest.approx(exact, abs=0.01)


def test_label_columns_on_lists_and_on_a_matrix_agree():
    rng = np.random.default_rng(3)
    reps = rng.lognormal(0.0, 0.05, size=(12, 5)) * np.repeat([1.0, 1.3, 2.0], 4)[:, None]
    kw = dict(verified=[True] * 12, rel_error=[0.0] * 12, attempts=[1] * 12, noisy_spread=0.05, tie_floor=0.02,
              groups=np.repeat(["s0", "s1", "s2"], 4))
    on_matrix, on_lists = label_columns(reps, **kw), label_columns([list(r) for r in reps], **kw)
    assert on_matrix["is_best"] == on_lists["is_best"] and on_matrix["near_best"] == on_lists["near_best"]
    np.testing.assert_allclose(on_matrix["time_s"], on_lists["time_s"], rtol=1e-12)
    np.testing.assert_allclose(on_matrix["time_spread"], on_lists["time_spread"], rtol=1e-9)
    assert summarize([2.0]) == (2.0, 0.0)
    assert math.isnan(failed_label("x")["time_s"]) and failed_label("x")["status"] == "failed"


def test_the_simulator_labels_by_the_same_rule():
    hw = load_hardware("h100-nvswitch")
    scenarios = [Scenario(group="g", op=op, m=4096, n=8192, k=4096, dtype="bfloat16", world_size=8,
                          hardware=hw.name) for op in ("ag_gemm", "gemm_rs")]
    rows = simulate(scenarios, hw, noise=0.05, seed=1)
    is_best, near = best_labels(rows["times_s"].tolist(), [True] * len(rows), 0.02, groups=rows["scenario_id"])
    assert rows["is_best"].tolist() == is_best.tolist() and rows["near_best"].tolist() == near.tolist()
    assert rows.groupby("scenario_id")["is_best"].sum().eq(1).all()
