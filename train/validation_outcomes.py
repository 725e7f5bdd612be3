"""What the runtime would run on each validation scenario, timed on the truth: the evidence
the shipped policy's rules are fitted on (``abstention_fit``, ``unseen_fit``).

Per scenario of a validation frame, a model fitted on the other side picks and scores its
candidates as the runtime's model does (``decision.pick_with_margin``), and every fallback a
rule may choose is what the runtime's own dispatch (``runtime.fallbacks.run_fallback``, through
``fallback_picks``) runs there: the heuristic, the cost model, the baseline and each fixed
rule, plain or gated on the model's scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from ficco_select.features import pair_features
from ficco_select.runtime.abstention import abstention_reason
from ficco_select.runtime.decision import GATED, pick_with_margin
from ficco_select.runtime.scope import COST_MODEL, RANGE_COLUMNS, Scope
from ficco_select.train.fallback_picks import RuntimeView, candidate_scores, picks, runtime_view
from ficco_select.train.metrics import true_times
from ficco_select.train.selectors import (
    AlwaysBaseline,
    BaseSelector,
    XGBRanker,
    feature_pairs,
    hardware_of,
    reference_picks,
)

FIXED_PREFIX = "t_fixed:"
"""Validation outcome columns holding a fixed rule's true time (``FIXED_PREFIX`` + schedule name)."""
MIN_FIXED_SHARE = 0.5
"""A schedule is tried as a fixed-rule fallback if at least this share of validation scenarios has it."""


def fixed_rule_schedules(ok: pd.DataFrame) -> list[str]:
    """The schedules (not baselines) that at least ``MIN_FIXED_SHARE`` of `ok`'s scenarios have:
    the fixed rules a fitted abstention rule may fall back to."""
    share = ok.groupby("schedule")["scenario_id"].nunique() / ok["scenario_id"].nunique()
    return sorted(name for name, v in share.items() if v >= MIN_FIXED_SHARE and not name.startswith("none."))


def _validation_outcomes(model: BaseSelector, val: pd.DataFrame, fixed: Sequence[str] = (),
                         scope: Scope | None = None) -> pd.DataFrame:
    """Per scenario of `val` (in sorted id order): the model's pick's true time and margin, and
    the true times of what the runtime's fallbacks run there (``t_heuristic``, ``t_cost_model``,
    ``t_baseline``, each `fixed` rule as ``FIXED_PREFIX`` + name and gated, ``FIXED_PREFIX`` +
    ``GATED`` + name), of the best and of the labels' own best (``t_oracle``).

    `scope`: the rules of a model trained on the other side (``fold_scope``); ``abstains``
    then holds the runtime's abstention reason (``runtime.abstention.abstention_reason``) for
    each scenario under them, "" where the model decides."""
    ok, X = feature_pairs(val)
    raw = model.model_.predict(X)
    lower_is_better = -raw if isinstance(model, XGBRanker) else raw
    truth = true_times(ok).to_numpy(float)
    sid, names = ok["scenario_id"].to_numpy(object), ok["schedule"].to_numpy(str)
    at, margin = pick_with_margin(lower_is_better, names, sid)
    first = pd.DataFrame({"t": truth[at], "margin": margin}, index=pd.Index(sid[at], name="sid")).sort_index()
    view = runtime_view(ok)
    assert view.ids == first.index.tolist()  # one order for every column
    t_of = dict(zip(zip(sid.tolist(), names.tolist()), truth.tolist()))
    baseline_of = AlwaysBaseline().predict(ok)

    def times(chosen: dict[str, str]) -> np.ndarray:
        """The true time of each scenario's pick; a pick the frame cannot time (a candidate
        without a usable row) is scored as the baseline, as the tables score it."""
        return np.array([t_of.get((s, chosen[s])) or t_of[(s, baseline_of[s])] for s in view.ids])

    scores = candidate_scores(view, ok, lower_is_better, lambda records, schedules: _scores(model, records, schedules))
    rules = (*fixed, *(f"{GATED}{name}" for name in fixed))
    t_best = pd.Series(truth).groupby(sid).min()
    # The labels' own best, timed on the truth: on measured rows with a second sweep, the
    # repeat oracle, whose slowdowns are what noise alone costs a perfect learner.
    labelled, _ = pick_with_margin(np.log(ok["time_s"].to_numpy(float)), names, sid)
    t_oracle = pd.Series(truth[labelled], index=sid[labelled])
    columns = ok.groupby("scenario_id", sort=False)[["hardware", "op", *RANGE_COLUMNS]].first().reindex(first.index)
    kind_of = {name: spec.kind for name, spec in zip(columns["hardware"], view.specs)}
    return pd.DataFrame({
        "kind": columns["hardware"].map(kind_of).to_numpy(),
        "op": columns["op"].to_numpy(),
        **{c: columns[c].to_numpy(float) for c in RANGE_COLUMNS},
        **({"abstains": _abstains(scope, view)} if scope is not None else {}),
        "margin": first["margin"].to_numpy(float),
        "t_model": first["t"].to_numpy(float),
        "t_heuristic": times(_fold_free_picks(val, view, "heuristic")),
        "t_cost_model": times(_fold_free_picks(val, view, COST_MODEL)),
        "t_baseline": times(baseline_of),
        "t_best": t_best.reindex(first.index).to_numpy(float),
        "t_oracle": t_oracle.reindex(first.index).to_numpy(float),
        **{f"{FIXED_PREFIX}{rule}": times(picks(view, rule, scores)) for rule in rules},
    })


def _fold_free_picks(val: pd.DataFrame, view: RuntimeView, fallback: str) -> dict[str, str]:
    """The picks of a fallback that reads no model (the heuristic, the cost model): the same in
    every fold, so read from the frame where ``selectors.with_reference_picks`` put them."""
    return reference_picks(val, fallback) or picks(view, fallback)


def _scores(model: BaseSelector, records: list[dict], schedules: list[str]) -> np.ndarray:
    """The model's scores (lower is better) of candidates the frame has no row of."""
    raw = model.model_.predict(pair_features(records, schedules, hardware_of(pd.DataFrame(records))))
    return -raw if isinstance(model, XGBRanker) else raw


def _abstains(scope: Scope, view: RuntimeView) -> np.ndarray:
    """The runtime's abstention reason for each scenario of `view` under `scope`, "" where the model decides."""
    return np.array([abstention_reason(scope, s, hw)[0] for s, hw in zip(view.scenarios, view.specs)], dtype=object)
