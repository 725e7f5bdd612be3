"""The hand heuristic: documented rules in the spirit of the FiCCO paper.

Estimates come from ``ficco_select.costs`` on the scenario's hardware spec:
T_comp (whole per-rank GEMM), T_comm (whole collective), DIL at degree d (the pieces'
GEMMs over the whole GEMM, minus 1) and a piece's transfer time.

Rules, in order:
1. **Does overlap pay at all?** If the ideal speedup (T_comp + T_comm) / max(...) is
   below ``min_ideal``, one side dwarfs the other: run the baseline.
2. **How fine?** Shard-level if its own decomposition loss (P shard GEMMs vs the whole)
   is at most ``max_dil``, else the baseline. Go one level deeper (d = 2, 4 or P, the finest
   that passes) only if its decomposition loss is at most ``max_dil`` and its piece
   transfer is not latency-bound (at least ``min_piece_over_latency`` times the
   per-transfer fixed cost): finer pieces hide more communication but lose GEMM efficiency
   and pay the fixed transfer cost more often.
3. **Which pattern?** ``a2a`` (every link at once) on a fully connected or switched
   topology with P >= 3, else ``ring``. A ring moves all bytes over one link per step: if
   that alone outlasts the estimated baseline, ring schedules (shard included) are out.
4. **GEMM per piece or per step?** Per step when per-piece GEMMs lose more than
   ``max_dil`` / 2 (fewer, larger GEMMs), else per piece.
5. **Which engine?** ``dma`` when the hardware has copy engines, the GEMM is at least as
   long as the transfers (so SM contention would cost), and a piece is large enough
   that the copy engine's larger fixed cost is amortized (transfer >= ``dma_amortize`` x
   its latency); else ``sm``.
6. If the result is not legal for the scenario, relax it step by step (ring, GEMM per
   piece, shard) down to the baseline, which is always legal.

``HeuristicParams`` are tuned on training data only (``train`` does the grid search).
Plain Python + NumPy: the runtime falls back to this.
"""

from __future__ import annotations

import dataclasses

from ficco_select.costs import OP_CODES, scenario_estimates
from ficco_select.hardware import HardwareSpec
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, SHARD, Schedule, degrees, is_legal


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeuristicParams:
    """The thresholds of rules 1, 2 and 5 (tuned on training data by ``train``)."""

    min_ideal: float = 1.1
    """Below this ideal overlap speedup, run the baseline."""
    max_dil: float = 0.15
    """Largest estimated decomposition loss accepted for a finer degree."""
    min_piece_over_latency: float = 4.0
    """A piece's transfer must take this many times the per-transfer fixed cost."""
    dma_amortize: float = 3.0
    """Use dma only if a piece's transfer takes this many times the DMA fixed cost."""


def backend_for(hw: HardwareSpec) -> str:
    """The backend whose candidate set applies: the cpu backend for a machine without copy
    engines (its kind, as ``schedule.hardware_problem`` says), else a GPU's (cuda/sim)."""
    return "sim" if hw.copy_engines else "cpu"


def estimates(s: Scenario, hw: HardwareSpec) -> dict[str, float]:
    """Analytic T_comp, T_comm, the ring's transfers, ideal speedup, DIL and piece transfer per
    degree (``costs.scenario_estimates``)."""
    # Floats, not ints: a huge int would overflow NumPy's int64 (the runtime must not fail on it).
    est = scenario_estimates(hw, op=OP_CODES[s.op], m=float(s.m), n=float(s.n), k=float(s.k), P=s.world_size,
                             imbalance=s.imbalance, dtype_bytes=s.dtype_bytes, peak=hw.peak_of(s.dtype) * 1e12,
                             degrees=(1, *degrees(s.world_size)))
    out = {key: float(est[key]) for key in ("t_comp", "t_comm", "ring")}
    out["ideal"] = (out["t_comp"] + out["t_comm"]) / max(out["t_comp"], out["t_comm"], 1e-30)
    for d in (1, *degrees(s.world_size)):
        dil = float(est[f"dil_{d}"])
        out[f"dil_{d}"] = dil if out["t_comp"] > 0 else -1.0  # an empty GEMM loses nothing
        out[f"piece_comm_{d}"] = float(est[f"piece_comm_{d}"])
    return out


def choose(s: Scenario, hw: HardwareSpec, params: HeuristicParams = HeuristicParams(),
           backend: str | None = None, est: dict[str, float] | None = None) -> Schedule:
    """The heuristic's schedule for `s` on `hw` (always legal on `backend`).

    `est` may pass ``estimates(s, hw)`` computed once (tuning calls this many times).
    """
    backend = backend or backend_for(hw)
    est = est or estimates(s, hw)
    P = s.world_size
    if est["ideal"] < params.min_ideal:
        return BASELINE
    # Pattern: every link at once where each peer has its own path; a ring otherwise.
    pattern = "a2a" if hw.topology in ("fully_connected", "switch") and P >= 3 else "ring"
    # A ring moves everything over one link per step: when that alone outlasts the whole
    # baseline, no ring schedule can win.
    ring_viable = est["ring"] < est["t_comp"] + est["t_comm"]
    latency = hw.sm_comm_latency_us * 1e-6
    degree = 1
    for d in degrees(P):
        if (est[f"dil_{d}"] <= params.max_dil
                and est[f"piece_comm_{d}"] >= params.min_piece_over_latency * latency):
            degree = d
    if degree == 1 and not (ring_viable and est["dil_1"] <= params.max_dil):
        return BASELINE  # shard-level overlap would not pay either
    engine = "sm"
    if "dma" in hw.engines and est["t_comp"] >= est["t_comm"]:
        if est[f"piece_comm_{degree}"] >= params.dma_amortize * hw.dma_latency_us * 1e-6:
            engine = "dma"
    wanted: list[Schedule] = []
    if degree > 1:
        compute = "gemm_per_step" if est[f"dil_{degree}"] > params.max_dil / 2 else "gemm_per_piece"
        base = Schedule(granularity="ficco", degree=degree, pattern=pattern, compute=compute, split="m",
                        engine=engine)
        wanted += [base, dataclasses.replace(base, compute="gemm_per_piece"),
                   dataclasses.replace(base, engine="sm")]
        if ring_viable:
            wanted += [dataclasses.replace(base, pattern="ring"),
                       dataclasses.replace(base, pattern="ring", compute="gemm_per_piece")]
    if ring_viable:
        wanted += [dataclasses.replace(SHARD, engine=engine), SHARD]
    for schedule in wanted:
        if is_legal(schedule, s, backend):
            return schedule
    return BASELINE
