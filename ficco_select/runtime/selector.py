"""The runtime selector: which schedule for this (collective + GEMM)? Cached, never raises.

    sel = Selector.load()            # the exported champion, else the heuristic alone
    decision = sel.select(scenario)  # Scenario or a dict with the scenario-table columns
    decision.schedule, decision.source, decision.confidence

The selector resolves the machine a scenario names and keeps what the policy decided
(``runtime/policy.py``: abstention, the model, its fallbacks, the GPU do-no-harm rule; the
one decision function every door calls):

1. the machine: a preset, a spec the export carries in ``hardware_specs``, one the job knows
   (``hardware.machines``), or a spec file by path, decided under the spec's ``name`` as
   training saw it; unknown, or more ranks than its ``devices``: the baseline (``fallback``,
   warned once);
2. its one cache: per layer (every scenario column but ``group`` and ``m``; a job's machine
   or a spec file kept under its numbers beside the layer), the layer's table
   (``runtime/layers.py``): m to the policy's decision, filled on a grid of m in one batch
   on the layer's second m, every other m decided on its first ask.

Sources: ``model``, ``heuristic``, ``cost_model`` or ``fallback`` (the baseline or a fixed
rule); ``Decision.abstained`` names the reason where the model did not decide. Reading an
export: ``runtime/loading.py``; its rules: ``runtime/scope.py``. Imports no pandas,
scikit-learn, mlflow or xgboost.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ficco_select.hardware import (HardwareError, HardwareSpec, is_spec_path, load_hardware, refuse_known_name,
                                   shipped_names)
from ficco_select.runtime import policy
from ficco_select.runtime.caches import BoundedCache
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.layers import DEFAULT_M_RANGE, LayerDecider, LayerTable, build_table, layer_step, read_tables
from ficco_select.runtime.loading import DEFAULT_PATH, read_export
from ficco_select.runtime.scope import Scope
from ficco_select.runtime.trees import TreeEnsemble
from ficco_select.scenario import LAYER_COLUMNS, MAX_EXTENT, SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import BASELINE, Schedule, backend_for

log = logging.getLogger("ficco_select.runtime.selector")


class Selector:
    def __init__(self, model: TreeEnsemble | None = None, meta: Mapping[str, Any] | None = None, *,
                 layer_tables: bool = True) -> None:
        # meta is selector.json's contents: checked here, so that every decision can trust it.
        self.rules = Scope.from_meta(meta) if meta is not None else Scope()
        """The export's rules, parsed once (``runtime/scope.py``): every decision reads them here."""
        self.model = model
        self.layer_tables = layer_tables
        """Fill a layer's table on a grid of m at its second m (``runtime/layers.py``). False:
        each m is decided on its first ask alone (evaluation, where thousands of one-off
        layers would each fill a grid)."""
        self._tables: BoundedCache[tuple, LayerTable] = BoundedCache(_TABLES_LIMIT)
        """The one cache of decisions: a layer's table by ``Scenario.layer``; for a machine a
        job names or a spec file, by (its numbers' key, the layer), since the name means what
        the caller's job says now."""
        self._fixed: dict[str, HardwareSpec] = dict(self.rules.specs)
        """Machines that mean one spec for this selector wherever it is asked: the export's own
        (``hardware_specs``, which win over a job's) and the shipped ones met so far."""
        self._files: BoundedCache[str, HardwareSpec] = BoundedCache(_MACHINES_LIMIT)
        """Spec files read, by path (a job may still refuse the name)."""
        # A machine by its numbers: id(spec) -> (spec, its number), and the numbers -> that number,
        # a small int that keys its tables cheaply; never reused, so a cache that starts over
        # can only miss.
        self._numbers: BoundedCache[int, tuple[HardwareSpec, int]] = BoundedCache(_MACHINES_LIMIT)
        self._machine_ids: BoundedCache[tuple, int] = BoundedCache(_MACHINES_LIMIT)
        self._next_id = itertools.count(1)
        self._warned: BoundedCache[Any, bool] = BoundedCache(_MACHINES_LIMIT)  # what was warned of, once

    # -- loading ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, **kw) -> "Selector":
        """From an exported folder; with no path, the default export if present.

        A missing, corrupt, malformed or incompatible model gives a heuristic-only selector
        and one warning naming the file and field; this never raises.
        """
        where = path if path is not None else DEFAULT_PATH
        try:
            if path is None and not DEFAULT_PATH.exists():
                return cls(**kw)
            folder, meta, model = read_export(where)
            selector = cls(model, meta, **kw)  # checks every field of the rules
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            log.warning("ficco-select: no usable model at %s (%s); using the heuristic", where, e)
            return cls(**kw)
        try:  # precompiled layer tables (ficco export --layers): known layers never walk trees at their grid
            if selector.layer_tables:
                for layer, table in read_tables(folder, selector._decider_of).items():
                    selector._tables.put(layer, selector._batching(table))
        except Exception as e:  # noqa: BLE001 - tables are built on first sight instead
            log.warning("ficco-select: layer tables at %s not used (%s); building them on first sight", where, e)
        return selector

    # -- deciding -------------------------------------------------------------------------
    def select(self, scenario: Scenario | Mapping[str, Any]) -> Decision:
        """The decision for a Scenario or a mapping with the scenario-table columns; never raises.

        Safe to call from any number of threads: a table's entries are written whole, and two
        threads that decide the same m at once write the same decision."""
        try:
            if type(scenario) is Scenario:  # the hot path: a layer met before, on a fixed machine
                table = self._tables.peek(scenario.layer)
                if table is not None:
                    decision = table.grid_get(scenario.m) or table.kept_get(scenario.m)
                    if decision is not None:
                        return decision
            elif type(scenario) is dict:
                key = _RECORD_KEY(scenario)
                # Exact int and float numbers and a group the Scenario would take: a bool (equal
                # to 1 in a key), another type or an empty group takes the slow way, which says why.
                if type(key[2]) is int and type(key[3]) is int and type(key[4]) is int and type(key[8]) is float \
                        and type(key[0]) is str and key[0].strip():
                    table = self._tables.peek(key[1:2] + key[3:])  # the layer: every column but group and m
                    if table is not None:
                        decision = table.grid_get(key[2]) or table.kept_get(key[2])
                        if decision is not None:
                            return decision
        except Exception:  # noqa: BLE001 - no imbalance, unhashable values: the slow path says what is wrong
            pass
        return self._select_slow(scenario)

    def decide_batch(self, scenarios: Sequence[Scenario | Mapping[str, Any]]) -> list[Decision]:
        """The decision for each scenario, as ``select`` gives it: the m not yet decided on
        each layer go to the policy in one batch per layer."""
        missing: dict[int, tuple[LayerTable, list[int]]] = {}
        for s in scenarios:
            try:
                table = self._table_of(s) if type(s) is Scenario else None
                if isinstance(table, LayerTable) and table.known(s.m) is None:
                    missing.setdefault(id(table), (table, []))[1].append(s.m)
            except Exception:  # noqa: BLE001 - select says what is wrong
                pass
        for table, ms in missing.values():
            table.decide_many(ms)
        return [self.select(s) for s in scenarios]

    def clear_cache(self) -> None:
        """Forget every decision made on an m's first ask (the next ``select`` of each such
        scenario decides again). The layers' grids are kept: they are the model's, decided for
        a whole layer at once (precompiled, or filled on a layer's second m)."""
        self._tables.drop(lambda key, table: bool(table.grid))
        for table in self._tables.values():
            table.forget()

    def layer_table(self, scenario: Scenario, also: Iterable[int] = ()) -> LayerTable | None:
        """The ``LayerTable`` of `scenario`'s layer (every column but ``m``), with its grid of
        ``m`` (and the points `also`), filled now if the layer has none
        (``ficco_select.runtime.layers``); None where the layer cannot have one (its hardware
        unknown, more ranks than devices). Never raises."""
        try:
            table = self._table_of(scenario)
            if isinstance(table.decide_points, _Refusal):
                return None
            if not table.grid:
                table = self._fill_grid(scenario, table, also)
            return table
        except Exception as e:  # noqa: BLE001 - no table: the caller decides call by call
            self._warn_once(("table", type(e).__name__), f"no layer table ({e!r}); deciding per call")
            return None

    def _select_slow(self, raw) -> Decision:
        """A scenario whose layer has no table yet, a new m, a mapping, or something wrong."""
        try:
            scenario = raw if isinstance(raw, Scenario) else Scenario.from_record(raw)
        except Exception as e:  # noqa: BLE001 - not a scenario
            self._warn_once(("invalid", str(e)), f"invalid scenario: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))
        try:
            table = self._table_of(scenario)
            second_m = table.known(scenario.m) is None and table.decided()
            if self.layer_tables and not table.grid and second_m and not isinstance(table.decide_points, _Refusal):
                table = self._fill_grid(scenario, table)  # the layer's second m
            decision = table.decide(scenario.m)
            if decision is None:  # the table's own failure (its policy's is a decision)
                raise RuntimeError(f"the layer table of {scenario.layer!r} gave no decision at m={scenario.m}")
            return decision
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            self._warn_once(("error", type(e).__name__), f"selector failed: {e!r}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, repr(e))

    def _table_of(self, scenario: Scenario) -> LayerTable:
        """`scenario`'s layer table, made (without a grid) on the layer's first sight; where no
        machine by its name can run it here, a table of the baseline's one decision at every m
        (``_Refusal``), kept apart from the layer's own (a later job may name the machine)."""
        machine, hw = self._machine_key(scenario.hardware)
        key = (_UNKNOWN, scenario.layer) if hw is None else scenario.layer if machine is _FIXED \
            else (machine, scenario.layer)
        table = self._tables.get(key)
        if table is not None:
            return table
        resolved = self._resolve(scenario, hw)
        step = layer_step(scenario.op, scenario.world_size)
        if isinstance(resolved, Decision):
            table = LayerTable(scenario, (), (), step, _Refusal(resolved))
        else:
            scenario, hw = resolved
            decide = functools.partial(self._decide_points, scenario, hw)
            table = self._batching(LayerTable(scenario, (), (), step, decide))
        return self._tables.put(key, table)  # two threads that meet a layer at once: the same decisions

    def _batching(self, table: LayerTable) -> LayerTable:
        """`table`, deciding an m off its grid with its nearest neighbours where a model scores
        them in one batch (``LayerTable.neighbours``)."""
        table.neighbours = NEIGHBOURS if self.model is not None else 1
        return table

    def _resolve(self, scenario: Scenario, hw: HardwareSpec | None) -> tuple[Scenario, HardwareSpec] | Decision:
        """`scenario` under its machine's name, and `hw`, the machine its hardware names; or the
        baseline's decision where no machine by that name can run it here."""
        if hw is None:  # warned once by _spec; kept for no later job, which may know the name
            return Decision(BASELINE, "fallback", 0.0, f"unknown hardware {scenario.hardware!r}")
        if why := hw.beyond_devices(scenario.world_size):  # the datasets' rule too (schedule.hardware_problem)
            self._warn_once(("devices", hw.name), f"{why}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, why)
        if is_spec_path(scenario.hardware):  # decided under the machine's name, as training saw it
            scenario = dataclasses.replace(scenario, hardware=hw.name)
        return scenario, hw

    def _fill_grid(self, scenario: Scenario, old: LayerTable, also: Iterable[int] = ()) -> LayerTable:
        """`scenario`'s layer table `old` with its grid: the m the model may decide (its
        trained range, widened by the validated slack; every m without a model), decided in
        batches, and the m decided before kept."""
        machine, hw = self._machine_key(scenario.hardware)
        key = scenario.layer if machine is _FIXED else (machine, scenario.layer)
        trained = {col: (lo, hi) for col, lo, hi in self.rules.ranges}
        lo, hi = trained.get("m", DEFAULT_M_RANGE) if self.model is not None else DEFAULT_M_RANGE
        slack = self.rules.range_slack.get(hw.kind, {}).get("m", 1.0) if "m" in trained else 1.0
        # A range or slack as wide as the export may give (1e308): the grid stops at the largest m a scenario takes.
        lo, hi = max(1, math.ceil(min(lo / slack, MAX_EXTENT))), math.floor(min(hi * slack, MAX_EXTENT))
        table = self._batching(build_table(old.scenario, lo, hi, old.decide_points, also, old.decided()))
        return self._tables.put(key, table)

    def _decide_points(self, scenario: Scenario, hw: HardwareSpec, ms: Sequence[int]) -> list[Decision]:
        """The policy's decisions for `scenario`'s layer at each m of `ms`, in one batch."""
        try:
            points = [dataclasses.replace(scenario, m=m) for m in ms]
            return policy.decide(self.rules, self.model, points, hw, self._warn_once)
        except Exception as e:  # noqa: BLE001 - even the heuristic failed: the baseline runs anywhere
            self._warn_once(("error", type(e).__name__), f"selector failed on {scenario.layer!r}: {e!r}; "
                                                         "running the baseline")
            return [Decision(BASELINE, "fallback", 0.0, repr(e))] * len(ms)

    def decide_as(self, scenario: Scenario, fallback: str) -> Decision:
        """What `fallback` (``heuristic``, ``baseline``, ``cost_model`` or a schedule name)
        decides for `scenario` in the model's place, under this export's GPU do-no-harm rule
        (``policy.decide_as``). Never raises."""
        try:
            resolved = self._resolve(scenario, self._spec(scenario.hardware))
            if isinstance(resolved, Decision):
                return resolved
            return policy.decide_as(self.rules, fallback, [resolved[0]], resolved[1])[0]
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            self._warn_once(("error", type(e).__name__), f"the {fallback} fallback failed: {e!r}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, repr(e))

    def contenders(self, scenario: Scenario, decision: Decision) -> tuple[Schedule, ...]:
        """What a job's own timings check `decision` for `scenario` against: the decision, the
        model's next best, the export's fitted fixed rule, the baseline
        (``policy.contenders``); the decision and the baseline alone where the machine is
        unknown or anything fails. Never raises."""
        alone = tuple(dict.fromkeys((decision.schedule, BASELINE)))
        try:
            resolved = self._resolve(scenario, self._spec(scenario.hardware))
            if isinstance(resolved, Decision):
                return alone
            return policy.contenders(self.rules, self.model, resolved[0], resolved[1], decision)
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            self._warn_once(("contenders", type(e).__name__), f"no alternatives to check ({e!r}); checking the "
                                                              "decision against the baseline alone")
            return alone

    def _decider_of(self, layer: Scenario) -> LayerDecider | None:
        """What a precompiled table of `layer` needs (``read_tables``), where its machine means
        one spec for this selector (a shipped one, the export's own); None for any other: a
        name a job may mean otherwise."""
        machine, hw = self._machine_key(layer.hardware)
        if machine is not _FIXED or hw is None:
            return None
        return LayerDecider(backend_for(hw.kind), functools.partial(self._decide_points, layer, hw),
                            lambda ms, decisions: policy.no_harm(
                                self.rules, list(decisions), [dataclasses.replace(layer, m=m) for m in ms], hw), hw)

    def machine(self, hardware: str) -> HardwareSpec | None:
        """The machine `hardware` names for this selector (``_spec``), None (warned once) if none."""
        return self._spec(hardware)

    def measured(self, hardware: str) -> bool:
        """Whether the model learned `hardware`'s own measured rows (a GPU's): there the GPU
        do-no-harm rule steps aside (``policy.measured``)."""
        spec = self._spec(hardware)
        return spec is not None and policy.measured(self.rules, spec)

    def _spec(self, value: str) -> HardwareSpec | None:
        """The machine a scenario's hardware names now: the model's own specs first, then a
        shipped machine, a machine the caller's job knows (``hardware.machines``) or a spec
        file; None (warned once) if none. Only the first two are remembered by name: what a
        job names lives as long as its job, and a file's name may mean another machine in a
        later job."""
        spec = self._fixed.get(value)
        if spec is not None:
            return spec
        try:
            if value in _shipped():
                spec = self._fixed[value] = load_hardware(value)
            elif is_spec_path(value):
                spec = self._files.get(value)
                if spec is None:
                    # Read and checked against the shipped names and the job's.
                    spec = self._files.put(value, load_hardware(value))
                else:
                    refuse_known_name(spec, value)
            else:
                spec = load_hardware(value)
        except HardwareError as e:
            self._warn_once(("hw", value), str(e))
        except Exception as e:  # noqa: BLE001 - a path the OS refuses (a NUL byte, too long)
            self._warn_once(("hw", value), f"hardware {value!r}: {e!r}")
        return spec

    def _machine_key(self, value: str) -> tuple[object, HardwareSpec | None]:
        """(how decisions for hardware `value` are kept, the machine it names now): ``_FIXED``
        for a machine that means one spec for this selector (its tables kept by the layer
        alone), else a key of the machine's numbers (kept beside the layer); the spec None
        where no machine has that name here."""
        spec = self._spec(value)
        if spec is None or self._fixed.get(value) is spec:
            return _FIXED, spec
        held = self._numbers.get(id(spec))
        if held is None or held[0] is not spec:
            numbers = _numbers_of(spec)
            machine = self._machine_ids.get(numbers)
            if machine is None:  # two threads may number one machine twice: two keys, the same decisions
                machine = self._machine_ids.put(numbers, next(self._next_id))
            held = self._numbers.put(id(spec), (spec, machine))  # the spec too: its id is not reused while held
        return (held[1],), spec

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.put(key, True)
            log.warning("ficco-select: %s", message)


_MACHINES_LIMIT = 1 << 12
"""Machines (spec files, numbers) and warnings a selector keeps, least recently used out."""
NEIGHBOURS = 16
"""Valid m of its grid interval an m off the grid is decided with, where a model decides (the
first pass of a 10,000-call decode stream, ``benchmarks/selector_speed.py``)."""
_TABLES_LIMIT = 1 << 12
"""Layer tables a selector holds before it starts over (a layer's grid: about 300 decisions)."""
_FIXED = ()
"""``_machine_key`` of a machine that means one spec for a selector: its tables are kept by
the layer alone."""
_UNKNOWN = ("unknown",)
"""The key beside the layer of a table for hardware no machine has here."""


class _Refusal:
    """A table's decisions for a layer no machine here can run: the baseline's one decision,
    with why, at every m."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision

    def __call__(self, ms: Sequence[int]) -> list[Decision]:
        return [self.decision] * len(ms)


@functools.cache
def _shipped() -> frozenset[str]:
    return frozenset(shipped_names())


def _numbers_of(spec: HardwareSpec) -> tuple:
    """Every field of `spec`, hashable: what its decisions depend on (the peaks in dtype order)."""
    return tuple(tuple(sorted(value.items())) if isinstance(value, dict) else value
                 for value in (getattr(spec, f.name) for f in dataclasses.fields(spec)))


_RECORD_KEY = operator.itemgetter(*SCENARIO_COLUMNS)
"""A record's scenario columns as a tuple, in one C call (KeyError without ``imbalance``)."""
if LAYER_COLUMNS != SCENARIO_COLUMNS[1:2] + SCENARIO_COLUMNS[3:]:  # select() slices a record's key so
    raise ImportError("LAYER_COLUMNS must be SCENARIO_COLUMNS without group and m, in order")
