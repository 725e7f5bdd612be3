"""The shipped policy's abstention rules, fitted on validation folds of the training side:
when the runtime trusts the model's pick (a margin threshold, per kind of machine and per
operator on a kind) and what runs where it does not (the fallback with the most expected speed
whose slowdowns stay within a tail guard), and how far outside the training ranges the model
may decide (``range_slack``) and what runs beyond them (``by_reason``'s ``shape_range``).

- ``fit_abstention``: selector.json's ``abstention``, from validation outcomes
  (``validation_outcomes``: what the runtime would run on each held-out scenario);
- ``_margin_rule``, ``_range_slack``, ``_range_fallbacks``: the rules, each on those outcomes;
- ``tail_guard``, ``_against_heuristic``, ``_apply_rule``: the shares they are judged by,
  which ``unseen_fit`` reads too.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from ficco_select.runtime.decision import margin_rule
from ficco_select.runtime.scope import ANY_KIND, DEFAULT_MIN_MARGIN, FALLBACKS, RANGE_COLUMNS, Scope
from ficco_select.schedule import TIE
from ficco_select.train.metrics import NEAR_OPT, usable_rows
from ficco_select.train.runtime_meta import training_ranges
from ficco_select.train.selectors import BaseSelector
from ficco_select.train.validation_outcomes import FIXED_PREFIX, _validation_outcomes, fixed_rule_schedules


SLOWER_BY = TIE
"""A choice is a slowdown when its true time exceeds the baseline's by more than this."""
SLOWDOWN_CAP = 0.01
"""The fitted abstention rule allows slowdowns in at most this share of validation scenarios."""


def fit_abstention(make: Callable[[], BaseSelector], df: pd.DataFrame, folds: int = 2) -> dict:
    """The runtime's abstention rule for models built by ``make()`` (an XGBoost selector),
    fitted on validation folds of `df`, the training side (never a test fold).

    The data are split into `folds` by model family (the ``group`` column; by scenario when
    there are fewer families); a model fitted on the other folds decides each held-out
    scenario as the runtime would: its pick and the margin between its two best candidates
    (the runtime's ``min_margin`` unit, the model's own). The rule is the margin threshold
    and fallback (``heuristic``, untuned as it ships, ``baseline``, or a fixed rule: a schedule
    that at least half the scenarios have, run where legal, or gated: run where the model
    predicts it faster than the baseline) with the most expected
    speed (capture of the best's speed, on the truth) among those whose slowdowns (more than
    ``SLOWER_BY`` slower than the baseline, on the truth) stay within ``tail_guard``. The
    threshold is in each model's units, but what it guarantees is the same for every
    model. One rule over every validation scenario, one per kind of machine (gpu, cpu;
    ``by_kind``, with at least ``MIN_KIND_SCENARIOS`` of them), since a model can be sure
    on one kind and guess on the other, and one per operator on a kind (``by_op``, with at
    least ``MIN_OP_SCENARIOS``): on cpu, shard-level overlap is the best fixed rule for the
    all-gather and reduce-scatter ops and the worst for the all-reduce, whose baseline is
    gloo's own. Returns selector.json's ``abstention`` plus the
    validation figures.
    """
    ok = usable_rows(df)
    key = ok["group"] if ok["group"].nunique() >= folds else ok["scenario_id"]
    # Dealt round-robin in a fixed shuffled order, so that every fold gets some groups.
    order = sorted(set(key), key=lambda v: (zlib.crc32(str(v).encode()), str(v)))
    fold_of = key.map({v: i % folds for i, v in enumerate(order)})
    fixed = fixed_rule_schedules(ok)
    parts = []
    for f in range(folds):
        train, held = ok[fold_of != f], ok[fold_of == f]
        if len(train) and len(held):
            v = _validation_outcomes(make().fit(train), held, fixed, fold_scope(train))
            parts.append(_beyond_ranges(v, train))
    if not parts:  # nothing to validate on: the runtime's own default
        return {"min_margin": DEFAULT_MIN_MARGIN, "fallback": "heuristic", "validation_scenarios": 0}
    v = pd.concat(parts, ignore_index=True)
    by_kind = {kind: _margin_rule(rows) for kind, rows in v.groupby("kind") if len(rows) >= MIN_KIND_SCENARIOS}
    by_op = {f"{kind}.{op}": _margin_rule(rows) for (kind, op), rows in v.groupby(["kind", "op"])
             if len(rows) >= MIN_OP_SCENARIOS}
    rule = {**_margin_rule(v), **({"by_kind": by_kind} if by_kind else {}), **({"by_op": by_op} if by_op else {})}
    slack = _range_slack(v, rule)
    reasons = _range_fallbacks(v, fixed)
    return {**rule, "range_slack": slack, **({"by_reason": reasons["by_reason"]} if reasons["by_reason"] else {}),
            "by_reason_validation": reasons["validation"]}


