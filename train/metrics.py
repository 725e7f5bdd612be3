"""Selector quality: how good are a selector's chosen schedules against the truth?

A dataset (see ``ficco_select.data.dataset``) has one row per (scenario, schedule). Only *usable* rows
count: ``status == "ok"``, ``verified == True`` and a finite positive ``time_s``.
Choices are scored against each row's *true* time (``true_times``): a simulated row's
noise-free ``time_model_s``; a measured row's ``time_repeat_s`` where an independent
second sweep timed it (``ficco_select.data.dataset.attach_repeat``), else its own ``time_s``.
Selectors learn from ``time_s``, the labels; they are judged on the truth. For a
scenario ``s``:

- the oracle time ``t*(s)`` is the smallest true time over its usable rows;
- the baseline time ``t_b(s)`` is the true time of its baseline (``none.sm``; the fastest
  ``none.*`` without one);
- ``t(c)`` is the time of the chosen schedule ``c``. A choice that is not a usable row of
  the scenario (unknown name, unverified, failed) is *invalid* and is scored as if the
  baseline had been chosen: ``t(c) = t_b(s)`` and its ``near_best`` flag is the baseline's,
  because at run time an unusable choice falls back to the baseline.

``score`` returns, over the scored scenarios (``n`` of them):

- ``top1``: fraction where the choice is the fastest verified schedule, ties counted as
  hits: ``t(c) <= t*`` or, on a measured row, the chosen row has ``near_best`` (within
  measurement noise; a noise-free simulated time has no ties).
- ``near_opt_2`` / ``near_opt_5``: fraction with ``t(c) <= 1.02 t*`` / ``<= 1.05 t*``.
- ``oracle_capture``: geometric mean of ``t* / t(c)``; 1 is perfect, in (0, 1].
- ``worst_regret``: max of ``t(c) / t*``; 1 is perfect, >= 1.
- ``mean_regret``: arithmetic mean of ``t(c) / t* - 1``; 0 is perfect.
- ``slower_than_baseline``: fraction with ``t(c) > t_b`` (strictly): the selector hurt.
- ``speedup``: geometric mean of ``t_b / t(c)``, the selector's gain over the baseline.
- ``oracle_speedup``: geometric mean of ``t_b / t*``, the best gain any selector can get.
- ``invalid``: fraction of choices that are not a usable row of their scenario.

A truth must time every candidate of a scenario it scores (``require_every_candidate``):
scored on the schedules that are there, a choice would be judged against a best that may
not be the scenario's best. With ``n == 0`` every metric but ``n`` is NaN. ``ceiling_choices`` gives what a perfect
selector picks from these labels (the *ceiling* row of every table): the noise-free best
of a simulated scenario (it scores 1), the measured best of a measured one, which scored
on a repeat sweep is the repeat oracle (below 1 by the measurement's own noise).
``comparison_table``/``format_table`` put several selectors' results side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pandas as pd

from ficco_select.scenario import SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import TIE, engine_candidates

NEAR_OPT = 1 + TIE
"""A choice within this factor of the best is near-best (``near_opt_2``); the shipped policy's
rules are fitted to the same tolerance (``ficco_select.train.shipped``)."""
METRICS: tuple[str, ...] = ("n", "top1", "near_opt_2", "near_opt_5", "oracle_capture", "worst_regret",
                            "mean_regret", "slower_than_baseline", "speedup", "oracle_speedup", "invalid")
"""The keys ``score`` returns, in the column order of ``comparison_table``."""

BASELINE_PREFIX = "none."
"""Every baseline (no overlap) schedule name starts with this."""
BASELINE_NAME = "none.sm"
"""The baseline proper: the framework's own collective, then the GEMM."""


def true_times(df: pd.DataFrame) -> pd.Series:
    """Each row's true time: ``time_model_s`` (sim), else ``time_repeat_s`` (a measured row a
    second sweep timed), else ``time_s``. Shape (len(df),), float."""
    truth = pd.to_numeric(df["time_s"], errors="coerce").astype(float)
    for col in ("time_repeat_s", "time_model_s"):  # later wins
        if col in df.columns:
            other = pd.to_numeric(df[col], errors="coerce").astype(float)
            truth = other.where(np.isfinite(other) & (other > 0), truth)
    return truth


def has_model_truth(df: pd.DataFrame) -> pd.Series:
    """Rows whose truth is a noise-free model time (no ties there). Shape (len(df),), bool."""
    if "time_model_s" not in df.columns:
        return pd.Series(False, index=df.index)
    t = pd.to_numeric(df["time_model_s"], errors="coerce")
    return np.isfinite(t) & (t > 0)


