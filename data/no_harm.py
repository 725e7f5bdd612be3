"""Fitting the GPU do-no-harm rule (``ficco_select.runtime.no_harm``) on published points.

At every collective + GEMM point of the calibration table (``data/published/gpu-calibration.csv``)
with a measured overlapped method, on the point's preset: the simulator's best overlap gain
(serial baseline over its fastest overlapped schedule) against the best gain measured
there, by any method (async-TP's fused ops, fused kernels). Their log ratio is the
residual, positive where the simulator was too optimistic. The margin of a regime is a
quantile of its residuals, clipped at 0 (a simulator that under-promises needs no margin)
and at ``FIT_MAX_MARGIN`` (a rule that strict already means "never overlap");
regimes split by the simulated serial time at ``SPLIT_US`` where each side has at least
``MIN_POINTS`` points and their margins differ by more than ``MIN_SPLIT``, else one margin
for all. The validation table is never read here.

Where a pick rests on terms no measurement fitted (``ficco_select.runtime.no_harm.TRUST_TERMS``),
the rule asks for ``unfitted_margin`` at every size: the worst machine's over-promise, the
largest median residual of one machine's points (over machines with at least ``MIN_POINTS``),
and at least the larger regime margin. A regime's margin pools machines and sizes; a pick
whose terms no measurement checked must clear what the simulator over-promised on the
machine where it over-promised most.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ficco_select.data.published import read_published
from ficco_select.data.published_calls import _cells, _measured_methods

QUANTILE = 0.5
"""Which quantile of the residuals a margin is: the median over-promise. Chosen on the
calibration points' calls (``ficco sim validate --published``): the 0.75 quantile sends the
calibration set's measured wins of 6% to 55% at serial times under a millisecond to the
baseline."""
SPLIT_US = 1000.0
"""The regime boundary, us of simulated serial time: below it, fixed costs the model lacks
(launch, synchronization, symmetric-memory handshakes) weigh on every overlapped call."""
FIT_MAX_MARGIN = math.log(1000.0)
"""The largest margin the fit writes: a gain of x1000, far past any overlap's (at most x2 over
the same links), so a rule this strict already means "never overlap"; the loader takes up to
``ficco_select.runtime.no_harm.MAX_MARGIN``."""
MIN_POINTS = 4
MIN_SPLIT = 0.05
"""Two regimes only where each has this many points and their margins differ by more than
this (in log gain): else the residuals do not say the regimes differ."""


def residuals(path: str | Path, specs: dict | None = None) -> list[dict]:
    """One record per collective + GEMM point of the table at `path` (on a preset, with a
    measured method): its rows, the simulated serial time (us), the simulator's best overlap
    gain, the best measured gain, and their log ratio ``residual``. `specs`: {preset: spec}
    to predict on instead of the committed presets."""
    from ficco_select.data.simulate import simulate_rows
    from ficco_select.hardware import load_hardware

    specs = specs or {}

    points = [p for p in read_published(path) if p.kind in ("overlap", "baseline") and p.hardware]
    methods = _measured_methods(path, _cells(path), points)
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault((p.source, p.hardware, p.op, p.m, p.n, p.k, p.dtype, p.world_size), []).append(p)
    out = []
    for group in groups.values():
        measured = [methods[p.row].speedup for p in group if p.row in methods]
        if not measured:
            continue
        hw = specs.get(group[0].hardware) or load_hardware(group[0].hardware)
        times = simulate_rows([group[0].scenario(hw.name)], hw).set_index("schedule")["time_s"]
        baseline = float(times["none.sm"])
        best = float(times[~times.index.str.startswith("none.")].min())
        out.append({"rows": [p.row for p in group], "hardware": hw.name, "op": group[0].op,
                    "baseline_us": baseline * 1e6, "simulated_gain": baseline / best,
                    "measured_gain": max(measured), "residual": math.log(baseline / best / max(measured))})
    return out


def best_gain_summary(records: list[dict]) -> dict:
    """How the simulator's best overlap gain compares with the best measured one: the median
    ratio, and the points where overlap wins or loses (gain > 1) as the best measured method."""
    if not records:
        return {"points": 0, "median_ratio": None, "wins_as_measured": 0}
    ratio = float(np.exp(np.median([r["residual"] for r in records])))
    agree = sum((r["simulated_gain"] > 1) == (r["measured_gain"] > 1) for r in records)
    return {"points": len(records), "median_ratio": round(ratio, 3), "wins_as_measured": agree}


def margins(residual: np.ndarray, baseline_us: np.ndarray, *, quantile: float = QUANTILE,
            split_us: float = SPLIT_US) -> dict:
    """selector.json's ``gpu_no_harm`` from residuals and the serial times they were seen at."""
    residual, baseline_us = np.asarray(residual, float), np.asarray(baseline_us, float)
    if not len(residual):
        raise ValueError("no published residuals to fit the GPU do-no-harm rule to")
    if not (np.isfinite(residual).all() and np.isfinite(baseline_us).all()):
        raise ValueError("a published residual or serial time is not a finite number: the simulator gave a time "
                         "of 0 or infinity there; no GPU do-no-harm rule is fitted on it")

    def margin(r: np.ndarray) -> float:
        return min(round(max(float(np.quantile(r, quantile)), 0.0), 4), FIT_MAX_MARGIN)

    small, large = residual[baseline_us < split_us], residual[baseline_us >= split_us]
    pooled = margin(residual)
    split = (len(small) >= MIN_POINTS and len(large) >= MIN_POINTS
             and abs(margin(small) - margin(large)) > MIN_SPLIT)
    return {"split_us": split_us if split else 0.0,
            "small_margin": margin(small) if split else pooled, "large_margin": margin(large) if split else pooled,
            "quantile": quantile, "points": int(len(residual)),
            "points_small": int(len(small)) if split else int(len(residual)),
            "points_large": int(len(large)) if split else 0}


def worst_machine(records: list[dict]) -> dict:
    """The machine whose overlap gains the simulator over-promises most: over the machines with
    at least ``MIN_POINTS`` residuals, the largest median residual (clipped at 0), and where."""
    by_machine: dict[str, list[float]] = {}
    for r in records:
        by_machine.setdefault(r["hardware"], []).append(r["residual"])
    worst = {"hardware": None, "median_residual": 0.0, "points": 0}
    for hardware, residual in sorted(by_machine.items()):
        median = float(np.median(residual))
        if len(residual) >= MIN_POINTS and median > worst["median_residual"]:
            worst = {"hardware": hardware, "median_residual": round(median, 4), "points": len(residual)}
    return worst


def fit_no_harm(path: str | Path | None = None) -> dict:
    """The rule fitted on the calibration table (default: the committed one), with its source."""
    from ficco_select.data.published import packaged

    path = Path(path) if path is not None else packaged()
    records = residuals(path)
    rule = margins(np.array([r["residual"] for r in records]), np.array([r["baseline_us"] for r in records]))
    worst = worst_machine(records)
    unfitted = max(rule["small_margin"], rule["large_margin"], worst["median_residual"])
    return {**rule, "unfitted_margin": min(round(unfitted, 4), FIT_MAX_MARGIN),
            "worst_machine": worst, "fitted_on": path.name}
