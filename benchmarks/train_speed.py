"""Training speed: seconds to fit each learned selector on the default training data (~146k (scenario, schedule) rows).

    python benchmarks/train_speed.py [--json]

Rows: the default training data (the committed cpu dataset, the full catalog simulated on
every GPU preset and part of it on machines sampled around them: ~146k rows). One run;
times are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import json
import time

from ficco_select.hardware import machines
from ficco_select.train.selectors import HGBClassifier, RandomForestTime, XGBRanker, XGBTimeRegressor
from ficco_select.train.training_data import default_training_data, training_machines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    df = default_training_data()
    out = {"rows": len(df)}
    for make in (XGBTimeRegressor, XGBRanker, HGBClassifier, RandomForestTime):
        t0 = time.perf_counter()
        make().fit(df)
        out[f"{make.name}_fit_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>24}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    with machines(training_machines()):  # the machines the training data names
        main()
