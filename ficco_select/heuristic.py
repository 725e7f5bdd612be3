"""The hand heuristic: documented rules in the spirit of the FiCCO paper.

Estimates come from ``ficco_select.costs`` on the scenario's hardware spec:
T_comp (whole per-rank GEMM), T_comm (whole collective), DIL at degree d (the pieces'
GEMMs over the whole GEMM, minus 1) and a piece's transfer time.

``choose`` (the runtime's fallback; ``heuristic`` in the tables) weighs what overlap hides
against what decomposing costs, the paper's trade-off, for a handful of schedule families:

1. **Candidates.** The shard-level ring and, at each finer degree d, the ring with one GEMM
   per step and (P >= 3) the all-to-all pattern with one GEMM per step or per piece (an MoE
   step's uneven chunks cannot be batched), pieces along m, on each engine the machine has
   (the switch: the all-to-all pattern only, and ``none.switch``, the whole collective in the
   switch, whose time is the GEMM then ``costs.switch_collective_time``).
   (A ring's GEMM per piece and pieces along n are the best schedule of under 1% of the
   simulated bf16 scenarios: fewer, larger GEMMs win.)
2. **A back-of-the-envelope time for each.**
   - GEMM: the whole GEMM with its decomposition loss (a ring's P shard GEMMs; all-to-all's
     d batched steps, or its P x d piece GEMMs), slowed while transfers run beside it (SM-driven transfers take
     compute units, copy engines memory bandwidth: ``costs.contended``);
   - COMM: steps x one step's transfer (ring: one peer per step; all-to-all: every peer at
     once, an all-reduce's twice, the reduce-scatter then the all-gather of each piece); an
     all-reduce's ring form ends with the whole all-gather of the reduced blocks;
   - time = max(GEMM, COMM) + ``fill`` x min(GEMM, COMM) / steps (the pipeline's fill and
     drain) + steps x the per-step synchronization.
   This is not the simulator (``costs.schedule_times``): one max per schedule, no pipeline
   stages, no per-piece GEMMs; it shares the simulator's primitives, so on simulated rows
   it sees the machine as the simulator does (read its scores there as an upper bound).
3. **Overlap only if it pays.** The fastest estimate runs if it saves at least ``min_gain``
   of the baseline's estimate (T_comp + T_comm); else the baseline. Candidates are tried in
   order of estimate; the first legal one runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ficco_select.costs import (OP_CODES, US, collective_time, contended, gemm_time, overlapped, scenario_estimates,
                                switch_bytes, switch_collective_time, switch_time, transfer_time)
from ficco_select.hardware import HardwareSpec
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, SHARD, Schedule, degrees, is_legal
from ficco_select.schedule import backend_for as schedule_backend


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeuristicParams:
    """``choose``'s two numbers (tuned on training data by ``ficco_select.train.selectors.Heuristic``)."""

    min_gain: float = 0.0
    """Overlap runs only if its estimate saves this share of the baseline's."""
    fill: float = 1.0
    """Share of one step's shorter side (GEMM or transfer) left exposed by fill and drain."""


def backend_for(hw: HardwareSpec) -> str:
    """The backend whose candidate set a decision on `hw` takes (``schedule.backend_for``)."""
    return schedule_backend(hw.kind)


def estimates(s: Scenario, hw: HardwareSpec) -> dict[str, float]:
    """Analytic T_comp, T_comm, the ring's transfers, ideal speedup, DIL and piece transfer per
    degree (``costs.scenario_estimates``)."""
    # Floats, not ints: a huge int would overflow NumPy's int64 (the runtime must not fail on it).
    est = scenario_estimates(hw, op=OP_CODES[s.op], m=float(s.m), n=float(s.n), k=float(s.k), P=s.world_size,
                             imbalance=s.imbalance, dtype_bytes=s.dtype_bytes, peak=hw.peak_of(s.dtype) * 1e12,
                             degrees=(1, *degrees(s.world_size)))
    out = {key: float(est[key]) for key in ("t_comp", "t_comm", "ring", "M", "N", "K", "shard_bytes")}
    out["ideal"] = (out["t_comp"] + out["t_comm"]) / max(out["t_comp"], out["t_comm"], 1e-30)
    for d in (1, *degrees(s.world_size)):
        dil = float(est[f"dil_{d}"])
        out[f"dil_{d}"] = dil if out["t_comp"] > 0 else -1.0  # an empty GEMM loses nothing
        out[f"piece_comm_{d}"] = float(est[f"piece_comm_{d}"])
    return out


