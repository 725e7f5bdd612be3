"""The runtime selector: which schedule for this (collective + GEMM)? Cached, never raises.

    sel = Selector.load()            # the exported champion, else the heuristic alone
    decision = sel.select(scenario)  # Scenario or a dict with the scenario-table columns
    decision.schedule, decision.source, decision.confidence

Sources: ``model`` (the learned selector decided), ``heuristic`` (no usable model, or it
abstained: hardware, op or dtype not seen in training, a scenario outside the training
ranges, a margin between the two best predictions below ``min_margin``, a non-finite
prediction, or an error while checking or scoring: the reason says which), ``fallback``
(the baseline, with one warning per key: the scenario is invalid, its hardware is
unknown, or its world_size exceeds the spec's ``devices``, since a spec describes one
node; not on the cpu backend, whose ranks are processes; and, without a warning, where
the export's fitted abstention rule sends a low-margin decision to the baseline). Decisions are cached: a
Scenario object seen before costs one dict lookup by its id; an equal scenario built
again, or a mapping, is found by value. A miss scores every candidate schedule with the
model (one feature row each, ``features.build.candidate_features``).

Hardware: a scenario names a machine (a preset, a spec the model carries in
``hardware_specs``, or one registered in this process) or a spec file by path. A path is
decided under the spec's ``name``, as training saw the machine; the model's own specs are
looked up first and never registered process-wide (a selector is self-contained).

An exported selector is a folder with ``model.json`` (XGBoost JSON, evaluated by
``ficco_select.trees``) and ``selector.json``: ``selector`` (``xgb-regressor`` or
``xgb-ranker``), ``feature_schema_hash``, ``training_ranges`` ([low, high] for m, n, k,
world_size; the values seen for hardware, dtype and op) and optional ``hardware_specs``
({name: every HardwareSpec field}), and optional ``abstention`` ({"min_margin": number >= 0
or null, "fallback": "heuristic" | "baseline"}: the rule fitted on validation folds at
training, ``train.selectors.fit_abstention``; null: the model never decides; an optional
``by_kind`` {"gpu" | "cpu": the same two fields} overrides it for that kind of machine;
without it, a margin below 0.01 goes to the heuristic), and optional ``unseen_hardware`` ({"decide":
"model" | "heuristic", "kinds": {"gpu" | "cpu": {"topologies": [...], "any_topology":
bool, "spec_ranges": {field: [low, high]}}}}: fitted at training on machines held out of the fit. With "model", a
machine not seen in training is decided by the model when the trained machines of its kind
know its topology and its spec numbers lie inside their ranges; the decision's reason
says so. Without it, unseen machines go to the heuristic). Both files are checked at load; anything missing,
malformed or inconsistent (another feature schema, a model whose ``num_feature`` is not
``len(features.FEATURE_NAMES)``, a tree that ``trees`` refuses) gives a heuristic-only
selector and one warning naming the file and field. ``ficco export`` writes the folder
from the MLflow registry. Imports no pandas, scikit-learn, mlflow or xgboost.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ficco_select.hardware import HardwareError, HardwareSpec, is_spec_path, load_hardware, spec_from_dict
from ficco_select.heuristic import backend_for, choose
from ficco_select.scenario import SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import BASELINE, Schedule, legal_candidates
from ficco_select.trees import TreeEnsemble, read_json

log = logging.getLogger("ficco_select.selector")

DEFAULT_PATH = Path(os.environ.get("FICCO_SELECTOR", Path.home() / ".cache" / "ficco-select" / "selector"))
"""Where ``ficco export`` puts the champion and ``Selector.load()`` looks for it."""
SELECTORS = ("xgb-regressor", "xgb-ranker")
"""Learned selectors an export may hold: a regressor predicts time (lower is better), a
ranker a score (higher is better)."""
RANGE_COLUMNS = ("m", "n", "k", "world_size")
"""training_ranges columns given as [low, high]."""
SEEN_COLUMNS = ("hardware", "dtype", "op")
"""training_ranges columns given as the list of values seen."""
DEFAULT_MIN_MARGIN = 0.01
"""The margin below which a model without a fitted ``abstention`` rule abstains."""
FALLBACKS = ("heuristic", "baseline")
"""Where a fitted abstention rule may send a low-margin decision."""
SPEC_RANGE_FIELDS = ("mem_bw_gbps", "compute_units", "link_bw_gbps", "sm_comm_latency_us", "dma_latency_us",
                     "copy_engines")
"""Spec fields (the features' hardware numbers, with ``peak_tflops.<dtype>``) whose trained
ranges bound the machines an ``unseen_hardware`` rule lets the model decide."""
MACHINE_KINDS = ("gpu", "cpu")
"""``unseen_hardware`` ranges are per kind of machine (``machine_kind``)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    schedule: Schedule
    source: str
    """``model``, ``heuristic`` or ``fallback``."""
    confidence: float
    """Model: predicted relative gap between the best and second-best candidate (0..1);
    heuristic and fallback: 0."""
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What ``selector.json`` says about the model, checked once (``from_meta``)."""

    ranker: bool = False
    """Higher scores are better (``xgb-ranker``)."""
    seen: tuple[tuple[str, frozenset], ...] = ()
    """(column, values seen in training) for the SEEN_COLUMNS the file gives."""
    ranges: tuple[tuple[str, float, float], ...] = ()
    """(column, low, high) for the RANGE_COLUMNS the file gives."""
    specs: Mapping[str, HardwareSpec] = dataclasses.field(default_factory=dict)
    """``hardware_specs``: the training data's non-preset machines, by name."""
    abstention: tuple[float | None, str] | None = None
    """``abstention``: (min_margin or None for never, fallback), if the export has one."""
    abstention_by_kind: Mapping[str, tuple[float | None, str]] = dataclasses.field(default_factory=dict)
    """``abstention.by_kind``: the same rule fitted per kind of machine (``machine_kind``):
    a model's margins mean more on one kind than on another."""
    unseen: Mapping[str, tuple[frozenset, tuple[tuple[str, float, float], ...]]] = \
        dataclasses.field(default_factory=dict)
    """``unseen_hardware`` when its rule lets the model decide machines it never saw: per
    kind of machine (``machine_kind``), (topologies seen, or None for any, (spec field, low,
    high) ranges of the trained machines)."""

    @classmethod
    def from_meta(cls, meta: Any, where: str = "selector.json") -> "_Scope":
        """ValueError naming `where` and the field for anything malformed."""
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(meta).__name__}")
        name = meta.get("selector")
        if name not in SELECTORS:
            raise ValueError(f"{where}: field 'selector' is {name!r}; expected one of {', '.join(SELECTORS)}")
        ranges = meta.get("training_ranges")
        if not isinstance(ranges, dict):
            raise ValueError(f"{where}: field 'training_ranges' must be an object "
                             f"(column -> range or values), got {type(ranges).__name__}")
        unknown = [col for col in ranges if col not in RANGE_COLUMNS + SEEN_COLUMNS]
        if unknown:
            raise ValueError(f"{where}: field 'training_ranges.{unknown[0]}' is not a scenario column this "
                             f"runtime checks ({', '.join(RANGE_COLUMNS + SEEN_COLUMNS)})")
        bounds = []
        for col in RANGE_COLUMNS:
            if col in ranges:
                pair = ranges[col]
                if not _is_range(pair):
                    raise ValueError(f"{where}: field 'training_ranges.{col}' must be [low, high], two finite "
                                     f"numbers with low <= high, got {pair!r}")
                bounds.append((col, pair[0], pair[1]))
        seen = []
        for col in SEEN_COLUMNS:
            if col in ranges:
                values = ranges[col]
                if not (isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values)):
                    raise ValueError(f"{where}: field 'training_ranges.{col}' must be a non-empty list of "
                                     f"strings, got {values!r}")
                seen.append((col, frozenset(values)))
        specs = meta.get("hardware_specs", {})
        if not isinstance(specs, dict):
            raise ValueError(f"{where}: field 'hardware_specs' must be an object (name -> spec), "
                             f"got {type(specs).__name__}")
        checked = {}
        for key, fields in specs.items():
            spec = spec_from_dict(fields, f"{where}, hardware_specs[{key!r}]")
            if spec.name != key:
                raise ValueError(f"{where}, hardware_specs[{key!r}]: field 'name' is {spec.name!r}, not the key")
            checked[key] = spec
        rule = meta.get("abstention")
        abstention, by_kind = None, {}
        if rule is not None:
            abstention = _margin_rule(rule, f"{where}: field 'abstention")
            kinds = rule.get("by_kind", {})
            if not isinstance(kinds, dict) or not set(kinds) <= set(MACHINE_KINDS):
                raise ValueError(f"{where}: field 'abstention.by_kind' must be an object keyed by "
                                 f"{' or '.join(MACHINE_KINDS)}, got {kinds!r}")
            by_kind = {kind: _margin_rule(r, f"{where}: field 'abstention.by_kind.{kind}") for kind, r in kinds.items()}
        return cls(ranker=name == "xgb-ranker", seen=tuple(seen), ranges=tuple(bounds), specs=checked,
                   abstention=abstention, abstention_by_kind=by_kind,
                   unseen=_unseen_rule(meta.get("unseen_hardware"), where))


