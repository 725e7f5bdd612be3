"""Runtime selector costs, as ratios measured in one run.

- cache hit of ``Selector.select`` vs a bare dict lookup (target: <= 2x);
- cache miss (features of every candidate + our NumPy tree walk) vs XGBoost's own
  ``inplace_predict`` on one row (target: <= 1/8 of it);
- import + load of the selector in a fresh process that has already imported torch
  (target: <= 200 ms).

    python benchmarks/selector_speed.py --model DIR   # DIR from `ficco export`
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="An exported selector folder.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import xgboost as xgb

    from data.catalog import catalog
    from features import pair_features
    from ficco_select import candidates
    from ficco_select.hardware import load_hardware
    from ficco_select.scenario import SCENARIO_COLUMNS, Scenario
    from ficco_select.selector import Selector

    sel = Selector.load(args.model)
    recs = catalog("full", world_sizes=(8,), hardware="mi300x-8", models=["llama3-70b"])
    scenario = Scenario.from_record(recs[0])
    sel.select(scenario)
    # The bare lookup a framework would do itself: a dict keyed by the scenario's columns.
    key = tuple(getattr(scenario, c) for c in SCENARIO_COLUMNS)
    table = {key: 1}
    n = 200_000
    hit = min(timeit.repeat(lambda: sel.select(scenario), number=n, repeat=5)) / n
    lookup = min(timeit.repeat(lambda: table.get(key), number=n, repeat=5)) / n

    def miss():
        sel._cache.clear()
        sel.select(scenario)

    t_miss = min(timeit.repeat(miss, number=200, repeat=5)) / 200
    booster = xgb.Booster()
    booster.load_model(f"{args.model}/model.json")
    hw = load_hardware("mi300x-8")
    x = pair_features([scenario.as_record()], [candidates(scenario, "sim")[0]], {"mi300x-8": hw})
    t_xgb = min(timeit.repeat(lambda: booster.inplace_predict(x), number=200, repeat=5)) / 200
    code = ("import time, torch; t=time.perf_counter(); from ficco_select.selector import Selector; "
            f"s=Selector.load({args.model!r}); print(time.perf_counter()-t)")
    loads = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
             for _ in range(3)]
    out = {"hit_us": hit * 1e6, "dict_lookup_us": lookup * 1e6, "hit_over_lookup": hit / lookup,
           "miss_us": t_miss * 1e6, "xgb_inplace_predict_1row_us": t_xgb * 1e6, "miss_over_inplace": t_miss / t_xgb,
           "candidates": len(candidates(scenario, "sim")), "import_load_ms": 1e3 * float(np.median(loads))}
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>28}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
