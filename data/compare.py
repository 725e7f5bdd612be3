"""Two independent sweeps of the same scenarios, compared: do the labels repeat?

``compare(a, b)`` takes two datasets (``ficco_select.data.dataset`` schema) and, over the scenarios
both measured (ok, with a verified baseline and at least two verified schedules in each):

- ``tau``: Kendall's tau between the two sweeps' schedule times (1: same order);
- ``best_agrees``: A's fastest schedule is a tie of B's best (``near_best`` in B) *and*
  B's fastest is a tie of A's best: the label "which schedule is best" repeats;
- ``repeat_capture``: B's best time / B's time of A's best (1: A's pick is B's best too);
  its geometric mean over scenarios is the repeat oracle's capture, the ceiling of any
  selector trained on A and judged on B;
- ``spread_a`` / ``spread_b``: the median repetition spread (IQR / median) of its rows;
- ``above_ideal_a`` / ``_b``: the best schedule's speedup over the baseline exceeds the
  ideal (T_comp + T_comm) / max(T_comp, T_comm) by more than the larger of the two
  rows' spreads: a speedup physics does not allow, so a timing artefact.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ficco_select.schedule import TIE

BASELINE = "none.sm"


def _usable(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["status"] == "ok") & df["verified"].eq(True)]


def _above_ideal(g: pd.DataFrame) -> bool:
    best = g.loc[g["time_s"].idxmin()]
    base = g[g["schedule"] == BASELINE].iloc[0]
    ideal = float(best["ideal_speedup"])
    speedup = float(base["time_s"]) / float(best["time_s"])
    return bool(speedup > ideal * (1 + max(float(best["time_spread"]), float(base["time_spread"]))))


def compare(a: pd.DataFrame, b: pd.DataFrame) -> tuple[dict, pd.DataFrame]:
    """(summary, per-scenario table) of sweeps `a` and `b`; see the module docstring."""
    ua, ub = _usable(a), _usable(b)
    rows = []
    for sid, ga in ua.groupby("scenario_id", sort=False):
        gb = ub[ub["scenario_id"] == sid]
        common = sorted(set(ga["schedule"]) & set(gb["schedule"]))
        if len(common) < 2 or BASELINE not in common:
            continue
        ga = ga.set_index("schedule").loc[common].reset_index()
        gb = gb.set_index("schedule").loc[common].reset_index()
        ta, tb = ga["time_s"].astype(float), gb["time_s"].astype(float)
        best_a, best_b = ga.loc[ta.idxmin(), "schedule"], gb.loc[tb.idxmin(), "schedule"]
        tau = ta.corr(tb, method="kendall")
        first = ga.iloc[0]
        rows.append({
            "scenario_id": sid, "op": first["op"], "world_size": int(first["world_size"]),
            "m": int(first["m"]), "n": int(first["n"]), "k": int(first["k"]), "schedules": len(common),
            "tau": float(tau) if tau == tau else math.nan,
            "best_a": best_a, "best_b": best_b,
            "best_agrees": bool(gb.set_index("schedule").at[best_a, "near_best"]
                                and ga.set_index("schedule").at[best_b, "near_best"]),
            "repeat_capture": float(tb.min() / gb.set_index("schedule").at[best_a, "time_s"]),
            "spread_a": float(ga["time_spread"].median()), "spread_b": float(gb["time_spread"].median()),
            "above_ideal_a": _above_ideal(ga), "above_ideal_b": _above_ideal(gb),
        })
    per = pd.DataFrame(rows)
    if per.empty:
        raise ValueError("no scenario is measured (ok, a verified baseline and another verified schedule) in "
                         "both sweeps; nothing to compare")
    return summarize(per), per


def summarize(per: pd.DataFrame) -> dict:
    """Medians and shares of the per-scenario table, overall and per world size."""
    def block(p: pd.DataFrame) -> dict:
        return {
            "scenarios": len(p),
            "median_tau": _r(p["tau"].median()),
            "best_agreement": _r(p["best_agrees"].mean()),
            "repeat_capture": _r(np.exp(np.log(p["repeat_capture"]).mean())),
            "repeat_near_opt_2": _r((p["repeat_capture"] >= 1 / (1 + TIE)).mean()),
            "median_spread": _r(pd.concat([p["spread_a"], p["spread_b"]]).median()),
            "above_ideal": _r(pd.concat([p["above_ideal_a"], p["above_ideal_b"]]).mean()),
        }

    return {**block(per), "by_world_size": {int(P): block(g) for P, g in per.groupby("world_size")}}


def _r(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)
