"""Running a planned call: PyTorch's own op for a baseline plan (``run_native``), the
executor's schedule for an overlapped one (``run_decided``); with telemetry on, each run
timed and recorded, and checked against the reference the first time a scenario runs a
schedule.

An overlapped plan is bound once, at its first run (``Runner``): its comm (one per group and
engine) and one operator, which each call binds to its inputs, runs, reads and resets, so
that a planned call builds no operator, no closure and no comm.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import time
from collections import deque

import torch
import torch.distributed as dist

from ficco_select.executor.comm import Comm, P2PComm
from ficco_select.executor.operators import TOLERANCE, relative_error
from ficco_select.executor.peer import CudaPeerMemory, HostPeerMemory, NcclComm, PeerCopyComm
from ficco_select.executor.switch import CudaSwitchComm, HostSwitchComm
from ficco_select.runtime.caches import BoundedCache
from ficco_select.runtime.context import GroupContext, Plan, Runner, note
from ficco_select.runtime.telemetry import Telemetry
from ficco_select.schedule import Schedule

log = logging.getLogger("ficco_select.runtime.torch_ops")

HOST_SLOT_BYTES = 1 << 20
"""Staging slot size of the CPU stand-in of the dma transport (it lives in /dev/shm)."""


# -- transports and the bound plan --------------------------------------------------------
def comm_for(ctx: GroupContext, engine: str, group: dist.ProcessGroup, device: torch.device) -> Comm | None:
    """The comm that moves `engine`'s bytes on `group`, or None where dma or switch has no transport.

    Built once per group. A dma or switch comm is built collectively (every rank runs the
    same decision). Building it can fail: symmetric memory not supported (dma), no multicast
    (switch: ``CudaSwitchComm`` agrees on that across the ranks before its rendezvous); the
    group then runs those schedules as their sm twins, with one warning, rather than fail
    the job. On the cpu the switch's comm is its shared-memory stand-in (``HostSwitchComm``).
    """
    if engine == "sm":
        comm = ctx.sm_comms.get(device.type)
        if comm is None or comm.group is not group:  # new, or a group re-made under the same name
            comm = ctx.sm_comms[device.type] = NcclComm(group) if device.type == "cuda" else P2PComm(group)
        return comm
    comms = ctx.switch_comms if engine == "switch" else ctx.dma_comms
    key = str(device)
    if key not in comms:
        try:
            if engine == "switch":
                comms[key] = CudaSwitchComm(group) if device.type == "cuda" else HostSwitchComm(group)
            elif device.type == "cuda":
                comms[key] = PeerCopyComm(CudaPeerMemory(group))
            else:
                comms[key] = PeerCopyComm(HostPeerMemory(group, slot_bytes=HOST_SLOT_BYTES))
        except Exception as e:  # noqa: BLE001 - any failure means: no transport for this engine
            log.warning("ficco-select: no %s transport on group %s (%s: %s); %s schedules run as "
                        "their sm twins", engine, group.group_name, type(e).__name__, e, engine)
            comms[key] = None
    return comms[key]


def _bind(plan: Plan, op_cls, ctx: GroupContext, group: dist.ProcessGroup, device: torch.device) -> Runner:
    """The plan's runner, made at its first run (or again for a group re-made under the same name)."""
    decision = plan.decision
    schedule = decision.schedule
    comm = comm_for(ctx, schedule.engine, group, device)
    if comm is None:  # the decision as it really runs (telemetry records this schedule)
        schedule = dataclasses.replace(schedule, engine="sm")
        comm = comm_for(ctx, "sm", group, device)
        wanted = decision.schedule
        decision = dataclasses.replace(decision, schedule=schedule,
                                       reason=f"{wanted.name} as its sm twin: no {wanted.engine} transport")
    operator = op_cls.template(plan.scenario, comm, device=device)
    plan.runner = Runner(schedule, comm, operator, dict(vars(operator)), decision)
    return plan.runner


# -- running ----------------------------------------------------------------------------------
def run_decided(op_cls, plan: Plan, ctx: GroupContext, group: dist.ProcessGroup, device: torch.device,
                reference, finish, **inputs):
    """Run the plan's schedule with the executor on `inputs`; return finish(operator, output),
    read while the operator holds this call's buffers. Telemetry, where on, times the run
    and checks it once against reference(operator, group) (module functions: nothing is
    built per call)."""
    runner = plan.runner
    if runner is None or getattr(runner.comm, "group", group) is not group:
        runner = _bind(plan, op_cls, ctx, group, device)
    if ctx.watched:
        note(runner.decision)
    if not runner.busy.acquire(blocking=False):  # another thread runs this shape now: a copy of its own
        op = _copy(runner, inputs)
        return finish(op, _run(op, plan, runner, ctx, device, reference, group))
    op = runner.operator
    try:
        op._bind(**inputs)
        if ctx.settings.telemetry or plan.trial is not None:
            return finish(op, _run(op, plan, runner, ctx, device, reference, group))
        return finish(op, op.run(runner.schedule))
    finally:
        state = vars(op)  # back to the shape alone: no call's tensors outlive it
        state.clear()
        state.update(runner.shape_state)
        runner.busy.release()


def _copy(runner: Runner, inputs: dict):
    op = object.__new__(type(runner.operator))
    vars(op).update(runner.shape_state)
    op._bind(**inputs)
    return op


def _run(op, plan: Plan, runner: Runner, ctx: GroupContext, device: torch.device, reference, group):
    if plan.trial is not None:
        return _trial_run(plan, ctx, device, op.run, (runner.schedule,), reference, op, group)
    if not ctx.settings.telemetry:
        return op.run(runner.schedule)
    return _timed(plan, ctx, runner.schedule, runner.decision.source, device, op.run, (runner.schedule,),
                  reference, op, group)


