"""Grouped evaluation: every selector trained on some groups, scored on groups it never saw.

Splits (each a list of folds; a fold is (name, train mask, test mask) over scenarios):
- ``random``: 20% of scenarios by id hash.
- ``family``: leave one model family out (the ``group`` column).
- ``hardware``: leave one hardware out.
- ``topology``: leave one interconnect topology out (``fully_connected``, ``switch``,
  ``ring``: the spec's), every machine of it at once.
- ``world_size``: train on world sizes below the largest, test on the largest.
No scenario of a fold's test side is in its training side (tested).
"""

from __future__ import annotations

import os
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from ficco_select.data.machines import base_machine, is_sampled
from ficco_select.hardware import known_machines, load_hardware, machines
from ficco_select.train.metrics import (METRICS, Truths, ceiling_choices, comparison_table, require_every_candidate,
                                       true_times, usable_rows)
from ficco_select.train import selectors
from ficco_select.train.selector_sets import shipping_selectors
from ficco_select.train.selectors import BaseSelector, with_features, with_reference_picks

Fold = tuple[str, pd.Series, pd.Series]
SPLITS = ("random", "family", "hardware", "topology", "world_size")


def folds(df: pd.DataFrame, split: str) -> list[Fold]:
    """Boolean masks over df's rows; every scenario is wholly on one side.

    Machines sampled around a preset (``ficco_select.data.machines``) are training data only: no test
    side holds them, and holding a machine out holds out the machines sampled around it."""
    base = df["hardware"].map({h: base_machine(h) for h in set(df["hardware"].unique())})
    scored = ~df["hardware"].map({h: is_sampled(h) for h in set(df["hardware"].unique())}).astype(bool)
    if split == "random":
        h = df["scenario_id"].map(lambda s: zlib.crc32(s.encode()) % 5)
        return [("random", h != 0, (h == 0) & scored)]
    if split in ("family", "hardware"):
        col = df["group"] if split == "family" else base
        values = sorted(set(col[scored]))
        if len(values) < 2:
            return []
        return [(f"{split}={v}", col != v, (col == v) & scored) for v in values]
    if split == "topology":
        topology = df["hardware"].map({h: load_hardware(h).topology for h in set(df["hardware"].unique())})
        values = sorted(set(topology[scored]))
        if len(values) < 2:
            return []
        return [(f"topology={v}", topology != v, (topology == v) & scored) for v in values]
    if split == "world_size":
        largest = df["world_size"].max()
        return [(f"world_size={largest}", df["world_size"] < largest, (df["world_size"] == largest) & scored)]
    raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def evaluate(df: pd.DataFrame, *, splits: Sequence[str] = SPLITS,
             make_selectors: Callable[[], list[BaseSelector]] = shipping_selectors, progress: bool = True,
             workers: int = 1) -> dict:
    """For each split and fold: fit every selector on train, score on test.

    Returns {"splits": {split: {"mean": {selector: metrics}, "folds": {fold: {selector: metrics}},
    "by_backend": {backend: {selector: metrics}}, "by_dtype": {"<backend>.<dtype>": {selector: metrics}},
    "by_op": {"<backend>.<dtype>.<op>": {selector: metrics}}}},
    "fit_seconds": {selector: total}, "choices": {split: {selector: {scenario_id: schedule}}}}
    (each scenario is in the test side of at most one fold per split). ValueError where a
    scenario lacks some of its candidates (``ficco_select.train.metrics.require_every_candidate``).
    `workers`: folds fitted at once, each in a process of its own (the folds are independent
    and every fit is seeded: the results do not depend on it).
    """
    require_every_candidate(df)
    df = with_reference_picks(with_features(df))  # once: every fold's selectors slice them
    truth = Truths.of(df)  # once: the pooled tables read it
    plan = [(split, fold) for split in splits for fold in folds(df, split)]
    unique, slots, order = _distinct_folds(plan)
    per_fold_fits = len(make_selectors())
    bar = tqdm(total=len(plan) * per_fold_fits, desc="evaluate", unit="fit", disable=not progress)
    if workers > 1 and len(unique) > 1:
        from joblib import Parallel, delayed

        # Each fold's process reads the frame once from a file (pickling it per fold costs
        # more than the fit) and knows the machines this job does (specs read from files
        # and datasets, machines sampled around the presets), by the same names and numbers.
        with tempfile.TemporaryDirectory(prefix="ficco-evaluate-") as tmp:
            path = str(Path(tmp) / "frame.parquet")
            df.to_parquet(path)
            machines = known_machines()
            n_jobs = min(workers, len(unique))
            threads = max(1, usable_cores() // n_jobs)
            outcomes = Parallel(n_jobs=n_jobs, return_as="generator")(
                delayed(_fold_in_worker)(machines, path, *unique[i], make_selectors, threads) for i in order)
            results = _gathered(plan, _by_slot(zip(order, outcomes), slots), bar, per_fold_fits)
    else:
        # One at a time: in the plan's order, so that each fold is reported as it ends.
        outcomes = (_fold(df.iloc[train_at], df.iloc[test_at], make_selectors) for train_at, test_at in unique)
        results = _gathered(plan, _by_slot(enumerate(outcomes), slots), bar, per_fold_fits)
    bar.close()
    for split, block in results["splits"].items():
        block["mean"] = _mean_over_folds(block["folds"])
        block["by_backend"] = _pooled_by(df, results["choices"][split], ["backend"], truth)
        block["by_dtype"] = _pooled_by(df, results["choices"][split], ["backend", "dtype"], truth)
        per_op = _pooled_by(df, results["choices"][split], ["backend", "dtype", "op"], truth)
        block["by_op"] = {name: scores for name, scores in per_op.items() if name.startswith(PER_OP_SETTINGS)}
    return results


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _distinct_folds(plan: list) -> tuple[list, list[int], list[int]]:
    """The plan's distinct folds as (training rows, test rows) positions; each plan entry's
    distinct fold (`slots`); and the order in which workers fit them. Two splits may hold
    out the same rows (a topology only one machine has): that fold is fitted once. Largest
    training sides first, so that the last folds to finish are small and the workers end
    together."""
    first: dict[tuple[bytes, bytes], int] = {}
    unique, slots = [], []
    for _, (_, train_mask, test_mask) in plan:
        train_at, test_at = np.flatnonzero(train_mask), np.flatnonzero(test_mask)
        key = (train_at.tobytes(), test_at.tobytes())
        if key not in first:
            first[key] = len(unique)
            unique.append((train_at, test_at))
        slots.append(first[key])
    return unique, slots, sorted(range(len(unique)), key=lambda i: -len(unique[i][0]))


def _by_slot(arrivals, slots: list[int]):
    """The outcome of each plan entry (its distinct fold's: `slots`), in plan order, from
    `arrivals`: (distinct fold, outcome) in the order they were fitted."""
    got: dict = {}
    for slot in slots:
        while slot not in got:
            fold, outcome = next(arrivals)
            got[fold] = outcome
        yield got[slot]


def _gathered(plan: list, outcomes, bar, per_fold_fits: int) -> dict:
    """The folds' outcomes (``_fold``), in plan order, as ``evaluate``'s results."""
    results: dict = {"splits": {}, "fit_seconds": {}, "choices": {}}
    timed = set()  # a fold two splits share was fitted once: its seconds count once
    for (split, (fold_name, _, _)), outcome in zip(plan, outcomes):
        results["splits"].setdefault(split, {"folds": {}})["folds"][fold_name] = outcome["scores"]
        for name, seconds in outcome["seconds"].items() if id(outcome) not in timed else ():
            results["fit_seconds"][name] = results["fit_seconds"].get(name, 0.0) + seconds
        timed.add(id(outcome))
        for name, chosen in outcome["choices"].items():
            results["choices"].setdefault(split, {}).setdefault(name, {}).update(chosen)
        if outcome["decisions"]:
            results.setdefault("decisions", {}).setdefault(split, {}).update(outcome["decisions"])
        bar.update(per_fold_fits)
    return results


def _fold(train: pd.DataFrame, test: pd.DataFrame, make_selectors: Callable[[], list[BaseSelector]]) -> dict:
    """Every selector fitted on one fold's `train` and scored on its `test`: their scores,
    fit seconds and choices, and why the runtime policy decided each scenario as it did."""
    truth = Truths.of(test)
    out: dict = {"scores": {}, "seconds": {}, "choices": {}, "decisions": {}}
    for selector in make_selectors():
        t0 = time.perf_counter()
        if selector.decides_unseen_machines:
            selector.fit(train, unseen_machines=set(test["hardware"]) - set(train["hardware"]))
        else:
            selector.fit(train)
        out["seconds"][selector.name] = time.perf_counter() - t0
        chosen = out["choices"][selector.name] = selector.predict(test)
        out["scores"][selector.name] = truth.score(chosen)
        if hasattr(selector, "decisions_"):  # the runtime policy: why each decision went where it did
            out["decisions"].update({sid: (d.abstained or "model", _ran(d, chosen[sid]))
                                     for sid, d in selector.decisions_.items()})
    return out


_FRAME: list = [None, None]
"""A fold process's copy of the evaluated frame: (the file it was read from, the frame)."""


def _fold_in_worker(known: dict, path: str, train_at: np.ndarray, test_at: np.ndarray,
                    make_selectors: Callable[[], list[BaseSelector]], threads: int) -> dict:
    selectors.FIT_THREADS = threads  # this process's share of the cores
    if _FRAME[0] != path:
        _FRAME[:] = [path, pd.read_parquet(path)]
    df = _FRAME[1]
    with machines(known.values()):  # known_machines() of the process it serves
        return _fold(df.iloc[train_at], df.iloc[test_at], make_selectors)


def _ran(decision, schedule: str) -> str:
    """What a runtime decision ran, as the abstention report names it: the model, the
    heuristic, the cost model, the baseline or a fixed rule's schedule."""
    if decision.source in ("model", "heuristic", "cost_model"):
        return decision.source
    return "baseline" if schedule.startswith("none.") else schedule


def abstention_table(df: pd.DataFrame, results: dict) -> pd.DataFrame:
    """Per split, setting (backend.dtype) and reason the shipped policy's model did not decide
    (``model`` where it did; ``decision.ABSTENTION_REASONS``), per what then ran: how many
    test scenarios, their share of the setting's, and what those decisions scored on the
    truth (within 2% of the best, capture of the best's speed, worst regret), beside the
    model's own pick on the same scenarios (the bare row of the same fit)."""
    setting = df.groupby("scenario_id")[["backend", "dtype"]].first().agg(".".join, axis=1)
    truth = Truths.of(df)
    rows = []
    for split, decided in results.get("decisions", {}).items():
        shipped = results["choices"][split].get("shipped", {})
        bare = results["choices"][split].get("xgb-regressor", {})
        frame = pd.DataFrame([(sid, reason, ran) for sid, (reason, ran) in decided.items()],
                             columns=["scenario_id", "reason", "ran"])
        frame["setting"] = frame["scenario_id"].map(setting)
        totals = frame.groupby("setting")["scenario_id"].size()
        for (where, reason, ran), group in frame.groupby(["setting", "reason", "ran"]):
            ids = set(group["scenario_id"])
            got = truth.score({sid: shipped[sid] for sid in ids})
            model = truth.score({sid: bare[sid] for sid in ids if sid in bare}) if bare else {}
            rows.append({"split": split, "setting": where, "reason": reason, "ran": ran, "n": len(ids),
                         "share": len(ids) / totals[where], "near_opt_2": got["near_opt_2"],
                         "capture": got["oracle_capture"], "worst_regret": got["worst_regret"],
                         "model_near_opt_2": model.get("near_opt_2", np.nan)})
    return pd.DataFrame(rows, columns=["split", "setting", "reason", "ran", "n", "share", "near_opt_2", "capture",
                                       "worst_regret", "model_near_opt_2"])


def _pooled_by(df: pd.DataFrame, choices: dict[str, dict[str, str]], columns: list[str], truth: Truths) -> dict:
    """{value: {selector: metrics}} over every test scenario of the split (all folds pooled),
    per value of `columns` (joined by "."), where the last column takes several values
    within one value of the others: measured and simulated rows answer different questions
    (and their ceilings differ), and each dtype is a setting of its own (bfloat16 is what
    LLM jobs run on GPUs; float32 on the cpu backend)."""
    of = df.groupby("scenario_id")[columns].first()
    inner = of.groupby(columns[:-1])[columns[-1]].transform("nunique") if len(columns) > 1 else \
        pd.Series(of[columns[0]].nunique(), index=of.index)
    of = of[inner > 1]
    out = {}
    for value, ids in of.groupby(columns if len(columns) > 1 else columns[0]).groups.items():
        ids = set(ids)
        name = ".".join(value) if isinstance(value, tuple) else value
        out[name] = {selector: truth.score({sid: c for sid, c in chosen.items() if sid in ids})
                     for selector, chosen in choices.items()}
    return out


def scores_by_dtype(df: pd.DataFrame, choices: dict[str, dict[str, str]]) -> dict[str, pd.DataFrame]:
    """Comparison tables of `choices` ({selector: {scenario_id: schedule}}) on the labeled
    dataset `df`, with the ``ceiling`` row: one over every scenario (``all``) and one per
    dtype and one per operator where there are several (``ficco select --truth``). Scenarios
    without usable rows in `df` are left out of every row; ValueError where a scenario lacks
    some of its candidates (``ficco_select.train.metrics.require_every_candidate``)."""
    require_every_candidate(df)
    ok = usable_rows(df)
    choices = {**choices, "ceiling": ceiling_choices(ok)}
    truth = Truths.of(ok)
    pooled = {"all": {name: truth.score(chosen) for name, chosen in choices.items()},
              **_pooled_by(ok, choices, ["dtype"], truth), **_pooled_by(ok, choices, ["op"], truth)}
    return {name: comparison_table(by_selector) for name, by_selector in pooled.items()}


def choices_table(df: pd.DataFrame, results: dict) -> pd.DataFrame:
    """One row per (split, selector, scenario): chosen and best schedule, regret, and the
    scenario's tokens and compute/communication ratio (for the report's plots)."""
    ok = usable_rows(df)
    ok = ok.assign(time_s=true_times(ok))  # regret on the truth, as the tables score it
    best = ok.loc[ok.groupby("scenario_id")["time_s"].idxmin(),
                  ["scenario_id", "schedule", "time_s", "op", "m", "hardware", "group", "t_comp_s", "t_comm_s"]]
    best = best.rename(columns={"schedule": "best", "time_s": "best_time_s"})
    picks = pd.DataFrame([(split, name, sid, schedule)
                          for split, by_selector in results["choices"].items()
                          for name, chosen in by_selector.items() for sid, schedule in chosen.items()],
                         columns=["split", "selector", "scenario_id", "chosen"])
    picks = picks.merge(ok[["scenario_id", "schedule", "time_s"]].rename(columns={"schedule": "chosen"}),
                        on=["scenario_id", "chosen"], how="left").merge(best, on="scenario_id", how="left")
    picks["regret"] = picks["time_s"] / picks["best_time_s"]
    picks["comp_comm_ratio"] = picks["t_comp_s"] / picks["t_comm_s"]
    return picks.drop(columns=["time_s", "best_time_s", "t_comp_s", "t_comm_s"])


def _mean_over_folds(per_fold: dict) -> dict:
    """Scenario-weighted mean of each metric over folds (worst_regret: the max)."""
    selectors = next(iter(per_fold.values())).keys()
    out = {}
    for name in selectors:
        rows = [fold[name] for fold in per_fold.values()]
        weights = np.array([r["n"] for r in rows], dtype=float)
        agg = {}
        for metric in METRICS:
            values = np.array([r[metric] for r in rows], dtype=float)
            if metric == "n":
                agg[metric] = int(values.sum())
            elif metric == "worst_regret":
                agg[metric] = float(np.nanmax(values))
            else:
                agg[metric] = float(np.nansum(values * weights) / weights.sum())
        out[name] = agg
    return out


PER_OP_SETTINGS = ("sim.bfloat16.", "cpu.float32.")
"""The settings whose tables come per operator too (``family.sim.bfloat16.gemm_ar``): what
jobs run on the GPUs, and the measured cpu rows."""

HEADLINE = ("family", "sim.bfloat16")
"""The headline table: unseen model families in bfloat16 on the GPU machines (what LLM jobs run)."""


def tables(results: dict) -> dict[str, pd.DataFrame]:
    """One comparison table (selectors x metrics) per split; where the data mix backends, one
    more per split and backend, named ``<split>.<backend>`` (e.g. ``family.cpu``); where a
    backend's rows mix dtypes, one per split, backend and dtype (``family.sim.bfloat16``); and
    for ``PER_OP_SETTINGS``, one per operator (``family.sim.bfloat16.gemm_ar``).
    The headline table (``HEADLINE``) comes first when the data have it."""
    out = {}
    for split, block in results["splits"].items():
        out[split] = comparison_table(block["mean"])
        for group in ("by_backend", "by_dtype", "by_op"):
            for value, by_selector in block.get(group, {}).items():
                out[f"{split}.{value}"] = comparison_table(by_selector)
    headline = ".".join(HEADLINE)
    return {headline: out.pop(headline), **out} if headline in out else out
