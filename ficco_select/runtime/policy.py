"""The policy: what each scenario runs, given an export's rules and model. Written once.

    decisions = decide(rules, model, scenarios, hw)   # one row or thousands, on machine hw

Every door calls it: the runtime ``Selector`` (the direct path and every point of a layer's
table, ``runtime/layers.py``), ``ficco advise``, ``ficco sim validate`` (``decide_as``: a
fallback judged alone) and training, which scores what ships through the ``Selector``.
A decision's way, each step in its own file:

1. whether the model may decide (``runtime/abstention.py``): a machine, dtype or shape
   outside what it was trained on sends the decision to the fallback the export fitted for
   that reason (``runtime/fallbacks.py``);
2. the model scores every legal candidate (``features``: one feature matrix and one walk of
   the trees for the whole batch); a margin between the two best below the export's rule
   (``decision.margin_rule``) goes to that rule's fallback;
3. on a GPU the export's do-no-harm rule (``runtime/no_harm.py``) sends an overlap pick whose
   predicted gain is within the simulator's published error to the baseline.

Resolving the machine a scenario names, and caching, are the ``Selector``'s; this module holds
no state. Never raises for a scenario: a failure of the model or of a check falls back to the
heuristic and is reported through `warn` once per kind of failure (the caller's choice).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from ficco_select.features import candidate_features, grid_features
from ficco_select.hardware import HardwareSpec, load_hardware, shipped_names
from ficco_select.runtime.abstention import abstention_reason, reason_fallback, unseen_note
from ficco_select.runtime.decision import Decision, margin_rule, pick_with_margin
from ficco_select.runtime.fallbacks import heuristic, names_of, run_fallback
from ficco_select.runtime.no_harm import cost_model_pick, refused, replaces_baseline, verdicts
from ficco_select.runtime.scope import Scope
from ficco_select.runtime.trees import TreeEnsemble
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, Schedule, backend_for, legal_candidates

log = logging.getLogger("ficco_select.runtime.policy")

Warn = Callable[[Hashable, str], None]
"""How a failure is reported: (a key naming its kind, the message)."""


def _log_warning(key: Hashable, message: str) -> None:
    log.warning("ficco-select: %s", message)


def decide(rules: Scope, model: TreeEnsemble | None, scenarios: Sequence[Scenario], hw: HardwareSpec,
           warn: Warn = _log_warning) -> list[Decision]:
    """Each scenario's decision on machine `hw` (every scenario under `hw`'s name, with no more
    ranks than its devices: the ``Selector`` sees to both), with its source and reason."""
    reasons = [_abstention(rules, model, s, hw, warn) for s in scenarios]
    scores = _scores(model, scenarios, reasons, hw) if model is not None else {}
    decisions = [_model_or_fallback(rules, model, s, hw, reasons[i], scores.get(i), warn)
                 for i, s in enumerate(scenarios)]
    return no_harm(rules, decisions, scenarios, hw)


def decide_as(rules: Scope, fallback: str, scenarios: Sequence[Scenario], hw: HardwareSpec) -> list[Decision]:
    """What `fallback` (``heuristic``, ``baseline``, ``cost_model`` or a schedule name) decides
    for each scenario in the model's place, under the rules' GPU do-no-harm rule: a fallback
    judged on its own (``ficco sim validate --published --fallback``)."""
    alone = [run_fallback(fallback, "other", s, hw, f"the {fallback} fallback alone") for s in scenarios]
    return no_harm(rules, alone, scenarios, hw)


def no_harm(rules: Scope, decisions: list[Decision], scenarios: Sequence[Scenario], hw: HardwareSpec) -> list[Decision]:
    """`decisions`, each overlap pick replaced by the baseline where the rules' GPU do-no-harm
    rule (``gpu_no_harm``) says its predicted gain is within the simulator's published error;
    one vectorized check for the batch."""
    rule = rules.gpu_no_harm
    if rule is None or hw.kind != "gpu" or measured(rules, hw):
        return decisions
    at = [i for i, d in enumerate(decisions) if replaces_baseline(d.schedule)]
    if not at:
        return decisions
    out = list(decisions)
    for i, why in zip(at, verdicts(rule, [scenarios[i] for i in at], hw, [decisions[i].schedule for i in at])):
        if why:
            out[i] = refused(decisions[i], why)
    return out


def contenders(rules: Scope, model: TreeEnsemble | None, s: Scenario, hw: HardwareSpec,
               decision: Decision) -> tuple[Schedule, ...]:
    """What a job's own timings check `decision` against (``runtime/learning.py``), in order,
    without repeats: the decision, the model's next best candidate (without a model, the cost
    model's pick), the export's fitted
    fixed rule for this kind of machine and operator (on GPUs the hand heuristic), and the
    baseline. Legal on `hw` each; raises on a failure (the caller steps aside)."""
    cands = legal_candidates(s, backend_for(hw.kind), hw)
    out = [decision.schedule]
    scores = None
    if model is not None and cands:
        scores = model.predict(candidate_features(s, cands, hw))
        if rules.ranker:
            scores = -scores  # lower is better, as the margin rule reads them
        ranked = sorted(range(len(cands)), key=lambda i: (scores[i], cands[i].name))
        out += [cands[i] for i in ranked if cands[i] != decision.schedule][:1]
    elif cands:  # no model: the cost model's pick in its place
        out.append(cost_model_pick(s, hw, cands))
    rule = margin_rule(rules.margin_rules, hw.kind, s.op)["fallback"]
    out.append(run_fallback(rule, "low_margin", s, hw, "the fitted fixed rule", cands, scores).schedule)
    out.append(BASELINE)
    return tuple(dict.fromkeys(out))


def measured(rules: Scope, hw: HardwareSpec) -> bool:
    """Whether the model learned `hw`'s own measured rows (a GPU's): there the GPU do-no-harm
    rule steps aside. By name and numbers: a spec file may take a measured machine's name with
    other numbers, and that machine the model never measured."""
    rule = rules.gpu_no_harm
    if rule is None or hw.name not in rule.measured:
        return False
    known = rules.specs.get(hw.name)
    if known is None and hw.name in shipped_names():
        known = load_hardware(hw.name)
    return hw == known


def _abstention(rules: Scope, model: TreeEnsemble | None, s: Scenario, hw: HardwareSpec,
                warn: Warn) -> tuple[str, str]:
    """(reason key, why) the model does not decide `s`; ("", "") where it does."""
    if model is None:
        return "other", "no model"
    try:
        return abstention_reason(rules, s, hw)
    except Exception as e:  # noqa: BLE001 - the heuristic is still a better guess than the baseline
        why = f"abstention check failed: {e!r}"
        warn(("abstain", type(e).__name__), f"{why}; using the heuristic")
        return "other", why


def _scores(model: TreeEnsemble, scenarios: Sequence[Scenario], reasons: Sequence[tuple[str, str]],
            hw: HardwareSpec) -> dict[int, np.ndarray]:
    """The model's scores of each scenario's legal candidates, from one feature matrix and one
    tree walk, for the scenarios the model decides. The features come a layer and candidate
    list at a time (``features.grid_features``: a layer's points at every m at once)."""
    backend = backend_for(hw.kind)
    blocks: dict[tuple, tuple[Scenario, tuple, list[int]]] = {}  # (layer, id(cands)): (a scenario, cands, its rows)
    for i, s in enumerate(scenarios):
        if not reasons[i][1]:
            cands = legal_candidates(s, backend, hw)  # shared tuples: one per legality key
            if cands:
                blocks.setdefault((s.layer, id(cands)), (s, cands, []))[2].append(i)
    if not blocks:
        return {}
    try:
        # One m: the scalar path (candidate_features, equal bit for bit), cheaper for a single point.
        X = np.concatenate([candidate_features(scenarios[at[0]], cands, hw) if len(at) == 1 else
                            grid_features(first, [scenarios[i].m for i in at], cands, hw).reshape(-1, model.n_features)
                            for first, cands, at in blocks.values()])
        scores = model.predict(X)
    except Exception:  # noqa: BLE001 - each scenario then scores alone, and a failure there names itself
        return {}
    out, start = {}, 0
    for _, cands, at in blocks.values():
        for i in at:
            out[i] = scores[start:start + len(cands)]
            start += len(cands)
    return out


def _model_or_fallback(rules: Scope, model: TreeEnsemble | None, s: Scenario, hw: HardwareSpec,
                       reason: tuple[str, str], scores: np.ndarray | None, warn: Warn) -> Decision:
    """The model's decision, or its fallback's with why (the model abstained or failed)."""
    key, why = reason
    if not why:
        try:
            return _model_decision(rules, model, s, hw, scores, warn)
        except Exception as e:  # noqa: BLE001
            key, why = "other", f"model failed: {e!r}"
            warn(("model", type(e).__name__), f"{why}; using the heuristic")
    return run_fallback(reason_fallback(rules, key, hw.kind), key, s, hw, why)


def _model_decision(rules: Scope, model: TreeEnsemble, s: Scenario, hw: HardwareSpec,
                    scores: np.ndarray | None, warn: Warn) -> Decision:
    cands = legal_candidates(s, backend_for(hw.kind), hw)
    if not cands:
        return heuristic(s, hw, "no legal candidate schedule to score")
    if scores is None:
        scores = model.predict(candidate_features(s, cands, hw))  # (n_candidates, n_features)
    return _from_scores(rules, s, hw, cands, scores, warn)


def _from_scores(rules: Scope, s: Scenario, hw: HardwareSpec, cands: Sequence[Schedule], scores: np.ndarray,
                 warn: Warn) -> Decision:
    """The model's pick among `cands` from their scores (n_candidates,), or the abstention its
    margin calls for."""
    if not np.isfinite(scores).all():  # checked trees cannot give one; a bug or a hand-edited model can
        warn(("non-finite",), "the model predicted a non-finite score; using the heuristic")
        return heuristic(s, hw, "model predicted a non-finite score", "other")
    if rules.ranker:
        scores = -scores  # ranker: higher is better; the pick is the lowest
    (at,), (margin,) = pick_with_margin(scores, names_of(cands))
    best, margin = cands[int(at)], float(margin)
    rule = margin_rule(rules.margin_rules, hw.kind, s.op)
    min_margin = rule["min_margin"]
    if min_margin is None or margin < min_margin:
        why = (f"model margin {margin:.4f} below {min_margin}" if min_margin is not None
               else "the export's abstention rule never trusts the model")
        return run_fallback(rule["fallback"], "low_margin", s, hw, why, cands, scores)
    return Decision(best, "model", float(min(1.0, margin)), unseen_note(rules, s))