def run_native(plan: Plan, ctx: GroupContext, device: torch.device, native, *args):
    """native(*args): PyTorch's own op, for a baseline decision (``runs_natively``).
    Telemetry times a scenario's run under the decided schedule's name; it is the
    reference, so its check passes by definition."""
    if plan.trial is not None:
        return _trial_run(plan, ctx, device, native, args, None, None, None)
    if not ctx.watched:
        return native(*args)
    note(plan.decision)
    if plan.scenario is None or not ctx.settings.telemetry:
        return native(*args)
    return _timed(plan, ctx, plan.decision.schedule, plan.decision.source, device, native, args, None, None, None)


def _trial_run(plan: Plan, ctx: GroupContext, device: torch.device, run, args: tuple, reference, op, group):
    """run(*args) for a learning shape's trial (``learning.Trial``): timed (perf_counter; on
    CUDA two events, read at the round's end), its first run checked against
    reference(op, group) (None: the run is the reference), telemetry recorded where on."""
    trial, i = plan.trial
    first = i not in trial.warmed
    if ctx.settings.telemetry:
        args = (plan, ctx, plan.decision.schedule, plan.decision.source, device, run, args, reference, op, group)
        run = _timed
    out, elapsed = _clocked(device, run, args)
    if first and not _checked(out, reference, op, group, plan.scenario, plan.decision.schedule)[0]:
        trial.failed_check(i)  # dropped for good: a wrong schedule is never kept
    trial.observe(i, elapsed)
    return out


def _clocked(device: torch.device, run, args: tuple):
    """(run(*args), its time): seconds on the cpu; on CUDA two events on the stream, (start,
    end), whose time is read once the GPU got there (no sync now)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(*args)
        end.record()
        return out, (start, end)
    t0 = time.perf_counter()
    out = run(*args)
    return out, time.perf_counter() - t0


def _checked(out, reference, op, group, scenario, schedule: Schedule) -> tuple[bool, float]:
    """(right, relative error) of a run's output against reference(op, group) (None: the run
    is the reference); a wrong one is warned of."""
    if reference is None:
        return True, 0.0
    err = relative_error(out, reference(op, group).float())
    right = err <= TOLERANCE[scenario.dtype]
    if not right:
        log.warning("ficco-select: schedule %s gave a wrong result on %s (rel. error %.2e)",
                    schedule.name, scenario.scenario_id, err)
    return right, err


# -- telemetry ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Telemetry:
    writers: BoundedCache[str, Telemetry] = dataclasses.field(default_factory=lambda: BoundedCache(WRITERS_KEPT))
    """Telemetry writers by "<file>@<rank>"."""
    timings: deque = dataclasses.field(default_factory=deque)
    """CUDA calls timed by events and not yet recorded: (start, end, writer, fields), oldest first."""


WRITERS_KEPT = 64
"""Telemetry files (by rank) whose writer a process keeps."""
TIMINGS_PENDING = 256
"""CUDA calls whose times may wait unread; beyond, the oldest is waited for (a GPU this far
behind its host is rare: one sync then, not one per call)."""

_telemetry = _Telemetry()


def _timed(plan: Plan, ctx: GroupContext, schedule: Schedule, source: str, device: torch.device, run,
           args: tuple, reference, op, group):
    """run(*args), timed and recorded, and checked against reference(op, group) the first
    time this scenario runs this schedule (reference None: the run is the reference)."""
    rec = _recorder(ctx.settings.telemetry)
    scenario = plan.scenario
    call = rec.next_call(scenario.scenario_id, schedule.name)
    out, elapsed = _clocked(device, run, args)
    verified = err = None
    if schedule.name not in plan.verified:
        plan.verified.add(schedule.name)
        verified, err = _checked(out, reference, op, group, scenario, schedule)
    fields = dict(record={**scenario.as_record(), "scenario_id": scenario.scenario_id}, schedule=schedule.name,
                  source=source, call=call, verified=verified,
                  rel_error=None if err is None or math.isinf(err) else err, backend=device.type)
    if device.type != "cuda":
        rec.record(time_s=elapsed, **fields)
        return out
    _telemetry.timings.append((*elapsed, rec, fields))
    _record_finished_timings()
    return out


def _recorder(path: str) -> Telemetry:
    rank = dist.get_rank()
    key = f"{path}@{rank}"
    return _telemetry.writers.get(key) or _telemetry.writers.put(key, Telemetry(path, rank))


def _record_finished_timings() -> None:
    """Record every timed CUDA call, oldest first, whose end the GPU has reached (a query, no
    sync); the oldest is waited for only when ``TIMINGS_PENDING`` are pending."""
    timings = _telemetry.timings
    while timings:
        start, end, rec, fields = timings[0]
        if not end.query():
            if len(timings) <= TIMINGS_PENDING:
                return
            end.synchronize()
        timings.popleft()
        rec.record(time_s=start.elapsed_time(end) / 1e3, **fields)


def flush_timings() -> None:
    """Record every pending CUDA call's time, waiting for the GPU (``reset()``, and at exit)."""
    timings = _telemetry.timings
    while timings:
        start, end, rec, fields = timings.popleft()
        try:
            end.synchronize()
            rec.record(time_s=start.elapsed_time(end) / 1e3, **fields)
        except Exception as e:  # noqa: BLE001 - telemetry must not break the job's exit
            log.warning("ficco-select: a pending telemetry time was lost: %r", e)


def forget_writers() -> None:
    """Every pending time recorded, every writer closed (``reset()``)."""
    flush_timings()
    _telemetry.writers.clear()


atexit.register(flush_timings)  # the last calls' times, read as the job ends