def fold_scope(train: pd.DataFrame) -> Scope:
    """The runtime's rules, as far as where its model may decide, for a model trained on
    `train` (a validation fold's training side): its training ranges, parsed as the runtime
    parses an export's (``Scope.from_meta``), so that the validation asks the runtime's own
    check (``runtime.abstention.abstention_reason``) which scenarios the model would not decide."""
    return Scope.from_meta({"selector": "xgb-regressor", "training_ranges": training_ranges(train)},
                           "a validation fold's training ranges")


SLACK_COLUMNS = ("m", "n", "k")
"""Shape columns whose training ranges a validated ``range_slack`` may widen (world size
has a hold-out of its own and is never widened)."""
MIN_OUTSIDE_SCENARIOS = 20
"""Validation scenarios outside their fold's training ranges needed to judge the model there."""


def _beyond_ranges(v: pd.DataFrame, train: pd.DataFrame) -> pd.DataFrame:
    """`v` with ``beyond_<col>`` for m, n, k and the world size (``RANGE_COLUMNS``, the
    runtime's range checks): how far (a factor >= 1) each validation scenario lies outside the
    ranges of the fold it was judged against (`train`)."""
    ok = usable_rows(train)
    out = v.copy()
    for col in RANGE_COLUMNS:
        lo, hi = float(ok[col].min()), float(ok[col].max())
        value = v[col].to_numpy(float)
        out[f"beyond_{col}"] = np.maximum(1.0, np.maximum(lo / value, value / hi))
    return out


def _outside_ranges(v: pd.DataFrame) -> np.ndarray:
    """The validation scenarios the runtime sends to its ``shape_range`` fallback: the
    verdict of its own check under the fold's rules (``abstains``, ``fold_scope``)."""
    return (v["abstains"] == "shape_range").to_numpy()


def _range_slack(v: pd.DataFrame, abstention: dict) -> dict:
    """selector.json's ``abstention.range_slack``: per kind of machine, the factor by which the
    runtime may let the model decide shapes outside the training ranges ({column: factor}).

    The validation folds hold model families out, so some of their scenarios lie outside the
    ranges their model was trained on: where the model (under `abstention`) was there ahead
    of the heuristic (more scenarios within 2% of their best, slowdowns within
    ``tail_guard`` or the heuristic's own share), the ranges widen by as much as those
    scenarios lay outside them, no more; elsewhere they stay as trained. Judged on the
    scenarios a slack would hand to the model: outside in m, n or k alone (not the world
    size, which no slack widens). One factor for the
    three columns, the largest tested in any: the features see shapes as log2 values and as
    the analytic estimates built on them, so a factor outside is the same step whichever
    dimension takes it (and the held-out families rarely stretch every dimension at once)."""
    out = {}
    for kind, rows in v.groupby("kind"):
        beyond = rows[[f"beyond_{c}" for c in SLACK_COLUMNS]].to_numpy(float)
        judged = _outside_ranges(rows) & (beyond > 1).any(axis=1) & (rows["beyond_world_size"] == 1).to_numpy()
        if judged.sum() < MIN_OUTSIDE_SCENARIOS:
            continue
        if _against_heuristic(rows[judged], abstention)["ahead"]:
            out[kind] = dict.fromkeys(SLACK_COLUMNS, float(beyond[judged].max()))
    return out


