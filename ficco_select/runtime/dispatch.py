"""A call's plan: looked up in its group's context (``context.py``), or decided once per call
shape and agreed by the group's ranks, then run (``running.py``).

Where the ops and hooks find the runtime: the names of ``settings``, ``context`` and
``running`` they use are re-exported here (``configure``, ``reset``, ``last_decision``,
``run_decided``...).

A plan is decided on the group's rank 0 and broadcast, so that every rank runs the same
schedule; a layer's later token counts are looked up in its table, which rank 0 built and
broadcast at the layer's first call. Plans and tables are each a bounded cache of the group's
context: continuous batching sends every token count, and a job's memory must not grow with
them.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from ficco_select.hardware import HardwareError, HardwareSpec, load_hardware
from ficco_select.runtime.context import (  # the runtime's names, in one place (__all__)
    GroupContext,
    Plan,
    check_agreed,
    checks_calls,
    configure,
    context,
    contexts,
    decisions,
    fall_back,
    hardware_name,
    last_decision,
    note,
    note_check_agreed,
    pinned_schedule,
    plans,
    resolve_group,
    runs_natively,
    scenario_for,
    selector,
    settings,
    start_over,
    tables,
)
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.layers import LayerTable
from ficco_select.runtime.learning import TRIALS_AT_ONCE, Trial, learned_decision
from ficco_select.runtime.running import flush_timings, forget_writers, run_decided, run_native
from ficco_select.runtime.settings import DECISION_CACHE_SIZE, Settings, debug_checks
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, backend_for, candidates, is_legal

log = logging.getLogger("ficco_select.runtime.dispatch")

__all__ = [
    # settings.py
    "DECISION_CACHE_SIZE", "Settings", "debug_checks",
    # context.py
    "GroupContext", "Plan", "check_agreed", "checks_calls", "configure", "context", "decisions", "fall_back",
    "hardware_name", "last_decision", "note", "note_check_agreed", "pinned_schedule", "plans", "resolve_group",
    "runs_natively", "scenario_for", "selector", "settings", "tables",
    # running.py
    "flush_timings", "run_decided", "run_native",
    # here
    "reset", "decide", "prepare_layer", "report",
]


def reset() -> None:
    """Back to defaults: the exported champion (or the heuristic), detected hardware, no
    telemetry (every pending time recorded first), no group's context."""
    forget_writers()
    start_over()


# -- deciding ---------------------------------------------------------------------------
def decide(ctx: GroupContext, key: tuple, group: dist.ProcessGroup, make_scenario, layer: tuple | None = None,
           m: int | None = None) -> Plan:
    """The cached, rank-agreed plan of a call shape; `make_scenario` -> Scenario or a reason.

    `layer`, `m`: the call's shape without its token count, and the token count. A new m of
    a layer seen before is looked up on the grid of the layer's table (``Selector.layer_table``),
    which rank 0 built and broadcast at the layer's first call: every rank looks up the same
    grid, so the group agrees on those m without another collective. An m off the grid, a
    pinned schedule, or a layer without a table is decided per shape: on the group's rank 0
    (by the same policy, ``runtime/policy.py``), broadcast (one small collective per new shape). A watched call
    (``Settings.watched``) comes here every time: its decision is kept, and exploration
    counts it.
    """
    trial = ctx.trials.get(key) if ctx.settings.learn else None
    if trial is not None:
        return _learning(ctx, key, trial, group)
    plan = ctx.plans.get(key)
    if plan is None:
        plan = _new_plan(ctx, key, group, make_scenario, layer, m)
    if plan.trial is not None:
        return plan
    if ctx.settings.explore_every and plan.scenario is not None:
        plan = _explore(ctx, plan)
    if ctx.watched:
        note(plan.decision)
    return plan


