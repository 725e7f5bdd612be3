"""The measured hold-out by machine (ficco_select.train.measured_holdout) on hand-made rows, and the
committed fabric sweeps as training data (ficco_select.train.training_data)."""

import numpy as np
import pandas as pd
import pytest

from ficco_select.train.measured_holdout import fixed_rules, holdout_tables, holdout_text, measured_machines
from ficco_select.train.metrics import score


def _rows(machine: str, times: dict[str, dict[str, float]], repeat: dict[str, dict[str, float]] | None) -> pd.DataFrame:
    """One row per (scenario, schedule) of `machine`, labels `times`, second sweep `repeat`."""
    rows = []
    for sid, by_schedule in times.items():
        for schedule, t in by_schedule.items():
            again = (repeat or {}).get(sid, {}).get(schedule, np.nan)
            rows.append({"scenario_id": sid, "schedule": schedule, "hardware": machine, "status": "ok",
                         "verified": True, "time_s": t, "near_best": False, "time_repeat_s": again,
                         "near_best_repeat": False})
    return pd.DataFrame(rows)


LABELS = {"a": {"none.sm": 1.0, "shard.ring.sm": 0.8, "ficco.d2.ring.gemm_per_step.m.sm": 0.9},
          "b": {"none.sm": 1.0, "shard.ring.sm": 1.2},
          "c": {"none.sm": 1.0, "shard.ring.sm": 1.1, "ficco.d2.ring.gemm_per_step.m.sm": 0.7}}
REPEAT = {"a": {"none.sm": 1.0, "shard.ring.sm": 0.85, "ficco.d2.ring.gemm_per_step.m.sm": 0.95},
          "b": {"none.sm": 1.0, "shard.ring.sm": 1.25},
          "c": {"none.sm": 1.0, "shard.ring.sm": 1.1, "ficco.d2.ring.gemm_per_step.m.sm": 1.3}}


def test_a_fixed_rule_runs_its_schedule_where_legal_and_the_baseline_elsewhere():
    rules = fixed_rules(_rows("cpu-1gbit", LABELS, REPEAT))
    assert set(rules) == {"none.sm", "shard.ring.sm", "ficco.d2.ring.gemm_per_step.m.sm"}  # 2 of 3 have ficco.d2
    assert rules["ficco.d2.ring.gemm_per_step.m.sm"] == {"a": "ficco.d2.ring.gemm_per_step.m.sm", "b": "none.sm",
                                                         "c": "ficco.d2.ring.gemm_per_step.m.sm"}
    rare = {**LABELS, "d": {"none.sm": 1.0}, "e": {"none.sm": 1.0}}  # now 2 of 5: below half, not a rule
    assert "ficco.d2.ring.gemm_per_step.m.sm" not in fixed_rules(_rows("cpu-1gbit", rare, None))


def test_only_machines_a_second_sweep_timed_are_measured_machines():
    df = pd.concat([_rows("cpu-1gbit", LABELS, REPEAT), _rows("h100-nvswitch", LABELS, None)])
    assert measured_machines(df) == ["cpu-1gbit"]
    assert measured_machines(df.drop(columns=["time_repeat_s"])) == []


def test_the_tables_judge_the_fold_on_the_second_sweep_beside_the_best_fixed_rule_and_the_ceiling():
    df = pd.concat([_rows("cpu-1gbit", LABELS, REPEAT), _rows("cpu-2gbit", LABELS, REPEAT)], ignore_index=True)
    one = df[df["hardware"] == "cpu-1gbit"]
    model = {"a": "shard.ring.sm", "b": "none.sm", "c": "ficco.d2.ring.gemm_per_step.m.sm"}  # the labels' best
    results = {"splits": {"hardware": {"folds": {
        "hardware=cpu-1gbit": {"shipped": score(one, model), "ceiling": score(one, model)}}}}}
    tables = holdout_tables(df, results)
    assert list(tables) == ["cpu-1gbit"]  # cpu-2gbit's fold was not evaluated: no table for it
    table = tables["cpu-1gbit"]
    # On the second sweep the labels' best at c (0.7) is a loss (1.3): the repeat oracle is below 1.
    assert table.loc["shipped", "oracle_capture"] == pytest.approx((0.85 / 0.85 * 1.0 / 1.0 * 1.0 / 1.3) ** (1 / 3))
    assert table.loc["shipped", "slower_than_baseline"] == pytest.approx(1 / 3)
    # The best fixed rule on the truth: shard everywhere loses at b and c; the baseline everywhere
    # misses only a's 0.85; so none.sm is the best rule, at capture (0.85 / 1)^(1/3).
    rules = [name for name in table.index if name.startswith("fixed ")]
    assert rules == ["fixed none.sm", "fixed shard.ring.sm", "fixed ficco.d2.ring.gemm_per_step.m.sm"]  # best first
    assert table.loc["fixed none.sm", "oracle_capture"] == pytest.approx(0.85 ** (1 / 3))
    assert table.loc["fixed shard.ring.sm", "oracle_capture"] == pytest.approx((1 / 1.25 / 1.1) ** (1 / 3))
    assert list(table.index)[-1] == "ceiling"
    text = holdout_text(tables)
    assert "-- cpu-1gbit --" in text and "fixed none.sm" in text and "fixed shard.ring.sm" not in text
    assert holdout_text({}) == ""


def test_the_fabric_sweeps_are_default_training_data_on_their_first_sweeps_spec():
    import json

    from ficco_select.hardware import load_hardware, machines
    from ficco_select.train.training_data import FABRICS, MEASURED_SWEEPS, measured_machines, measured_path, measured_rows

    rows = measured_rows()
    names = set(rows["hardware"])
    assert len(FABRICS) >= 2
    for rate in FABRICS:
        assert f"cpu-{rate}" in names
        ours = rows[rows["hardware"] == f"cpu-{rate}"]
        assert ours["time_repeat_s"].notna().mean() > 0.95  # judged on the second sweep
        first = json.loads(measured_path(f"fabric_{rate}.parquet.fabric.json").read_text())
        with machines(measured_machines()):
            assert load_hardware(f"cpu-{rate}").link_bw_gbps == pytest.approx(first["spec"]["link_bw_gbps"])
    assert all(measured_path(a).is_file() and measured_path(b).is_file() for a, b in MEASURED_SWEEPS)