def _range_fallbacks(v: pd.DataFrame, fixed: Sequence[str]) -> dict:
    """``abstention.by_reason``'s ``shape_range``: per kind of machine, the fallback
    (``_best_fallback``) with the most expected speed on the validation scenarios that the
    runtime's check sends to it under their fold's training ranges (m, n, k or the world size
    outside: ``_outside_ranges``): they are the nearest evidence of what does well outside
    the ranges. A kind with fewer than
    ``MIN_OUTSIDE_SCENARIOS`` of them takes the choice made on every kind's (``any``); with
    fewer still, the heuristic. Returns {"by_reason": {reason: {kind: fallback}},
    "validation": {reason: {kind: figures}}}."""
    return _fallbacks_by_kind({"shape_range": v[_outside_ranges(v)]}, fixed)


def _fallbacks_by_kind(rows_of: dict[str, pd.DataFrame], fixed: Sequence[str]) -> dict:
    """For each reason's validation outcomes in `rows_of`: the best fallback per kind of machine
    with ``MIN_OUTSIDE_SCENARIOS`` or more, and (``any``) for the kinds with fewer, on their
    scenarios pooled where those reach ``MIN_OUTSIDE_SCENARIOS``. ``any`` serves only kinds
    without a choice of their own, so it is judged on theirs: one kind's evidence says
    little of another's (the cost model's pick is the truth's own on simulated GPU rows,
    not on measured cpu rows). A kind without either keeps the heuristic."""
    by_reason, validation = {}, {}
    for reason, rows in rows_of.items():
        groups = [(kind, r) for kind, r in rows.groupby("kind") if len(r) >= MIN_OUTSIDE_SCENARIOS]
        rest = rows[~rows["kind"].isin([kind for kind, _ in groups])]
        if len(rest) >= MIN_OUTSIDE_SCENARIOS:
            groups.append((ANY_KIND, rest))
        for kind, r in groups:
            best = _best_fallback(r, fixed)
            by_reason.setdefault(reason, {})[kind] = best["fallback"]
            validation.setdefault(reason, {})[kind] = best
    return {"by_reason": by_reason, "validation": validation}


def _best_fallback(v: pd.DataFrame, fixed: Sequence[str]) -> dict:
    """Among the heuristic, the baseline, the cost model's pick and the plain fixed rules
    (`fixed`), the fallback with the most expected speed (capture of the best's speed, on the
    truth) on validation outcomes `v` whose slowdowns stay within ``tail_guard(v)`` (the
    baseline always does); ties to more scenarios within 2% of their best, then in that
    order of candidates. With its figures and every candidate's.

    Outside the trained ranges the model extrapolates a distillation of the cost model, while
    the cost model reads the machine's spec as it is. On simulated rows its pick is the
    truth's own argmin, so there it wins by construction: what it is worth on real GPUs is
    judged on published points (``ficco sim validate --published``), under the GPU
    do-no-harm rule that the runtime applies to it as to every overlap pick. On measured
    rows it competes on their truth."""
    t_best, slow_at = v["t_best"].to_numpy(float), (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float)
    guard, best, candidates = tail_guard(v), None, {}
    for preference, fallback in enumerate([*FALLBACKS, *fixed]):
        t = _fallback_times(v, fallback)
        capture, near = float(np.mean(t_best / t)), float(np.mean(t <= NEAR_OPT * t_best))
        slow = float(np.mean(t > slow_at))
        candidates[fallback] = {"capture": capture, "near_opt_2": near, "slowdowns": slow}
        if slow <= guard and (best is None or (capture, near, -preference) > best[0]):
            best = ((capture, near, -preference), fallback, near, slow)
    (capture, _, _), fallback, near, slow = best
    return {"fallback": fallback, "scenarios": len(v), "capture": capture, "near_opt_2": near, "slowdowns": slow,
            "tail_guard": guard, "candidates": candidates}


