"""Overlap benchmark on the cpu backend (real gloo ranks): does overlapping pay, and how
much of the ideal gain does the best schedule realize?

For each scenario, measured in this one run: compute alone and communication alone
(T_comp, T_comm), the baseline (whole collective, then whole GEMM), the best verified
schedule, speedup = baseline / best, ideal = (T_comp + T_comm) / max(T_comp, T_comm),
and the realized fraction (speedup - 1) / (ideal - 1). Communication really runs
concurrently with compute when best < T_comp + T_comm.

    python benchmarks/overlap.py [--reps 7] [--json]

This machine is shared and noisy (5-15% between close schedules); read the ratios, not
the absolute times, and rerun before trusting a difference of a few percent.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd

from ficco_select.data.measure.gloo import MeasureConfig, measure_spawned
from ficco_select.data.measure.sweep import summary_table
from ficco_select import Scenario

SCENARIOS = [
    # (op, m, n, k, P, imbalance): compute-bound, balanced and communication-bound shapes
    ("ag_gemm", 1536, 512, 512, 2, 1.0),
    ("ag_gemm", 2048, 64, 1024, 2, 1.0),
    ("gemm_rs", 1536, 1024, 256, 2, 1.0),
    ("gemm_rs", 1536, 512, 96, 3, 1.0),
    ("a2a_gemm", 1024, 512, 512, 2, 1.5),
    ("a2a_gemm", 768, 512, 512, 3, 1.5),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scenarios = [Scenario(group="bench", op=op, m=m, n=n, k=k, dtype="float32", world_size=P,
                          hardware="cpu", imbalance=imb) for op, m, n, k, P, imb in SCENARIOS]
    rows: list[dict] = []
    config = MeasureConfig(warmup=2, reps=args.reps)
    for P in sorted({s.world_size for s in scenarios}):
        measure_spawned([s for s in scenarios if s.world_size == P], config, on_scenario=rows.extend)
    df = pd.DataFrame(rows)
    table = summary_table(df)
    first = df.groupby("scenario_id", sort=False).first()
    table["comp_ms"] = 1e3 * first["t_comp_s"].to_numpy()
    table["comm_ms"] = 1e3 * first["t_comm_s"].to_numpy()
    table["best_vs_sum"] = table["best_ms"] / (table["comp_ms"] + table["comm_ms"])
    cols = ["op", "P", "m", "n", "k", "comp_ms", "comm_ms", "baseline_ms", "best", "best_ms",
            "speedup", "ideal", "realized_frac", "best_vs_sum"]
    if args.json:
        print(json.dumps(table[cols].to_dict("records"), indent=2, default=str))
    else:
        print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print("\nbest_vs_sum < 1: the best schedule took less than compute alone + communication alone,")
        print("so communication progressed while the GEMMs ran. All rows verified:", bool(df["verified"].all()))


if __name__ == "__main__":
    main()