def usable_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Rows that may be scored: ok, verified, finite positive time. Shape (<= len(df), same columns)."""
    time = pd.to_numeric(df["time_s"], errors="coerce")
    mask = df["status"].eq("ok") & df["verified"].eq(True) & np.isfinite(time) & (time > 0)
    return df.loc[mask]


def lacking_schedules(df: pd.DataFrame) -> dict[str, tuple[list[str], int]]:
    """scenario_id -> (the candidates it has no row for, its number of candidates), for each
    scenario with usable rows that lacks some. A scenario's candidates are the legal
    schedules of its op, world size and machine on its backend: what ``ficco measure`` and
    ``ficco simulate`` time (``ficco_select.data.dataset.validate`` holds a dataset to the same). A row
    that is no scenario, or of an unknown backend, is left to ``validate``."""
    from ficco_select.data.dataset import row_hardware_problem

    scored = df[df["scenario_id"].isin(set(usable_rows(df)["scenario_id"]))]
    have = scored.groupby("scenario_id", sort=False)["schedule"].agg(set)
    out = {}
    for record in scored.drop_duplicates("scenario_id").to_dict("records"):
        try:
            scenario = Scenario.from_record({c: record[c] for c in SCENARIO_COLUMNS})
            engines = row_hardware_problem(scenario, record["backend"])[1]
            expected = [c.name for c in engine_candidates(scenario, record["backend"], engines)]
        except (ValueError, KeyError):
            continue
        lacking = [name for name in expected if name not in have[record["scenario_id"]]]
        if lacking:
            out[record["scenario_id"]] = (lacking, len(expected))
    return out


def require_every_candidate(df: pd.DataFrame) -> None:
    """ValueError where a scenario to be scored lacks some of its candidates
    (``lacking_schedules``): how many scenarios, how many schedules at most, one example."""
    lacking = lacking_schedules(df)
    if not lacking:
        return
    scenarios = df.loc[df["scenario_id"].isin(set(usable_rows(df)["scenario_id"])), "scenario_id"].nunique()
    sid, (names, of) = next(iter(lacking.items()))
    most = max(lacking.values(), key=lambda entry: len(entry[0]))
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ValueError(f"{len(lacking)} of {scenarios} scenarios lack candidate schedules (up to {len(most[0])} of "
                     f"{most[1]}; e.g. scenario {sid!r} lacks {len(names)} of {of}: {shown}); scored on what is "
                     "there, a choice would be judged against a best that may not be the best: give a dataset "
                     "that times every candidate (`ficco measure`, `ficco simulate`)")


def _fastest(rows: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """One row per `key` value: the fastest, ties broken by schedule name."""
    return (rows.sort_values([*key, "time_s", "schedule"], kind="mergesort")
            .drop_duplicates(key, keep="first"))


def _geomean(x: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(x))))


def score(df: pd.DataFrame, chosen: Mapping[str, str]) -> dict[str, float]:
    """Score the choices ``chosen`` (scenario_id -> schedule name) against the dataset ``df``.

    Only scenarios in ``chosen`` are scored. Returns ``{metric: value}`` for the keys in
    ``METRICS`` (see the module docstring); ``n`` is the number of scenarios scored.
    Raises ValueError naming a scenario of ``chosen`` that has no usable rows (unknown id,
    failed, nothing verified) or no usable baseline (``none.*``) row. To score many choices
    on one dataset, make its ``Truths`` once.
    """
    u = usable_rows(df)
    return Truths.of(u.loc[u["scenario_id"].isin(list(chosen))]).score(chosen)


class Truths:
    """The truth of every usable scenario of a dataset, read once, to score many choices on:
    one row per (scenario, schedule) with its true time and near-tie flag, the oracle time
    and the baseline row per scenario. A scenario's truth depends on its own rows only, so
    scoring a subset of scenarios here equals ``score`` on that subset's rows."""

    def __init__(self, rows: pd.DataFrame, best: pd.Series, base: pd.DataFrame) -> None:
        self.rows, self.best, self.base = rows, best, base

    @classmethod
    def of(cls, df: pd.DataFrame) -> "Truths":
        u = usable_rows(df)
        # Scored on the truth: time_s below is the true time; ties are the truth's own (a repeat
        # sweep's labels where it timed the row; none for a noise-free model time).
        near = u["near_best"].eq(True)
        if {"near_best_repeat", "time_repeat_s"} <= set(u.columns):
            near = near.where(pd.to_numeric(u["time_repeat_s"], errors="coerce").isna(),
                              u["near_best_repeat"].eq(True))
        u = pd.DataFrame({"scenario_id": u["scenario_id"].to_numpy(object), "schedule": u["schedule"].to_numpy(object),
                          "time_s": true_times(u).to_numpy(float),
                          "near_best": (near & ~has_model_truth(u)).to_numpy(bool)})
        best = u.groupby("scenario_id", sort=False)["time_s"].min()
        # The baseline is what a framework runs: none.sm; the fastest none.* if there is no none.sm.
        nones = u[u["schedule"].str.startswith(BASELINE_PREFIX)]
        nones = nones.assign(_rank=(nones["schedule"] != BASELINE_NAME).astype(int))
        base = (nones.sort_values(["scenario_id", "_rank", "time_s", "schedule"], kind="mergesort")
                .drop_duplicates(["scenario_id"]).set_index("scenario_id"))
        rows = _fastest(u, ["scenario_id", "schedule"]).set_index(["scenario_id", "schedule"])
        return cls(rows, best, base)

    def score(self, chosen: Mapping[str, str]) -> dict[str, float]:
        """``score`` of `chosen` on these truths (ValueError as ``score`` raises)."""
        ids = list(chosen.keys())
        if not ids:
            return {m: (0 if m == "n" else float("nan")) for m in METRICS}
        ts = self.best.reindex(ids).to_numpy(float)                   # (n,) oracle time
        _refuse_missing(ids, np.isnan(ts), "no usable (ok and verified) rows")
        base = self.base.reindex(ids)
        tb = base["time_s"].to_numpy(float)                           # (n,) baseline time
        _refuse_missing(ids, np.isnan(tb), f"no usable baseline ({BASELINE_PREFIX}*) row")
        picks = self.rows.reindex(pd.MultiIndex.from_arrays([np.array(ids, object),
                                                             np.array(list(chosen.values()), object)]))
        invalid = picks["time_s"].isna().to_numpy()                   # (n,) bool
        t = np.where(invalid, tb, picks["time_s"].to_numpy(float))    # (n,) chosen time
        nb = np.where(invalid, base["near_best"].eq(True).to_numpy(),
                      picks["near_best"].eq(True).to_numpy())         # (n,) chosen is a near-tie

        regret = t / ts
        return {
            "n": len(ids),
            "top1": float(np.mean((t <= ts) | nb)),
            "near_opt_2": float(np.mean(t <= NEAR_OPT * ts)),
            "near_opt_5": float(np.mean(t <= 1.05 * ts)),
            "oracle_capture": _geomean(ts / t),
            "worst_regret": float(np.max(regret)),
            "mean_regret": float(np.mean(regret - 1.0)),
            "slower_than_baseline": float(np.mean(t > tb)),
            "speedup": _geomean(tb / t),
            "oracle_speedup": _geomean(tb / ts),
            "invalid": float(np.mean(invalid)),
        }