def with_machine_fallbacks(abstention: dict, unseen: dict) -> dict:
    """`abstention` (``fit_abstention``'s) with the ``unseen_machine`` fallbacks that
    ``fit_unseen_hardware`` chose on held-out machines in ``by_reason``."""
    chosen = unseen.get("by_reason", {})
    if not chosen:
        return abstention
    return {**abstention, "by_reason": {**abstention.get("by_reason", {}), **chosen}}


def _against_heuristic(v: pd.DataFrame, abstention: dict) -> dict:
    """The runtime policy (the model under `abstention`) against the heuristic on validation
    outcomes `v`: each one's share within 2% of the best and of slowdowns, and whether the
    policy is ahead: more near-best scenarios, slowdowns within ``tail_guard(v)`` (the
    labels' own best's share where noise makes that exceed the cap, as for every rule
    fitted here) or the heuristic's own share."""
    policy = _apply_rule(v, abstention)
    best, base = NEAR_OPT * v["t_best"].to_numpy(float), (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float)
    heuristic = v["t_heuristic"].to_numpy(float)
    near = {"model": float(np.mean(policy <= best)), "heuristic": float(np.mean(heuristic <= best))}
    slow = {"model": float(np.mean(policy > base)), "heuristic": float(np.mean(heuristic > base))}
    guard = tail_guard(v)
    ahead = near["model"] > near["heuristic"] and slow["model"] <= max(guard, slow["heuristic"])
    return {"scenarios": len(v), "near_opt_2": near, "slowdowns": slow, "tail_guard": guard, "ahead": ahead}


MIN_KIND_SCENARIOS = 50
"""Validation scenarios of one kind of machine needed to fit that kind its own rule."""
MIN_OP_SCENARIOS = 20
"""Validation scenarios of one operator on one kind of machine needed to fit it its own rule
(one scenario moves its shares by 5% at most). The rule picks among a handful of fallbacks
and a threshold, under the same tail guard, so it needs fewer than a kind's."""


