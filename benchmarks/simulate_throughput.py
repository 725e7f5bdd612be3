"""Simulator throughput: schedule evaluations per second on this machine.

Two figures from one run, on the full-scale catalog replicated on the MI300X preset:
- model: ``ficco_select.data.simulate.predict`` on column arrays already built (the vectorized model:
  every legal schedule's time and the signatures), evaluations per second;
- end to end: ``simulate_rows`` from Scenario objects to a DataFrame (enumerating the
  legal schedules, building the rows, predicting).

    python benchmarks/simulate_throughput.py [--copies 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from ficco_select.data.catalog import catalog
from ficco_select.data.simulate import build_rows, predict, simulate_rows
from ficco_select import Scenario
from ficco_select.hardware import load_hardware


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=20, help="Replications of the catalog (distinct objects).")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    hw = load_hardware("mi300x-8")
    records = catalog("full", world_sizes=(2, 4, 8), hardware="mi300x-8")
    scenarios = [Scenario.from_record(r) for _ in range(args.copies) for r in records]
    cols = build_rows(scenarios, hw)
    n = len(cols["schedule"])
    t_model = best_of(lambda: predict(cols, hw))
    t_end = best_of(lambda: simulate_rows(scenarios, hw))
    result = {"scenarios": len(scenarios), "schedule_evaluations": n,
              "model_evals_per_s": round(n / t_model), "end_to_end_evals_per_s": round(n / t_end),
              "model_s": round(t_model, 4), "end_to_end_s": round(t_end, 4)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
