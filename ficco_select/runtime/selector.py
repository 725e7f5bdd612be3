"""The runtime selector: which schedule for this (collective + GEMM)? Cached, never raises.

    sel = Selector.load()            # the exported champion, else the heuristic alone
    decision = sel.select(scenario)  # Scenario or a dict with the scenario-table columns
    decision.schedule, decision.source, decision.confidence

A decision's way, each step in its own file:
1. the machine the scenario names (a preset, a spec the export carries in ``hardware_specs``,
   one the job knows (``hardware.machines``), or a spec file by path, decided under the spec's
   ``name`` as training saw it); unknown, or more ranks than its ``devices``: the baseline
   (``fallback``, warned once);
2. whether the model may decide (``runtime/abstention.py``): a machine, dtype or shape
   outside what it was trained on sends the decision to the fallback the export fitted
   for that reason (``runtime/fallbacks.py``);
3. the model scores every legal candidate (``features.candidate_features``); a margin
   between the two best below the export's rule (``decision.margin_rule``) goes to that
   rule's fallback;
4. on a GPU the export's do-no-harm rule (``runtime/no_harm.py``) sends an overlap pick
   whose predicted gain is within the simulator's published error to the baseline.

Sources: ``model``, ``heuristic``, ``cost_model`` or ``fallback`` (the baseline or a fixed
rule); ``Decision.abstained`` names the reason where the model did not decide.

Decisions are cached: a Scenario object seen before costs one dict lookup by its id; an
equal scenario built again, or a mapping, is found by value; a layer met at a second m is
decided over a grid of m at once (its table, ``runtime/layers.py``). Reading an export:
``runtime/loading.py``; its rules: ``runtime/scope.py``. Imports no pandas, scikit-learn,
mlflow or xgboost.
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

import numpy as np

from ficco_select.features import candidate_features, grid_features
from ficco_select.hardware import (HardwareError, HardwareSpec, is_spec_path, load_hardware, refuse_known_name,
                                   shipped_names)
from ficco_select.heuristic import backend_for
from ficco_select.runtime.abstention import abstention_reason, reason_fallback, unseen_note
from ficco_select.runtime.decision import Decision, margin_rule, pick_with_margin
from ficco_select.runtime.fallbacks import heuristic, names_of, run_fallback
from ficco_select.runtime.layers import DEFAULT_M_RANGE, LayerTable, build_table, read_tables
from ficco_select.runtime.loading import DEFAULT_PATH, read_export
from ficco_select.runtime.no_harm import TableGuard, refused, verdicts
from ficco_select.runtime.scope import Scope
from ficco_select.runtime.trees import TreeEnsemble
from ficco_select.scenario import LAYER_COLUMNS, MAX_EXTENT, SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import BASELINE, Schedule, legal_candidates

log = logging.getLogger("ficco_select.runtime.selector")
_MISSING = object()


class Selector:
    def __init__(self, model: TreeEnsemble | None = None, meta: Mapping[str, Any] | None = None, *,
                 layer_tables: bool = True) -> None:
        # meta is selector.json's contents: checked here, so that every decision can trust it.
        self.rules = Scope.from_meta(meta) if meta is not None else Scope()
        """The export's rules, parsed once (``runtime/scope.py``): every decision reads them here."""
        self.model = model
        self.meta = dict(meta or {})
        self.layer_tables = layer_tables
        """Decide every m of a layer from its table (``runtime/layers.py``), built on the layer's
        first sight: the same answer through every door. False: every call decides directly
        (evaluation, where thousands of one-off layers would each build a table)."""
        # Decisions, found three ways: by the id of a Scenario object seen before (the hot
        # path; each entry holds the object, so that no other object can take its id), by
        # scenario value (an equal Scenario built again), by a mapping's scenario columns.
        # A machine a job names (``hardware.machines``) or a spec file means what the caller's
        # job says now: its decisions and tables are kept under its numbers beside the
        # scenario (``_machine_key``), never under the bare name, and never by id.
        self._by_id: dict[int, tuple[Scenario, Decision]] = {}
        self._cache: dict[Scenario | tuple, Decision] = {}
        self._by_record: dict[tuple, Decision] = {}
        self._fixed: dict[str, HardwareSpec] = dict(self.rules.specs)
        """Machines that mean one spec for this selector wherever it is asked: the export's own
        (``hardware_specs``, which win over a job's) and the shipped ones met so far."""
        self._files: dict[str, HardwareSpec] = {}  # spec files read, by path (a job may still refuse the name)
        # A machine by its numbers: id(spec) -> (spec, its number), and the numbers -> that number,
        # a small int that keys its decisions cheaply; never reused, so a cache that starts over
        # can only miss.
        self._numbers: dict[int, tuple[HardwareSpec, int]] = {}
        self._machine_ids: dict[tuple, int] = {}
        self._next_id = itertools.count(1)
        self._unknown: dict[str, Decision] = {}  # the baseline's decision for a name no machine has here
        self._tables: dict[tuple, LayerTable | None] = {}  # by Scenario.layer (runtime/layers.py)
        self._seen_m: dict[tuple, set[int]] = {}  # m decided directly, per layer without a table yet
        self._warned: set = set()

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
        try:  # precompiled layer tables (ficco export --layers): known layers never walk trees
            selector._tables.update(read_tables(folder, selector._backend_of, selector._guard_of))
        except Exception as e:  # noqa: BLE001 - tables are built on first sight instead
            log.warning("ficco-select: layer tables at %s not used (%s); building them on first sight", where, e)
        return selector

    # -- deciding -------------------------------------------------------------------------
    def select(self, scenario: Scenario | Mapping[str, Any]) -> Decision:
        """The decision for a Scenario or a mapping with the scenario-table columns; never raises.

        Safe to call from any number of threads: every cache entry is written whole, and an
        entry found by an object's id holds that object, so an id reused by another object
        never finds it."""
        # The hot path: a Scenario object decided before, found by its id. Scenario.__hash__
        # is Python code, so a dict keyed by the scenario itself costs nearly twice this.
        entry = self._by_id.get(id(scenario))
        if entry is not None and entry[0] is scenario:
            return entry[1]
        try:
            if type(scenario) is Scenario:  # a new object, perhaps a new m of a known layer
                table = self._tables.get(scenario.layer) if self.layer_tables else None
                decision = table.decide(scenario.m) if table is not None else None
                if decision is not None:
                    _bound(_OBJECTS_LIMIT, self._by_id)
                    self._by_id[id(scenario)] = (scenario, decision)  # the object too: its id is not reused while held
                    return decision
            elif type(scenario) is dict:
                key = _RECORD_KEY(scenario)
                # Exact int and float numbers: a bool (equal to 1 in a key) or another type
                # takes the slow way, which keeps them apart.
                if type(key[2]) is int and type(key[3]) is int and type(key[4]) is int and type(key[8]) is float:
                    decision = self._by_record.get(key)  # a record decided before
                    if decision is not None:
                        return decision
                    # A new m on a known layer: its table (LAYER_COLUMNS: every column but group
                    # and m), when the record holds the layer's own values (a spec path or an
                    # alias goes the slow way).
                    table = self._tables.get(key[1:2] + key[3:]) if self.layer_tables else None
                    if table is not None and type(key[0]) is str and key[0].strip():
                        decision = table.decide(key[2])
                        if decision is not None:
                            return decision
        except Exception:  # noqa: BLE001 - no imbalance, unhashable values: the slow path
            pass
        return self._select_slow(scenario)

    def clear_cache(self) -> None:
        """Forget every decision (the next ``select`` of each scenario decides again). Layer
        tables are kept: they are the model's, built for every m of a layer at once."""
        for cache in (self._by_id, self._cache, self._by_record):
            cache.clear()

    def layer_table(self, scenario: Scenario, also: Iterable[int] = ()):
        """The ``LayerTable`` of `scenario`'s layer (every column but ``m``): its decisions on a
        grid of ``m`` (with the points `also`), built now if the layer has none
        (``ficco_select.runtime.layers``); None where the layer cannot have one (its hardware
        unknown, more ranks than devices). Never raises. Two threads that meet a new layer at
        once may both build its table: the same one."""
        try:
            key, hw = self._machine_key(scenario.hardware)
        except Exception:  # noqa: BLE001 - not a scenario
            return None
        if hw is None:
            return None
        return self._layer_table(scenario, scenario.layer if key is _FIXED else (key, scenario.layer), hw, also)

    def _layer_table(self, scenario: Scenario, key: tuple, hw: HardwareSpec, also: Iterable[int] = ()):
        """The table kept under `key` (``layer_table``), built for machine `hw` if none is."""
        table = self._tables.get(key, _MISSING)
        if table is not _MISSING:
            return table
        try:
            table = self._build_table(scenario, also, hw)
        except Exception as e:  # noqa: BLE001 - no table: the caller decides call by call
            self._warn_once(("table", type(e).__name__), f"no layer table ({e!r}); deciding per call")
            table = None
        _bound(_TABLES_LIMIT, self._tables)
        self._tables[key] = table
        return table

    def _build_table(self, scenario: Scenario, also: Iterable[int], hw: HardwareSpec) -> LayerTable | None:
        """`scenario`'s layer decided over the m the model may decide (its trained range,
        widened by the validated slack; every m without a model), in batches, on machine `hw`;
        None where no table applies (more ranks than its devices: the direct path says why)."""
        machine = self._machine(scenario, hw)
        if isinstance(machine, Decision):
            return None
        scenario, hw = machine
        trained = {col: (lo, hi) for col, lo, hi in self.rules.ranges}
        lo, hi = trained.get("m", DEFAULT_M_RANGE) if self.model is not None else DEFAULT_M_RANGE
        slack = self.rules.range_slack.get(hw.kind, {}).get("m", 1.0) if "m" in trained else 1.0
        # A range or slack as wide as the export may give (1e308): the table stops at the largest m a scenario takes.
        lo, hi = max(1, math.ceil(min(lo / slack, MAX_EXTENT))), math.floor(min(hi * slack, MAX_EXTENT))
        return build_table(scenario, lo, hi, lambda ms: self._decide_points(scenario, ms, hw), also,
                           self._table_guard(scenario, hw))

    def _decide_points(self, scenario: Scenario, ms: Sequence[int], hw: HardwareSpec) -> list[Decision]:
        """The direct decisions for `scenario` at each m of `ms`, scored in one batch."""
        points = [dataclasses.replace(scenario, m=m) for m in ms]
        scores = self._batch_scores(points, hw) if self.model is not None else {}
        return self._no_harm([self._unguarded(s, hw, scores.get(i)) for i, s in enumerate(points)], points, hw)

    def _batch_scores(self, points: list[Scenario], hw: HardwareSpec) -> dict[int, np.ndarray]:
        """The model's scores of each point's legal candidates, from one feature matrix and one
        tree walk; only for the points where the model would decide. The features come a
        candidate list at a time (points with fewer rows per shard have fewer legal
        schedules), each over its points' m at once (``features.grid_features``)."""
        backend = backend_for(hw)
        by_candidates: dict[int, tuple[tuple, list[int]]] = {}  # id(candidate tuple): (the tuple, its points)
        for i, s in enumerate(points):
            if not abstention_reason(self.rules, s, hw)[1]:
                cands = legal_candidates(s, backend)  # shared tuples: one per legality key
                if cands:
                    by_candidates.setdefault(id(cands), (cands, []))[1].append(i)
        if not by_candidates:
            return {}

        X = np.concatenate([grid_features(points[0], [points[i].m for i in at], cands, hw)
                            .reshape(-1, self.model.n_features) for cands, at in by_candidates.values()])
        scores = self.model.predict(X)
        out, start = {}, 0
        for cands, at in by_candidates.values():
            for i in at:
                out[i] = scores[start:start + len(cands)]
                start += len(cands)
        return out

    def decide_batch(self, scenarios: Sequence[Scenario]) -> list[Decision]:
        """The decision for each scenario, as ``select`` gives it: a layer met with several m
        is decided once over its grid (its table), then each of its rows looked up."""
        return [self.select(s) for s in scenarios]

    def _select_slow(self, raw) -> Decision:
        """A scenario not seen as this object: its layer's table, or its decision by value, or decide."""
        try:
            if isinstance(raw, Scenario):
                machine, hw = self._machine_key(raw.hardware)
                if hw is None:  # no machine by that name here: decided now, kept for no later job
                    return self._decide(raw, raw, hw)
                key = raw if machine is _FIXED else (machine, raw)
                decision = self._from_table(raw, machine, hw) or self._cache.get(key)
                if decision is None:
                    decision = self._decide(raw, raw, hw)
                    _bound(_CACHE_LIMIT, self._cache)
                    self._cache[key] = decision
                if type(raw) is Scenario and machine is _FIXED:  # frozen: found by id from now on
                    _bound(_OBJECTS_LIMIT, self._by_id)
                    self._by_id[id(raw)] = (raw, decision)  # the object too: its id is not reused while held
                return decision
            return self._select_record(raw)
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            self._warn_once(("error", type(e).__name__), f"selector failed: {e!r}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, repr(e))

    def _from_table(self, scenario: Scenario, machine: tuple, hw: HardwareSpec) -> Decision | None:
        """The decision of `scenario`'s layer table at its m, or None (decided directly):
        tables off, the layer's first m, no table for the layer, or an m outside it.
        `machine`, `hw`: ``_machine_key`` of its hardware.

        A layer's table is built at its second distinct m: a one-off scenario costs one
        decision, not a table. The m decided directly before are points of the table, so it
        gives them the decisions they got."""
        if not self.layer_tables:
            return None
        layer, m = scenario.layer if machine is _FIXED else (machine, scenario.layer), scenario.m
        table = self._tables.get(layer, _MISSING)
        if table is _MISSING:
            seen = self._seen_m.get(layer)
            if seen is None:
                _bound(_CACHE_LIMIT, self._seen_m)
                self._seen_m[layer] = {m}
                return None
            if m in seen:
                return None
            table = self._layer_table(scenario, layer, hw, also=tuple(seen))
        return table.decide(m) if table is not None else None

    def _select_record(self, raw) -> Decision:
        """A mapping, found by its scenario columns when they are hashable."""
        try:
            key = tuple(map(raw.get, SCENARIO_COLUMNS))
            if not _BOOLS.isdisjoint(map(type, key)):
                # True == 1 == 1.0 in a key, but from_record refuses a bool: keep such keys apart.
                key = (*key, *map(type, key))
            hardware = key[_HARDWARE_AT]
            machine, hw = self._machine_key(hardware) if type(hardware) is str else (_FIXED, None)
            if type(hardware) is str and hw is None:  # no machine by that name here: kept for no later job
                return self._decide(raw, key, hw)
            if machine is not _FIXED:
                key = (machine, *key)  # another length than any record's key: never found by the fast path
            decision = self._by_record.get(key)
        except Exception:  # noqa: BLE001 - not a mapping, or unhashable values: decide, uncached
            return self._decide(raw, ("unhashable", type(raw).__name__))
        if decision is None:
            decision = self._decide(raw, key, hw)
            _bound(_CACHE_LIMIT, self._by_record)
            self._by_record[key] = decision
        return decision

    def _decide(self, raw, key, hw: HardwareSpec | None | object = _MISSING) -> Decision:
        """Baseline (fallback) for what cannot run as described; else the model or the heuristic.
        `hw`: the machine its hardware names, if resolved already (``_machine_key``)."""
        try:
            scenario = raw if isinstance(raw, Scenario) else Scenario.from_record(raw)
        except Exception as e:  # noqa: BLE001
            self._warn_once(key, f"invalid scenario {key!r}: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))
        try:
            if hw is _MISSING:
                hw = self._spec(scenario.hardware)
            if scenario is not raw and hw is not None:  # a record: its layer's table, as for a Scenario
                machine, _ = self._machine_key(scenario.hardware, hw)
                decision = self._from_table(scenario, machine, hw)
                if decision is not None:
                    return decision
            machine = self._machine(scenario, hw)
            return machine if isinstance(machine, Decision) else self._model_or_heuristic(*machine)
        except Exception as e:  # noqa: BLE001 - even the heuristic failed: the baseline runs anywhere
            self._warn_once(("error", key), f"selector failed on {key!r}: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))

    def _no_harm(self, decisions: list[Decision], points: Sequence[Scenario], hw: HardwareSpec) -> list[Decision]:
        """`decisions` of `points`, each replaced by the baseline where the export's GPU
        do-no-harm rule (``gpu_no_harm``) says its predicted gain is within the simulator's
        published error; one vectorized check for all of them (a layer table's grid)."""
        rule = self.rules.gpu_no_harm
        if rule is None or hw.kind != "gpu" or self._measured(hw):
            return decisions
        at = [i for i, d in enumerate(decisions) if not d.schedule.is_baseline]
        if not at:
            return decisions
        out = list(decisions)
        whys = verdicts(rule, [points[i] for i in at], hw, [decisions[i].schedule for i in at])
        for i, why in zip(at, whys):
            if why:
                out[i] = refused(decisions[i], why)
        return out

    def _guard_of(self, layer: Scenario) -> TableGuard | None:
        """The GPU do-no-harm rule over a precompiled table of `layer` (``read_tables``)."""
        machine, hw = self._machine_key(layer.hardware)
        return self._table_guard(layer, hw) if machine is _FIXED and hw is not None else None

    def _table_guard(self, layer: Scenario, hw: HardwareSpec) -> TableGuard | None:
        """The GPU do-no-harm rule over `layer`'s table on `hw`, where it applies (``_no_harm``)."""
        rule = self.rules.gpu_no_harm
        if rule is None or hw.kind != "gpu" or self._measured(hw):
            return None
        return TableGuard(rule, hw, layer)

    def _machine(self, scenario: Scenario, hw: HardwareSpec | None | object = _MISSING
                 ) -> tuple[Scenario, HardwareSpec] | Decision:
        """The scenario (under its machine's name) and its machine's spec (`hw`, if resolved
        already), or the baseline's decision where the scenario cannot be decided on any
        machine we know."""
        if hw is _MISSING:
            hw = self._spec(scenario.hardware)
        if hw is None:  # one decision object per name: asked again, the same answer (never kept for a scenario)
            unknown = self._unknown.get(scenario.hardware)
            if unknown is None:
                _bound(_CACHE_LIMIT, self._unknown)
                unknown = self._unknown.setdefault(
                    scenario.hardware, Decision(BASELINE, "fallback", 0.0, f"unknown hardware {scenario.hardware!r}"))
            return unknown
        if why := hw.beyond_devices(scenario.world_size):  # the datasets' rule too (schedule.hardware_problem)
            self._warn_once(("devices", hw.name), f"{why}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, why)
        if is_spec_path(scenario.hardware):  # decided under the machine's name, as training saw it
            scenario = dataclasses.replace(scenario, hardware=hw.name)
        return scenario, hw

    def _backend_of(self, hardware: str) -> str | None:
        """The backend of the machine `hardware` names wherever this selector is asked (a
        shipped one, the export's own), None for any other (``read_tables``: a precompiled
        table of a name a job may mean otherwise is not used)."""
        machine, spec = self._machine_key(hardware)
        return backend_for(spec) if machine is _FIXED and spec is not None else None

    def machine(self, hardware: str) -> HardwareSpec | None:
        """The machine `hardware` names for this selector (``_spec``), None (warned once) if none."""
        return self._spec(hardware)

    def measured(self, hardware: str) -> bool:
        """Whether the model learned `hardware`'s own measured rows (a GPU's): there the GPU
        do-no-harm rule steps aside."""
        spec = self._spec(hardware)
        return spec is not None and self._measured(spec)

    def _measured(self, hw: HardwareSpec) -> bool:
        # By name and numbers: a spec file may take a measured machine's name with other
        # numbers, and that machine the model never measured.
        rule = self.rules.gpu_no_harm
        return rule is not None and hw.name in rule.measured and hw == self._spec(hw.name)

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
                    spec = load_hardware(value)  # read and checked against the shipped names and the job's
                    _bound(_CACHE_LIMIT, self._files)
                    self._files[value] = spec
                else:
                    refuse_known_name(spec, value)
            else:
                spec = load_hardware(value)
        except HardwareError as e:
            self._warn_once(("hw", value), str(e))
        except Exception as e:  # noqa: BLE001 - a path the OS refuses (a NUL byte, too long)
            self._warn_once(("hw", value), f"hardware {value!r}: {e!r}")
        return spec

    def _machine_key(self, value: str, spec: HardwareSpec | None | object = _MISSING
                     ) -> tuple[object, HardwareSpec | None]:
        """(how decisions for hardware `value` are kept, the machine it names now): ``_FIXED``
        for a machine that means one spec for this selector (kept by the scenario alone),
        else a key of the machine's numbers (kept beside the scenario); the spec None where no machine
        has that name here (its decision is kept for nothing). `spec`: the machine, if
        resolved already."""
        if spec is _MISSING:
            spec = self._spec(value)
        if spec is None or self._fixed.get(value) is spec:
            return _FIXED, spec
        held = self._numbers.get(id(spec))
        if held is None or held[0] is not spec:
            numbers = _numbers_of(spec)
            machine = self._machine_ids.get(numbers)
            if machine is None:
                _bound(_CACHE_LIMIT, self._machine_ids)
                machine = self._machine_ids.setdefault(numbers, next(self._next_id))
            _bound(_CACHE_LIMIT, self._numbers)
            held = self._numbers[id(spec)] = (spec, machine)  # the spec too: its id is not reused while held
        return (held[1],), spec

    def _model_or_heuristic(self, s: Scenario, hw: HardwareSpec, scores: np.ndarray | None = None) -> Decision:
        """The model's decision, or its fallback's with why (the model abstained or failed),
        under the GPU do-no-harm rule: every door (direct, layer tables) comes through here.
        `scores`: the model's scores of the legal candidates, if already computed (layer tables)."""
        return self._no_harm([self._unguarded(s, hw, scores)], [s], hw)[0]

    def _unguarded(self, s: Scenario, hw: HardwareSpec, scores: np.ndarray | None) -> Decision:
        try:
            key, why = ("other", "no model") if self.model is None else abstention_reason(self.rules, s, hw)
        except Exception as e:  # noqa: BLE001 - the heuristic is still a better guess than the baseline
            key, why = "other", f"abstention check failed: {e!r}"
            self._warn_once(("abstain", type(e).__name__), f"{why}; using the heuristic")
        if not why:
            try:
                return self._model_decision(s, hw, scores)
            except Exception as e:  # noqa: BLE001
                key, why = "other", f"model failed: {e!r}"
                self._warn_once(("model", type(e).__name__), f"{why}; using the heuristic")
        return self._fallback(key, s, hw, why)

    def _fallback(self, key: str, s: Scenario, hw: HardwareSpec, why: str) -> Decision:
        """What runs where the model abstained for reason `key` (``ABSTENTION_REASONS``)."""
        return run_fallback(reason_fallback(self.rules, key, hw.kind), key, s, hw, why)

    def decide_as(self, scenario: Scenario, fallback: str) -> Decision:
        """What `fallback` (``heuristic``, ``baseline``, ``cost_model`` or a schedule name)
        decides for `scenario` in the model's place, under this export's GPU do-no-harm rule:
        a fallback judged on its own (``ficco sim validate --published --fallback``). Never raises."""
        try:
            machine = self._machine(scenario)
            if isinstance(machine, Decision):
                return machine
            s, hw = machine
            return self._no_harm([run_fallback(fallback, "other", s, hw, f"the {fallback} fallback alone")],
                                 [s], hw)[0]
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            self._warn_once(("error", type(e).__name__), f"the {fallback} fallback failed: {e!r}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, repr(e))

    def _model_decision(self, s: Scenario, hw: HardwareSpec, scores: np.ndarray | None = None) -> Decision:
        cands = legal_candidates(s, backend_for(hw))
        if not cands:
            return heuristic(s, hw, "no legal candidate schedule to score")
        if scores is None:
            scores = self.model.predict(candidate_features(s, cands, hw))  # X: (n_candidates, n_features)
        return self._decision_from_scores(s, hw, cands, scores)

    def _decision_from_scores(self, s: Scenario, hw: HardwareSpec, cands: Sequence[Schedule],
                              scores: np.ndarray) -> Decision:
        """The model's pick among `cands` from their scores (n_candidates,), or the
        abstention its margin calls for."""
        if not np.isfinite(scores).all():  # checked trees cannot give one; a bug or a hand-edited model can
            self._warn_once(("non-finite",), "the model predicted a non-finite score; using the heuristic")
            return heuristic(s, hw, "model predicted a non-finite score", "other")
        if self.rules.ranker:
            scores = -scores  # ranker: higher is better; we take the argmin below
        (at,), (margin,) = pick_with_margin(scores, names_of(cands))
        best, margin = cands[int(at)], float(margin)
        rule = margin_rule(self.rules.margin_rules, hw.kind, s.op)
        min_margin = rule["min_margin"]
        if min_margin is None or margin < min_margin:
            why = (f"model margin {margin:.4f} below {min_margin}" if min_margin is not None
                   else "the export's abstention rule never trusts the model")
            return run_fallback(rule["fallback"], "low_margin", s, hw, why, cands, scores)
        return Decision(best, "model", float(min(1.0, margin)), unseen_note(self.rules, s))

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ficco-select: %s", message)


# Bounds for callers that pass ever-new shapes or objects; decisions are deterministic, so
# a cache that starts over only costs the misses.
_CACHE_LIMIT = 1 << 16
"""Decisions (or hardware values) a by-value cache holds before it starts over."""
_TABLES_LIMIT = 1 << 10
"""Layer tables a selector holds before it starts over (each up to 256 KiB: its index over m)."""
_OBJECTS_LIMIT = 1 << 12
"""Scenario objects the by-id cache holds (alive) before it starts over."""


_BOOLS = frozenset({bool, np.bool_})
"""Types equal to numbers in a dict key that a scenario column refuses."""
_RECORD_KEY = operator.itemgetter(*SCENARIO_COLUMNS)
"""A record's scenario columns as a tuple, in one C call (KeyError without ``imbalance``)."""
_FIXED = ()
"""``_machine_key`` of a machine that means one spec for a selector: its decisions are kept by
the scenario alone."""
_HARDWARE_AT = SCENARIO_COLUMNS.index("hardware")


@functools.cache
def _shipped() -> frozenset[str]:
    return frozenset(shipped_names())


def _numbers_of(spec: HardwareSpec) -> tuple:
    """Every field of `spec`, hashable: what its decisions depend on (the peaks in dtype order)."""
    return tuple(tuple(sorted(value.items())) if isinstance(value, dict) else value
                 for value in (getattr(spec, f.name) for f in dataclasses.fields(spec)))


if LAYER_COLUMNS != SCENARIO_COLUMNS[1:2] + SCENARIO_COLUMNS[3:]:  # select() slices a record's key so
    raise ImportError("LAYER_COLUMNS must be SCENARIO_COLUMNS without group and m, in order")


def _bound(limit: int, *caches: dict) -> None:
    """Empty the caches, in order, if the first holds `limit` entries."""
    if len(caches[0]) >= limit:
        for cache in caches:
            cache.clear()
