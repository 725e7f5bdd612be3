"""What the torch ops share in a process: the settings (``configure``), the decision per call
shape agreed by the group's ranks, the transports per group, telemetry; and running a
decided schedule with the executor.

Everything mutable lives in one ``_State`` (``reset()`` starts a fresh one). Decisions and
transports are keyed by the group's name, never the group object (see ``decide``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators import TOLERANCE, relative_error
from ficco_select.executor.peer import CudaPeerMemory, HostPeerMemory, NcclComm, PeerCopyComm
from ficco_select.hardware import HardwareError, load_hardware, preset_for_device
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.layers import LayerTable
from ficco_select.runtime.selector import Selector
from ficco_select.runtime.telemetry import Telemetry
from ficco_select.runtime.telemetry import from_env as telemetry_from_env
from ficco_select.scenario import Scenario, ScenarioError
from ficco_select.schedule import BASELINE, Schedule, candidates, is_legal, parse

log = logging.getLogger("ficco_select.runtime.torch_ops")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass
class Settings:
    """What ``configure`` sets."""

    selector: Selector | None = None
    hardware: str | None = None
    telemetry: str | None = None
    group_label: str = "runtime"
    schedule: Schedule | None = None
    """Pinned by the caller (benchmarks, debugging): runs wherever it is legal."""
    explore_every: int = 0
    """Every n-th call of a shape runs another candidate, in turn (0: never)."""
    check_calls: bool = dataclasses.field(default_factory=lambda: os.environ.get("FICCO_CHECK_CALLS", "1") != "0")
    """Each call first checks that every rank passes the same call (``torch_ops``): one tiny
    host collective per call. False (or $FICCO_CHECK_CALLS=0): PyTorch's own ops' contract,
    nothing checked, for a job whose steps are too short to pay it."""


@dataclasses.dataclass
class _State:
    """Everything the ops remember in this process; ``reset()`` starts a fresh one."""

    settings: Settings = dataclasses.field(default_factory=Settings)
    decisions: dict[tuple, tuple[Scenario | None, Decision]] = dataclasses.field(default_factory=dict)
    """(call shape key, group name) -> the rank-agreed (scenario, decision)."""
    tables: dict[tuple, tuple[Scenario | None, LayerTable | None]] = dataclasses.field(default_factory=dict)
    """(call layer key, group name) -> the rank-agreed (layer's first scenario, its layer table)."""
    calls: dict[tuple, int] = dataclasses.field(default_factory=dict)
    """(call shape key, group name) -> calls so far (the same on every rank: they make the same calls)."""
    telemetry: dict[str, Telemetry] = dataclasses.field(default_factory=dict)
    """Telemetry writers by "<file>@<rank>"."""
    verified: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """(scenario id, schedule) checked against the reference once (with telemetry on)."""
    dma_comms: dict[tuple[str, str], PeerCopyComm | None] = dataclasses.field(default_factory=dict)
    """(group name, device) -> the dma comm; its staging slots persist, its transfer counts
    match on every rank because every rank runs the same schedules on the group."""
    last_decision: Decision | None = None
    """The decision of the latest call in this process (for logging and tests)."""


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


def checks_calls() -> bool:
    """Whether each call first checks that every rank passes the same call (``configure``)."""
    return _state.settings.check_calls


def decisions() -> dict[tuple, Decision]:
    """(call shape key, group name) -> the decision cached for it (benchmarks, examples)."""
    return {key: decision for key, (_, decision) in _state.decisions.items()}


def configure(*, selector: Selector | str | os.PathLike | None = None, hardware: str | None = None,
              telemetry: str | os.PathLike | None = None, group_label: str | None = None,
              schedule: str | Schedule | None = None, explore_every: int | None = None,
              check_calls: bool | None = None) -> None:
    """Set the selector (object or exported folder), the hardware preset name, the
    telemetry file, the scenario ``group`` label, pin one schedule (``""`` unpins: the
    decision says ``source="pinned"`` where the schedule is legal, else the selector
    decides), or explore: every ``explore_every``-th call of a shape runs the next of its
    candidates, baseline first (``source="explore"``), so that telemetry times the
    alternatives ``ficco train`` needs on the job's own shapes; ``check_calls=False`` skips
    the per-call check that every rank passes the same shapes (``Settings.check_calls``).
    Clears the decision cache."""
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
    _state.decisions.clear()
    _state.tables.clear()
    _state.calls.clear()


def reset() -> None:
    """Back to defaults: the exported champion (or the heuristic), detected hardware, no telemetry."""
    global _state
    for comm in _state.dma_comms.values():
        if comm is not None:
            comm.memory.close()
    _state = _State()


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
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


# -- deciding ---------------------------------------------------------------------------
def decide(key: tuple, group: dist.ProcessGroup, make_scenario, layer: tuple | None = None,
           m: int | None = None) -> tuple[Scenario | None, Decision]:
    """The cached, rank-agreed decision for a call shape; `make_scenario` -> Scenario or a reason.

    `layer`, `m`: the call's shape without its token count, and the token count. A new m of
    a layer seen before is looked up in the layer's table (``Selector.layer_table``), which
    rank 0 built and broadcast at the layer's first call: every rank looks up the same
    table, so the group agrees on every m without another collective. An m outside the
    table, a pinned schedule, or a layer without a table is decided per shape, as above.
    """
    # Keyed by the group's name: holding ProcessGroup objects in a module global would keep
    # gloo's threads alive until interpreter teardown, where they can abort the process.
    key = (key, group.group_name)
    hit = _state.decisions.get(key)
    if hit is None and layer is not None and _state.settings.schedule is None:
        hit = _from_table((layer, group.group_name), m, group, make_scenario)
        if hit is not None:
            _state.decisions[key] = hit
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
        hit = _state.decisions[key] = box[0]
    if _state.settings.explore_every and hit[0] is not None:
        hit = _explore(key, *hit)
    _state.last_decision = hit[1]
    return hit


def _from_table(key: tuple, m: int, group: dist.ProcessGroup, make_scenario) -> tuple[Scenario, Decision] | None:
    """The decision for token count `m` from the layer's table, or None (decide per shape)."""
    first, table = _table_entry(key, group, make_scenario)
    decision = table.decide(m) if table is not None else None
    return None if decision is None else (dataclasses.replace(first, m=m), decision)


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


def _explore(key: tuple, scenario: Scenario, decision: Decision) -> tuple[Scenario, Decision]:
    # Deterministic in the call count, so every rank explores the same schedule.
    n = _state.calls[key] = _state.calls.get(key, 0) + 1
    every = _state.settings.explore_every
    if n % every:
        return scenario, decision
    runnable = candidates(scenario, _backend(scenario))
    pick = runnable[(n // every - 1) % len(runnable)]
    return scenario, Decision(pick, "explore", 0.0, f"exploration: call {n} of this shape")


def _backend(scenario: Scenario) -> str:
    """The backend whose schedules a call may run: the cpu backend's on a machine without
    copy engines, whatever its name (a shaped fabric's ``cpu-1gbit`` too), else a GPU's."""
    try:
        return "cuda" if load_hardware(scenario.hardware).copy_engines else "cpu"
    except HardwareError:  # a name no spec describes: the cpu preset's name alone is the cpu
        return "cpu" if scenario.hardware == "cpu" else "cuda"


HOST_SLOT_BYTES = 1 << 20
"""Staging slot size of the CPU stand-in of the dma transport (it lives in /dev/shm)."""


def _comm(engine: str, group: dist.ProcessGroup, device: torch.device):
    """The comm that moves `engine`'s bytes on `group`, or None where dma has no transport.

    A dma comm is built once per group, collectively (every rank runs the same decision).
    Building it can fail where symmetric memory is not supported; the group then runs
    dma schedules as their sm twins, with a warning, rather than fail the job.
    """
    if engine == "sm":
        return NcclComm(group) if device.type == "cuda" else P2PComm(group)
    key = (group.group_name, str(device))  # not the group object: see _state.decisions
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


def run_decided(op_cls, scenario: Scenario, decision: Decision, group: dist.ProcessGroup, reference, **inputs):
    """Run the decided schedule with the executor; telemetry (and a first-call check) if on."""
    schedule = decision.schedule
    device = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device
    comm = _comm(schedule.engine, group, device)
    if comm is None:  # the decision as it really runs (telemetry records this schedule)
        schedule = dataclasses.replace(schedule, engine="sm")
        comm = _comm("sm", group, device)
        _state.last_decision = dataclasses.replace(decision, schedule=schedule,
                                            reason=f"{decision.schedule.name} as its sm twin: no dma transport")
    op = op_cls(scenario, comm, device=device, **inputs)
    return _timed(scenario, schedule, decision, device, lambda: op.run(schedule), reference), op


def runs_natively(decision: Decision) -> bool:
    """Whether the decision is the baseline (which an op whose measured baseline is
    PyTorch's own collective runs as PyTorch's op: ``matmul_all_reduce``)."""
    return decision.schedule.granularity == "none"


def run_native(scenario: Scenario | None, decision: Decision, device: torch.device, native):
    """native(): PyTorch's own op, for a call without a scenario and for a baseline decision
    measured as PyTorch's op (``runs_natively``). Telemetry times a scenario's run under the
    decided schedule's name; it is the reference, so its check passes by definition."""
    if scenario is None:
        return native()
    return _timed(scenario, decision.schedule, decision, device, native, None)


def _timed(scenario: Scenario, schedule: Schedule, decision: Decision, device: torch.device, run, reference):
    """run(); with telemetry on, timed and recorded, and checked against reference() the
    first time this scenario runs this schedule (reference None: the run is the reference)."""
    rec = _recorder()
    if rec is None:
        return run()
    call = rec.next_call(scenario.scenario_id, schedule.name)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    verified = err = None
    if (scenario.scenario_id, schedule.name) not in _state.verified:
        _state.verified.add((scenario.scenario_id, schedule.name))
        if reference is None:
            verified, err = True, 0.0
        else:
            err = relative_error(out, reference().float())
            verified = err <= TOLERANCE[scenario.dtype]
        if not verified:
            log.warning("ficco-select: schedule %s gave a wrong result on %s (rel. error %.2e)",
                        schedule.name, scenario.scenario_id, err)
    rec.record({**scenario.as_record(), "scenario_id": scenario.scenario_id}, schedule=schedule.name,
               source=decision.source, call=call, time_s=elapsed, verified=verified,
               rel_error=None if err is None or math.isinf(err) else err, backend=device.type)
    return out


def _recorder() -> Telemetry | None:
    path = _state.settings.telemetry or os.environ.get("FICCO_TELEMETRY")
    if not path:
        return None
    rank = dist.get_rank()
    key = f"{path}@{rank}"
    if key not in _state.telemetry:
        _state.telemetry[key] = Telemetry(path, rank) if _state.settings.telemetry else telemetry_from_env(rank)
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
