"""Runtime selector costs, as ratios measured in one run.

- cache hit: ``sel.select(scenario)`` on a Scenario object decided before, vs the bare
  lookup a framework would otherwise do itself, ``table.get(key)`` on a dict keyed by the
  tuple of the scenario's columns (target: <= 2x). Both are timed as statements, with no
  wrapper call around either. A bare dict keyed by the Scenario object itself is shown
  too: that is slower, because Scenario.__hash__ is Python code; and a hit for a plain dict
  input (found by its scenario columns), for information.
- cache miss: the whole decision (candidates, their features, the NumPy tree walk over
  every tree for every candidate, argmin and margin), after ``clear_cache()``, vs XGBoost's
  own ``booster.inplace_predict`` (default threads) on the same feature rows: on one row
  (target: <= 1/8) and on all the scenario's candidate rows in one call. Measured on the
  first scenario of the catalog slice llama3-70b / mi300x-8 / P = 8, then averaged over
  the slice (each scenario against XGBoost on its own rows).
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


def best_of(stmt, number: int, repeat: int = 5, **names) -> float:
    """Seconds per run of `stmt` (a statement string, or a callable), best of `repeat`."""
    return min(timeit.repeat(stmt, number=number, repeat=repeat, globals=names)) / number


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="An exported selector folder.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import xgboost as xgb

    from data.catalog import catalog
    from features.build import candidate_features
    from ficco_select import candidates
    from ficco_select.hardware import load_hardware
    from ficco_select.heuristic import backend_for
    from ficco_select.runtime.selector import Selector
    from ficco_select.scenario import SCENARIO_COLUMNS, Scenario

    sel = Selector.load(args.model)
    if sel.model is None:
        raise SystemExit(f"{args.model}: no usable model (see the warning above)")
    hw = load_hardware("mi300x-8")
    scenarios = [Scenario.from_record(r)
                 for r in catalog("full", world_sizes=(8,), hardware="mi300x-8", models=["llama3-70b"])]
    scenario = scenarios[0]

    # -- hit ------------------------------------------------------------------------------
    sel.select(scenario)
    key = tuple(getattr(scenario, c) for c in SCENARIO_COLUMNS)
    by_tuple, by_scenario = {key: 1}, {scenario: 1}
    n = 1_000_000
    hit = best_of("sel.select(scenario)", n, sel=sel, scenario=scenario)
    lookup = best_of("table.get(key)", n, table=by_tuple, key=key)
    lookup_scenario = best_of("table.get(key)", n, table=by_scenario, key=scenario)
    record = scenario.as_record()
    sel.select(record)
    hit_record = best_of("sel.select(record)", n // 10, sel=sel, record=record)

    # -- miss -----------------------------------------------------------------------------
    booster = xgb.Booster()
    booster.load_model(f"{args.model}/model.json")

    def miss_and_xgb(s: Scenario, number: int) -> tuple[float, float, float, int, str]:
        def miss():
            sel.clear_cache()
            return sel.select(s)

        X = candidate_features(s, candidates(s, backend_for(hw)), hw)  # the rows the selector scores
        t_miss = best_of(miss, number)
        t_one = best_of(lambda: booster.inplace_predict(X[:1]), number)
        t_all = best_of(lambda: booster.inplace_predict(X), number)
        return t_miss, t_one, t_all, len(X), miss().source

    t_miss, t_one, t_all, n_cands, source = miss_and_xgb(scenario, 200)
    slice_ = np.array([miss_and_xgb(s, 100)[:4] for s in scenarios])

    # -- import + load ----------------------------------------------------------------------
    code = ("import time, torch; t=time.perf_counter(); from ficco_select.runtime.selector import Selector; "
            f"s=Selector.load({args.model!r}); print(time.perf_counter()-t)")
    loads = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
             for _ in range(3)]

    out = {
        "hit_us": hit * 1e6, "dict_lookup_tuple_key_us": lookup * 1e6, "hit_over_lookup": hit / lookup,
        "dict_lookup_scenario_key_us": lookup_scenario * 1e6, "hit_dict_input_us": hit_record * 1e6,
        "trees": sel.model.n_trees, "tree_depth": sel.model.depth,
        "candidates": n_cands, "miss_source": source,
        "miss_us": t_miss * 1e6, "xgb_inplace_predict_1row_us": t_one * 1e6,
        "xgb_inplace_predict_candidates_us": t_all * 1e6,
        "miss_over_inplace_1row": t_miss / t_one, "miss_over_inplace_candidates": t_miss / t_all,
        "slice_scenarios": len(scenarios), "slice_mean_candidates": float(slice_[:, 3].mean()),
        "slice_mean_miss_us": 1e6 * float(slice_[:, 0].mean()),
        "slice_mean_miss_over_inplace_1row": float((slice_[:, 0] / slice_[:, 1]).mean()),
        "slice_mean_miss_over_inplace_candidates": float((slice_[:, 0] / slice_[:, 2]).mean()),
        "import_load_ms": 1e3 * float(np.median(loads)),
    }
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>40}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
