"""The runtime as a context per process group, and the process's settings they follow.

A ``GroupContext`` is made at a group's first ficco call (or ``tp.install``'s preparing of
its layers) and holds what only that group's ranks agree on: its plans (one per call shape,
bound once: the decision, and for an overlapped schedule the comm and the operator that run
it), its layers' decision tables, its transports, and whether its ranks agreed on the
debug mode's check. A planned call reads its group's context and writes nothing outside its
plan: no process-wide state, no closure, no operator copied. ``last_decision`` is kept only
where a call is watched (``Settings.watched``: telemetry, the debug mode or exploration).

Contexts are found by the group's name, never the group object: holding ProcessGroup
objects in a module global would keep gloo's threads alive until interpreter teardown,
where they can abort the process. A context keeps a weak reference to its group: a group
destroyed and re-made under the same name (its size or ranks may differ) gets a fresh
context, its old one closed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ficco_select.executor.comm import Comm
from ficco_select.executor.operators import DTYPE_NAMES, Operator
from ficco_select.executor.peer import PeerCopyComm
from ficco_select.executor.switch import SwitchComm
from ficco_select.hardware import preset_for_device, when_a_job_ends
from ficco_select.runtime.caches import BoundedCache
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.layers import LayerTable
from ficco_select.runtime.learning import Trial
from ficco_select.runtime.selector import Selector
from ficco_select.runtime.settings import LAYER_TABLES_KEPT, Settings
from ficco_select.scenario import Scenario, ScenarioError
from ficco_select.schedule import BASELINE, Schedule, parse

@dataclasses.dataclass(eq=False)
class Runner:
    """An overlapped plan as it runs, bound at its first run: the schedule (its sm twin where
    the group has no dma transport), the comm, and one operator that each call binds to its
    inputs and releases after (``running.run_decided``)."""

    schedule: Schedule
    comm: Comm
    operator: Operator
    shape_state: dict
    """The operator's attributes that depend on the shape alone: what it is reset to after a
    call, so that no call's tensors outlive it."""
    decision: Decision
    """The plan's decision as it runs (its schedule replaced where it runs as its sm twin)."""
    busy: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Held while a call has the operator bound; a call of the same shape from another
    thread meanwhile runs a copy of it."""


@dataclasses.dataclass(eq=False)
class Plan:
    """What one call shape runs, agreed by the group's ranks and made once: the scenario, the
    decision, and (at its first overlapped run) its ``Runner``."""

    scenario: Scenario | None
    decision: Decision
    native: bool
    """The decision is the baseline on PyTorch's own collective (``runs_natively``)."""
    runner: Runner | None = None
    calls: int = 0
    """Calls so far (with ``explore_every``; the same on every rank: they make the same calls)."""
    verified: set[str] = dataclasses.field(default_factory=set)
    """Schedules checked against the reference once (with telemetry on)."""
    trial: tuple | None = None
    """(the ``learning.Trial``, this plan's contender) where the call shape is learning: each
    run is timed for the trial (``running``)."""


def runs_natively(decision: Decision) -> bool:
    """Whether the decision is the baseline over the group's own backend (``none.sm``): every
    op then runs PyTorch's own collective and GEMM, exactly what the unhooked job runs."""
    return decision.schedule == BASELINE


class GroupContext:
    """One process group's runtime: its plans, its layers' tables, its transports."""

    def __init__(self, name: str, settings: Settings, group: dist.ProcessGroup | None = None) -> None:
        self.name = name
        self.group = (lambda: None) if group is None else weakref.ref(group)
        """The group this context was made for (weak: ``context`` tells a re-made group by it)."""
        self.settings = settings
        self.plans: BoundedCache[tuple, Plan] = BoundedCache(settings.cache_size)
        """Call shape key -> the rank-agreed plan."""
        self.tables: BoundedCache[tuple, tuple[Scenario | None, LayerTable | None]] = BoundedCache(LAYER_TABLES_KEPT)
        """Layer key -> the rank-agreed (layer's first scenario, its table)."""
        self.trials: dict[tuple, Trial] = {}
        """Call shape key -> its trial while it learns (``learning.py``; at most
        ``TRIALS_AT_ONCE``); a settled shape's plan goes to ``plans``."""
        self.learned: BoundedCache[tuple, Trial] = BoundedCache(settings.cache_size)
        """Call shape key -> its settled trial (``learning.report``)."""
        self.records: dict[str, tuple] = {}
        """Machine name -> (its record file of measured decisions, the shapes in it: scenario
        id -> entry), read at the group's first learning shape on that machine, on rank 0."""
        self.watched = settings.watched
        """Each call goes through ``dispatch.decide`` (``Settings.watched``); else a cached
        plan is one lookup."""
        self.check_agreed = False
        """The group's ranks agreed on ``Settings.check_calls`` (``ops.agree_on_the_check``)."""
        self.sm_comms: dict[str, Comm] = {}
        """Device type -> the sm comm (stateless: one per device type)."""
        self.dma_comms: dict[str, PeerCopyComm | None] = {}
        """Device -> the dma comm (None: none could be built); its staging slots persist,
        its transfer counts match on every rank because every rank runs the same schedules."""
        self.switch_comms: dict[str, SwitchComm | None] = {}
        """Device -> the switch comm (None: none could be built), kept as the dma comms are."""
        self.host_group: dist.ProcessGroup | None = None
        """Where the debug mode's check runs (``ops._host_group``)."""
        self.agreeing = threading.RLock()
        """Held while this group's ranks agree on the check or make its host group: per group,
        since with one lock per process two threads' first calls on two groups wait on each
        other across ranks (each rank's lock held by the other group's collective)."""

    def plan(self, key: tuple) -> Plan | None:
        """The cached plan of a call shape where nothing else applies (the call is not
        watched), else None (``dispatch.decide``). The hot path: one lookup."""
        return None if self.watched else self.plans.get(key)

    def reconfigure(self, *, check_changed: bool) -> None:
        """The settings changed (``configure``): every plan and table is decided again; the
        ranks agree on the check again where it changed (every rank configures alike)."""
        self.plans = BoundedCache(self.settings.cache_size)
        self.tables.clear()
        self.trials.clear()
        self.records.clear()
        self.watched = self.settings.watched
        if check_changed:
            self.check_agreed = False

    def close(self) -> None:
        for comm in self.dma_comms.values():
            if comm is not None:
                comm.memory.close()
        self.dma_comms.clear()
        for comm in self.switch_comms.values():
            if comm is not None:
                comm.close()
        self.switch_comms.clear()


