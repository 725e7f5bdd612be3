"""What runs where the model does not decide: every fitted fallback of an export, in one
dispatch (``run_fallback``), for the low-margin rule and every abstention reason alike.

Fallbacks (``abstention`` in ``selector.json``, ``runtime/scope.py``): ``heuristic`` (the hand
heuristic, ``ficco_select.heuristic.choose``), ``baseline``, ``cost_model`` (the cost model's
pick), a fixed rule (a schedule name: that schedule where legal, else the baseline) and a
gated rule (``gated:`` + a schedule name: of that schedule and the baseline, the one the
model predicts faster). On a GPU the selector's do-no-harm rule judges every overlap pick
after (``Selector._no_harm``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ficco_select.hardware import HardwareSpec
from ficco_select.heuristic import backend_for, choose
from ficco_select.runtime.caches import BoundedCache
from ficco_select.runtime.decision import GATED, Decision, fixed_rule_pick
from ficco_select.runtime.no_harm import cost_model_pick
from ficco_select.runtime.scope import COST_MODEL
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, Schedule, legal_candidates, parse


def run_fallback(fallback: str, key: str, s: Scenario, hw: HardwareSpec, why: str,
                 cands: Sequence[Schedule] | None = None, scores: np.ndarray | None = None) -> Decision:
    """What `fallback` runs where the model abstained for reason `key`
    (``decision.ABSTENTION_REASONS``), its reason saying why and which fallback. `cands` and
    `scores`: the legal candidates and the model's scores of them, where the model scored
    them (a gated rule needs them; without, the baseline)."""
    if fallback == "heuristic":
        return heuristic(s, hw, why, key)
    said = f"{why}; the fitted fallback for {key}"
    if fallback == "baseline":
        return Decision(BASELINE, "fallback", 0.0, f"{said} is the baseline", key)
    cands = legal_candidates(s, backend_for(hw), hw) if cands is None else cands
    if fallback == COST_MODEL:
        return Decision(cost_model_pick(s, hw, cands) if cands else BASELINE, COST_MODEL, 0.0,
                        f"{said} is the cost model", key)
    names = list(names_of(cands))
    name = fallback.removeprefix(GATED)
    if name not in names:
        return Decision(BASELINE, "fallback", 0.0, f"{said}, {fallback}, is not legal here, so the baseline", key)
    if name != fallback and scores is None:
        return Decision(BASELINE, "fallback", 0.0, f"{said}, {fallback}, has no model scores to gate on, "
                                                   "so the baseline", key)
    pick = fixed_rule_pick(fallback, names, scores, BASELINE.name)
    if pick != name:
        return Decision(BASELINE, "fallback", 0.0, f"{said}, {fallback}, predicts the baseline faster", key)
    return Decision(parse(pick), "fallback", 0.0, f"{said} is {fallback}", key)


def heuristic(s: Scenario, hw: HardwareSpec, why: str, key: str = "other") -> Decision:
    """The hand heuristic's pick, with why the model did not decide."""
    return Decision(choose(s, hw), "heuristic", 0.0, why, key)


_NAMES: BoundedCache[int, tuple[tuple, np.ndarray]] = BoundedCache(1 << 14)
"""The names of shared candidate tuples (``schedule.legal_candidates``), by the tuple's id
(kept alive with it, so that the id is not reused while its entry lives)."""


def names_of(cands: Sequence[Schedule]) -> np.ndarray:
    """The candidates' names as an array (``pick_with_margin`` breaks ties by name), made once
    per shared tuple."""
    seen = _NAMES.get(id(cands))
    if seen is not None and seen[0] is cands:
        return seen[1]
    names = np.array([c.name for c in cands])
    _NAMES.put(id(cands), (cands, names))
    return names
