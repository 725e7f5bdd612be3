"""Loopback sections: the real schedules on this GPU, verified, then timed against the ideal overlap.

Both run every legal cuda schedule of a scenario with ``ficco_select.data.measure.loopback.run_loopback``
(P virtual ranks on one device):

- ``loopback_correctness``: small scenarios, odd sizes on purpose; each schedule's output
  checked against the reference (``loopback.correctness``).
- ``loopback_realized``: >= 6 model-sized scenarios timed; per schedule, the realized
  fraction of the ideal overlap speedup (``loopback.realized``, see ``realized_fractions``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ficco_select.data.gpu_profile.runner import Run
from ficco_select.data.gpu_profile.timing import median, time_gpu
from ficco_select.data.measure.loopback import LoopbackResult, run_loopback
from ficco_select.executor.operators import TORCH_DTYPES
from ficco_select.scenario import Scenario
from ficco_select.schedule import Schedule, candidates

CORRECTNESS_SCENARIOS = tuple(
    [dict(op=op, m=m, n=n, k=k, dtype="bfloat16", world_size=P)
     for P in (2, 4, 8)
     for op, m, n, k in (("ag_gemm", 129 * P, 24 * P, 72), ("gemm_rs", 66 * P, 100, 24 * P),
                         ("a2a_gemm", 96, 80, 64))]
    + [dict(op=op, m=m, n=n, k=k, dtype="float32", world_size=4)
       for op, m, n, k in (("ag_gemm", 516, 96, 72), ("gemm_rs", 264, 100, 96), ("a2a_gemm", 96, 80, 64))]
    + [dict(op="a2a_gemm", m=128, n=64, k=64, dtype="bfloat16", world_size=4, imbalance=2.5)]
)
"""Small scenarios, odd sizes on purpose (uneven pieces): every schedule verified."""

REALIZED_SCENARIOS = (
    dict(group="llama3-8b", op="ag_gemm", m=8192, n=14336, k=4096, dtype="bfloat16", world_size=4),
    dict(group="llama3-8b", op="gemm_rs", m=8192, n=4096, k=14336, dtype="bfloat16", world_size=4),
    dict(group="llama3-70b", op="ag_gemm", m=16384, n=28672, k=8192, dtype="bfloat16", world_size=8),
    dict(group="llama3-70b", op="gemm_rs", m=16384, n=8192, k=28672, dtype="bfloat16", world_size=8),
    dict(group="mixtral", op="a2a_gemm", m=4096, n=14336, k=4096, dtype="bfloat16", world_size=4),
    dict(group="mixtral", op="a2a_gemm", m=4096, n=14336, k=4096, dtype="bfloat16", world_size=8, imbalance=2.0),
    dict(group="small", op="ag_gemm", m=4096, n=4096, k=2048, dtype="bfloat16", world_size=8),
)
"""The >= 6 scenarios whose realized fraction of ideal speedup is measured, largest work first
per operator; as many as the budget allows run."""


TINY_CORRECTNESS_SCENARIOS = (dict(op="gemm_rs", m=24, n=8, k=12, dtype="float32", world_size=2),)
TINY_REALIZED_SCENARIOS = (dict(op="ag_gemm", m=32, n=16, k=16, dtype="float32", world_size=2),)
"""The rehearsal's scenarios (``Run.tiny``)."""


def scenario_for(spec: Mapping[str, Any], hardware: str) -> Scenario:
    """The Scenario of one entry of CORRECTNESS_SCENARIOS / REALIZED_SCENARIOS."""
    return Scenario(**{"group": "gpu-check", "hardware": hardware, **spec})


def _loopback_scenarios(run: Run, specs: Sequence[Mapping[str, Any]], until: float
                        ) -> Iterator[tuple[Scenario, list[Schedule], dict[str, Any]]]:
    """(scenario, its legal cuda schedules, its result row) for each spec, until time is up."""
    hardware = run.state.get("preset") or "h200-nvswitch"
    for spec in specs:
        if time.monotonic() > until:
            break
        scenario = scenario_for(spec, hardware)
        row: dict[str, Any] = {"scenario": scenario.as_record(), "scenario_id": scenario.scenario_id}
        yield scenario, candidates(scenario, "cuda"), row


def _loopback(run: Run, scenario: Scenario, schedules: Sequence[Schedule], *, reps: int, warmup: int
              ) -> dict[str, LoopbackResult]:
    """run_loopback, each schedule on its own engine; results keyed by schedule name."""
    results = run_loopback(scenario, schedules, device=run.device, reps=reps, warmup=warmup)
    return {r.schedule.name: r for r in results}


