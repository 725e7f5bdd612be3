"""What the torch ops share in a process: the settings (``configure``), one plan per call
shape agreed by the group's ranks (its decision and the operator that runs it), the
transports per group, telemetry; and running a decided schedule with the executor.

Everything mutable lives in one ``_State`` (``reset()`` starts a fresh one). Plans and
transports are keyed by the group's name, never the group object (see ``decide``). The plans
are one least-recently-used cache of ``Settings.cache_size`` call shapes: continuous batching
sends every token count, and a job's memory must not grow with them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ficco_select.executor.comm import Comm, P2PComm
from ficco_select.executor.operators import DTYPE_NAMES, TOLERANCE, Operator, relative_error
from ficco_select.executor.peer import CudaPeerMemory, HostPeerMemory, NcclComm, PeerCopyComm
from ficco_select.hardware import HardwareError, load_hardware, preset_for_device, when_a_job_ends
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.layers import LayerTable
from ficco_select.runtime.selector import Selector
from ficco_select.runtime.telemetry import Telemetry
from ficco_select.runtime.telemetry import ENV as TELEMETRY_ENV
from ficco_select.scenario import Scenario, ScenarioError
from ficco_select.schedule import BASELINE, Schedule, backend_for, candidates, is_legal, parse

log = logging.getLogger("ficco_select.runtime.torch_ops")

DECISION_CACHE_SIZE = 4096
"""Call shapes whose plan a process keeps by default: every token count of a serving engine up
to 4096 (``benchmarks/hook_overhead.py --memory``: resident memory flat over 12,000 of them)."""


@dataclasses.dataclass
class Settings:
    """What ``configure`` sets."""

    selector: Selector | None = None
    hardware: str | None = None
    telemetry: str | None = dataclasses.field(default_factory=lambda: os.environ.get(TELEMETRY_ENV) or None)
    """The telemetry file (default: $FICCO_TELEMETRY, read when the settings are made)."""
    group_label: str = "runtime"
    schedule: Schedule | None = None
    """Pinned by the caller (benchmarks, debugging): runs wherever it is legal."""
    explore_every: int = 0
    """Every n-th call of a shape runs another candidate, in turn (0: never)."""
    check_calls: bool = dataclasses.field(default_factory=lambda: debug_checks()[0])
    """A debug mode, off by default: each call first checks that every rank passes the same
    call (``ops``), one blocking host collective per call. On with PyTorch's own switch
    ($TORCH_DISTRIBUTED_DEBUG=DETAIL) or $FICCO_CHECK_CALLS=1 ($FICCO_CHECK_CALLS=0: off
    whatever PyTorch's says). Off is PyTorch's own collectives' contract: nothing per call.
    A group's ranks agree on it once (``ops.agree_on_the_check``)."""
    check_source: str = dataclasses.field(default_factory=lambda: debug_checks()[1])
    """What set ``check_calls``, as an error names it: ``FICCO_CHECK_CALLS=1``, ``configure(check_calls=True)``..."""
    cache_size: int = DECISION_CACHE_SIZE
    """Call shapes whose plan the process keeps (least recently used first out)."""


def debug_checks() -> tuple[bool, str]:
    """Whether the environment turns the per-call check on (``Settings.check_calls``), and
    what decides it, as an error names it."""
    ours = os.environ.get("FICCO_CHECK_CALLS", "").strip()
    if ours:
        return ours != "0", f"FICCO_CHECK_CALLS={ours[:32]}"
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        return True, "TORCH_DISTRIBUTED_DEBUG=DETAIL"
    return False, "the default"


@dataclasses.dataclass(eq=False)
class Plan:
    """What one call shape runs, agreed by the group's ranks and made once: the scenario, the
    decision, and (at its first overlapped run) the comm and operator template that run it."""

    scenario: Scenario | None
    decision: Decision
    native: bool
    """The decision is the baseline on PyTorch's own collective (``runs_natively``)."""
    runner: tuple[Schedule, Comm, Operator] | None = None
    calls: int = 0
    """Calls so far (with ``explore_every``; the same on every rank: they make the same calls)."""
    verified: set[str] = dataclasses.field(default_factory=set)
    """Schedules checked against the reference once (with telemetry on)."""


class PlanCache:
    """The plans of the call shapes seen last, at most `size` of them (least recently used out).
    Safe from any number of threads: insertions and eviction under one lock, lookups atomic."""

    def __init__(self, size: int) -> None:
        self.size = max(1, int(size))
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Plan | None:
        # Without the lock: a dict lookup and move_to_end are each atomic under the GIL; an
        # entry evicted between the two is still a valid plan for this one call.
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:
                pass
        return plan

    def put(self, key: tuple, plan: Plan) -> None:
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)

    def items(self) -> list[tuple[tuple, Plan]]:
        with self._lock:
            return list(self._plans.items())

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def drop(self, keep) -> None:
        """Drop the plans for which keep(plan) is false."""
        with self._lock:
            for key in [key for key, plan in self._plans.items() if not keep(plan)]:
                del self._plans[key]


