"""Measuring one scenario on one rank: verification, timing, inefficiency signatures.

Every rank calls ``measure_scenario`` with the same arguments; all decisions (which
schedules to re-measure) are taken on times already reduced over ranks, so the ranks
stay in lock-step. Definitions (DESIGN.md, "Inefficiency signatures"):

- ``t_comp_s``, ``t_comm_s``: the whole GEMM alone, the whole collective alone.
- ``ideal_speedup`` = (t_comp + t_comm) / max(t_comp, t_comm).
- ``dil_<g>``: decomposition loss at granularity g (``shard``, ``d2``, ``d4``, ``dP``):
  the ring schedule's compute skeleton (its piece GEMMs and reduction adds back to back,
  no transfers) / t_comp - 1.
- ``chunk_loss_<g>``: the same schedule's communication skeleton (its transfers, no
  compute) / t_comm - 1.
- ``cil_gemm_<engine>``: the whole GEMM while the whole collective's transfers are in
  flight / t_comp - 1; ``cil_overlap_<engine>``: that pair's total time /
  max(t_comp, t_comm) - 1 (0 = perfect overlap).
NaN where a granularity is not legal for the scenario.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ficco_select.data.dataset import dataset_row
from ficco_select.data.labels import failed_label, label_columns, summarize
from ficco_select.data.measure.config import TimingPolicy
from ficco_select.executor.cuda import make_timer
from ficco_select.executor.operators import TOLERANCE, Operator, relative_error
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, SHARD, Schedule, candidates, is_legal
from ficco_select.signatures import SIGNATURE_GRANULARITIES, signature


def slowest_rank(values: list[float]) -> list[float]:
    """Element-wise max over ranks (every rank gets the same list)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed_interleaved(fns: Sequence[Callable[[], Any]], warmup: int, reps: int,
                      device: str | torch.device = "cpu", heartbeat: Callable[[], None] = lambda: None,
                      runs: int = 1) -> tuple[list[list[float]], list[list[float]]]:
    """(times[i][rep], returned[i][rep]) of fns[i], slowest rank's, functions interleaved.

    Each pass runs every function once, in an order rotated per pass, so that a noisy
    phase of the machine slows all of them alike instead of one schedule's repetitions.
    A repetition runs the function `runs` times back to back and keeps the mean: runs of
    a few ms against a scheduler tick of ms are timed as one longer span.
    A function may return a float (a time it measured inside); it is reduced likewise.
    On CUDA a run is timed by events on the caller's stream, after the device is idle.
    heartbeat: called after every pass (the launcher's sign that the ranks progress).
    """
    cuda = torch.device(device).type == "cuda"
    n, width = len(fns), warmup + reps
    times = [[0.0] * width for _ in range(n)]
    inner = [[0.0] * width for _ in range(n)]
    for p in range(width):
        for i in [(p + j) % n for j in range(n)]:
            if cuda:
                torch.cuda.synchronize(device)  # nothing of the previous run still in flight
            dist.barrier()
            timer = make_timer(device)
            inner_sum = 0.0
            timer.start()
            for _ in range(runs):
                ret = fns[i]()
                inner_sum += float(ret) if isinstance(ret, float) else 0.0
            timer.stop()
            times[i][p] = timer.seconds() / runs
            inner[i][p] = inner_sum / runs
        heartbeat()
    flat = slowest_rank([t for row in times + inner for t in row])
    rows = [flat[i * width + warmup:(i + 1) * width] for i in range(2 * n)]
    return rows[:n], rows[n:]


def ring_at(granularity: str, scenario: Scenario, backend: str = "cpu") -> Schedule | None:
    """The ring, GEMM-per-piece, row-split schedule whose skeletons define DIL and chunking
    loss at `granularity` (``shard``, ``d2``, ``d4``, ``dP``); None where it is not legal
    for `scenario` on `backend`."""
    if granularity == "shard":
        return SHARD
    d = scenario.world_size if granularity == "dP" else int(granularity[1:])
    s = Schedule(granularity="ficco", degree=d, pattern="ring", compute="gemm_per_piece", split="m")
    return s if is_legal(s, scenario, backend) else None


def run_schedule(op: Operator, schedule: Schedule) -> Any:
    """Run `schedule` with its engine's comm (a comm with one engine has no ``select``)."""
    select = getattr(op.comm, "select", None)
    if select is not None:
        select(schedule.engine)
    return op.run(schedule)


