"""Fitting a preset's model terms to published points (``ficco sim fit``).

``fit`` runs least squares on the log ratios of the simulator's predictions to the times (or
bandwidths) others measured on the preset's device; ``ficco_select.data.published`` reads the
points and predicts them."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ficco_select.data.published import Point, PublishedError, compare, predict, within_devices
from ficco_select.hardware import HardwareSpec, spec_field

FITTED = ("gemm_efficiency", "gemm_mem_efficiency", "coll_latency_us", "coll_bw_gbps", "step_sync_us",
          "dma_mem_contention", "overlap_efficiency", "overlap_call_us")
"""The spec numbers ``fit`` fits by default: the GEMM's efficiency and the bandwidth its
operands reach (what bounds a piece with few rows), the collective library's latency and
bus bandwidth, a decomposed schedule's per-step cost and the GEMM's slowdown beside
copy-engine transfers, the realized fraction of ideal overlap and an overlapped call's
fixed cost (on request: ``fp8_gemm_efficiency`` to fp8 ``gemm`` rows, ``sm_comm_latency_us`` and
``sm_bw_gbps`` to ``sm_collective`` rows, ``switch_bw_gbps`` and ``switch_latency_us`` to
``switch_collective`` rows). The data-sheet numbers (peaks, memory and link bandwidth, units,
tiles) stay as published; a fixed cost the times cannot tell from the others (a GEMM's
launch, a copy's issue latency) stays as the preset says."""
FIT_KINDS = ("overlap", "collective")
"""The points a fit reads by default: each overlap point's baseline and method times, each
collective's time. ``fused`` (on request) adds each ``baseline`` point that times a fused
overlap kernel: its baseline time, and the kernel's time against the simulator's fastest
overlapped schedule, one-sided (a fused kernel is the finest overlap a library ships, so
the best schedule the model knows may be slower, not faster). It is not a default: on
h100-nvswitch's rows the fused kernels' losses and async-TP's measured wins cannot both
be met by one set of terms (``docs/published.md``). GEMM and bandwidth rows are checks there: the GEMM rows were measured in
other setups (a best shape found by a sweep, the L2 not flushed). A preset without overlap
points fits its GEMM efficiency and bus bandwidth to them (``kinds``)."""
KINDS = ("overlap", "baseline", "collective", "sm_collective", "switch_collective", "gemm", "bandwidth", "fused")
NEGLIGIBLE = 1e-3
"""A fitted fraction or fixed cost below this is written as 0: the data say the term is absent."""


def _written(field: str, value: float) -> float:
    """A fitted number as a preset holds it: 3 significant digits; 0 where the term vanished
    and may be off (a term a spec may leave out, a contention factor)."""
    may_be_off = spec_field(field).default == 0 or field == "dma_mem_contention"
    return 0.0 if value < NEGLIGIBLE and may_be_off else float(f"{max(value, NEGLIGIBLE):.3g}")


def _is_fused(point: Point) -> bool:
    """A ``baseline`` point that times a fused overlap kernel (a ``fused`` point of a fit)."""
    return point.kind == "baseline" and math.isfinite(point.method_us)


def fit(points: list[Point], spec: HardwareSpec, *, fields: tuple[str, ...] = FITTED,
        kinds: tuple[str, ...] = FIT_KINDS) -> tuple[HardwareSpec, dict]:
    """`spec` with `fields` fitted to the points of its preset whose kind is in `kinds`: least
    squares on the log ratios of predicted to measured times (bandwidths for ``bandwidth``
    points), fractions kept in (0, 1]. Returns the fitted spec and what it was fitted to: the
    rows, their sources, and the APE medians before and after."""
    from scipy.optimize import least_squares

    extra = ("fp8_gemm_efficiency", "sm_comm_units", "gemm_launch_us", "dma_latency_us", "dma_bw_gbps",
             "sm_comm_latency_us", "sm_bw_gbps", "switch_bw_gbps", "switch_latency_us")
    unknown = [f for f in fields if f not in FITTED and f not in extra]
    if unknown:
        raise PublishedError(f"cannot fit field '{unknown[0]}' (fitted: {', '.join(FITTED + extra)})")
    fused = "fused" in kinds
    mine = [p for p in points if p.hardware == spec.name and (p.kind in kinds or fused and _is_fused(p))]
    if not mine:
        raise PublishedError(f"no {' or '.join(kinds)} points of {spec.name} to fit to")
    for p in mine:
        within_devices(p, spec)
    fractions = [f for f in fields if f in ("gemm_efficiency", "gemm_mem_efficiency", "dma_mem_contention", "sm_comm_units",
                                            "overlap_efficiency")]

    def spec_at(x: np.ndarray) -> HardwareSpec:
        return dataclasses.replace(spec, **{f: float(np.exp(v)) for f, v in zip(fields, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        hw = spec_at(x)
        out = []
        for p in mine:
            predicted = predict(p, hw)
            if p.kind == "bandwidth":
                out.append(np.log(predicted["bandwidth_gbps"] / p.bandwidth_gbps))
                continue
            out.append(np.log(predicted["time_us"] / p.baseline_us))
            if p.kind == "overlap":
                out.append(np.log(predicted["method_us"] / p.method_us))
            elif fused and _is_fused(p):  # one-sided: a schedule slower than the kernel is no error
                out.append(min(np.log(predicted["best_us"] / p.method_us), 0.0))
        return np.array(out)

    def start_of(f: str) -> float:
        if f == "sm_bw_gbps" and not 0 < spec.sm_bw_gbps < spec.link_bw_gbps:
            return spec.link_bw_gbps / 2  # off (0) or at the link's rate, it moves nothing: a fit there cannot move
        return max(getattr(spec, f), 0.5 if f.endswith("_us") else 0.05)

    start = np.log([start_of(f) for f in fields])
    low = np.full(len(fields), -np.inf)
    high = np.array([0.0 if f in fractions else np.log(2.0) if f == "fp8_gemm_efficiency" else np.inf
                     for f in fields])
    result = least_squares(residuals, np.minimum(start, high - 1e-9), bounds=(low, high), x_scale=1.0)
    fitted = dataclasses.replace(spec, **{f: _written(f, v) for f, v in zip(fields, np.exp(result.x))})
    before, after = compare(mine, {spec.name: spec}), compare(mine, {spec.name: fitted})
    return fitted, {"rows": [p.row for p in mine], "sources": sorted({p.source for p in mine}),
                    "fields": {f: getattr(fitted, f) for f in fields},
                    "before": before["presets"][spec.name], "after": after["presets"][spec.name]}
