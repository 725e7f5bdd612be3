"""What the runtime selector answers for a scenario: a schedule, where it came from, how sure."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ficco_select.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class Decision:
    schedule: Schedule
    source: str
    """``model``, ``heuristic``, ``cost_model`` (the cost model's pick, a fitted fallback) or
    ``fallback`` (the baseline or a fixed rule); the torch ops add ``pinned`` and ``explore``."""
    confidence: float
    """Model: predicted relative gap between the best and second-best candidate (0..1);
    heuristic, cost model and fallback: 0."""
    reason: str = ""
    abstained: str = ""
    """Why the model did not decide, as a key (``ABSTENTION_REASONS``), "" where it did."""


ABSTENTION_REASONS = ("low_margin", "shape_range", "unseen_machine", "other", "no_harm")
"""Why a model abstains: its two best candidates too close (``low_margin``: the margin rules'
fallback); m, n, k or the world size outside the training ranges (``shape_range``); a machine
not seen in training that no validated rule lets the model decide, or whose spec numbers or
topology lie outside the trained machines' (``unseen_machine``); or anything else (a dtype or
operator not seen, no model, a failure: ``other``, the heuristic). ``shape_range`` and
``unseen_machine`` get the fallback that validation found best for them
(``abstention.by_reason``). On a GPU
machine, a model's overlap pick whose predicted gain is within the simulator's published
error runs the baseline instead (``no_harm``: ``runtime/no_harm.py``)."""


SINGLE_CANDIDATE_MARGIN = 1.0
"""The margin of a pick that had no rival: trusted by any margin rule short of "never"."""


def pick_with_margin(scores: np.ndarray, names: np.ndarray,
                     groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each scenario's pick among its scored candidates, and the margin behind it: the one
    rule for the runtime (one scenario), evaluation, abstention fitting and ``ficco adapt``.

    scores: (n,) predicted log times, lower is better; names: (n,) the schedules' names;
    groups: (n,) the scenario of each row (None: one scenario). The pick is the lowest
    score, ties broken by name (so a pick never depends on row order); the margin is the
    second-lowest score minus the lowest, ``SINGLE_CANDIDATE_MARGIN`` for a lone candidate.
    Returns (the pick's row, its margin), one per scenario in order of first appearance.
    """
    scores = np.asarray(scores, dtype=float)
    if groups is None:
        groups = np.zeros(len(scores), dtype=np.intp)
    else:
        _, first_at, groups = np.unique(np.asarray(groups), return_index=True, return_inverse=True)
        groups = np.argsort(np.argsort(first_at, kind="stable"), kind="stable")[groups]  # codes by first appearance
    order = np.lexsort((np.asarray(names), scores, groups))
    if not len(order):
        return order, np.empty(0)
    starts = np.flatnonzero(np.r_[True, groups[order][1:] != groups[order][:-1]])
    first = order[starts]
    rival = np.r_[starts[1:], len(order)] - starts > 1
    second = order[np.where(rival, starts + 1, starts)]
    return first, np.where(rival, scores[second] - scores[first], SINGLE_CANDIDATE_MARGIN)


def margin_rule(rules: Mapping[str, Any], kind: str, op: str) -> Mapping[str, Any]:
    """The abstention rule (``min_margin``, ``fallback``) for operator `op` on a `kind` of
    machine: its own (``by_op``, keyed ``<kind>.<op>``), else its kind's (``by_kind``), else the
    pooled one (`rules` itself). The one lookup order for the runtime and the abstention fit."""
    return rules.get("by_op", {}).get(f"{kind}.{op}") or rules.get("by_kind", {}).get(kind) or rules


GATED = "gated:"
"""A fixed-rule fallback named ``gated:<schedule>``: of that schedule and the baseline, the one
the model predicts faster (``fixed_rule_pick``)."""


def fixed_rule_pick(fallback: str, names: list[str], scores, baseline: str) -> str:
    """The schedule a fixed-rule fallback runs among a scenario's candidates `names` (scores:
    the model's, lower is better): its schedule where the scenario has it, else `baseline`;
    gated (``GATED`` + a schedule name), the one of the two the model predicts faster, ties
    to the baseline. The runtime's rule (``fallbacks.run_fallback``), which the abstention
    fit's validation outcomes call too (``ficco_select.train.fallback_picks``)."""
    name = fallback.removeprefix(GATED)
    if name not in names:
        return baseline
    if name != fallback and baseline in names and scores[names.index(name)] >= scores[names.index(baseline)]:
        return baseline
    return name