def _margin_rule(rule: Any, at: str) -> tuple[float | None, str]:
    """(min_margin, fallback) of an abstention rule; ValueError naming the field (`at` + "...")."""
    if not isinstance(rule, dict):
        raise ValueError(f"{at}' must be an object (min_margin, fallback), got {type(rule).__name__}")
    threshold, fallback = rule.get("min_margin"), rule.get("fallback")
    if threshold is not None and not (_is_number(threshold) and threshold >= 0):
        raise ValueError(f"{at}.min_margin' must be a finite number >= 0 or null, got {threshold!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"{at}.fallback' must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    return threshold, fallback


def _unseen_rule(rule: Any, where: str) -> dict:
    """``unseen_hardware``: {"decide": "model" | "heuristic", "kinds": {kind: {"topologies":
    [...], "spec_ranges": {field: [low, high]}}}, ...evidence}; {} unless the model decides."""
    if rule is None:
        return {}
    if not isinstance(rule, dict) or rule.get("decide") not in ("model", "heuristic"):
        raise ValueError(f"{where}: field 'unseen_hardware' must be an object whose 'decide' is model or "
                         f"heuristic, got {rule!r}")
    if rule["decide"] == "heuristic":
        return {}
    kinds = rule.get("kinds")
    if not isinstance(kinds, dict) or not kinds or not set(kinds) <= set(MACHINE_KINDS):
        raise ValueError(f"{where}: field 'unseen_hardware.kinds' must be a non-empty object keyed by "
                         f"{' or '.join(MACHINE_KINDS)} (-> topologies and spec_ranges), got {kinds!r}")
    out = {}
    for kind, block in kinds.items():
        at = f"{where}: field 'unseen_hardware.kinds.{kind}"
        if not isinstance(block, dict):
            raise ValueError(f"{at}' must be an object, got {type(block).__name__}")
        topologies, ranges = block.get("topologies"), block.get("spec_ranges")
        if not (isinstance(topologies, list) and topologies and all(isinstance(t, str) for t in topologies)):
            raise ValueError(f"{at}.topologies' must be a non-empty list of strings, got {topologies!r}")
        any_topology = block.get("any_topology", False)
        if not isinstance(any_topology, bool):
            raise ValueError(f"{at}.any_topology' must be true or false, got {any_topology!r}")
        if not isinstance(ranges, dict):
            raise ValueError(f"{at}.spec_ranges' must be an object (field -> [low, high]), got {ranges!r}")
        bounds = []
        for field, pair in ranges.items():
            if not (field in SPEC_RANGE_FIELDS or field.startswith("peak_tflops.")):
                raise ValueError(f"{at}.spec_ranges.{field}' is not a spec field this runtime checks "
                                 f"({', '.join(SPEC_RANGE_FIELDS)}, peak_tflops.<dtype>)")
            if not _is_range(pair):
                raise ValueError(f"{at}.spec_ranges.{field}' must be [low, high], two finite numbers with "
                                 f"low <= high, got {pair!r}")
            bounds.append((field, float(pair[0]), float(pair[1])))
        out[kind] = (None if any_topology else frozenset(topologies), tuple(bounds))
    return out


def machine_kind(hw: HardwareSpec) -> str:
    """``cpu`` or ``gpu``: machines of one kind share candidate sets and feature scales."""
    return "cpu" if backend_for(hw) == "cpu" else "gpu"


def spec_value(hw: HardwareSpec, field: str) -> float | None:
    """A SPEC_RANGE_FIELDS value of `hw`, or ``peak_tflops.<dtype>`` (None if the spec has no such dtype)."""
    if field.startswith("peak_tflops."):
        return hw.peak_tflops.get(field.split(".", 1)[1])
    return float(getattr(hw, field))


def _is_range(pair: Any) -> bool:
    """[low, high]: two finite numbers with low <= high."""
    return (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_is_number(v) for v in pair)
            and pair[0] <= pair[1])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Selector:
    def __init__(self, model: TreeEnsemble | None = None, meta: Mapping[str, Any] | None = None, *,
                 min_margin: float | None = None) -> None:
        # meta is selector.json's contents: checked here, so that every decision can trust it.
        self._scope = _Scope.from_meta(meta) if meta is not None else _Scope()
        self.model = model
        self.meta = dict(meta or {})
        # A margin given here wins over the export's fitted rules (its fallback: the heuristic).
        rule = self._scope.abstention if min_margin is None else None
        self.min_margin = rule[0] if rule else (DEFAULT_MIN_MARGIN if min_margin is None else min_margin)
        self.margin_fallback = rule[1] if rule else "heuristic"
        self._margin_by_kind = dict(self._scope.abstention_by_kind) if min_margin is None else {}
        self._trained_hardware = dict(self._scope.seen).get("hardware")  # None: not recorded
        # Decisions, found three ways: by the id of a Scenario object seen before (the hot
        # path; `_alive` holds those objects so that no other object can take their id), by
        # scenario value (an equal Scenario built again), by a mapping's scenario columns.
        self._by_id: dict[int, Decision] = {}
        self._alive: dict[int, Scenario] = {}
        self._cache: dict[Scenario, Decision] = {}
        self._by_record: dict[tuple, Decision] = {}
        self._hardware: dict[str, HardwareSpec | None] = {}
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
            folder = Path(path) if path is not None else DEFAULT_PATH
            if path is None and not folder.exists():
                return cls(**kw)
            selector = cls(meta=read_json(folder / "selector.json"), **kw)  # checks every field
            from features import FEATURE_NAMES, FEATURE_SCHEMA_HASH

            if selector.meta.get("feature_schema_hash") != FEATURE_SCHEMA_HASH:
                raise ValueError(f"selector.json: field 'feature_schema_hash' is "
                                 f"{selector.meta.get('feature_schema_hash')!r}, this code's is {FEATURE_SCHEMA_HASH}; "
                                 "re-export a model trained with this version")
            selector.model = TreeEnsemble.load(folder / "model.json", expected_features=len(FEATURE_NAMES))
            return selector
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            log.warning("ficco-select: no usable model at %s (%s); using the heuristic", where, e)
            return cls(**kw)

    # -- deciding -------------------------------------------------------------------------
    def select(self, scenario: Scenario | Mapping[str, Any]) -> Decision:
        """The decision for a Scenario or a mapping with the scenario-table columns; never raises."""
        # The hot path: a Scenario object decided before, found by its id. Scenario.__hash__
        # is Python code, so a dict keyed by the scenario itself costs nearly twice this.
        try:
            return self._by_id[id(scenario)]
        except KeyError:
            return self._select_slow(scenario)

    def clear_cache(self) -> None:
        """Forget every decision (the next ``select`` of each scenario decides again)."""
        for cache in (self._by_id, self._alive, self._cache, self._by_record):
            cache.clear()

    def _select_slow(self, raw) -> Decision:
        """A scenario not seen as this object: find its decision by value, or decide."""
        try:
            if isinstance(raw, Scenario):
                decision = self._cache.get(raw)
                if decision is None:
                    decision = self._decide(raw, raw)
                    _bound(_CACHE_LIMIT, self._cache)
                    self._cache[raw] = decision
                if type(raw) is Scenario:  # frozen: its decision can be found by id from now on
                    _bound(_OBJECTS_LIMIT, self._by_id, self._alive)
                    self._alive[id(raw)] = raw  # before _by_id: an id found there is held
                    self._by_id[id(raw)] = decision
                return decision
            return self._select_record(raw)
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            self._warn_once(("error", type(e).__name__), f"selector failed: {e!r}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, repr(e))

    def _select_record(self, raw) -> Decision:
        """A mapping, found by its scenario columns when they are hashable."""
        try:
            key = tuple(map(raw.get, SCENARIO_COLUMNS))
            if not _BOOLS.isdisjoint(map(type, key)):
                # True == 1 == 1.0 in a key, but from_record refuses a bool: keep such keys apart.
                key = (*key, *map(type, key))
            decision = self._by_record.get(key)
        except Exception:  # noqa: BLE001 - not a mapping, or unhashable values: decide, uncached
            return self._decide(raw, ("unhashable", type(raw).__name__))
        if decision is None:
            decision = self._decide(raw, key)
            _bound(_CACHE_LIMIT, self._by_record)
            self._by_record[key] = decision
        return decision

    def _decide(self, raw, key) -> Decision:
        """Baseline (fallback) for what cannot run as described; else the model or the heuristic."""
        try:
            scenario = raw if isinstance(raw, Scenario) else Scenario.from_record(raw)
        except Exception as e:  # noqa: BLE001
            self._warn_once(key, f"invalid scenario {key!r}: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))
        try:
            hw = self._spec(scenario.hardware)
            if hw is None:
                return Decision(BASELINE, "fallback", 0.0, f"unknown hardware {scenario.hardware!r}")
            if scenario.world_size > hw.devices and backend_for(hw) != "cpu":
                # A spec describes one node: its costs say nothing about a larger job. The
                # datasets follow the same rule (schedule.hardware_problem); cpu ranks are
                # processes, not devices, so the cpu backend runs any world size.
                why = (f"world_size={scenario.world_size} exceeds the {hw.devices} devices of hardware "
                       f"{hw.name} (a spec describes one node)")
                self._warn_once(("devices", hw.name), f"{why}; running the baseline")
                return Decision(BASELINE, "fallback", 0.0, why)
            if is_spec_path(scenario.hardware):  # decided under the machine's name, as training saw it
                scenario = dataclasses.replace(scenario, hardware=hw.name)
            return self._model_or_heuristic(scenario, hw)
        except Exception as e:  # noqa: BLE001 - even the heuristic failed: the baseline runs anywhere
            self._warn_once(("error", key), f"selector failed on {key!r}: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))

    def _spec(self, value: str) -> HardwareSpec | None:
        """The machine a scenario's hardware names: the model's own specs first, then a
        preset, a spec registered in this process or a spec file; None (warned once) if none."""
        if value in self._hardware:
            return self._hardware[value]
        spec = self._scope.specs.get(value)
        if spec is None:
            try:
                spec = load_hardware(value)
            except HardwareError as e:
                self._warn_once(("hw", value), str(e))
            except Exception as e:  # noqa: BLE001 - a path the OS refuses (a NUL byte, too long)
                self._warn_once(("hw", value), f"hardware {value!r}: {e!r}")
        _bound(_CACHE_LIMIT, self._hardware)
        self._hardware[value] = spec
        return spec

    def _model_or_heuristic(self, s: Scenario, hw: HardwareSpec) -> Decision:
        """The model's decision, or the heuristic's with why: the model abstained or failed."""
        try:
            why = self._abstain_reason(s, hw)
        except Exception as e:  # noqa: BLE001 - the heuristic is still a better guess than the baseline
            why = f"abstention check failed: {e!r}"
            self._warn_once(("abstain", type(e).__name__), f"{why}; using the heuristic")
        if not why:
            try:
                return self._model_decision(s, hw)
            except Exception as e:  # noqa: BLE001
                why = f"model failed: {e!r}"
                self._warn_once(("model", type(e).__name__), f"{why}; using the heuristic")
        return self._heuristic(s, hw, why)

    def _heuristic(self, s: Scenario, hw: HardwareSpec, why: str) -> Decision:
        return Decision(choose(s, hw), "heuristic", 0.0, why)

    def _abstain_reason(self, s: Scenario, hw: HardwareSpec) -> str:
        """Why the model should not decide `s` (outside what it was trained on), or ""."""
        if self.model is None:
            return "no model"
        scope = self._scope
        for col, seen in scope.seen:  # hardware first: its message is the one users look for
            if getattr(s, col) not in seen:
                if col == "hardware" and scope.unseen:
                    why = self._unseen_hardware_problem(hw, s.dtype)
                    if not why:
                        continue  # the model decides it (its decision says so)
                    return f"hardware {s.hardware} not seen in training ({why})"
                return f"{col} {getattr(s, col)} not seen in training"
        trained = scope.specs.get(s.hardware)
        if trained is not None and trained != hw:
            return f"hardware {s.hardware}: the spec given differs from the one seen in training"
        for col, lo, hi in scope.ranges:
            value = getattr(s, col)
            if not lo <= value <= hi:
                return f"{col}={value} outside the training range [{lo}, {hi}]"
        return ""

    def _unseen_hardware_problem(self, hw: HardwareSpec, dtype: str) -> str:
        """Why the model may not decide a machine it never saw, or "" if its export's
        ``unseen_hardware`` rule lets it (validated on held-out machines at training) and
        the machine lies inside the trained machines' spec ranges (of the peak, only the
        scenario's dtype's: the one its features use)."""
        rule = self._scope.unseen.get(machine_kind(hw))
        if rule is None:
            return f"no trained {machine_kind(hw)} machine"
        topologies, ranges = rule
        if topologies is not None and hw.topology not in topologies:
            return f"topology {hw.topology} not seen in training"
        for field, lo, hi in ranges:
            if field.startswith("peak_tflops."):
                if field != f"peak_tflops.{dtype}":
                    continue
                value = hw.peak_of(dtype)  # as the features read it
            else:
                value = spec_value(hw, field)
            if value is not None and not lo <= value <= hi:
                return f"{field}={value:g} outside the trained machines' range [{lo:g}, {hi:g}]"
        return ""

    def _model_decision(self, s: Scenario, hw: HardwareSpec) -> Decision:
        cands = _candidates(s, backend_for(hw))
        if not cands:
            return self._heuristic(s, hw, "no legal candidate schedule to score")
        X = _candidate_features()(s, cands, hw)  # (n_candidates, n_features)
        scores = self.model.predict(X)
        if not np.isfinite(scores).all():  # checked trees cannot give one; a bug or a hand-edited model can
            self._warn_once(("non-finite",), "the model predicted a non-finite score; using the heuristic")
            return self._heuristic(s, hw, "model predicted a non-finite score")
        if self._scope.ranker:
            scores = -scores  # ranker: higher is better; we take the argmin below
        order = np.argsort(scores, kind="stable")
        best = cands[int(order[0])]
        margin = float(scores[order[1]] - scores[order[0]]) if len(cands) > 1 else 1.0
        min_margin, fallback = self._margin_by_kind.get(machine_kind(hw), (self.min_margin, self.margin_fallback))
        if min_margin is None or margin < min_margin:
            why = (f"model margin {margin:.4f} below {min_margin}" if min_margin is not None
                   else "the export's abstention rule never trusts the model")
            if fallback == "baseline":
                return Decision(BASELINE, "fallback", 0.0, f"{why}; its fitted fallback is the baseline")
            return self._heuristic(s, hw, why)
        seen = self._trained_hardware
        note = ("" if seen is None or s.hardware in seen else
                f"hardware {s.hardware} not seen in training: inside the trained machines' spec ranges, "
                "where held-out machines showed the model ahead of the heuristic")
        return Decision(best, "model", float(min(1.0, margin)), note)

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ficco-select: %s", message)


# Bounds for callers that pass ever-new shapes or objects; decisions are deterministic, so
# a cache that starts over only costs the misses.
_CACHE_LIMIT = 1 << 16
"""Decisions (or hardware values) a by-value cache holds before it starts over."""
_OBJECTS_LIMIT = 1 << 12
"""Scenario objects the by-id cache holds (alive) before it starts over."""


_BOOLS = frozenset({bool, np.bool_})
"""Types equal to numbers in a dict key that a scenario column refuses."""


def _bound(limit: int, *caches: dict) -> None:
    """Empty the caches, in order, if the first holds `limit` entries."""
    if len(caches[0]) >= limit:
        for cache in caches:
            cache.clear()


_candidates = legal_candidates
"""``candidates(s, backend)`` as a shared tuple, cached per legality key (schedule.py)."""


@functools.cache
def _candidate_features():
    """``features.build.candidate_features``, imported on the first model decision."""
    from features.build import candidate_features

    return candidate_features
