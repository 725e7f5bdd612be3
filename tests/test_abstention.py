"""The abstention objective on hand-made validation outcomes (``train.shipped._margin_rule``):
the most expected speed, under a tail guard set by what noise alone costs the labels' own best."""

import numpy as np
import pandas as pd

from train.shipped import SLOWDOWN_CAP, _margin_rule, tail_guard


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