@dataclasses.dataclass
class _State:
    """Everything the ops remember in this process; ``reset()`` starts a fresh one."""

    settings: Settings = dataclasses.field(default_factory=Settings)
    plans: PlanCache = dataclasses.field(default_factory=lambda: PlanCache(DECISION_CACHE_SIZE))
    """(call shape key, group name) -> the rank-agreed plan."""
    tables: dict[tuple, tuple[Scenario | None, LayerTable | None]] = dataclasses.field(default_factory=dict)
    """(call layer key, group name) -> the rank-agreed (layer's first scenario, its layer table)."""
    telemetry: dict[str, Telemetry] = dataclasses.field(default_factory=dict)
    """Telemetry writers by "<file>@<rank>"."""
    timings: deque = dataclasses.field(default_factory=deque)
    """CUDA calls timed by events and not yet recorded: (start, end, writer, fields), oldest first."""
    sm_comms: dict[tuple[str, str], Comm] = dataclasses.field(default_factory=dict)
    """(group name, device type) -> the sm comm (stateless: one per group)."""
    dma_comms: dict[tuple[str, str], PeerCopyComm | None] = dataclasses.field(default_factory=dict)
    """(group name, device) -> the dma comm; its staging slots persist, its transfer counts
    match on every rank because every rank runs the same schedules on the group."""
    last_decision: Decision | None = None
    """The decision of the latest call in this process (for logging and tests)."""
    check_agreed: set[str] = dataclasses.field(default_factory=set)
    """Names of the groups whose ranks agreed on ``Settings.check_calls`` (``ops.agree_on_the_check``)."""


_state = _State()


def last_decision() -> Decision | None:
    """The decision of the latest call in this process (for logging and tests)."""
    return _state.last_decision


def pinned_schedule() -> Schedule | None:
    """The schedule ``configure(schedule=...)`` pinned, or None (the selector decides)."""
    return _state.settings.schedule


def selector() -> Selector:
    """The selector the ops decide with (``configure``; default: the exported champion)."""
    return _selector()


def settings() -> Settings:
    """The process's settings (``configure``); read-only by convention."""
    return _state.settings


def checks_calls() -> bool:
    """Whether each call first checks that every rank passes the same call (``configure``)."""
    return _state.settings.check_calls


def check_agreed(group: dist.ProcessGroup) -> bool:
    """Whether `group`'s ranks agreed on ``checks_calls()`` since the last ``reset`` or
    ``configure(check_calls=...)`` (``ops.agree_on_the_check``)."""
    return group.group_name in _state.check_agreed


def note_check_agreed(group: dist.ProcessGroup) -> None:
    _state.check_agreed.add(group.group_name)


def plans() -> list[tuple[tuple, Plan]]:
    """(call shape key, group name) and the plan cached for it, least recently used first."""
    return _state.plans.items()


def decisions() -> dict[tuple, Decision]:
    """(call shape key, group name) -> the decision cached for it (benchmarks, examples)."""
    return {key: plan.decision for key, plan in _state.plans.items()}