def section_loopback_correctness(run: Run, until: float) -> None:
    """Every legal cuda schedule of small scenarios, verified against the reference."""
    specs = TINY_CORRECTNESS_SCENARIOS if run.tiny else CORRECTNESS_SCENARIOS
    for scenario, schedules, row in _loopback_scenarios(run, specs, until):
        row["schedules"] = len(schedules)
        try:
            res = _loopback(run, scenario, schedules, reps=1, warmup=0)
        except Exception as e:  # noqa: BLE001 - one scenario's failure is recorded, the rest run
            row["error"] = f"{type(e).__name__}: {e}"
            run.append("loopback", "correctness", value=row)
            continue
        failed = [name for name, r in res.items() if not r.verified]
        missing = [s.name for s in schedules if s.name not in res]
        row.update(verified=len(res) - len(failed), failed=failed, missing=missing,
                   max_rel_error=max((r.rel_error for r in res.values()), default=None),
                   per_schedule={name: [r.verified, r.rel_error] for name, r in res.items()})
        run.append("loopback", "correctness", value=row)
    done = run.state.get("loopback", {}).get("correctness", [])
    run.put("loopback", "correctness_summary", value={
        "scenarios": len(done), "schedules": sum(r["schedules"] for r in done),
        "all_verified": bool(done) and all(not r.get("error") and not r.get("failed") and not r.get("missing")
                                           for r in done)})


def realized_fractions(results: Mapping[str, LoopbackResult], t_comp_s: float | None
                       ) -> list[dict[str, Any]]:
    """Per verified schedule: realized speedup over its engine's baseline and its fraction of ideal.

    results: by schedule name. realized = t(none.<engine>) / t(schedule); ideal =
    (T_comp + T_comm) / max(T_comp, T_comm); fraction = (realized - 1) / (ideal - 1).
    T_comp is `t_comp_s` (every rank's GEMM timed alone on the device) and T_comm the
    baseline's time minus it (the baseline runs them one after the other; ``ideal_from:
    estimate``). None where `t_comp_s` is None or the ideal speedup is ~1 (nothing to overlap).
    """
    rows = []
    for name, r in results.items():
        if not r.times_s or not r.verified:
            continue
        base = results.get(f"none.{r.schedule.engine}")
        if base is None or not base.times_s:
            continue
        t_none, t = median(base.times_s), median(r.times_s)
        ideal = source = None
        if t_comp_s is not None:
            comp, comm, source = t_comp_s, max(t_none - t_comp_s, 0.0), "estimate"
            ideal = (comp + comm) / max(comp, comm) if max(comp, comm) > 0 else None
        realized = t_none / t
        fraction = (realized - 1) / (ideal - 1) if ideal is not None and ideal > 1.01 else None
        rows.append({"schedule": name, "time_s": t, "realized_speedup": round(realized, 4),
                     "ideal_speedup": None if ideal is None else round(ideal, 4),
                     "realized_fraction": None if fraction is None else round(fraction, 4),
                     "ideal_from": source})
    return rows


def best_by_engine(per: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fastest verified schedule of each engine with its realized fraction: the issue's
    question (does dma realize more of the ideal than sm?) per scenario."""
    best: dict[str, dict[str, Any]] = {}
    for p in per:
        engine = p["schedule"].rsplit(".", 1)[-1]
        if engine not in best or p["time_s"] < best[engine]["time_s"]:
            best[engine] = {k: p[k] for k in ("schedule", "time_s", "realized_speedup", "realized_fraction")}
    return best


def section_loopback_realized(run: Run, until: float) -> None:
    """Every legal schedule timed on >= 6 scenarios: realized fraction of ideal speedup."""
    specs = TINY_REALIZED_SCENARIOS if run.tiny else REALIZED_SCENARIOS
    for scenario, schedules, row in _loopback_scenarios(run, specs, until):
        try:
            t_comp = _ranks_gemm_time(scenario, run.device)
            row["t_comp_alone_s"] = t_comp
            res = _loopback(run, scenario, schedules, reps=5, warmup=2)
        except Exception as e:  # noqa: BLE001 - recorded; the next scenario runs
            row["error"] = f"{type(e).__name__}: {e}"
            run.append("loopback", "realized", value=row)
            continue
        per = realized_fractions(res, t_comp)
        fractions = [p for p in per if p["realized_fraction"] is not None]
        best = min(per, key=lambda p: p["time_s"]) if per else None
        row.update(schedules=per, unverified=[n for n, r in res.items() if not r.verified],
                   best=best and best["schedule"], best_realized_speedup=best and best["realized_speedup"],
                   best_realized_fraction=best and best["realized_fraction"],
                   best_by_engine=best_by_engine(per),
                   median_realized_fraction=round(median([p["realized_fraction"] for p in fractions]), 4)
                   if fractions else None)
        run.append("loopback", "realized", value=row)


def _ranks_gemm_time(scenario: Scenario, device: str = "cuda") -> float:
    """Seconds of every rank's whole GEMM back to back on this device (T_comp of loopback)."""
    dev, dtype = torch.device(device), TORCH_DTYPES[scenario.dtype]
    bufs = [(torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype),
             torch.empty(m, n, device=dev, dtype=dtype)) for m, n, k in scenario.rank_gemms() if m and n and k]

    def all_ranks() -> None:
        for x, y, z in bufs:
            torch.mm(x, y, out=z)

    return median(time_gpu(all_ranks, reps=5, warmup=2, device=device))