@dataclasses.dataclass
class _Process:
    """What the process holds beside its groups' contexts; ``reset()`` starts a fresh one."""

    settings: Settings = dataclasses.field(default_factory=Settings)
    contexts: dict[str, GroupContext] = dataclasses.field(default_factory=dict)
    """Group name -> its context. Not evicted: the ranks of a group agree collectively on
    what it holds (the check, the dma transport), and a job's groups are few."""
    last_decision: Decision | None = None
    """The decision of the latest watched call in this process."""


_process = _Process()
_MAKING = threading.Lock()


def context(group: dist.ProcessGroup) -> GroupContext:
    """`group`'s context, made at its first use."""
    ctx = _process.contexts.get(group.group_name)
    if ctx is None or ctx.group() is not group:
        with _MAKING:
            ctx = _process.contexts.get(group.group_name)
            if ctx is None or ctx.group() is not group:
                if ctx is not None:  # a group re-made under the name: its plans, tables, comms are the old one's
                    ctx.close()
                ctx = _process.contexts[group.group_name] = GroupContext(group.group_name, _process.settings, group)
    return ctx


def contexts() -> list[GroupContext]:
    return list(_process.contexts.values())


def last_decision() -> Decision | None:
    """The decision of the latest watched call in this process: where telemetry, the debug
    mode (``configure(check_calls=True)``) or exploration is on. None otherwise: a planned
    call writes nothing outside its group's plan."""
    return _process.last_decision


def note(decision: Decision) -> None:
    """A watched call's decision (``last_decision``)."""
    _process.last_decision = decision


def fall_back(ctx: GroupContext, reason: str) -> None:
    """A call ran PyTorch's implementation: said where calls are watched."""
    if ctx.watched:
        _process.last_decision = Decision(BASELINE, "fallback", 0.0, reason)


def settings() -> Settings:
    """The process's settings (``configure``); read-only by convention."""
    return _process.settings


def pinned_schedule() -> Schedule | None:
    """The schedule ``configure(schedule=...)`` pinned, or None (the selector decides)."""
    return _process.settings.schedule


def selector() -> Selector:
    """The selector the ops decide with (``configure``; default: the exported champion)."""
    if _process.settings.selector is None:
        _process.settings.selector = Selector.load()
    return _process.settings.selector


def checks_calls() -> bool:
    """Whether each call first checks that every rank passes the same call (``configure``)."""
    return _process.settings.check_calls


def check_agreed(group: dist.ProcessGroup) -> bool:
    """Whether `group`'s ranks agreed on ``checks_calls()`` since the last ``reset`` or
    ``configure(check_calls=...)`` (``ops.agree_on_the_check``)."""
    return context(group).check_agreed


def note_check_agreed(group: dist.ProcessGroup) -> None:
    context(group).check_agreed = True


def plans() -> list[tuple[tuple, Plan]]:
    """(call shape key, group name) and the plan cached for it, each group's least recently used first."""
    return [((key, ctx.name), plan) for ctx in contexts() for key, plan in ctx.plans.items()]


def decisions() -> dict[tuple, Decision]:
    """(call shape key, group name) -> the decision cached for it (benchmarks, examples)."""
    return {key: plan.decision for key, plan in plans()}


