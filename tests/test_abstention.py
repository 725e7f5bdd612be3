"""The abstention objective on hand-made validation outcomes (``ficco_select.train.abstention_fit._margin_rule``):
the most expected speed, under a tail guard set by what noise alone costs the labels' own best."""

import numpy as np
import pandas as pd
import pytest

from ficco_select.train.abstention_fit import SLOWDOWN_CAP, _margin_rule, tail_guard
from ficco_select.train.validation_outcomes import FIXED_PREFIX, fixed_rule_schedules


def as_judged(v: pd.DataFrame) -> pd.DataFrame:
    """Hand-made outcomes outside the ranges (``beyond_*`` > 1) as the validation gives them: with the
    runtime's verdict (``abstains``) beside them, the world size inside its range."""
    beyond = v[[c for c in v.columns if c.startswith("beyond_")]].to_numpy(float)
    return v.assign(abstains=np.where((beyond > 1).any(axis=1), "shape_range", ""), beyond_world_size=1.0)


def outcomes(**columns) -> pd.DataFrame:
    n = len(columns["margin"])
    return pd.DataFrame({"kind": ["cpu"] * n, **{k: np.asarray(v, dtype=float) for k, v in columns.items()}})


def test_the_rule_maximizes_expected_speed_not_the_count_of_near_best_picks():
    # The model is always 3% off the best; the heuristic hits the best once and is 2x slow twice.
    v = outcomes(margin=[0.1, 0.1, 0.1], t_model=[1.03] * 3, t_heuristic=[2.0, 2.0, 1.0],
                 t_baseline=[2.06] * 3, t_best=[1.0] * 3, t_oracle=[1.0] * 3)
    rule = _margin_rule(v)
    assert rule["min_margin"] is not None and rule["min_margin"] <= 0.1  # trust the model: capture 0.97
    assert abs(rule["validation_capture"] - 1 / 1.03) < 1e-12
    assert rule["validation_near_opt_2"] == 0.0  # though the heuristic alone would have had 1 of 3 near-best


def test_the_tail_guard_is_the_labels_own_slowdown_share_when_noise_makes_it_exceed_the_cap():
    n = 100
    slow = np.arange(n) < 5  # the model is confidently wrong on 5 scenarios: 10% slower than the baseline
    v = outcomes(margin=np.where(slow, 0.9, np.linspace(0.1, 0.8, n)),
                 t_model=np.where(slow, 1.1, 0.5), t_heuristic=np.ones(n), t_baseline=np.ones(n),
                 t_best=np.full(n, 0.5), t_oracle=np.where(np.arange(n) >= 90, 1.1, 0.5))  # noise: 10 of 100
    assert tail_guard(v) == 0.10
    rule = _margin_rule(v)
    assert rule["min_margin"] is not None and rule["validation_slowdowns"] == 0.05
    assert rule["validation_capture"] > 0.95
    # Against an absolute cap (no second sweep to say what noise costs), the model cannot be trusted at all.
    strict = _margin_rule(v.drop(columns="t_oracle"))
    assert tail_guard(v.drop(columns="t_oracle")) == SLOWDOWN_CAP
    assert strict["min_margin"] is None and strict["validation_slowdowns"] == 0.0


def test_a_rule_never_scores_below_the_fixed_fallbacks_it_could_have_chosen():
    rng = np.random.default_rng(0)
    n = 200
    t_best = rng.uniform(0.5, 1.0, n)
    v = outcomes(margin=rng.uniform(0, 1, n), t_model=t_best * rng.choice([1.0, 1.5], n, p=[0.7, 0.3]),
                 t_heuristic=t_best * rng.uniform(1.0, 1.4, n), t_baseline=np.ones(n), t_best=t_best,
                 t_oracle=t_best)
    rule = _margin_rule(v)
    for fixed in ("t_heuristic", "t_baseline"):
        t = v[fixed].to_numpy()
        if np.mean(t > 1.02 * v["t_baseline"].to_numpy()) <= tail_guard(v):
            assert rule["validation_capture"] >= np.mean(t_best / t) - 1e-12


