"""A dataset's summary (``ficco dataset info``): its scenarios, how often each schedule is
fastest, speedups over the baseline, measurement noise and provenance.
"""

from __future__ import annotations

import math

import pandas as pd

from ficco_select.data.dataset import COLUMNS, DatasetError

def info(df: pd.DataFrame) -> dict:
    """Summary: scenarios, how often each schedule is fastest, speedups over baseline, noise.

    A scenario without a baseline row (a broken file: ``validate`` says where) counts in
    ``scenarios_without_baseline`` and nowhere else.
    """
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DatasetError(f"column '{missing[0]}' is missing{more}; `ficco dataset validate` lists every problem")
    ok = df[df["status"] == "ok"]
    per_scenario = []
    no_baseline = 0
    for sid, g in ok.groupby("scenario_id", sort=False, dropna=False):
        v = g[g["verified"]]
        base = g[g["schedule"].astype(str).str.startswith("none.")]["time_s"]
        if base.empty:
            no_baseline += 1
            continue
        if v.empty:
            continue
        best = v.loc[v["time_s"].idxmin()]
        per_scenario.append({"best": best["schedule"], "speedup": float(base.iloc[0] / best["time_s"]),
                             "ties": int(v["near_best"].sum()),
                             "baseline_near_best": bool(g.loc[base.index[0], "near_best"])})
    ps = pd.DataFrame(per_scenario)
    speedup = ps["speedup"] if len(ps) else pd.Series(dtype=float)
    family = ps["best"].str.split(".").str[0] if len(ps) else pd.Series(dtype=str)
    return {
        "scenarios": int(df["scenario_id"].nunique()),
        "rows": len(df),
        "failed_scenarios": int(df.loc[df["status"] == "failed", "scenario_id"].nunique()),
        "scenarios_without_baseline": no_baseline,
        "unverified_rows": int((~ok["verified"]).sum()),
        "noisy_rows": int(ok["noisy"].sum()),
        "noisy_fraction": round(float(ok["noisy"].mean()), 3) if len(ok) else 0.0,
        "median_spread": round(float(ok["time_spread"].median()), 3) if len(ok) else None,
        "by_op": {k: int(v) for k, v in df.groupby("op")["scenario_id"].nunique().items()},
        "by_world_size": {int(k): int(v) for k, v in df.groupby("world_size")["scenario_id"].nunique().items()},
        "by_group": {k: int(v) for k, v in df.groupby("group")["scenario_id"].nunique().items()},
        "fastest_count": {k: int(v) for k, v in ps["best"].value_counts().items()} if len(ps) else {},
        "fastest_by_granularity": {k: int(v) for k, v in family.value_counts().items()},
        "speedup_over_baseline": {
            "min": _r(speedup.min()), "p25": _r(speedup.quantile(0.25)), "median": _r(speedup.median()),
            "p75": _r(speedup.quantile(0.75)), "max": _r(speedup.max()),
            "share_above_1.05": _r((speedup > 1.05).mean()),
        },
        "mean_near_ties_per_scenario": _r(ps["ties"].mean()) if len(ps) else None,
        "baseline_within_noise_of_best": _r(ps["baseline_near_best"].mean()) if len(ps) else None,
        "provenance": {c: sorted(map(str, df[c].dropna().unique()))[:3] for c in
                       ("backend", "hardware_fingerprint", "torch_version", "ficco_version")}
                      | {"created_at": [str(df["created_at"].min()), str(df["created_at"].max())]},
    }


def _r(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 3)
