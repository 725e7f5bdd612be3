"""One scenario measured on P virtual ranks (the loopback executor): the loopback
counterpart of ``harness.measure_scenario``, with the same rows, re-measure rule, labels
and signature definitions. The sweep (``sweep.measure``) calls it scenario by scenario.
"""

from __future__ import annotations

import functools
import statistics

import torch

from ficco_select.data.measure.config import MeasureConfig
from ficco_select.data.measure.harness import pool_until_calm, ring_at, schedule_rows
from ficco_select.data.measure.loopback import VirtualRanks, run_loopback
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, Schedule, candidates
from ficco_select.signatures import SIGNATURE_GRANULARITIES, signature


def loopback_rows(scenario: Scenario, config: MeasureConfig, *, backend: str = "cuda",
                  device: str = "cuda") -> list[dict]:
    """Verify and time every legal schedule of `scenario` on `backend` with the loopback
    executor on `device`; one dataset row per schedule (without provenance columns).

    Times: ``run_loopback``'s, each repetition the slowest virtual rank's (CUDA events on
    CUDA); while a schedule's spread exceeds ``config.noisy_spread``, every schedule is re-run (fresh
    virtual ranks, verified again) up to ``config.max_remeasure`` times, pooling the
    repetitions, as the harness does. Labels by ``ficco_select.data.labels``. Signatures from
    skeleton and contended runs (``loopback_signature``).
    Raises ``LoopbackError`` (or ``LoopbackTimeout``) naming the scenario, schedule and rank.
    """
    schedules = candidates(scenario, backend)
    run = functools.partial(run_loopback, scenario, schedules, device=device, reps=config.reps,
                            warmup=config.warmup, seed=config.seed, timeout_s=config.timeout_s)
    results = run()
    errors = [r.rel_error for r in results]

    def retime() -> list[list[float]]:  # fresh virtual ranks, every schedule verified again
        again = run()
        for i, r in enumerate(again):
            errors[i] = max(errors[i], r.rel_error)  # verified only if every verification run was
        return [r.times_s for r in again]

    pooled, attempts = pool_until_calm([r.times_s for r in results], config, retime)
    sig = loopback_signature(scenario, config, backend=backend, device=device)
    threads = torch.get_num_threads() if torch.device(device).type == "cpu" else 0  # 0 on a GPU
    return schedule_rows(scenario, schedules, errors, pooled, attempts, config, sig, threads)


def loopback_signature(scenario: Scenario, config: MeasureConfig, *, backend: str = "cuda",
                       device: str = "cuda") -> dict[str, float]:
    """The signature columns (``ficco_select.signatures``) from loopback runs.

    As ``harness.measure_scenario`` defines them: t_comp = the baseline with comm off (the
    whole GEMM), t_comm = the baseline with compute off (the whole collective, with the
    baseline's ``sm`` engine); dil_g / chunk_loss_g from the ring schedule at granularity g
    (``harness.ring_at``) with comm off / compute off; cil_gemm_sm / cil_overlap_sm from
    the operator's ``contended`` run (the whole GEMM while the whole collective's ``sm``
    copies are in flight). Each is the median over ``config.reps`` repetitions (slowest
    virtual rank's, interleaved passes after ``config.warmup``).
    """
    rings = {g: ring_at(g, scenario, backend) for g in SIGNATURE_GRANULARITIES}
    skeletons = list(dict.fromkeys(s for s in rings.values() if s is not None))  # dP may be d2 or d4
    jobs: list[tuple[Schedule | None, bool, bool]] = [(BASELINE, True, False), (BASELINE, False, True)]
    jobs += [(s, True, False) for s in skeletons] + [(s, False, True) for s in skeletons]
    jobs.append((None, True, True))  # contended: GEMM beside the whole collective
    world = VirtualRanks(scenario, device=device, seed=config.seed, timeout_s=config.timeout_s)
    times, inner = _time_skeletons(world, jobs, config.warmup, config.reps)
    med = [statistics.median(t) for t in times]
    t_comp, t_comm = med[:2]
    k = len(skeletons)
    dil_of = dict(zip(skeletons, med[2:2 + k]))
    chunk_of = dict(zip(skeletons, med[2 + k:2 + 2 * k]))
    return signature(t_comp=t_comp, t_comm=t_comm, t_pair=med[-1], gemm_slowdown=statistics.median(inner[-1]) / t_comp,
                     ring_comp={g: dil_of[s] for g, s in rings.items() if s is not None},
                     ring_comm={g: chunk_of[s] for g, s in rings.items() if s is not None})


def _time_skeletons(world: VirtualRanks, jobs: list[tuple[Schedule | None, bool, bool]], warmup: int,
                    reps: int) -> tuple[list[list[float]], list[list[float]]]:
    """(times[job][rep], inner[job][rep]) of (schedule, compute on, comm on) skeleton runs,
    slowest virtual rank's; a job without a schedule is the operator's ``contended`` run,
    whose inner time is its GEMM's (0 for the others).

    Timed as ``run_loopback`` times a schedule (every rank starts a repetition on an idle
    device; the lanes' timer on the rank's compute stream), in passes that run every job
    once in an order rotated per pass, so a noisy phase slows all jobs alike.
    """
    n, width = len(jobs), warmup + reps
    first = world.next_runs(n * width)

    def rank_main(r: int) -> tuple[list[list[float]], list[list[float]]]:
        op, comm = world.ops[r], world.comms[r]
        timers: list[list] = [[None] * width for _ in range(n)]
        gemm = [[0.0] * width for _ in range(n)]
        for p in range(width):
            for i in [(p + j) % n for j in range(n)]:
                schedule, compute_on, comm_on = jobs[i]
                world.sync_point(r)
                timer = world.lanes.timer()
                timer.start()
                comm.begin_run(first + p * n + i, "sm" if schedule is None else schedule.engine)
                if schedule is None:
                    gemm[i][p] = op.contended()
                else:
                    with op.skeleton(compute=compute_on, comm=comm_on):
                        op.run(schedule)
                timer.stop()
                timers[i][p] = timer
        world.lanes.synchronize()
        return ([[t.seconds() for t in row[warmup:]] for row in timers], [row[warmup:] for row in gemm])

    per_rank = world.each(rank_main, what="signature skeletons")

    def slowest(part: int) -> list[list[float]]:
        return [[max(pr[part][i][k] for pr in per_rank) for k in range(reps)] for i in range(n)]

    return slowest(0), slowest(1)