def _margin_rule(v: pd.DataFrame) -> dict:
    """The threshold and fallback that ``fit_abstention`` picks on validation outcomes `v`:
    the most expected speed (``capture``: the mean of best time / time run, on the truth)
    among the rules whose slowdowns stay within ``tail_guard(v)``; ties go to more scenarios
    within 2% of their best, then to the lower threshold (the model decides more), then to
    the heuristic, the baseline, then fixed rules (each plain, then gated: of its schedule and
    the baseline, the one the model predicts faster). A fixed rule among the fallbacks,
    with a threshold of None among the thresholds, makes the rule never worse on validation
    than that fixed rule alone."""
    margin, t_model = v["margin"].to_numpy(float), v["t_model"].to_numpy(float)
    slow_at, t_best = (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float), v["t_best"].to_numpy(float)
    guard = tail_guard(v)
    thresholds = [0.0, *np.quantile(np.unique(margin), np.linspace(0, 1, 101)).tolist(), None]  # None: never trust
    # Every threshold at once: with the scenarios sorted by margin, a threshold trusts the
    # model on a suffix of them, the first `untrusted[i]` going to the fallback.
    order = np.argsort(margin, kind="stable")
    untrusted = np.array([len(v) if th is None else np.searchsorted(margin[order], th, side="left")
                          for th in thresholds])

    def share(model: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        """Per threshold: the mean over scenarios of `model` where trusted, `fallback` elsewhere."""
        suffix = np.concatenate([[0.0], np.cumsum(model[order][::-1])])[::-1]
        prefix = np.concatenate([[0.0], np.cumsum(fallback[order])])
        return (suffix[untrusted] + prefix[untrusted]) / len(v)

    def figures(t: np.ndarray) -> tuple[np.ndarray, ...]:  # slowdown, near-best, speed (best / time)
        return (t > slow_at).astype(float), (t <= NEAR_OPT * t_best).astype(float), t_best / t

    of_model = figures(t_model)
    # Not the cost model: inside the ranges the model is its distillation, and on simulated
    # truth its pick is the truth's own argmin, so "never trust the model" would always win.
    fixed = [c.removeprefix(FIXED_PREFIX) for c in v.columns if c.startswith(FIXED_PREFIX)]
    fallbacks = ["heuristic", "baseline", *fixed]
    best = None
    for preference, fallback in enumerate(fallbacks):
        slow, near, capture = (share(m, f) for m, f in zip(of_model, figures(_fallback_times(v, fallback))))
        for i, threshold in enumerate(thresholds):
            if slow[i] <= guard:
                rank = (capture[i], near[i], -(np.inf if threshold is None else threshold), -preference)
                if best is None or rank > best[0]:
                    best = (rank, threshold, fallback, float(capture[i]), float(near[i]), float(slow[i]),
                            1 - untrusted[i] / len(v))
    _, threshold, fallback, capture, near, slow, trusted = best
    return {"min_margin": threshold, "fallback": fallback, "validation_scenarios": len(v),
            "validation_capture": capture, "validation_near_opt_2": near, "validation_slowdowns": slow,
            "validation_tail_guard": guard, "validation_model_share": float(trusted)}


def _fallback_times(v: pd.DataFrame, fallback: str) -> np.ndarray:
    """The true time of `fallback` (heuristic, baseline or a fixed rule's schedule) on each
    validation scenario of `v`."""
    column = f"t_{fallback}" if fallback in FALLBACKS else f"{FIXED_PREFIX}{fallback}"
    return v[column].to_numpy(float)


def tail_guard(v: pd.DataFrame) -> float:
    """The share of validation scenarios `v` a fitted rule may slow down: ``SLOWDOWN_CAP``, or
    the labels' own best's share (``t_oracle`` slower than the baseline on the truth) where
    that is higher. On measured rows judged on a second sweep, a perfect learner of the
    first sweep's labels slows some scenarios down by noise alone: a cap below that would
    forbid the model any decision, however good."""
    if "t_oracle" not in v.columns:
        return SLOWDOWN_CAP
    oracle_slow = float(np.mean(v["t_oracle"].to_numpy(float) > (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float)))
    return max(SLOWDOWN_CAP, oracle_slow)


def _under_rule(margin: np.ndarray, t_model: np.ndarray, t_fallback: np.ndarray,
                threshold: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Per validation scenario: whether the runtime trusts the model under a margin rule
    (None: never), and the true time of what it then runs (the model's pick, else the fallback's)."""
    trust = margin >= threshold if threshold is not None else np.zeros(len(margin), bool)
    return trust, np.where(trust, t_model, t_fallback)


def _apply_rule(v: pd.DataFrame, abstention: dict) -> np.ndarray:
    """The true time of what the runtime runs on each validation scenario under `abstention`
    (its rule for the scenario's operator on its kind of machine, else for its kind, else the
    pooled one: the runtime selector's order)."""
    out = np.empty(len(v))
    for kind, op in set(zip(v["kind"], v["op"])):
        rule = margin_rule(abstention, kind, op)
        at = ((v["kind"] == kind) & (v["op"] == op)).to_numpy()
        rows = v[at]
        out[at] = _under_rule(rows["margin"].to_numpy(float), rows["t_model"].to_numpy(float),
                              _fallback_times(rows, rule["fallback"]), rule["min_margin"])[1]
    return out
