"""Generalization measured: the hold-out by machine on the measured machines.

A measured machine is one whose rows a sweep timed on this host and an independent second
sweep timed again (``time_repeat_s``): the unshaped host (``cpu``) and each shaped fabric
(``cpu-2gbit``, ...; ``ficco measure --fabric``). The ``hardware`` split already holds each
machine out in turn: its fold trains on every other machine (the other fabrics, the host,
the simulated GPUs) and scores on this one zero-shot, knowing only its spec (the fabric's
profiled link). This module reads those folds back as one table per machine, judged on
the second sweep, beside what a user could run without a model:

- every **fixed rule**: one schedule wherever it is legal, else the baseline (rules of a
  schedule that at least half of the machine's scenarios have); the tables hold every
  rule (``measured_holdout.csv``), comparison.txt the best of them on the machine's truth,
  which no rule chosen beforehand can beat;
- the **ceiling**: the first sweep's best, judged on the second (the repeat oracle).
"""

from __future__ import annotations

import pandas as pd

from ficco_select.train.metrics import BASELINE_NAME, BASELINE_PREFIX, comparison_table, format_table, score, usable_rows
from ficco_select.train.shipped import fixed_rule_schedules

SPLIT = "hardware"


def measured_machines(df: pd.DataFrame) -> list[str]:
    """The machines whose rows an independent second sweep timed (sorted)."""
    if "time_repeat_s" not in df.columns:
        return []
    timed = df[pd.to_numeric(df["time_repeat_s"], errors="coerce").notna()]
    return sorted(set(timed["hardware"]))


def fixed_rules(rows: pd.DataFrame) -> dict[str, dict[str, str]]:
    """{rule: {scenario_id: schedule}}: the baseline everywhere, and for each schedule that
    the shipped policy's fallbacks may use (``ficco_select.train.shipped.fixed_rule_schedules``: one that
    at least half of the scenarios of `rows` can run), that schedule where it is a usable
    row, else the scenario's baseline (``none.sm``, or its first ``none.*``)."""
    ok = usable_rows(rows)
    by_scenario = ok.groupby("scenario_id")["schedule"].agg(set)
    common = [BASELINE_NAME, *fixed_rule_schedules(ok)]
    baseline = {sid: ("none.sm" if "none.sm" in names else sorted(n for n in names if n.startswith(BASELINE_PREFIX))[0])
                for sid, names in by_scenario.items()}
    return {rule: {sid: rule if rule in names else baseline[sid] for sid, names in by_scenario.items()}
            for rule in common}


def holdout_tables(df: pd.DataFrame, results: dict) -> dict[str, pd.DataFrame]:
    """{machine: comparison table} for every measured machine the ``hardware`` split held
    out: its fold's selectors (zero-shot), every fixed rule (``fixed <schedule>``, the best
    first) and the ceiling last; every row judged on the second sweep (``ficco_select.train.metrics``)."""
    folds = results.get("splits", {}).get(SPLIT, {}).get("folds", {})
    out = {}
    for machine in measured_machines(df):
        fold = folds.get(f"{SPLIT}={machine}")
        if not fold:
            continue
        rows = df[df["hardware"] == machine]
        rules = {f"fixed {rule}": score(rows, chosen) for rule, chosen in fixed_rules(rows).items()}
        by_capture = sorted(rules, key=lambda r: -rules[r]["oracle_capture"])
        selectors = {name: scores for name, scores in fold.items() if name != "ceiling"}
        table = {**selectors, **{rule: rules[rule] for rule in by_capture}}
        if "ceiling" in fold:
            table["ceiling"] = fold["ceiling"]
        out[machine] = comparison_table(table)
    return out


def holdout_text(tables: dict[str, pd.DataFrame]) -> str:
    """The tables as comparison.txt's section (empty without a measured machine)."""
    if not tables:
        return ""

    head = ("== measured hold-out by machine (hardware split: trained without the machine, zero-shot on its "
            "spec; judged on its second sweep; ceiling = repeat oracle) ==")
    parts = [f"-- {machine} --\n{format_table(_best_rule_only(t))}" for machine, t in tables.items()]
    return "\n\n".join([head, *parts])


def _best_rule_only(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with only the first (best) of its fixed rules."""
    rules = [name for name in table.index if name.startswith("fixed ")]
    return table.drop(index=rules[1:])
