"""Selector-quality metrics on hand-made datasets whose expected numbers are worked out below."""

import math

import pandas as pd
import pytest

from ficco_select.train.metrics import METRICS, capture_scorer, comparison_table, format_table, oracle_choices, score


def rows(scenario_id, *specs, status="ok"):
    """specs: (schedule, time_s, verified, near_best) -> dataset rows of one scenario."""
    return [{"scenario_id": scenario_id, "schedule": s, "status": status, "time_s": t, "time_spread": 0.01,
             "verified": v, "near_best": nb, "group": "llama", "world_size": 2, "hardware": "cpu",
             "backend": "gloo"} for s, t, v, nb in specs]


@pytest.fixture
def df():
    # Scenario A: baseline 1.00, oracle x.fast 0.80; shard.ring.sm 0.824 = 1.03 * 0.80 (3% slower);
    #   x.bad 0.50 is faster but unverified, so the oracle ignores it.
    # Scenario B: baseline 1.20, oracle x.fast 0.60, shard.ring.sm 1.50 (slower than the baseline).
    # Scenario C: failed, nothing usable.
    return pd.DataFrame(
        rows("A", ("none.sm", 1.00, True, False), ("x.fast", 0.80, True, True),
             ("shard.ring.sm", 0.824, True, False), ("x.bad", 0.50, False, False))
        + rows("B", ("none.sm", 1.20, True, False), ("x.fast", 0.60, True, True),
               ("shard.ring.sm", 1.50, True, False))
        + rows("C", ("none.sm", float("nan"), False, False), ("x.fast", float("nan"), False, False),
               status="failed"))


def test_oracle_choice_is_perfect(df):
    # t* = 0.8 (A), 0.6 (B); t_b = 1.0, 1.2; oracle_speedup = sqrt(1.0/0.8 * 1.2/0.6) = sqrt(2.5)
    m = score(df, {"A": "x.fast", "B": "x.fast"})
    assert m["n"] == 2
    assert m["top1"] == 1.0 and m["near_opt_2"] == 1.0 and m["near_opt_5"] == 1.0
    assert m["oracle_capture"] == pytest.approx(1.0)
    assert m["worst_regret"] == pytest.approx(1.0)
    assert m["mean_regret"] == pytest.approx(0.0)
    assert m["slower_than_baseline"] == 0.0
    assert m["invalid"] == 0.0
    assert m["oracle_speedup"] == pytest.approx(math.sqrt(2.5))
    assert m["speedup"] == pytest.approx(m["oracle_speedup"])
    assert set(m) == set(METRICS)


def test_baseline_choice(df):
    # t = t_b = 1.0, 1.2: speedup 1, never slower than itself.
    # regret = 1.0/0.8 = 1.25 and 1.2/0.6 = 2.0 -> worst 2.0, mean (0.25 + 1.0)/2 = 0.625,
    # capture sqrt(0.8 * 0.5) = sqrt(0.4); baseline rows are not near_best -> top1 0.
    m = score(df, {"A": "none.sm", "B": "none.sm"})
    assert m["speedup"] == pytest.approx(1.0)
    assert m["slower_than_baseline"] == 0.0
    assert m["top1"] == 0.0 and m["near_opt_2"] == 0.0 and m["near_opt_5"] == 0.0
    assert m["worst_regret"] == pytest.approx(2.0)
    assert m["mean_regret"] == pytest.approx(0.625)
    assert m["oracle_capture"] == pytest.approx(math.sqrt(0.4))
    assert m["oracle_speedup"] == pytest.approx(math.sqrt(2.5))
    assert m["invalid"] == 0.0


def test_three_percent_slower_is_near_opt_5_not_near_opt_2(df):
    # A -> shard.ring.sm 0.824: 0.824 > 1.02*0.8 = 0.816, <= 1.05*0.8 = 0.84; near_best False.
    # B -> oracle. top1 = 1/2, near_opt_2 = 1/2, near_opt_5 = 2/2, worst regret 1.03,
    # mean regret (0.03 + 0)/2 = 0.015, capture sqrt(1/1.03), speedup sqrt(1/0.824 * 2).
    m = score(df, {"A": "shard.ring.sm", "B": "x.fast"})
    assert m["top1"] == 0.5
    assert m["near_opt_2"] == 0.5
    assert m["near_opt_5"] == 1.0
    assert m["worst_regret"] == pytest.approx(1.03)
    assert m["mean_regret"] == pytest.approx(0.015)
    assert m["oracle_capture"] == pytest.approx(math.sqrt(1 / 1.03))
    assert m["speedup"] == pytest.approx(math.sqrt(1 / 0.824 * 2.0))