def _refuse_missing(ids: list[str], missing: np.ndarray, what: str) -> None:
    if missing.any():
        names = [s for s, m in zip(ids, missing) if m]
        raise ValueError(f"{what} for scenario(s) {names[:5]}{' ...' if len(names) > 5 else ''}")


def capture_scorer(df: pd.DataFrame) -> Callable[[Mapping[str, str]], float]:
    """``score(df, chosen)["oracle_capture"]`` for many `chosen` over every scenario of `df`
    (e.g. a grid search), the truths computed once. Raises as ``score`` does."""
    truth = Truths.of(df)
    ids = list(truth.best.index)
    ts = truth.best.to_numpy(float)
    tb = truth.base["time_s"].reindex(ids).to_numpy(float)
    _refuse_missing(ids, np.isnan(tb), f"no usable baseline ({BASELINE_PREFIX}*) row")
    time_of = dict(zip(truth.rows.index, truth.rows["time_s"].to_numpy(float)))

    def capture(chosen: Mapping[str, str]) -> float:
        t = np.array([time_of.get((sid, chosen.get(sid)), b) for sid, b in zip(ids, tb)])  # invalid: baseline
        return _geomean(ts / t)

    return capture


def oracle_choices(df: pd.DataFrame) -> dict[str, str]:
    """scenario_id -> its fastest usable schedule by the labels (``time_s``), ties broken by
    schedule name. Scenarios without usable rows are left out. Keys in scenario_id order.
    """
    best = _fastest(usable_rows(df)[["scenario_id", "schedule", "time_s"]], ["scenario_id"])
    return dict(zip(best["scenario_id"], best["schedule"]))


def ceiling_choices(df: pd.DataFrame) -> dict[str, str]:
    """What a perfect selector picks from these labels: per scenario the fastest usable
    schedule by its noise-free model time where it has one (sim), else by its measured
    ``time_s`` (scored on a repeat sweep, that is the repeat oracle)."""
    u = usable_rows(df)
    model = pd.to_numeric(u["time_model_s"], errors="coerce") if "time_model_s" in u.columns else None
    key = u["time_s"].astype(float) if model is None else model.where(has_model_truth(u), u["time_s"]).astype(float)
    best = _fastest(pd.DataFrame({"scenario_id": u["scenario_id"], "schedule": u["schedule"], "time_s": key}),
                    ["scenario_id"])
    return dict(zip(best["scenario_id"], best["schedule"]))


def comparison_table(results: Mapping[str, Mapping[str, float]]) -> pd.DataFrame:
    """Selectors side by side: one row per selector (in the given order), columns ``METRICS``.

    ``results`` maps selector name -> ``score`` output; a missing metric is NaN, extra keys
    are dropped.
    """
    table = pd.DataFrame([[r.get(m, np.nan) for m in METRICS] for r in results.values()],
                         index=pd.Index(list(results.keys()), name="selector"), columns=list(METRICS),
                         dtype=float)
    if table["n"].notna().all():
        table["n"] = table["n"].astype(int)
    return table


def format_table(df: pd.DataFrame) -> str:
    """Plain-text rendering of a ``comparison_table`` with 3 decimals."""
    return df.to_string(float_format=lambda x: f"{x:.3f}")

