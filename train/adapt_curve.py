"""The learning curve of ``ficco adapt`` (``benchmarks/adapt_curve.py``): every GPU preset
held out in turn, a machine whose numbers are the preset's perturbed, adapted at several
budgets by the active and the random choice, beside a full retrain."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select.data.calibrate import recalibrate
from ficco_select.scenario import Scenario
from ficco_select.train.adapt import (
    STRATEGIES,
    Machine,
    adapt,
    candidate_rows,
    fit_model,
    perturbed,
    predictions,
    sim_machine,
    summary_curve,
    usable_base,
)
from ficco_select.train.metrics import score

CURVE_CHECKPOINTS = (0.0, 0.02, 0.05, 0.10, 0.20)
FULL_FOLDS = 5


def full_retrain(machine: Machine, base: pd.DataFrame, *, seed: int = 0) -> dict:
    """The reference of measuring everything: the machine's whole grid measured, then
    ``FULL_FOLDS``-fold cross-fitting (recalibrate and refit on the other folds, score the
    held-out fold); the folds' picks pooled into one score. 80% of the grid measured."""
    start = machine.spec
    ids = [s.scenario_id for s in machine.grid]
    everything = machine.measure(machine.grid)
    fold = np.random.default_rng(seed).permutation(len(ids)) % FULL_FOLDS
    picks: dict[str, str] = {}
    for f in range(FULL_FOLDS):
        train_ids = {sid for sid, g in zip(ids, fold) if g != f}
        measured = everything[everything["scenario_id"].isin(train_ids)]
        machine.spec = dataclasses.replace(recalibrate(start, measured), name=machine.name)
        with machine.known():
            model = fit_model(base, measured)
            rest = candidate_rows(machine)
        rest = rest[~rest["scenario_id"].isin(train_ids)]
        picks.update(predictions(model, rest)["pick"].to_dict())
    machine.spec = start
    return score(machine.truth, picks)


def learning_curve(df: pd.DataFrame, presets: Sequence[str], *, spread: float = 1.3, seed: int = 0,
                   checkpoints: Sequence[float] = CURVE_CHECKPOINTS, world_sizes=(2, 4, 8),
                   progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """For each preset: a machine whose true numbers are the preset's perturbed by up to
    `spread` (``perturbed``), adapted from the preset's own spec and a model trained on `df`
    without that preset's family; near-opt@2% (and the simulator's on the adapted spec) on
    the grid's unmeasured rest at each checkpoint, for the active and the random choice,
    and the full retrain's. One row per (preset, strategy, fraction)."""
    from ficco_select.data.catalog import catalog
    from ficco_select.hardware import load_hardware

    rows = []
    for i, preset in enumerate(presets):
        spec = load_hardware(preset)
        name = f"{preset}-new"
        truth = perturbed(spec, name, spread=spread, seed=seed + i)
        grid = [Scenario.from_record(r) for r in catalog("full", hardware=preset, world_sizes=world_sizes)]
        base = usable_base(df, preset)
        for strategy in STRATEGIES:
            machine = sim_machine(name, spec, truth, grid, seed=seed + i)
            for r in adapt(machine, base, checkpoints=checkpoints, strategy=strategy, seed=seed + i):
                rows.append({"preset": preset, "strategy": strategy, "fraction": r.fraction, "measured": r.measured,
                             "near_opt_2": r.scores["near_opt_2"], "speedup": r.scores["speedup"],
                             "simulator_near_opt_2": r.scores["simulator"]["near_opt_2"]})
            if progress is not None:
                progress(f"{preset} {strategy} done")
        full = full_retrain(sim_machine(name, spec, truth, grid, seed=seed + i), base, seed=seed + i)
        rows.append({"preset": preset, "strategy": "full", "fraction": 1 - 1 / FULL_FOLDS,
                     "measured": round(len(grid) * (1 - 1 / FULL_FOLDS)), "near_opt_2": full["near_opt_2"],
                     "speedup": full["speedup"], "simulator_near_opt_2": float("nan")})
        if progress is not None:
            progress(f"{preset} full retrain done")
    return pd.DataFrame(rows)


def curve_from_runs(folders: Sequence[str | Path]) -> pd.DataFrame:
    """The rounds of finished ``ficco adapt`` runs (their output folders' ``summary.json``) as
    curve rows (``summary_curve``); ValueError naming a folder without a summary or a round
    without a score (a machine without a truth to score against)."""
    curves = []
    for folder in folders:
        path = Path(folder) / "summary.json"
        if not path.exists():
            raise ValueError(f"{path}: no such file (not a finished `ficco adapt` output folder)")
        summary = json.loads(path.read_text())
        for r in summary["rounds"]:
            if "near_opt_2" not in r:
                raise ValueError(f"{path}: round at {r['fraction']} has no score (a machine without a truth)")
        curves.append(summary_curve(summary))
    return pd.concat(curves, ignore_index=True)
