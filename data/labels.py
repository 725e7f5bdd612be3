"""How timed repetitions become a dataset row's label columns: one rule for every source.

The harness (a sweep's ranks), the simulator (noisy repetitions around the model's time)
and telemetry read back (a job's executed calls) all label with ``label_columns``:
``time_s`` the median of a schedule's repetitions, ``time_spread`` their interquartile
range / median (``summarize``), ``noisy`` the spread above the policy's limit, and
``is_best`` / ``near_best`` by ``best_labels``: the fastest verified median, and every
verified schedule whose repetitions cannot show it more than the tie floor
(``ficco_select.schedule.TIE``) slower, by a bootstrap of the ratio of medians.
NumPy and the standard library only: measuring tools and training both import it.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

import numpy as np

TIE_CONFIDENCE = 0.95
"""One-sided confidence that a schedule is more than the tie floor slower than the best."""


def summarize(times: Sequence[float]) -> tuple[float, float]:
    """(median, relative spread) of one schedule's repetitions; spread = IQR / median, 0 for one repetition."""
    med = statistics.median(times)
    if len(times) < 2:
        return med, 0.0
    q = statistics.quantiles(times, n=4, method="inclusive")
    return med, (q[2] - q[0]) / med if med > 0 else 0.0


def best_labels(times: Sequence[Sequence[float]] | np.ndarray, verified: Sequence[bool], tie_floor: float, *,
                groups: Sequence | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(is_best, near_best) of each schedule's repetitions `times`, within its scenario
    (`groups`: one id per row; None: all rows are one scenario's).

    is_best: verified with the smallest verified median (every such one, should medians be
    equal). near_best (a tie) by evidence: verified, and the repetitions cannot show it
    more than `tie_floor` slower than the best: the lower end of a one-sided
    ``TIE_CONFIDENCE`` bootstrap interval of median(its reps) / median(best's reps) is
    within 1 + `tie_floor`, i.e. the bootstrap's chance that the ratio is within it exceeds
    1 - ``TIE_CONFIDENCE``. More repetitions narrow the interval; a noisy pair stays a tie,
    a clearly slower schedule does not; equal repetitions give the plain ratio of medians.
    The bootstrap is exact (``_median_law``): deterministic, no resamples drawn.
    """
    rows = _as_rows(times)
    n = len(rows)
    codes = np.zeros(n, dtype=np.intp) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    medians, lowest, highest = _row_stats(rows, np.median), _row_stats(rows, np.min), _row_stats(rows, np.max)
    good = np.asarray(verified, dtype=bool) & np.isfinite(medians)
    best = np.full(codes.max() + 1 if n else 0, np.inf)
    np.minimum.at(best, codes[good], medians[good])
    is_best = good & (medians == best[codes])
    near = is_best.copy()
    # Each scenario's best row (the first at the best median) and the rows that might tie it:
    # every bootstrap ratio is at least min(own reps) / max(best's reps), so beyond 1 + tie_floor
    # a row is no tie without resampling.
    tops = np.flatnonzero(is_best)
    best_row = np.full(len(best), -1)
    best_row[codes[tops][::-1]] = tops[::-1]
    top = best_row[codes]
    with np.errstate(invalid="ignore", divide="ignore"):
        maybe = np.flatnonzero(good & ~is_best & (lowest / np.where(top >= 0, highest[top], np.nan) <= 1 + tie_floor))
    best_laws = {b: _bootstrap_median(rows[b]) for b in set(top[maybe].tolist())}  # once per scenario
    for i in maybe:
        near[i] = _chance_within(_bootstrap_median(rows[i]), best_laws[top[i]], 1 + tie_floor) >= 1 - TIE_CONFIDENCE
    return is_best, near


def _as_rows(times) -> np.ndarray | list[np.ndarray]:
    """`times` as a 2-D array (every row as many repetitions) or a list of 1-D arrays."""
    if isinstance(times, np.ndarray) and times.ndim == 2:
        return times.astype(float, copy=False)
    return [np.asarray(t, dtype=float) for t in times]


def _row_stats(rows, stat) -> np.ndarray:
    """`stat` (np.median, np.min, np.max) of each row; NaN for a row without repetitions."""
    if isinstance(rows, np.ndarray):
        return stat(rows, axis=1) if rows.shape[1] else np.full(len(rows), math.nan)
    return np.array([stat(t) if len(t) else math.nan for t in rows])


def _chance_within(law: tuple[np.ndarray, np.ndarray], best_law: tuple[np.ndarray, np.ndarray],
                   factor: float) -> float:
    """The bootstrap's chance that median(resample of a schedule's reps) <= `factor` x
    median(resample of the best's reps), resamples drawn with replacement, from the exact
    laws of the two resample medians (``_bootstrap_median``), not from drawn resamples."""
    (values, chances), (best_values, best_chances) = law, best_law
    within = values[:, None] <= factor * best_values[None, :]
    return float(chances @ within @ best_chances)


def _bootstrap_median(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The values a resample's median takes, and their chances."""
    lower, upper, chance = _median_law(len(times))
    t = np.sort(times)
    return (t[lower] + t[upper]) / 2, chance


@functools.cache
def _median_law(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The law of the median of n draws, with replacement, from n sorted values: the
    (lower, upper) middle order statistics' indices into the sorted values (equal for odd
    n) and their probabilities. N_j, the draws at index <= j, is Binomial(n, (j + 1) / n)."""
    def at_most(j):  # a draw's chance to land at index <= j
        return (j + 1) / n

    def binom(k, p):
        return math.comb(n, k) * p ** k * (1 - p) ** (n - k)

    lower, upper, chance = [], [], []
    if n % 2:  # the median is the middle draw: P(index <= j) = P(N_j >= (n + 1) / 2)
        k = (n + 1) // 2
        cdf = [sum(binom(i, at_most(j)) for i in range(k, n + 1)) for j in range(n)]
        for j in range(n):
            lower.append(j), upper.append(j), chance.append(cdf[j] - (cdf[j - 1] if j else 0.0))
    else:  # the mean of draws h and h + 1 (h = n / 2) in sorted order
        h = n // 2
        for a in range(n):
            p_a, p_below = at_most(a), at_most(a - 1)
            # both middle draws at a: N_{a-1} <= h - 1 and N_a >= h + 1
            both = (sum(binom(i, p_a) for i in range(h + 1, n + 1))
                    - sum(binom(i, p_below) for i in range(h + 1, n + 1))
                    - math.comb(n, h) * p_below ** h * ((1 - p_below) ** (n - h) - (1 - p_a) ** (n - h)))
            lower.append(a), upper.append(a), chance.append(both)
            # the lower at a, the upper at b > a: exactly h draws at <= a with one at a, none in (a, b), one at b
            exactly_h = math.comb(n, h) * (p_a ** h - p_below ** h) * (1 - p_a) ** (n - h)
            above = n - 1 - a
            for b in range(a + 1, n):
                lower.append(a), upper.append(b)
                chance.append(exactly_h * (((n - b) / above) ** (n - h) - ((n - 1 - b) / above) ** (n - h)))
    return np.array(lower), np.array(upper), np.array(chance)


def label_columns(times: Sequence[Sequence[float]] | np.ndarray, *, verified: Sequence[bool],
                  rel_error: Sequence[float], attempts: Sequence[int], noisy_spread: float, tie_floor: float,
                  groups: Sequence | None = None) -> dict[str, list]:
    """The label columns of rows of timed repetitions (``ficco_select.data.dataset.LABEL_COLUMNS`` but
    ``scenario_id``, ``schedule``, ``status``, ``error`` and ``time_model_s``), one list
    entry per row: median, spread, the repetitions, the noisy flag, verification and the
    best labels (``best_labels``, within each of `groups`)."""
    if isinstance(times, np.ndarray) and times.ndim == 2:  # many rows (the simulator's): the same quantiles, vectorized
        (q1, q3), med = np.percentile(times, [25, 75], axis=1), np.median(times, axis=1)
        medians, spreads = med.tolist(), np.where(med > 0, (q3 - q1) / np.where(med > 0, med, 1.0), 0.0).tolist()
    else:
        medians, spreads = (list(column) for column in zip(*map(summarize, times))) if len(times) else ([], [])
    is_best, near = best_labels(times, verified, tie_floor, groups=groups)
    return {
        "time_s": medians,
        "time_spread": spreads,
        "times_s": [list(t) for t in times],
        "attempts": list(attempts),
        "noisy": [spread > noisy_spread for spread in spreads],
        "verified": [bool(v) for v in verified],
        "rel_error": list(rel_error),
        "is_best": is_best.tolist(),
        "near_best": near.tolist(),
    }


def failed_label(reason: str) -> dict:
    """The label columns of a schedule that could not be measured (``label_columns``'s
    columns, with ``status`` and ``error``): kept so that a rerun does not retry it."""
    return {"status": "failed", "error": reason, "time_s": math.nan, "time_model_s": math.nan,
            "time_spread": math.nan, "times_s": [], "attempts": 0, "noisy": False, "verified": False,
            "rel_error": math.nan, "is_best": False, "near_best": False}
