"""The runtime selector: which schedule for this (collective + GEMM)? Cached, never raises.

    sel = Selector.load()            # the exported champion, else the heuristic alone
    decision = sel.select(scenario)  # Scenario or a dict with the scenario-table columns
    decision.schedule, decision.source, decision.confidence

Sources: ``model`` (the learned selector decided), ``heuristic`` (no usable model, or it
abstained: unknown hardware, a scenario outside the training ranges, or a margin between
the two best predictions below ``min_margin``), ``fallback`` (the scenario is invalid:
the baseline, with one warning per key). Decisions are cached: a Scenario object seen
before costs one dict lookup by its id; an equal scenario built again, or a mapping, is
found by value. A miss scores every candidate schedule with the model (one feature row
each, ``features.build.candidate_features``).

An exported selector is a folder with ``model.json`` (XGBoost JSON, evaluated by
``ficco_select.trees``) and ``selector.json`` (feature schema hash, training ranges);
``ficco export`` writes it from the MLflow registry. Imports no pandas, scikit-learn,
mlflow or xgboost.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ficco_select.hardware import HardwareError, HardwareSpec, load_hardware
from ficco_select.heuristic import backend_for, choose
from ficco_select.scenario import SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import BASELINE, Schedule, legal_candidates
from ficco_select.trees import TreeEnsemble

log = logging.getLogger("ficco_select.selector")

DEFAULT_PATH = Path(os.environ.get("FICCO_SELECTOR", Path.home() / ".cache" / "ficco-select" / "selector"))
"""Where ``ficco export`` puts the champion and ``Selector.load()`` looks for it."""


@dataclasses.dataclass(frozen=True)
class Decision:
    schedule: Schedule
    source: str
    """``model``, ``heuristic`` or ``fallback``."""
    confidence: float
    """Model: predicted relative gap between the best and second-best candidate (0..1);
    heuristic and fallback: 0."""
    reason: str = ""


class Selector:
    def __init__(self, model: TreeEnsemble | None = None, meta: Mapping[str, Any] | None = None, *,
                 min_margin: float = 0.01) -> None:
        self.model = model
        self.meta = dict(meta or {})
        self.min_margin = min_margin
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

        A missing, corrupt or incompatible model gives a heuristic-only selector and one
        warning; this never raises.
        """
        folder = Path(path) if path is not None else DEFAULT_PATH
        if path is None and not folder.exists():
            return cls(**kw)
        try:
            meta = json.loads((folder / "selector.json").read_text())
            from features import FEATURE_SCHEMA_HASH

            if meta.get("feature_schema_hash") != FEATURE_SCHEMA_HASH:
                raise ValueError(f"feature schema {meta.get('feature_schema_hash')} != this code's "
                                 f"{FEATURE_SCHEMA_HASH}; re-export a model trained with this version")
            model = TreeEnsemble.load(folder / "model.json")
            return cls(model, meta, **kw)
        except Exception as e:  # noqa: BLE001 - never break the caller's job
            log.warning("ficco-select: no usable model at %s (%s); using the heuristic", folder, e)
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
            decision = self._by_record.get(key)
        except Exception:  # noqa: BLE001 - not a mapping, or unhashable values: decide, uncached
            return self._decide(raw, ("unhashable", type(raw).__name__))
        if decision is None:
            decision = self._decide(raw, key)
            _bound(_CACHE_LIMIT, self._by_record)
            self._by_record[key] = decision
        return decision

    def _decide(self, raw, key) -> Decision:
        try:
            scenario = raw if isinstance(raw, Scenario) else Scenario.from_record(raw)
        except Exception as e:  # noqa: BLE001
            self._warn_once(key, f"invalid scenario {key!r}: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))
        try:
            hw = self._spec(scenario.hardware)
            if hw is None:
                return Decision(BASELINE, "fallback", 0.0, f"unknown hardware {scenario.hardware!r}")
            why = self._abstain_reason(scenario)
            if why:
                return Decision(choose(scenario, hw), "heuristic", 0.0, why)
            return self._model_decision(scenario, hw)
        except Exception as e:  # noqa: BLE001 - a model bug must not break the job
            self._warn_once(("error", key), f"selector failed on {key!r}: {e}; running the baseline")
            return Decision(BASELINE, "fallback", 0.0, str(e))

    def _spec(self, name: str) -> HardwareSpec | None:
        if name not in self._hardware:
            try:
                self._hardware[name] = load_hardware(name)
            except HardwareError as e:
                self._warn_once(("hw", name), str(e))
                self._hardware[name] = None
        return self._hardware[name]

    def _abstain_reason(self, s: Scenario) -> str:
        if self.model is None:
            return "no model"
        ranges = self.meta.get("training_ranges", {})
        if s.hardware not in ranges.get("hardware", [s.hardware]):
            return f"hardware {s.hardware} not seen in training"
        for col in ("m", "n", "k", "world_size"):
            lo, hi = ranges.get(col, (None, None))
            value = getattr(s, col)
            if lo is not None and not lo <= value <= hi:
                return f"{col}={value} outside the training range [{lo}, {hi}]"
        return ""

    def _model_decision(self, s: Scenario, hw: HardwareSpec) -> Decision:
        cands = _candidates(s, backend_for(hw))
        X = _candidate_features()(s, cands, hw)  # (n_candidates, n_features)
        scores = self.model.predict(X)
        if self.meta.get("selector") == "xgb-ranker":
            scores = -scores  # ranker: higher is better; we take the argmin below
        order = np.argsort(scores, kind="stable")
        best = cands[int(order[0])]
        margin = float(scores[order[1]] - scores[order[0]]) if len(cands) > 1 else 1.0
        if margin < self.min_margin:
            return Decision(choose(s, hw), "heuristic", 0.0, f"model margin {margin:.4f} below {self.min_margin}")
        return Decision(best, "model", float(min(1.0, margin)))

    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ficco-select: %s", message)


# Bounds for callers that pass ever-new shapes or objects; decisions are deterministic, so
# a cache that starts over only costs the misses.
_CACHE_LIMIT = 1 << 16
"""Decisions a by-value cache holds before it starts over."""
_OBJECTS_LIMIT = 1 << 12
"""Scenario objects the by-id cache holds (alive) before it starts over."""


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