def test_a_fixed_rule_is_a_fallback_and_the_rule_is_never_below_it():
    # On half the scenarios the sharded ring is 20% faster than the baseline; the model knows
    # which only where its margin is high, and the heuristic runs the baseline everywhere.
    n = 100
    ring_pays = np.arange(n) % 2 == 0
    t_shard = np.where(ring_pays, 0.8, 1.0)
    v = outcomes(margin=np.where(np.arange(n) < 20, 0.9, 0.1),
                 t_model=np.where(np.arange(n) < 20, np.where(ring_pays, 0.8, 0.95), 1.3),
                 t_heuristic=np.ones(n), t_baseline=np.ones(n), t_best=np.where(ring_pays, 0.8, 0.95),
                 t_oracle=np.where(ring_pays, 0.8, 0.95))
    v[f"{FIXED_PREFIX}shard.ring.sm"] = t_shard
    rule = _margin_rule(v)
    assert rule["fallback"] == "shard.ring.sm" and rule["min_margin"] is not None
    # Trust the 20 high-margin picks, run the ring elsewhere: above the ring alone and the model alone.
    assert rule["validation_capture"] > np.mean(v["t_best"] / t_shard)
    assert rule["min_margin"] > 0.1
    # Without the fixed rule to fall back to, the capture is lower.
    assert _margin_rule(v.drop(columns=f"{FIXED_PREFIX}shard.ring.sm"))["validation_capture"] < rule["validation_capture"]


def test_the_fixed_rules_tried_are_the_schedules_most_scenarios_have_baselines_aside():
    # Three scenarios: all have the baseline and the ring; only one (P = 4) has a degree-4 split.
    rows = [(sid, name) for sid in ("a", "b", "c") for name in ("none.sm", "shard.ring.sm")]
    rows += [("a", "ficco.d2.ring.gemm_per_piece.m.sm"), ("b", "ficco.d2.ring.gemm_per_piece.m.sm"),
             ("c", "ficco.d4.ring.gemm_per_piece.m.sm")]
    ok = pd.DataFrame(rows, columns=["scenario_id", "schedule"])
    assert fixed_rule_schedules(ok) == ["ficco.d2.ring.gemm_per_piece.m.sm", "shard.ring.sm"]


def direct_rule(v: pd.DataFrame) -> tuple:
    """The rule by brute force: every fallback and threshold, each scored on its own."""
    from ficco_select.train.metrics import NEAR_OPT

    margin, t_best, slow_at = v["margin"].to_numpy(), v["t_best"].to_numpy(), 1.02 * v["t_baseline"].to_numpy()
    thresholds = [0.0, *np.quantile(np.unique(margin), np.linspace(0, 1, 101)).tolist(), None]
    columns = ["t_heuristic", "t_baseline", *(c for c in v.columns if c.startswith(FIXED_PREFIX))]
    best = None
    for preference, column in enumerate(columns):
        for threshold in thresholds:
            trust = margin >= threshold if threshold is not None else np.zeros(len(v), bool)
            t = np.where(trust, v["t_model"].to_numpy(), v[column].to_numpy())
            if np.mean(t > slow_at) <= tail_guard(v):
                rank = (np.mean(t_best / t), np.mean(t <= NEAR_OPT * t_best),
                        -(np.inf if threshold is None else threshold), -preference)
                if best is None or rank > best[0]:
                    best = (rank, threshold, column)
    return best