def _new_plan(ctx: GroupContext, key: tuple, group: dist.ProcessGroup, make_scenario, layer: tuple | None,
              m: int | None) -> Plan:
    hit = None
    pinned = ctx.settings.schedule
    learn = ctx.settings.learn and pinned is None
    if layer is not None and pinned is None and not learn:  # a shape that learns is agreed per shape
        hit = _from_table(ctx, layer, m, group, make_scenario)
    contenders = ()
    if hit is None:
        scenario = decision = None
        if dist.get_rank(group) == 0:
            try:
                scenario = make_scenario()
            except Exception as e:  # noqa: BLE001 - the other ranks wait for this rank's answer
                decision = Decision(BASELINE, "fallback", 0.0, f"not a scenario the executor runs: {e}")
            if decision is None and pinned is not None and is_legal(pinned, scenario, _backend(scenario)):
                decision = Decision(pinned, "pinned", 1.0, "configure(schedule=...)")
            if decision is None:
                decision = selector().select(scenario)
                if learn:
                    decision, contenders = _to_learn(ctx, scenario, decision)
        # One rank decides so that every rank runs the same schedule.
        box = [(scenario, decision, contenders)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        scenario, decision, contenders = box[0]
        if scenario is not None and dist.get_rank(group) != 0:
            scenario = _own_scenario(make_scenario, scenario)
        hit = (scenario, decision)
    scenario, decision = hit
    if len(contenders) > 1:
        return _start_trial(ctx, key, scenario, contenders, group)
    return ctx.plans.put(key, Plan(scenario, decision, scenario is None or runs_natively(decision)))


# -- learning (``learning.py``) ---------------------------------------------------------------
def _to_learn(ctx: GroupContext, scenario: Scenario, decision: Decision) -> tuple[Decision, tuple]:
    """On the group's rank 0: (the decision, the contenders a trial of this new shape
    measures), or the machine's record's decision and no trial where an earlier job measured
    the shape, or no trial where ``TRIALS_AT_ONCE`` shapes learn already."""
    runnable = _runnable(scenario)
    recorded = _record_of(ctx, scenario)[1].get(scenario.scenario_id)
    if recorded is not None and (learned := learned_decision(recorded, scenario, runnable)) is not None:
        return learned, ()
    if len(ctx.trials) >= TRIALS_AT_ONCE:
        return decision, ()
    # The baseline always races: it is the reference a contender is dropped against, and the
    # fallback where every other contender is wrong (a selector of the caller's may leave it out).
    return decision, tuple(dict.fromkeys(c for c in (*selector().contenders(scenario, decision), BASELINE)
                                         if c in runnable))


def _record_of(ctx: GroupContext, scenario: Scenario) -> tuple:
    """(the machine's record file, its shapes: scenario id -> entry), made and read once per
    group and machine name; (None, {}) where there is none."""
    record = ctx.records.get(scenario.hardware)
    if record is None:
        record = ctx.records[scenario.hardware] = (None, {})
        try:
            from ficco_select.runtime.learned import LearnedRecord, record_key

            file = LearnedRecord(record_key(scenario.hardware, _device_of(scenario)), ctx.settings.learn_dir)
            record = ctx.records[scenario.hardware] = (file, file.load())
        except Exception as e:  # noqa: BLE001 - no record: every shape learns
            log.warning("ficco-select: the machine's record of learned decisions is not read (%r)", e)
    return record


def _device_of(scenario: Scenario) -> torch.device:
    """The device a scenario's calls run on: this process's GPU on the cuda backend, else the cpu."""
    return torch.device("cuda", torch.cuda.current_device()) if _backend(scenario) == "cuda" else torch.device("cpu")


def _start_trial(ctx: GroupContext, key: tuple, scenario: Scenario, contenders: tuple,
                 group: dist.ProcessGroup) -> Plan:
    trial = Trial(scenario, contenders, _device_of(scenario))
    n = len(contenders)
    trial.plans = [Plan(scenario, d, runs_natively(d), trial=(trial, i)) for i, d in enumerate(
        Decision(c, "learning", 0.0, f"learning: contender {i + 1} of {n}") for i, c in enumerate(contenders))]
    ctx.trials[key] = trial
    return _learning(ctx, key, trial, group)


def _learning(ctx: GroupContext, key: tuple, trial: Trial, group: dist.ProcessGroup) -> Plan:
    """The plan of a learning shape's call: its trial's next contender; settled, the settled
    contender's plan, kept as the shape's plan (and in the machine's record)."""
    i = trial.next_contender(group)
    if trial.settled is None:
        return trial.plans[i]
    del ctx.trials[key]
    ctx.learned.put(key, trial)
    pick = trial.contenders[i]
    agreed = trial.agreed[-1]
    decision = Decision(pick, "learned", 1.0, f"measured fastest in this job: {agreed[i] * 1e3:.3f} ms of "
                        + ", ".join(f"{c.name} {t * 1e3:.3f}" for c, t in zip(trial.contenders, agreed) if t == t))
    if dist.get_rank(group) == 0:
        file, shapes = _record_of(ctx, trial.scenario)
        shapes[trial.scenario.scenario_id] = entry = trial.entry()
        if file is not None:
            file.put({trial.scenario.scenario_id: entry})  # warns itself where it cannot write: the job goes on
    plan = Plan(trial.scenario, decision, runs_natively(decision))
    runner = trial.plans[i].runner
    if runner is not None and runner.schedule == pick:  # bound already (not as an sm twin): keep it, say why it runs
        plan.runner = dataclasses.replace(runner, decision=decision)
    return ctx.plans.put(key, plan)


def report() -> list[dict]:
    """Every call shape that learned or learns in this process, by group: its contenders, the
    settled one (None while it learns), rounds, calls explored and their cost (seconds
    beyond the settled contender's time, by the agreed times)."""
    return [{"group": ctx.name, "scenario_id": trial.scenario.scenario_id, **trial.summary()}
            for ctx in contexts() for trial in [*ctx.learned.values(), *ctx.trials.values()]]


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


def _from_table(ctx: GroupContext, layer: tuple, m: int, group: dist.ProcessGroup,
                make_scenario) -> tuple[Scenario, Decision] | None:
    """The decision for token count `m` on the grid of the layer's table (the one the group
    agreed on at the layer's first call), or None (decide per shape). The grid alone: rank 0's
    table also keeps the m it decided since, which the other ranks' copies do not know."""
    first, table = _table_entry(ctx, layer, group, make_scenario)
    decision = table.on_grid(m) if table is not None else None
    return None if decision is None else (_own_scenario(make_scenario, first), decision)


def _table_entry(ctx: GroupContext, layer: tuple, group: dist.ProcessGroup,
                 make_scenario) -> tuple[Scenario | None, LayerTable | None]:
    """The layer's (first scenario, table), built on the group's rank 0 and broadcast at its
    first use (None, None where it has none)."""
    entry = ctx.tables.get(layer)
    if entry is None:
        first = table = None
        if dist.get_rank(group) == 0:
            try:
                first = make_scenario()
                table = selector().layer_table(first)
            except Exception:  # noqa: BLE001 - no table: the per-shape path decides and says why
                first = table = None
        box = [(first, table)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        entry = ctx.tables.put(layer, box[0])
    return entry


def prepare_layer(layer: tuple, group: dist.ProcessGroup, make_scenario) -> LayerTable | None:
    """Build a layer's table now, as its first call would (every rank of `group` calls this,
    in the same order): the calls that follow decide by a lookup, with no collective and
    no model. None where the layer gets no table (a pinned schedule, a scenario the
    selector cannot table)."""
    ctx = context(group)
    if ctx.settings.schedule is not None:
        return None
    return _table_entry(ctx, layer, group, make_scenario)[1]


def _explore(ctx: GroupContext, plan: Plan) -> Plan:
    # Deterministic in the call count, so every rank explores the same schedule.
    plan.calls += 1
    n, every = plan.calls, ctx.settings.explore_every
    if n % every:
        return plan
    runnable = _runnable(plan.scenario)
    pick = runnable[(n // every - 1) % len(runnable)]
    decision = Decision(pick, "explore", 0.0, f"exploration: call {n} of this shape")
    return Plan(plan.scenario, decision, runs_natively(decision), verified=plan.verified)


def _runnable(scenario: Scenario) -> list:
    """The schedules a call may run: its backend's, on its machine's engines where a spec
    describes the machine (no switch schedule on a fabric without the switch's reduction)."""
    spec = _spec(scenario)
    return candidates(scenario, _backend(scenario, spec), spec)


def _spec(scenario: Scenario) -> HardwareSpec | None:
    try:
        return load_hardware(scenario.hardware)
    except HardwareError:
        return None


def _backend(scenario: Scenario, spec: HardwareSpec | None = None) -> str:
    """The backend whose schedules a call may run: the cpu backend's on a machine without
    copy engines, whatever its name (a shaped fabric's ``cpu-1gbit`` too), else a GPU's.
    `spec`: the scenario's machine, where the caller has it."""
    spec = spec or _spec(scenario)
    if spec is None:  # a name no spec describes: the cpu preset's name alone is the cpu
        kind = "cpu" if scenario.hardware == "cpu" else "gpu"
    else:
        kind = spec.kind
    return backend_for(kind, runs=True)