def choose(s: Scenario, hw: HardwareSpec, params: HeuristicParams = HeuristicParams(),
           backend: str | None = None, est: dict[str, float] | None = None) -> Schedule:
    """The heuristic's schedule for `s` on `hw` (always legal on `backend`): the module's rules.

    `est` may pass ``estimates(s, hw)`` computed once (tuning calls this many times).
    """
    backend = backend or backend_for(hw)
    est = est or estimates(s, hw)
    families = _families(s, hw, backend)
    times = _estimated_times(s, hw, est, families, params.fill)
    baseline = est["t_comp"] + est["t_comm"]
    for at in np.argsort(times, kind="stable"):
        if not times[at] <= (1 - params.min_gain) * baseline:  # (a NaN estimate never runs)
            break
        if is_legal(families.schedules[at], s, backend):
            return families.schedules[at]
    return BASELINE


@dataclasses.dataclass(frozen=True)
class _Families:
    """Rule 1's candidates, one entry each: the schedule and its axes as arrays."""

    schedules: tuple[Schedule, ...]
    degree: np.ndarray
    a2a: np.ndarray
    per_piece: np.ndarray
    dma: np.ndarray
    switch: np.ndarray
    whole: np.ndarray
    """``none.switch``: the whole collective in the switch, then the GEMM (no overlap)."""


_FAMILIES: dict[tuple, _Families] = {}


def _families(s: Scenario, hw: HardwareSpec, backend: str) -> _Families:
    """Rule 1's candidates for world size P on `hw`'s engines (made once per key)."""
    engines = hw.engines if backend != "cpu" else ("sm",)
    key = (s.world_size, engines)
    if key not in _FAMILIES:
        ring_engines = [e for e in engines if e != "switch"]  # the switch has no ring
        out = [Schedule(granularity="none", engine="switch")] if "switch" in engines else []
        out += [dataclasses.replace(SHARD, engine=e) for e in ring_engines]
        for d in degrees(s.world_size):
            out += [Schedule(granularity="ficco", degree=d, pattern="ring", compute="gemm_per_step", split="m",
                             engine=e) for e in ring_engines]
            if s.world_size >= 3:  # all-to-all; per piece too: an MoE step's uneven chunks cannot be batched
                out += [Schedule(granularity="ficco", degree=d, pattern="a2a", compute=compute, split="m", engine=e)
                        for compute in ("gemm_per_step", "gemm_per_piece") for e in engines]
        _FAMILIES[key] = _Families(tuple(out), np.array([c.degree for c in out], float),
                                   np.array([c.pattern == "a2a" for c in out]),
                                   np.array([c.compute == "gemm_per_piece" for c in out]),
                                   np.array([c.engine == "dma" for c in out]),
                                   np.array([c.engine == "switch" for c in out]),
                                   np.array([c.granularity == "none" for c in out]))
    return _FAMILIES[key]


def _estimated_times(s: Scenario, hw: HardwareSpec, est: dict[str, float], f: _Families, fill: float) -> np.ndarray:
    """Rule 2's back-of-the-envelope time of each candidate in `f`, in seconds."""
    P, d = s.world_size, f.degree
    is_ar = s.op == "gemm_ar"
    peak = hw.peak_of(s.dtype) * 1e12
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # GEMM: a ring runs the P shard GEMMs (split over its d steps); all-to-all, d steps of
        # one batched GEMM over every peer's piece, or of P piece GEMMs.
        ring_gemm = est["t_comp"] * (1 + max(est["dil_1"], 0.0))
        a2a_step_gemm = d * gemm_time(hw, est["M"] / d, est["N"], est["K"], s.dtype_bytes, peak)
        a2a_piece_gemm = est["t_comp"] * (1 + np.maximum([est.get(f"dil_{int(x)}", 0.0) for x in d], 0.0))
        gemm = np.where(f.a2a, np.where(f.per_piece, a2a_piece_gemm, a2a_step_gemm), ring_gemm)
        steps = np.where(f.a2a, d, (P - 1) * d)
        step = transfer_time(hw, est["shard_bytes"] / d, np.where(f.a2a, P - 1, 1), f.dma, P)
        comm = steps * step * np.where(f.a2a & is_ar, 2.0, 1.0)
        if f.switch.any():  # a switch step: the step's pieces in one operation, reduced in the switch
            op = OP_CODES[s.op]
            comm = np.where(f.switch, steps * switch_time(hw, switch_bytes(op, est["shard_bytes"] / d, P)), comm)
        slowed = contended(hw, gemm, comm, f.dma)
        time = (overlapped(hw, slowed, comm) + fill * np.minimum(gemm, comm) / steps
                + steps * hw.step_sync_us * US + hw.overlap_call_us * US)
        if is_ar:  # the ring form's all-gather of the reduced blocks comes last
            time = time + np.where(f.a2a | f.whole, 0.0, collective_time(hw, OP_CODES["ag_gemm"], est["shard_bytes"], P))
        if f.whole.any():
            whole = est["t_comp"] + switch_collective_time(hw, OP_CODES[s.op], est["shard_bytes"], P)
            time = np.where(f.whole, whole, time)
    return np.asarray(time, float)