def configure(*, selector: Selector | str | os.PathLike | None = None, hardware: str | None = None,
              telemetry: str | os.PathLike | None = None, group_label: str | None = None,
              schedule: str | Schedule | None = None, explore_every: int | None = None,
              check_calls: bool | None = None, cache_size: int | None = None) -> None:
    """Set the selector (object or exported folder), the hardware preset name, the
    telemetry file, the scenario ``group`` label, pin one schedule (``""`` unpins: the
    decision says ``source="pinned"`` where the schedule is legal, else the selector
    decides), or explore: every ``explore_every``-th call of a shape runs the next of its
    candidates, baseline first (``source="explore"``), so that telemetry times the
    alternatives ``ficco train`` needs on the job's own shapes; ``check_calls=False`` skips
    the per-call check that every rank passes the same shapes (``Settings.check_calls``: a
    debug mode, off by default; the group's ranks agree on it again at their next checked
    call); ``cache_size``: call shapes whose plan the process keeps. Clears the plans: every
    rank of a group configures alike, as it makes the same calls."""
    if selector is not None:
        _state.settings.selector = selector if isinstance(selector, Selector) else Selector.load(selector)
    if hardware is not None:
        _state.settings.hardware = hardware
    if telemetry is not None:
        _state.settings.telemetry = str(telemetry)
    if group_label is not None:
        _state.settings.group_label = group_label
    if schedule is not None:
        _state.settings.schedule = parse(schedule) if isinstance(schedule, str) and schedule else schedule or None
    if explore_every is not None:
        _state.settings.explore_every = max(0, int(explore_every))
    if check_calls is not None:
        _state.settings.check_calls = bool(check_calls)
        _state.settings.check_source = f"configure(check_calls={bool(check_calls)})"
        _state.check_agreed.clear()  # every rank configures alike, so every rank agrees again
    if cache_size is not None:
        _state.settings.cache_size = max(1, int(cache_size))
    _state.plans = PlanCache(_state.settings.cache_size)
    _state.tables.clear()


def reset() -> None:
    """Back to defaults: the exported champion (or the heuristic), detected hardware, no telemetry."""
    global _state
    flush_timings()
    for comm in _state.dma_comms.values():
        if comm is not None:
            comm.memory.close()
    _state = _State()


def _forget_machines(names: frozenset[str]) -> None:
    """A job's machines ended (``hardware.machines``): the plans and layer tables decided for
    them go with it, as the selector's own do; a later job's machine of the same name gets
    its own."""
    _state.plans.drop(lambda plan: plan.scenario is None or plan.scenario.hardware not in names)
    for key, (first, _) in list(_state.tables.items()):
        if first is not None and first.hardware in names:
            _state.tables.pop(key, None)


when_a_job_ends(_forget_machines)


def _selector() -> Selector:
    if _state.settings.selector is None:
        _state.settings.selector = Selector.load()
    return _state.settings.selector


def hardware_name(device: torch.device) -> str | None:
    """The hardware preset for tensors on `device`: $FICCO_HARDWARE, cpu, or by GPU name."""
    if _state.settings.hardware or os.environ.get("FICCO_HARDWARE"):
        return _state.settings.hardware or os.environ["FICCO_HARDWARE"]
    if device.type == "cpu":
        return "cpu"
    return preset_for_device(torch.cuda.get_device_name(device))


def resolve_group(group_name) -> dist.ProcessGroup:
    """The process group of a name (or the group itself). A type check, not isinstance: the
    group class's instance check is Python code, a microsecond per call."""
    if type(group_name) is str:
        return c10d._resolve_process_group(group_name)
    return dist.group.WORLD if group_name is None else group_name


# -- deciding ---------------------------------------------------------------------------
def decide(key: tuple, group: dist.ProcessGroup, make_scenario, layer: tuple | None = None,
           m: int | None = None) -> Plan:
    """The cached, rank-agreed plan of a call shape; `make_scenario` -> Scenario or a reason.

    `layer`, `m`: the call's shape without its token count, and the token count. A new m of
    a layer seen before is looked up in the layer's table (``Selector.layer_table``), which
    rank 0 built and broadcast at the layer's first call: every rank looks up the same
    table, so the group agrees on every m without another collective. An m outside the
    table, a pinned schedule, or a layer without a table is decided per shape: on the
    group's rank 0, broadcast (one small collective per new shape).
    """
    # Keyed by the group's name: holding ProcessGroup objects in a module global would keep
    # gloo's threads alive until interpreter teardown, where they can abort the process.
    key = (key, group.group_name)
    plan = _state.plans.get(key)
    if plan is None:
        plan = _new_plan(key, group, make_scenario, layer, m)
    if _state.settings.explore_every and plan.scenario is not None:
        plan = _explore(plan)
    _state.last_decision = plan.decision
    return plan


