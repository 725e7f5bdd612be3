"""One round of ``ficco adapt`` (the rounds stage): which scenarios to measure next, the
model refitted on what was measured, its predictions and the round's scores.

``choose`` takes the next scenarios: the ``active`` rule (``active_priority``) those where
the model is least sure (the smallest predicted gap between its two best schedules),
scenarios where it disagrees with the simulator on the current spec first, spread over the
``strata`` of operator, world size and size; ``random`` draws them (the reference).
``measure_chosen`` measures them on the machine; ``refit`` makes the machine believe the
recalibrated spec and refits the model (``fit_model``) on the training rows
(``usable_base``) plus the measured ones; ``finished_round`` scores the model on the
scenarios not measured, beside the simulator's pick and the ceiling.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ficco_select.data.calibrate import recalibrate
from ficco_select.data.machines import base_machine
from ficco_select.data.simulate import simulate_rows
from ficco_select.hardware import HardwareSpec, spec_as_dict
from ficco_select.runtime.decision import SINGLE_CANDIDATE_MARGIN, pick_with_margin
from ficco_select.scenario import Scenario
from ficco_select.train.adapt.machines import Machine
from ficco_select.train.adapt.state import Round
from ficco_select.train.metrics import ceiling_choices, score, usable_rows
from ficco_select.train.selectors import FEATURE_COLUMNS, XGBTimeRegressor, feature_pairs, with_features

STRATEGIES = ("active", "random")


def check_plan(strategy: str, checkpoints: Sequence[float]) -> None:
    """Refuse a strategy that is not one of ``STRATEGIES`` or checkpoints that do not ascend
    within [0, 1]."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if list(checkpoints) != sorted(checkpoints) or not all(0 <= c <= 1 for c in checkpoints):
        raise ValueError(f"checkpoints must ascend within [0, 1], got {list(checkpoints)}")


def adapted_model(debug: bool = False) -> XGBTimeRegressor:
    """The model refitted each round: the pipeline champion's (100 trees, rate 0.12); `debug`:
    the pipeline's debug one (20 trees, rate 0.3: a rehearsal's, whose numbers mean nothing)."""
    if debug:
        return XGBTimeRegressor(n_estimators=20, learning_rate=0.3)
    return XGBTimeRegressor(n_estimators=100, learning_rate=0.12)