def measure_scenario(op: Operator, scenario: Scenario, policy: TimingPolicy, *,
                     backend: str = "cpu", corrupt: str | None = None,
                     heartbeat: Callable[[], None] = lambda: None) -> list[dict]:
    """Verify and time every legal schedule of `scenario`; one row per schedule.

    heartbeat: called as the work advances (after each verification and each timed pass),
    so that a launcher can tell slow from hung.
    """
    schedules = candidates(scenario, backend)
    ref = op.reference()
    errors = []
    for schedule in schedules:
        op.poison()
        out = run_schedule(op, schedule)
        if corrupt == schedule.name and out.numel():  # tests: prove the check can fail
            out.view(-1)[0] += 1e3
        errors.append(relative_error(out, ref))
        heartbeat()
    errors = slowest_rank(errors)

    # Signatures and schedules are timed in the same interleaved passes.
    rings = {g: ring_at(g, scenario) for g in SIGNATURE_GRANULARITIES}
    skeletons = list(dict.fromkeys(s for s in rings.values() if s is not None))  # dP may be d2 or d4

    def skeleton_run(schedule: Schedule, **switch: bool) -> Callable[[], None]:
        def run() -> None:
            with op.skeleton(**switch):
                run_schedule(op, schedule)
        return run

    select = getattr(op.comm, "select", None)
    if select is not None:
        select("sm")  # the signature columns are the sm engine's (cil_*_sm)
    runs = runs_per_rep(op, policy)

    fns: list[Callable[[], Any]] = [op.compute_alone, op.comm_alone, op.contended]
    fns += [skeleton_run(s, comm=False) for s in skeletons]
    fns += [skeleton_run(s, compute=False) for s in skeletons]
    fns += [(lambda s=s: run_schedule(op, s)) for s in schedules]
    times, inner = timed_interleaved(fns, policy.warmup, policy.reps, op.device, heartbeat, runs)
    med = [statistics.median(t) for t in times]
    t_comp, t_comm, t_pair = med[:3]
    k = len(skeletons)
    dil_of = dict(zip(skeletons, med[3:3 + k]))
    chunk_of = dict(zip(skeletons, med[3 + k:3 + 2 * k]))
    sig = signature(t_comp=t_comp, t_comm=t_comm, t_pair=t_pair, gemm_slowdown=statistics.median(inner[2]) / t_comp,
                    ring_comp={g: dil_of[s] for g, s in rings.items() if s is not None},
                    ring_comm={g: chunk_of[s] for g, s in rings.items() if s is not None})

    sched_times = times[3 + 2 * k:]
    pooled, attempts = pool_until_calm(sched_times, policy, lambda: timed_interleaved(
        [(lambda s=s: run_schedule(op, s)) for s in schedules], 1, policy.reps, op.device, heartbeat, runs)[0])
    return schedule_rows(scenario, schedules, errors, pooled, attempts, policy, sig, torch.get_num_threads(),
                         runs)


def runs_per_rep(op: Operator, policy: TimingPolicy) -> int:
    """Runs per timed repetition so that the scenario's baseline lasts ``policy.min_rep_s``
    (the median of three runs, each the slowest rank's; every rank gets the same count)."""
    if policy.min_rep_s <= 0:
        return 1
    times, _ = timed_interleaved([lambda: run_schedule(op, BASELINE)], 0, 3, op.device)
    t0 = max(statistics.median(times[0]), 1e-6)
    return max(1, min(policy.max_runs, math.ceil(policy.min_rep_s / t0)))


def pool_until_calm(times: list[list[float]], policy: TimingPolicy,
                    retime: Callable[[], Sequence[Sequence[float]]]) -> tuple[list[list[float]], list[int]]:
    """While any schedule's spread is above the limit, re-time every schedule (``retime()``:
    fresh repetitions of each, in order) and pool the new repetitions, at most
    ``policy.max_remeasure`` times. Returns (pooled times, attempts per schedule).

    Every schedule, not only the noisy ones: the labels compare schedules, and times of a
    subset taken in a later phase of the machine would be compared with times of the rest
    taken in an earlier one (the repeatability benchmark's P=2 spread rose with that).
    Pooling (rather than keeping the calmest attempt): the calmest attempt would favour a
    round in which every repetition happened to be slow alike.
    """
    pooled = [list(t) for t in times]
    attempts = [1] * len(pooled)
    for _ in range(policy.max_remeasure):
        if not any(summarize(t)[1] > policy.noisy_spread for t in pooled):
            break
        for i, t in enumerate(retime()):
            attempts[i] += 1
            pooled[i] += t
    return pooled, attempts


def failed_rows(scenario: Scenario, reason: str, backend: str = "cpu") -> list[dict]:
    """Rows recording that `scenario` could not be measured (kept so a rerun does not retry it)."""
    return [dataset_row(scenario, s.name, failed_label(reason)) for s in candidates(scenario, backend)]


def schedule_rows(scenario: Scenario, schedules: Sequence[Schedule], errors: Sequence[float],
                  pooled: Sequence[list[float]], attempts: Sequence[int], policy: TimingPolicy,
                  signature: dict, threads_per_rank: int, runs_per_rep: int = 1) -> list[dict]:
    """One dataset row per measured schedule: median, spread, verification, best labels
    (``ficco_select.data.labels.label_columns``)."""
    labels = label_columns(pooled, verified=[e <= TOLERANCE[scenario.dtype] for e in errors], rel_error=errors,
                           attempts=attempts, noisy_spread=policy.noisy_spread, tie_floor=policy.tie_floor)
    return [dataset_row(scenario, schedule.name, {"status": "ok", "error": "", "time_model_s": math.nan,
                                                  **{c: v[i] for c, v in labels.items()}},
                        signature=signature, threads_per_rank=threads_per_rank, runs_per_rep=runs_per_rep)
            for i, schedule in enumerate(schedules)]
