"""Training speed: seconds to fit each learned selector on about 100k (scenario, schedule) rows.

    python benchmarks/train_speed.py [--json]

Rows: the committed cpu dataset plus the full catalog simulated on every GPU preset
(the default training data, ~93k rows), topped up with a second simulated copy (other
noise seed) to pass 100k. One run; times are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import json
import time

import pandas as pd

from train.selectors import HGBClassifier, RandomForestTime, XGBRanker, XGBTimeRegressor
from train.training_data import default_training_data, simulated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    df = default_training_data()
    extra = simulated("mi300x-8", seed=7)
    extra["scenario_id"] = extra["scenario_id"] + "-copy"  # distinct scenarios, same shapes
    df = pd.concat([df, extra], ignore_index=True)
    out = {"rows": len(df)}
    for make in (XGBTimeRegressor, XGBRanker, HGBClassifier, RandomForestTime):
        t0 = time.perf_counter()
        make().fit(df)
        out[f"{make.name}_fit_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>24}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