# -- which scenarios next -------------------------------------------------------------------
def strata(scenarios: Sequence[Scenario]) -> list[tuple]:
    """Each scenario's stratum: operator, world size, and the octave band of its per-rank
    FLOPs (4 octaves wide), so that a round's picks spread over kinds and sizes."""
    return [(s.op, s.world_size, int(math.log2(max(s.busiest_rank_gflop(), 1e-9) * 1e9) // 4)) for s in scenarios]


def choose(ids: Sequence[str], groups: Sequence, k: int, *, measured: set[str], priority: Sequence[float] | None,
           seed: int = 0) -> list[str]:
    """`k` scenario ids to measure next among `ids` not in `measured`.

    `priority` (lower first, one per id): the active rule, taken round-robin over the
    strata `groups` (one per id) so every stratum gives its most uncertain scenario before
    any gives a second; None: a uniform random draw (`seed`). Never an id in `measured`,
    never one twice, at most what is left."""
    left = [i for i, sid in enumerate(ids) if sid not in measured]
    k = min(k, len(left))
    if k <= 0:
        return []
    if priority is None:
        picks = np.random.default_rng(seed).choice(len(left), size=k, replace=False)
        return [ids[left[j]] for j in sorted(picks)]
    by_stratum: dict = {}
    for i in sorted(left, key=lambda i: (priority[i], ids[i])):
        by_stratum.setdefault(groups[i], []).append(i)
    queues = sorted(by_stratum.values(), key=lambda q: (priority[q[0]], ids[q[0]]))
    out: list[str] = []
    while len(out) < k:
        for q in queues:
            if q and len(out) < k:
                out.append(ids[q.pop(0)])
    return out


def active_priority(model: XGBTimeRegressor, candidates: pd.DataFrame, ids: Sequence[str]) -> list[tuple]:
    """The active rule's priority of each of `ids` (lower first): whether the model's pick
    agrees with the simulator's on the believed spec (disagreeing first), then its margin."""
    pred = predictions(model, candidates)
    physics = candidates.sort_values(["scenario_id", "time_s", "schedule"]).groupby("scenario_id").first()
    agree = (pred["pick"] == physics["schedule"].reindex(pred.index)).astype(float)
    return [(agree.get(sid, 1.0), pred["margin"].get(sid, SINGLE_CANDIDATE_MARGIN)) for sid in ids]


# -- measuring and refitting ----------------------------------------------------------------
def measured_ids(measured: pd.DataFrame) -> set[str]:
    """The scenarios measured so far."""
    return set(measured["scenario_id"]) if len(measured) else set()


def measure_chosen(machine: Machine, chosen: Sequence[str], measured: pd.DataFrame) -> pd.DataFrame:
    """`measured` plus the rows of the `chosen` scenarios measured on `machine` (without
    feature columns: the features follow the spec, which the next fit recalibrates)."""
    by_id = {s.scenario_id: s for s in machine.grid}
    new = machine.measure([by_id[sid] for sid in chosen])
    measured = pd.concat([measured, new], ignore_index=True) if len(measured) else new
    return measured.drop(columns=[c for c in FEATURE_COLUMNS if c in measured.columns])


def usable_base(df: pd.DataFrame, machine: str) -> pd.DataFrame:
    """The training rows without `machine` and the machines sampled around it (its preset's
    family): the start must not have seen the machine."""
    base = df["hardware"].map({h: base_machine(h) for h in set(df["hardware"])})
    return usable_rows(df[base != base_machine(machine)]).reset_index(drop=True)


def fit_model(base: pd.DataFrame, measured: pd.DataFrame, debug: bool = False) -> XGBTimeRegressor:
    rows = pd.concat([base, with_features(measured)], ignore_index=True) if len(measured) else base
    return adapted_model(debug).fit(rows)


def candidate_rows(machine: Machine) -> pd.DataFrame:
    """Every grid scenario's legal schedules on the believed spec (the rows to predict on),
    with the simulator's pick there (time_s: the spec's model time)."""
    rows = simulate_rows(machine.grid, machine.spec)
    return rows.assign(status="ok", verified=True)


def checked_spec(machine: Machine, start: HardwareSpec, base: pd.DataFrame, measured: pd.DataFrame,
                 folds: int = 2, debug: bool = False) -> HardwareSpec:
    """`start` recalibrated to the rows `measured` (``ficco_select.data.calibrate.recalibrate``) where the
    adapted model picks better with it, else `start`. The spec is what the model reads the
    machine by, so a fit that predicts times better can still mislead it: the training data's
    other measured machines carry specs of another making (a fabric's is its quick profile,
    which its own rows put 2.8x lower), and a few scenarios chosen where the model is least
    sure are no fair sample. Cross-fitted over `folds` groups of the measured scenarios: the
    model refitted on the others under each spec picks for the group's scenarios, and the
    capture of their measured best (summed) decides; a tie keeps `start`. With fewer than two
    scenarios per group nothing can be judged: `start`."""
    fitted = recalibrate(start, measured)
    ok = measured[(measured["status"] == "ok") & measured["verified"].astype(bool)]
    ids = sorted(ok["scenario_id"].unique(), key=lambda sid: zlib.crc32(str(sid).encode()))
    if fitted is start or len(ids) < 2 * folds:
        return start
    group = ok["scenario_id"].map({sid: i % folds for i, sid in enumerate(ids)}).to_numpy()
    by_id = {s.scenario_id: s for s in machine.grid}
    splits = []  # per fold: the rows to fit on, the held-out scenarios, their times and best times
    for g in range(folds):
        held = ok[group == g]
        splits.append((measured[measured["scenario_id"].isin(ok["scenario_id"][group != g])],
                       [by_id[sid] for sid in held["scenario_id"].unique()],
                       held.set_index(["scenario_id", "schedule"])["time_s"].astype(float),
                       held.groupby("scenario_id")["time_s"].min().astype(float)))
    capture = {}
    for name, spec in (("start", start), ("fitted", fitted)):
        machine.believe(spec)
        capture[name] = 0.0
        for fit_on, scenarios, times, best in splits:
            rows = simulate_rows(scenarios, machine.spec).assign(status="ok", verified=True)
            picks = predictions(fit_model(base, fit_on, debug), rows)["pick"]
            capture[name] += sum(best[sid] / times.get((sid, pick), np.inf) for sid, pick in picks.items())
    machine.believe(start)
    return fitted if capture["fitted"] > capture["start"] + 1e-9 else start


def refit(machine: Machine, spec: HardwareSpec, base: pd.DataFrame, measured: pd.DataFrame, debug: bool = False
          ) -> tuple[XGBTimeRegressor, pd.DataFrame]:
    """`machine` believes `spec` from now on; the model refitted on `base` plus `measured`
    (``adapted_model``), and the rows to predict on (``candidate_rows``) on that spec."""
    machine.believe(spec)
    return fit_model(base, measured, debug), candidate_rows(machine)


# -- predictions and scores -----------------------------------------------------------------
def predictions(model: XGBTimeRegressor, grid_rows: pd.DataFrame) -> pd.DataFrame:
    """Per scenario of `grid_rows`: the model's pick and its margin (second-best minus best
    predicted log time)."""
    ok, X = feature_pairs(grid_rows)
    names = ok["schedule"].to_numpy(str)
    at, margin = pick_with_margin(model.model_.predict(X), names, ok["scenario_id"].to_numpy())
    return pd.DataFrame({"pick": names[at], "margin": margin},
                        index=pd.Index(ok["scenario_id"].to_numpy()[at], name="sid")).sort_index()


def round_scores(model: XGBTimeRegressor, candidates: pd.DataFrame, machine: Machine, measured: set[str]) -> dict:
    """The model's picks on the scenarios not measured, scored against the machine's truth
    (an empty dict without one)."""
    if machine.truth is None:
        return {}
    rest = candidates[~candidates["scenario_id"].isin(measured)]
    if rest.empty:
        return {}
    picks = predictions(model, rest)["pick"].to_dict()
    physics = rest.sort_values(["scenario_id", "time_s", "schedule"]).groupby("scenario_id")["schedule"].first()
    truth = machine.truth[machine.truth["scenario_id"].isin(picks)]
    return {**score(truth, picks), "simulator": score(truth, physics.to_dict()),
            "ceiling": score(truth, ceiling_choices(truth))}


def finished_round(model: XGBTimeRegressor, candidates: pd.DataFrame, machine: Machine, measured: pd.DataFrame,
                   target: float, chosen: list[str]) -> Round:
    """The round that measured `chosen` for the checkpoint `target`: the scenarios measured so
    far, the spec the machine believes after it, and its scores."""
    scores = round_scores(model, candidates, machine, measured_ids(measured))
    return Round(measured=int(measured["scenario_id"].nunique()) if len(measured) else 0,
                 fraction=target, chosen=chosen, spec=spec_as_dict(machine.spec), scores=scores)