def test_the_rule_scored_all_thresholds_at_once_is_the_brute_force_rule():
    rng = np.random.default_rng(1)
    for n in (7, 50, 400):
        t_best = rng.uniform(0.5, 1.0, n)
        v = outcomes(margin=rng.choice(rng.uniform(0, 1, n // 3 + 1), n),  # repeated margins, as trees give
                     t_model=t_best * rng.choice([1.0, 1.1, 1.6], n), t_heuristic=t_best * rng.uniform(1, 1.5, n),
                     t_baseline=rng.uniform(0.8, 1.2, n), t_best=t_best, t_oracle=t_best * rng.choice([1.0, 2.5], n))
        v[f"{FIXED_PREFIX}shard.ring.sm"] = t_best * rng.uniform(1.0, 1.3, n)
        rank, threshold, column = direct_rule(v)
        rule = _margin_rule(v)
        assert rule["min_margin"] == threshold
        assert column.endswith(rule["fallback"])
        assert rule["validation_capture"] == pytest.approx(rank[0], rel=1e-12)


def test_shapes_outside_the_ranges_get_the_fallback_that_did_best_there_per_kind():
    from ficco_select.train.abstention_fit import MIN_OUTSIDE_SCENARIOS, _range_fallbacks

    n = MIN_OUTSIDE_SCENARIOS
    # gpu: m outside (beyond_m > 1) on n scenarios, where the heuristic is 2x slow and the ring
    # is best; n, k outside on n more, where the heuristic is best (1.4x faster than the
    # ring): pooled, the ring has the most capture. cpu: too few outside.
    ring = FIXED_PREFIX + "shard.ring.sm"
    gpu_m = pd.DataFrame({"kind": "gpu", "beyond_m": 4.0, "beyond_n": 1.0, "beyond_k": 1.0, "t_heuristic": 2.0,
                          ring: 1.0, "t_baseline": 1.5}, index=range(n))
    gpu_nk = pd.DataFrame({"kind": "gpu", "beyond_m": 1.0, "beyond_n": 2.0, "beyond_k": 1.0, "t_heuristic": 1.0,
                           ring: 1.4, "t_baseline": 1.5}, index=range(n))
    cpu = pd.DataFrame({"kind": "cpu", "beyond_m": 2.0, "beyond_n": 1.0, "beyond_k": 1.0, "t_heuristic": 1.0,
                        ring: 3.0, "t_baseline": 1.2}, index=range(3))
    inside = pd.DataFrame({"kind": "gpu", "beyond_m": 1.0, "beyond_n": 1.0, "beyond_k": 1.0, "t_heuristic": 9.0,
                           ring: 9.0, "t_baseline": 1.0}, index=range(50))
    v = pd.concat([gpu_m, gpu_nk, cpu, inside], ignore_index=True).assign(t_cost_model=3.0)  # the cost model: slow here
    v = v.assign(t_best=v[["t_heuristic", ring, "t_baseline"]].min(axis=1), t_oracle=v["t_baseline"])
    got = _range_fallbacks(as_judged(v), ["shard.ring.sm"])
    # cpu: 3 < n scenarios, no rule of its own, and too few for one on the kinds without one
    # (any): the gpu's evidence is not carried to it; the runtime's default, the heuristic.
    assert got["by_reason"] == {"shape_range": {"gpu": "shard.ring.sm"}}
    # Two kinds each short of n, together n or more: one choice (any) on their scenarios
    # pooled; here the ring slows the 3 cpu scenarios down beyond the guard: the baseline.
    few = pd.concat([gpu_m.iloc[: n - 3], cpu], ignore_index=True).assign(t_cost_model=3.0)
    few = few.assign(t_best=few[["t_heuristic", ring, "t_baseline"]].min(axis=1), t_oracle=few["t_baseline"])
    assert _range_fallbacks(as_judged(few), ["shard.ring.sm"])["by_reason"]["shape_range"] == {"any": "baseline"}
    assert got["validation"]["shape_range"]["gpu"]["scenarios"] == 2 * n  # only the scenarios outside: not the 50 inside
    assert got["validation"]["shape_range"]["gpu"]["candidates"]["baseline"]["capture"] == pytest.approx(1 / 1.5)
    # Where the n, k scenarios alone judge it, the heuristic.
    nk = as_judged(v[v["beyond_m"] == 1.0])
    assert _range_fallbacks(nk, ["shard.ring.sm"])["by_reason"] == {"shape_range": {"gpu": "heuristic"}}
    # A fallback that slows down more than the tail guard allows is never chosen, however fast elsewhere.
    risky = gpu_m.assign(t_cost_model=3.0, **{ring: np.where(np.arange(n) < n // 2, 0.5, 1.6)})
    risky = risky.assign(t_best=risky[["t_heuristic", ring, "t_baseline"]].min(axis=1), t_oracle=risky["t_baseline"])
    assert _range_fallbacks(as_judged(risky), ["shard.ring.sm"])["by_reason"]["shape_range"]["gpu"] == "baseline"


def test_the_cost_model_is_a_range_fallback_where_it_does_best_but_never_a_margin_fallback():
    from ficco_select.train.abstention_fit import MIN_OUTSIDE_SCENARIOS, _range_fallbacks

    n = MIN_OUTSIDE_SCENARIOS
    # m outside on n gpu scenarios: the cost model's pick is the best, the heuristic 2x slow.
    gpu_m = pd.DataFrame({"kind": "gpu", "beyond_m": 4.0, "beyond_n": 1.0, "beyond_k": 1.0, "t_heuristic": 2.0,
                          "t_cost_model": 1.0, "t_baseline": 1.5}, index=range(n))
    v = gpu_m.assign(t_best=1.0, t_oracle=1.5)
    got = _range_fallbacks(as_judged(v), [])
    assert got["by_reason"]["shape_range"] == {"gpu": "cost_model"}
    assert got["validation"]["shape_range"]["gpu"]["candidates"]["cost_model"]["capture"] == pytest.approx(1.0)
    # One that slows down more than the tail guard allows is not chosen.
    risky = v.assign(t_cost_model=np.where(np.arange(n) < n // 2, 1.0, 1.6))
    assert _range_fallbacks(as_judged(risky), [])["by_reason"]["shape_range"]["gpu"] == "baseline"
    # The margin rule does not offer it: inside the ranges the model is its distillation, and
    # on simulated truth "never trust the model" would always win.
    inside = outcomes(margin=[0.1, 0.2, 0.3], t_model=[1.2, 1.2, 1.2], t_heuristic=[1.5, 1.5, 1.5],
                      t_cost_model=[1.0, 1.0, 1.0], t_baseline=[2.0, 2.0, 2.0], t_best=[1.0, 1.0, 1.0],
                      t_oracle=[1.0, 1.0, 1.0])
    assert _margin_rule(inside)["fallback"] != "cost_model"


def test_the_model_is_ahead_of_the_heuristic_within_what_noise_costs_the_labels_own_best():
    # _against_heuristic (unseen machines, range slack): more scenarios within 2% of their
    # best, and slowdowns within the tail guard: on measured rows judged on a second sweep,
    # the labels' own best slows down that often by noise alone.
    from ficco_select.train.abstention_fit import _against_heuristic

    n = 100
    # The model is the best but on 6 of 100, which it slows down (past the baseline); the
    # heuristic never slows one down and is 10% off the best on half.
    v = pd.DataFrame({"kind": "cpu", "op": "ag_gemm", "margin": 1.0, "t_best": 1.0, "t_baseline": 1.2,
                      "t_model": np.where(np.arange(n) < 6, 1.3, 1.0),
                      "t_heuristic": np.where(np.arange(n) < 50, 1.0, 1.1)})
    rule = {"min_margin": 0.0, "fallback": "heuristic"}
    noisy = v.assign(t_oracle=np.where(np.arange(n) < 15, 1.3, 1.0))  # the labels' best slows 15 down
    got = _against_heuristic(noisy, rule)
    assert got["tail_guard"] == pytest.approx(0.15) and got["slowdowns"]["model"] == pytest.approx(0.06)
    assert got["ahead"]
    quiet = v.assign(t_oracle=1.0)  # simulated truth: the cap, 1%, and 6% slowdowns are too many
    assert _against_heuristic(quiet, rule)["tail_guard"] == SLOWDOWN_CAP and not _against_heuristic(quiet, rule)["ahead"]


def test_the_validation_s_fallback_times_are_each_scenario_s_own_decisions():
    # The validation times every fixed rule for a whole column of scenarios at once; each
    # must be the time of what the runtime's rule (fixed_rule_pick) runs for that scenario.
    from ficco_select.runtime.decision import GATED, fixed_rule_pick
    from ficco_select.train.metrics import true_times, usable_rows
    from ficco_select.train.selectors import AlwaysBaseline, XGBTimeRegressor, feature_pairs, with_features
    from ficco_select.train.validation_outcomes import _validation_outcomes
    from ficco_select.train.training_data import simulated

    df = with_features(simulated("mi300x-8", world_sizes=(2, 4), share=0.2, seed=1))
    train_ids = set(df["scenario_id"].unique()[::2])
    train, val = df[df["scenario_id"].isin(train_ids)], df[~df["scenario_id"].isin(train_ids)]
    model = XGBTimeRegressor(n_estimators=20).fit(train)
    fixed = fixed_rule_schedules(usable_rows(train))
    got = _validation_outcomes(model, val, fixed)

    ok, X = feature_pairs(val)
    scores, truth = model.model_.predict(X), true_times(ok).to_numpy(float)
    baseline = AlwaysBaseline().predict(val)
    expected = {}
    for sid, rows in ok.groupby("scenario_id").indices.items():
        names = ok["schedule"].to_numpy(str)[rows].tolist()
        t_of = dict(zip(names, truth[rows]))
        expected[sid] = [t_of[baseline[sid]]] + [
            t_of[fixed_rule_pick(rule, names, scores[rows], baseline[sid])]
            for rule in (*fixed, *(f"{GATED}{name}" for name in fixed))]
    want = pd.DataFrame(expected).T.sort_index().to_numpy()
    columns = ["t_baseline", *(f"{FIXED_PREFIX}{rule}" for rule in (*fixed, *(f"{GATED}{n}" for n in fixed)))]
    assert len(fixed) >= 2 and len(got) == len(expected)
    np.testing.assert_array_equal(got[columns].to_numpy(), want)
    gated = got[[f"{FIXED_PREFIX}{GATED}{n}" for n in fixed]].to_numpy()
    assert (gated != got[[f"{FIXED_PREFIX}{n}" for n in fixed]].to_numpy()).any()  # the gate decided somewhere


def test_the_range_slack_is_judged_only_where_a_slack_would_let_the_model_decide():
    from ficco_select.train.abstention_fit import MIN_OUTSIDE_SCENARIOS, _range_slack

    # n lies 3x outside its range, where the model is ahead of the heuristic; but so does the
    # world size, which no slack widens: the runtime would abstain there anyway.
    v = pd.DataFrame({"kind": "gpu", "op": "ag_gemm", "margin": 1.0, "beyond_m": 1.0, "beyond_n": 3.0, "beyond_k": 1.0,
                      "beyond_world_size": 2.0, "abstains": "shape_range", "t_best": 1.0, "t_baseline": 1.5,
                      "t_model": 1.0, "t_heuristic": 1.3}, index=range(2 * MIN_OUTSIDE_SCENARIOS))
    rule = {"min_margin": 0.0, "fallback": "heuristic"}
    assert _range_slack(v, rule) == {}
    assert _range_slack(v.assign(beyond_world_size=1.0), rule) == {"gpu": {"m": 3.0, "n": 3.0, "k": 3.0}}
    # Nor where the runtime abstains for another reason first (a machine the fold never saw).
    assert _range_slack(v.assign(beyond_world_size=1.0, abstains="unseen_machine"), rule) == {}