def cached_plan(key: tuple, group: dist.ProcessGroup) -> Plan | None:
    """`decide`'s answer where the call shape's plan is cached and nothing else applies (no
    exploration); else None (call ``decide``). The hot path: one lookup."""
    if _state.settings.explore_every:
        return None
    plan = _state.plans.get((key, group.group_name))
    if plan is not None:
        _state.last_decision = plan.decision
    return plan


def _new_plan(key: tuple, group: dist.ProcessGroup, make_scenario, layer: tuple | None, m: int | None) -> Plan:
    hit = None
    if layer is not None and _state.settings.schedule is None:
        hit = _from_table((layer, group.group_name), m, group, make_scenario)
    if hit is None:
        scenario = decision = None
        if dist.get_rank(group) == 0:
            try:
                scenario = make_scenario()
            except Exception as e:  # noqa: BLE001 - the other ranks wait for this rank's answer
                decision = Decision(BASELINE, "fallback", 0.0, f"not a scenario the executor runs: {e}")
            pinned = _state.settings.schedule
            if decision is None and pinned is not None and is_legal(pinned, scenario, _backend(scenario)):
                decision = Decision(pinned, "pinned", 1.0, "configure(schedule=...)")
            if decision is None:
                decision = _selector().select(scenario)
        # One rank decides so that every rank runs the same schedule.
        box = [(scenario, decision)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        hit = box[0]
        if hit[0] is not None and dist.get_rank(group) != 0:
            hit = (_own_scenario(make_scenario, hit[0]), hit[1])
    scenario, decision = hit
    plan = Plan(scenario, decision, scenario is None or runs_natively(decision))
    _state.plans.put(key, plan)
    return plan


def _own_scenario(make_scenario, agreed: Scenario) -> Scenario:
    """This rank's own description of its call. Each rank runs its own shapes, so that ranks
    that pass different ones fail in their transfers (sizes that do not match), never run
    one rank's shapes on another's tensors. ValueError where this rank cannot describe a
    call that rank 0 could: they passed different calls."""
    try:
        return make_scenario()
    except Exception as e:  # noqa: BLE001 - named below
        raise ValueError(f"rank 0 passed {agreed.scenario_id}, this rank a call that is not a scenario ({e}); every "
                         "rank of the group must pass the same shapes, dtype and dims") from None


def _from_table(key: tuple, m: int, group: dist.ProcessGroup, make_scenario) -> tuple[Scenario, Decision] | None:
    """The decision for token count `m` from the layer's table (the one the group agreed on
    at the layer's first call), or None (decide per shape)."""
    first, table = _table_entry(key, group, make_scenario)
    decision = table.decide(m) if table is not None else None
    return None if decision is None else (_own_scenario(make_scenario, first), decision)


def _table_entry(key: tuple, group: dist.ProcessGroup, make_scenario) -> tuple[Scenario | None, LayerTable | None]:
    """The layer's (first scenario, table), built on the group's rank 0 and broadcast at its
    first use (None, None where it has none)."""
    entry = _state.tables.get(key)
    if entry is None:
        first = table = None
        if dist.get_rank(group) == 0:
            try:
                first = make_scenario()
                table = _selector().layer_table(first)
            except Exception:  # noqa: BLE001 - no table: the per-shape path decides and says why
                first = table = None
        box = [(first, table)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        entry = _state.tables[key] = box[0]
    return entry


def prepare_layer(layer: tuple, group: dist.ProcessGroup, make_scenario) -> LayerTable | None:
    """Build a layer's table now, as its first call would (every rank of `group` calls this,
    in the same order): the calls that follow decide by a lookup, with no collective and
    no model. None where the layer gets no table (a pinned schedule, a scenario the
    selector cannot table)."""
    if _state.settings.schedule is not None:
        return None
    return _table_entry((layer, group.group_name), group, make_scenario)[1]


def _explore(plan: Plan) -> Plan:
    # Deterministic in the call count, so every rank explores the same schedule.
    plan.calls += 1
    n, every = plan.calls, _state.settings.explore_every
    if n % every:
        return plan
    runnable = candidates(plan.scenario, _backend(plan.scenario))
    pick = runnable[(n // every - 1) % len(runnable)]
    decision = Decision(pick, "explore", 0.0, f"exploration: call {n} of this shape")
    return Plan(plan.scenario, decision, runs_natively(decision), verified=plan.verified)


def _backend(scenario: Scenario) -> str:
    """The backend whose schedules a call may run: the cpu backend's on a machine without
    copy engines, whatever its name (a shaped fabric's ``cpu-1gbit`` too), else a GPU's."""
    try:
        kind = load_hardware(scenario.hardware).kind
    except HardwareError:  # a name no spec describes: the cpu preset's name alone is the cpu
        kind = "cpu" if scenario.hardware == "cpu" else "gpu"
    return backend_for(kind, runs=True)


HOST_SLOT_BYTES = 1 << 20
"""Staging slot size of the CPU stand-in of the dma transport (it lives in /dev/shm)."""


def _comm(engine: str, group: dist.ProcessGroup, device: torch.device) -> Comm | None:
    """The comm that moves `engine`'s bytes on `group`, or None where dma has no transport.

    Built once per group. A dma comm is built collectively (every rank runs the same
    decision). Building it can fail where symmetric memory is not supported; the group then
    runs dma schedules as their sm twins, with a warning, rather than fail the job.
    """
    if engine == "sm":
        key = (group.group_name, device.type)
        comm = _state.sm_comms.get(key)
        if comm is None or comm.group is not group:  # new, or a group re-made under the same name
            comm = _state.sm_comms[key] = NcclComm(group) if device.type == "cuda" else P2PComm(group)
        return comm
    key = (group.group_name, str(device))  # not the group object: see decide
    if key not in _state.dma_comms:
        try:
            if device.type == "cuda":
                memory = CudaPeerMemory(group)
            else:
                memory = HostPeerMemory(group, slot_bytes=HOST_SLOT_BYTES)
            _state.dma_comms[key] = PeerCopyComm(memory)
        except Exception as e:  # noqa: BLE001 - any failure means: no copy-engine transport
            log.warning("ficco-select: no dma transport on group %s (%s: %s); dma schedules run as "
                        "their sm twins", group.group_name, type(e).__name__, e)
            _state.dma_comms[key] = None
    return _state.dma_comms[key]


def _runner(plan: Plan, op_cls, group: dist.ProcessGroup, inputs: dict) -> tuple[Schedule, Comm, Operator]:
    """The plan's (schedule as it runs, comm, operator template), made at its first run (or
    again for a group re-made under the same name)."""
    if plan.runner is None or getattr(plan.runner[1], "group", group) is not group:
        device = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device
        schedule = plan.decision.schedule
        comm = _comm(schedule.engine, group, device)
        if comm is None:  # the decision as it really runs (telemetry records this schedule)
            schedule = dataclasses.replace(schedule, engine="sm")
            comm = _comm("sm", group, device)
        plan.runner = (schedule, comm, op_cls.template(plan.scenario, comm, device=device))
    return plan.runner


def run_decided(op_cls, plan: Plan, group: dist.ProcessGroup, reference, **inputs):
    """Run the plan's schedule with the executor; telemetry (and a first-call check) if on.
    Returns (output, the operator that ran)."""
    schedule, _, template = _runner(plan, op_cls, group, inputs)
    if schedule is not plan.decision.schedule:
        _state.last_decision = dataclasses.replace(
            plan.decision, schedule=schedule, reason=f"{plan.decision.schedule.name} as its sm twin: no dma transport")
    op = template.for_call(**inputs)
    if not _state.settings.telemetry:
        return op.run(schedule), op
    return _timed(plan, schedule, template.device, lambda: op.run(schedule), reference), op


def runs_natively(decision: Decision) -> bool:
    """Whether the decision is the baseline over the group's own backend (``none.sm``): every
    op then runs PyTorch's own collective and GEMM, exactly what the unhooked job runs."""
    return decision.schedule == BASELINE


def run_native(plan: Plan, device: torch.device, native):
    """native(): PyTorch's own op, for a call without a scenario and for a baseline
    decision (``runs_natively``). Telemetry times a scenario's run under the decided
    schedule's name; it is the reference, so its check passes by definition."""
    if plan.scenario is None or not _state.settings.telemetry:
        return native()
    return _timed(plan, plan.decision.schedule, device, native, None)


def _timed(plan: Plan, schedule: Schedule, device: torch.device, run, reference):
    """run(); with telemetry on, timed and recorded, and checked against reference() the
    first time this scenario runs this schedule (reference None: the run is the reference)."""
    rec = _recorder()
    if rec is None:
        return run()
    scenario, decision = plan.scenario, plan.decision
    call = rec.next_call(scenario.scenario_id, schedule.name)
    if device.type == "cuda":  # events on the stream: the time is read once the GPU got there, no sync now
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run()
        end.record()
    else:
        t0 = time.perf_counter()
        out = run()
        elapsed = time.perf_counter() - t0
    verified = err = None
    if schedule.name not in plan.verified:
        plan.verified.add(schedule.name)
        if reference is None:
            verified, err = True, 0.0
        else:
            err = relative_error(out, reference().float())
            verified = err <= TOLERANCE[scenario.dtype]
        if not verified:
            log.warning("ficco-select: schedule %s gave a wrong result on %s (rel. error %.2e)",
                        schedule.name, scenario.scenario_id, err)
    fields = dict(record={**scenario.as_record(), "scenario_id": scenario.scenario_id}, schedule=schedule.name,
                  source=decision.source, call=call, verified=verified,
                  rel_error=None if err is None or math.isinf(err) else err, backend=device.type)
    if device.type != "cuda":
        rec.record(time_s=elapsed, **fields)
        return out
    _state.timings.append((start, end, rec, fields))
    _record_finished_timings()
    return out


TIMINGS_PENDING = 256
"""CUDA calls whose times may wait unread; beyond, the oldest is waited for (a GPU this far
behind its host is rare: one sync then, not one per call)."""


def _record_finished_timings() -> None:
    """Record every timed CUDA call, oldest first, whose end the GPU has reached (a query, no
    sync); the oldest is waited for only when ``TIMINGS_PENDING`` are pending."""
    timings = _state.timings
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
    timings = _state.timings
    while timings:
        start, end, rec, fields = timings.popleft()
        try:
            end.synchronize()
            rec.record(time_s=start.elapsed_time(end) / 1e3, **fields)
        except Exception as e:  # noqa: BLE001 - telemetry must not break the job's exit
            log.warning("ficco-select: a pending telemetry time was lost: %r", e)


atexit.register(flush_timings)  # the last calls' times, read as the job ends


def _recorder() -> Telemetry | None:
    path = _state.settings.telemetry
    if not path:
        return None
    rank = dist.get_rank()
    key = f"{path}@{rank}"
    if key not in _state.telemetry:
        _state.telemetry[key] = Telemetry(path, rank)
    return _state.telemetry[key]


def scenario_for(op: str, m: int, n: int, k: int, dtype: torch.dtype, P: int, device: torch.device,
              imbalance: float = 1.0) -> Scenario:
    if dtype not in DTYPE_NAMES:
        raise ScenarioError(f"column 'dtype': {dtype} is not one of {', '.join(DTYPE_NAMES.values())}")
    hw = hardware_name(device)
    if hw is None:
        raise ScenarioError(f"column 'hardware': no preset for {torch.cuda.get_device_name(device)}; "
                            "set $FICCO_HARDWARE")
    return Scenario(group=_state.settings.group_label, op=op, m=m, n=n, k=k, dtype=DTYPE_NAMES[dtype],
                    world_size=P, hardware=hw, imbalance=imbalance)


def fall_back(reason: str) -> None:
    _state.last_decision = Decision(BASELINE, "fallback", 0.0, reason)