def tables() -> dict[tuple, tuple[Scenario | None, LayerTable | None]]:
    """(layer key, group name) -> the (layer's first scenario, table) its group agreed on."""
    return {(key, ctx.name): entry for ctx in contexts() for key, entry in ctx.tables.items()}


def configure(*, selector: Selector | str | os.PathLike | None = None, hardware: str | None = None,
              telemetry: str | os.PathLike | None = None, group_label: str | None = None,
              schedule: str | Schedule | None = None, explore_every: int | None = None,
              check_calls: bool | None = None, cache_size: int | None = None, learn: bool | None = None,
              learn_dir: str | os.PathLike | None = None) -> None:
    """Set the selector (object or exported folder), the hardware preset name, the
    telemetry file, the scenario ``group`` label, pin one schedule (``""`` unpins: the
    decision says ``source="pinned"`` where the schedule is legal, else the selector
    decides), or explore: every ``explore_every``-th call of a shape runs the next of its
    candidates, baseline first (``source="explore"``), so that telemetry times the
    alternatives ``ficco train`` needs on the job's own shapes; ``check_calls``: the
    per-call check that every rank passes the same shapes (``Settings.check_calls``: a
    debug mode, off by default; the group's ranks agree on it again at their next checked
    call); ``cache_size``: call shapes whose plan each process group keeps; ``learn``: each
    call shape's decision checked against a few alternatives on the job's own timings and
    the measured best kept, also for the machine's next job (``runtime/learning.py``; default
    $FICCO_LEARN), the record kept in ``learn_dir``. Every group's
    plans and tables are decided again: every rank of a group configures alike, as it makes
    the same calls."""
    s = _process.settings
    if selector is not None:
        s.selector = selector if isinstance(selector, Selector) else Selector.load(selector)
    if hardware is not None:
        s.hardware = hardware
    if telemetry is not None:
        s.telemetry = str(telemetry)
    if group_label is not None:
        s.group_label = group_label
    if schedule is not None:
        s.schedule = parse(schedule) if isinstance(schedule, str) and schedule else schedule or None
    if explore_every is not None:
        s.explore_every = max(0, int(explore_every))
    if check_calls is not None:
        s.check_calls = bool(check_calls)
        s.check_source = f"configure(check_calls={bool(check_calls)})"
    if cache_size is not None:
        s.cache_size = max(1, int(cache_size))
    if learn is not None:
        s.learn = bool(learn)
    if learn_dir is not None:
        s.learn_dir = str(learn_dir)
    for ctx in contexts():
        ctx.reconfigure(check_changed=check_calls is not None)


def start_over() -> None:
    """Back to default settings, no group's context (``dispatch.reset``)."""
    global _process
    for ctx in contexts():
        ctx.close()
    _process = _Process()


def _forget_machines(names: frozenset[str]) -> None:
    """A job's machines ended (``hardware.machines``): the plans and layer tables decided for
    them go with it, as the selector's own do; a later job's machine of the same name gets
    its own."""
    for ctx in contexts():
        ctx.plans.drop(lambda _, plan: plan.scenario is None or plan.scenario.hardware not in names)
        ctx.tables.drop(lambda _, entry: entry[0] is None or entry[0].hardware not in names)
        for key in [key for key, trial in ctx.trials.items() if trial.scenario.hardware in names]:
            del ctx.trials[key]
        ctx.learned.drop(lambda _, trial: trial.scenario.hardware not in names)


when_a_job_ends(_forget_machines)


def hardware_name(device: torch.device) -> str | None:
    """The hardware preset for tensors on `device`: $FICCO_HARDWARE, cpu, or by GPU name."""
    if _process.settings.hardware or os.environ.get("FICCO_HARDWARE"):
        return _process.settings.hardware or os.environ["FICCO_HARDWARE"]
    if device.type == "cpu":
        return "cpu"
    return preset_for_device(torch.cuda.get_device_name(device))


def resolve_group(group_name) -> dist.ProcessGroup:
    """The process group of a name (or the group itself). A type check, not isinstance: the
    group class's instance check is Python code, a microsecond per call."""
    if type(group_name) is str:
        return c10d._resolve_process_group(group_name)
    return dist.group.WORLD if group_name is None else group_name


def scenario_for(op: str, m: int, n: int, k: int, dtype: torch.dtype, P: int, device: torch.device,
                 imbalance: float = 1.0) -> Scenario:
    if dtype not in DTYPE_NAMES:
        raise ScenarioError(f"column 'dtype': {dtype} is not one of {', '.join(DTYPE_NAMES.values())}")
    hw = hardware_name(device)
    if hw is None:
        raise ScenarioError(f"column 'hardware': no preset for {torch.cuda.get_device_name(device)}; "
                            "set $FICCO_HARDWARE")
    return Scenario(group=_process.settings.group_label, op=op, m=m, n=n, k=k, dtype=DTYPE_NAMES[dtype],
                    world_size=P, hardware=hw, imbalance=imbalance)
