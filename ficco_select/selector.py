"""The runtime selector: which schedule for this (collective + GEMM)? Cached, never raises.

    sel = Selector.load()            # the exported champion, else the heuristic alone
    decision = sel.select(scenario)  # Scenario or a dict with the scenario-table columns
    decision.schedule, decision.source, decision.confidence

Sources: ``model`` (the learned selector decided), ``heuristic`` (no usable model, or it
abstained: unknown hardware, a scenario outside the training ranges, or a margin between
the two best predictions below ``min_margin``), ``fallback`` (the scenario is invalid:
the baseline, with one warning per key). Decisions are cached per scenario key.

An exported selector is a folder with ``model.json`` (XGBoost JSON, evaluated by
``ficco_select.trees``) and ``selector.json`` (feature schema hash, training ranges);
``ficco export`` writes it from the MLflow registry. Imports no pandas, scikit-learn,
mlflow or xgboost.
"""

from __future__ import annotations

import dataclasses
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
from ficco_select.schedule import BASELINE, Schedule, candidates
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
        self._cache: dict[tuple, Decision] = {}
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
        if type(scenario) is Scenario:  # the hot path: the scenario is its own (cached-hash) key
            hit = self._cache.get(scenario)
            if hit is not None:
                return hit
        try:
            key = self._key(scenario)
        except Exception:  # noqa: BLE001 - unhashable or odd input
            key = ("unhashable", id(scenario))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        decision = self._decide(scenario, key)
        self._cache[key] = decision
        return decision

    @staticmethod
    def _key(scenario) -> Any:
        if isinstance(scenario, Scenario):
            return scenario
        return tuple(scenario.get(c) for c in SCENARIO_COLUMNS)

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
        from features import pair_features

        cands = candidates(s, backend_for(hw))
        record = s.as_record()
        X = pair_features([record] * len(cands), cands, {s.hardware: hw})
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