def test_near_best_flag_makes_a_top1_hit(df):
    # Same choice as above, but A's shard.ring.sm is within noise of the best: top1 2/2.
    df.loc[(df["scenario_id"] == "A") & (df["schedule"] == "shard.ring.sm"), "near_best"] = True
    m = score(df, {"A": "shard.ring.sm", "B": "x.fast"})
    assert m["top1"] == 1.0
    assert m["near_opt_2"] == 0.5  # the time-based metrics do not change


def test_slower_than_baseline(df):
    # B -> shard.ring.sm 1.50 > t_b 1.2; A -> oracle. slower 1/2, regret 1.5/0.6 = 2.5,
    # speedup sqrt(1.25 * 1.2/1.5) = sqrt(1.0) = 1.
    m = score(df, {"A": "x.fast", "B": "shard.ring.sm"})
    assert m["slower_than_baseline"] == 0.5
    assert m["worst_regret"] == pytest.approx(2.5)
    assert m["speedup"] == pytest.approx(1.0)


def test_unverified_fastest_row_is_ignored(df):
    # x.bad (0.50) is unverified: oracle stays x.fast (0.80), choosing x.bad is invalid.
    assert oracle_choices(df)["A"] == "x.fast"
    m = score(df, {"A": "x.fast"})
    assert m["n"] == 1 and m["worst_regret"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad", ["x.bad", "no.such.schedule", None])
def test_invalid_choice_counts_as_baseline(df, bad):
    # A -> invalid, scored as baseline (t = 1.0); B -> oracle. invalid 1/2, speedup sqrt(1 * 2),
    # top1 1/2 (the baseline is not near_best), regret worst 1.25.
    m = score(df, {"A": bad, "B": "x.fast"})
    assert m["invalid"] == 0.5
    assert m["speedup"] == pytest.approx(math.sqrt(2.0))
    assert m["top1"] == 0.5
    assert m["worst_regret"] == pytest.approx(1.25)
    assert m["slower_than_baseline"] == 0.0
    assert m == score(df, {"A": "none.sm", "B": "x.fast"}) | {"invalid": 0.5}


def test_unknown_scenario_raises(df):
    with pytest.raises(ValueError, match="nope"):
        score(df, {"A": "x.fast", "nope": "x.fast"})


def test_failed_scenario_is_not_usable(df):
    with pytest.raises(ValueError, match="C"):
        score(df, {"C": "x.fast"})
    assert "C" not in oracle_choices(df)


def test_failed_row_in_an_ok_scenario_is_invalid():
    # D: a failed row that claims to be fastest is neither the oracle nor a valid choice.
    d = pd.DataFrame(rows("D", ("none.sm", 1.0, True, False), ("x.fast", 0.5, True, True))
                     + rows("D", ("x.fail", 0.1, True, False), status="failed"))
    assert oracle_choices(d) == {"D": "x.fast"}
    m = score(d, {"D": "x.fail"})
    assert m["invalid"] == 1.0 and m["speedup"] == pytest.approx(1.0)


def test_only_chosen_scenarios_are_scored(df):
    # Only A: t* 0.8, t_b 1.0 -> oracle_speedup 1.25.
    m = score(df, {"A": "x.fast"})
    assert m["n"] == 1
    assert m["oracle_speedup"] == pytest.approx(1.25)


def test_the_baseline_is_none_sm_when_several_engines_exist():
    # t_b = t(none.sm) = 1.0, what a framework runs; none.dma is just another candidate.
    d = pd.DataFrame(rows("E", ("none.sm", 1.0, True, False), ("none.dma", 0.9, True, False),
                          ("x.fast", 0.6, True, True)))
    m = score(d, {"E": "none.sm"})
    assert m["slower_than_baseline"] == 0.0
    assert m["speedup"] == pytest.approx(1.0)
    assert m["oracle_speedup"] == pytest.approx(1 / 0.6)
    assert score(d, {"E": "none.dma"})["speedup"] == pytest.approx(1 / 0.9)
    # An invalid choice falls back to the baseline.
    assert score(d, {"E": "bogus"})["speedup"] == pytest.approx(1.0)


def test_without_none_sm_the_fastest_none_is_the_baseline():
    d = pd.DataFrame(rows("F", ("none.dma", 0.9, True, False), ("none.x", 1.2, True, False),
                          ("x.fast", 0.6, True, True)))
    assert score(d, {"F": "none.x"})["slower_than_baseline"] == 1.0


def test_empty_choice_scores_nothing(df):
    m = score(df, {})
    assert m["n"] == 0 and all(math.isnan(m[k]) for k in METRICS if k != "n")


def test_oracle_choices_break_ties_by_name():
    d = pd.DataFrame(rows("F", ("none.sm", 1.0, True, False), ("b.x", 0.5, True, True), ("a.x", 0.5, True, True))
                     + rows("G", ("none.sm", 1.0, True, False), ("z.x", 0.5, True, True), ("c.x", 0.5, True, True)))
    assert oracle_choices(d) == {"F": "a.x", "G": "c.x"}
    assert oracle_choices(d.iloc[::-1]) == {"F": "a.x", "G": "c.x"}


def test_oracle_choices_score_perfectly(df):
    m = score(df, oracle_choices(df))
    assert m["n"] == 2 and m["top1"] == 1.0 and m["oracle_capture"] == pytest.approx(1.0)


def test_comparison_table_keeps_order_and_formats(df):
    results = {"oracle": score(df, oracle_choices(df)),
               "baseline": score(df, {"A": "none.sm", "B": "none.sm"}),
               "mixed": score(df, {"A": "shard.ring.sm", "B": "x.fast"})}
    table = comparison_table(results)
    assert list(table.index) == ["oracle", "baseline", "mixed"]
    assert list(table.columns) == list(METRICS)
    assert table.loc["baseline", "worst_regret"] == pytest.approx(2.0)
    assert list(comparison_table(dict(reversed(list(results.items())))).index) == ["mixed", "baseline", "oracle"]
    text = format_table(table)
    assert text.splitlines()[0].split()[:2] == ["n", "top1"]
    assert "0.625" in text and "1.581" in text  # baseline mean_regret, oracle_speedup sqrt(2.5)
    assert "0.6250" not in text


def truth_rows(scenario_id, *specs, backend="sim"):
    """specs: (schedule, label time_s, true time, near_best) -> rows whose truth is the model
    time (sim) or a repeat sweep's time (measured)."""
    column = "time_model_s" if backend == "sim" else "time_repeat_s"
    return [{**rows(scenario_id, (s, t, True, nb))[0], "backend": backend, column: truth,
             **({"time_model_s": float("nan")} if backend != "sim" else {})}
            for s, t, truth, nb in specs]


def test_sim_rows_are_scored_on_the_noise_free_time_and_have_no_noise_ties():
    from ficco_select.train.metrics import ceiling_choices

    # Labels (noisy) say b is best; the model's truth says a (0.80) beats b (0.82, 2.5% slower).
    d = pd.DataFrame(truth_rows("S", ("none.sm", 1.00, 1.00, False), ("a", 0.84, 0.80, True),
                                ("b", 0.79, 0.82, True)))
    assert oracle_choices(d) == {"S": "b"}  # what a label-follower picks
    m = score(d, {"S": "b"})
    assert m["near_opt_2"] == 0.0 and m["near_opt_5"] == 1.0
    assert m["top1"] == 0.0  # b's near_best flag is a noise tie; the truth has none
    assert m["oracle_capture"] == pytest.approx(0.80 / 0.82)
    assert ceiling_choices(d) == {"S": "a"}
    assert score(d, ceiling_choices(d))["oracle_capture"] == 1.0  # the sim ceiling is 1


def test_measured_rows_with_a_repeat_sweep_are_scored_on_it_and_the_ceiling_is_the_repeat_oracle():
    from ficco_select.train.metrics import ceiling_choices

    # Sweep A (labels): a 0.80 best; sweep B (truth): b 0.84 beats a 0.90.
    d = pd.DataFrame(truth_rows("M", ("none.sm", 1.00, 1.00, False), ("a", 0.80, 0.90, True),
                                ("b", 0.85, 0.84, False), backend="cpu"))
    assert ceiling_choices(d) == {"M": "a"}
    m = score(d, ceiling_choices(d))
    assert m["oracle_capture"] == pytest.approx(0.84 / 0.90)  # below 1: the measurement's own noise
    assert m["top1"] == 1.0  # a is a near_best tie of its measured scenario
    d["near_best_repeat"] = [False, False, True]  # the repeat sweep's own ties decide on its times
    assert score(d, ceiling_choices(d))["top1"] == 0.0
    assert m["speedup"] == pytest.approx(1.00 / 0.90)
    # without the repeat column the truth is the sweep itself: the ceiling is 1
    plain = d.drop(columns=["time_repeat_s"])
    assert score(plain, ceiling_choices(plain))["oracle_capture"] == 1.0


def test_the_capture_scorer_equals_score_for_every_choice_set(df):
    # capture_scorer (the heuristic's grid search) computes the truths once; invalid or
    # missing picks count as the baseline, as in score. A: t* 0.8, B: t* 0.6.
    capture = capture_scorer(df)
    for chosen in ({"A": "x.fast", "B": "x.fast"}, {"A": "shard.ring.sm", "B": "shard.ring.sm"},
                   {"A": "x.bad", "B": "nope"}, {"A": "none.sm", "B": "x.fast"}):
        assert capture(chosen) == pytest.approx(score(df, chosen)["oracle_capture"]), chosen
    assert capture({"A": "x.bad", "B": "nope"}) == pytest.approx(math.sqrt(0.8 / 1.0 * 0.6 / 1.2))
