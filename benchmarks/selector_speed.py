"""Runtime selector costs, as ratios measured in one run.

- cache hit: ``sel.select(scenario)`` on a Scenario object decided before, vs the bare
  lookup a framework would otherwise do itself, ``table.get(key)`` on a dict keyed by the
  tuple of the scenario's columns (target: <= 2x). Both are timed as statements, with no
  wrapper call around either. A bare dict keyed by the Scenario object itself is shown
  too: that is slower, because Scenario.__hash__ is Python code; and a hit for a plain dict
  input (found by its scenario columns; target: <= 2x).
- cache miss: the whole decision (candidates, their features, the NumPy tree walk over
  every tree for every candidate, argmin and margin), after ``clear_cache()`` on a selector
  that decides directly (``layer_tables=False``), vs XGBoost's
  own ``booster.inplace_predict`` (default threads) on the same feature rows: on one row
  (target: <= 1/8) and on all the scenario's candidate rows in one call. Measured on the
  first scenario of the catalog slice llama3-70b / mi300x-8 / P = 8, then averaged over
  the slice (each scenario against XGBoost on its own rows).
- import + load of the selector in a fresh process that has already imported torch
  (target: <= 200 ms).
- layer tables (``layer_tables``): an m kept on a known layer vs a bare dict lookup (target:
  <= 2x), by ``table.decide(m)`` and through ``select()`` with a fresh Scenario or dict
  (each passed once, as a job passes them); the first ask of an m off the grid (one direct
  decision); the first sight of a layer (target: <= 5 ms); a decode-like stream of 10,000
  calls over 8 layers, m any multiple of P up to 4096, on its first pass (every new
  (layer, m) a direct decision) and its second (target: mean <= 1 us per call); and the
  table's decision equal to the direct path's (target: every m).

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

    from ficco_select.data.catalog import catalog
    from ficco_select import candidates
    from ficco_select.features import candidate_features
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
    hit_record = best_of("sel.select(record)", n, sel=sel, record=record)

    # -- miss -----------------------------------------------------------------------------
    booster = xgb.Booster()
    booster.load_model(f"{args.model}/model.json")

    def miss_and_xgb(s: Scenario, number: int) -> tuple[float, float, float, int, str]:
        def miss():
            direct.clear_cache()
            return direct.select(s)

        X = candidate_features(s, candidates(s, backend_for(hw)), hw)  # the rows the selector scores
        t_miss = best_of(miss, number)
        t_one = best_of(lambda: booster.inplace_predict(X[:1]), number)
        t_all = best_of(lambda: booster.inplace_predict(X), number)
        return t_miss, t_one, t_all, len(X), miss().source

    direct = Selector.load(args.model, layer_tables=False)  # every miss a decision, not a table's answer
    t_miss, t_one, t_all, n_cands, source = miss_and_xgb(scenario, 200)
    slice_ = np.array([miss_and_xgb(s, 100)[:4] for s in scenarios])

    tables = layer_tables(sel, args.model)

    # -- import + load ----------------------------------------------------------------------
    code = ("import time, torch; t=time.perf_counter(); from ficco_select.runtime.selector import Selector; "
            f"s=Selector.load({args.model!r}); print(time.perf_counter()-t)")
    loads = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
             for _ in range(3)]

    out = {
        "hit_us": hit * 1e6, "dict_lookup_tuple_key_us": lookup * 1e6, "hit_over_lookup": hit / lookup,
        "dict_lookup_scenario_key_us": lookup_scenario * 1e6, "hit_dict_input_us": hit_record * 1e6,
        "hit_dict_input_over_lookup": hit_record / lookup,
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
        **tables,
    }
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>40}: {v}" for k, v in out.items()))


def layer_tables(sel, model: str, n_layers: int = 8, stream_calls: int = 10_000, max_m: int = 4096,
                 seed: int = 0) -> dict:
    """Layer tables (``ficco_select.runtime.layers``) on the catalog's layers (llama3-70b and
    mixtral-8x7b, mi300x-8, P = 8): a kept m on a known layer against a bare dict lookup; the
    first ask of an m off the grid; the first sight of a layer (its table built); a
    decode-like stream of calls over the layers with m any multiple of P up to `max_m`,
    without tables and with them (built, as precompiled tables would be), its first pass
    and its second; and the table's decision against the direct path's at every call."""
    import dataclasses
    import random
    import time

    from ficco_select.data.catalog import catalog
    from ficco_select.runtime.layers import GRID_STEPS_PER_OCTAVE
    from ficco_select.runtime.selector import Selector
    from ficco_select.scenario import Scenario

    layers: dict[tuple, Scenario] = {}
    for r in catalog("full", world_sizes=(8,), hardware="mi300x-8", models=["llama3-70b", "mixtral-8x7b"]):
        s = Scenario.from_record(r)
        layers.setdefault(s.layer, s)
    layers = dict(list(layers.items())[:n_layers])
    P = 8

    # A kept m on a known layer vs a bare dict lookup (both one method call on a warm table).
    first = next(iter(layers.values()))
    table = sel.layer_table(first)
    m = 8 * 37
    table.decide(m)
    lookup_table = best_of("t.decide(m)", 1_000_000, t=table, m=m)
    bare = best_of("d.get(k)", 1_000_000, d={first.layer: 1}, k=first.layer)

    # Every door with a kept m on a known layer: a fresh Scenario object, and a fresh dict,
    # each passed once; against the same loop over a bare dict lookup.
    objects = [dataclasses.replace(first, m=8 * (i % 512 + 1)) for i in range(4000)]
    records = [{**first.as_record(), "m": s.m} for s in objects]
    loop_lookup = best_of("for s in objs: d.get(k)", 1, repeat=20, objs=objects, d={first.layer: 1}, k=first.layer)
    door = Selector.load(model)
    door.decide_batch(objects)  # every m kept
    kept_scenario = best_of("for s in inputs: door.select(s)", 1, repeat=20, inputs=objects, door=door)
    kept_record = best_of("for s in inputs: door.select(s)", 1, repeat=20, inputs=records, door=door)

    # The first ask of an m off the grid: one direct decision, then kept.
    off_grid = [m for m in range(8, 1 << 14, 8) if table.on_grid(m) is None][:200]
    t0 = time.perf_counter()
    for m in off_grid:
        table.decide(m)
    first_ask = (time.perf_counter() - t0) / len(off_grid)

    # First sight: every layer's table built by a fresh selector.
    fresh = Selector.load(model)
    builds = []
    for s in layers.values():
        t0 = time.perf_counter()
        fresh.layer_table(s)
        builds.append(time.perf_counter() - t0)

    # The stream: (layer, m) calls through select, on a selector whose tables are built (as
    # precompiled tables would be); its first pass decides each new (layer, m) once.
    rng = random.Random(seed)
    keys = list(layers)
    calls = [dataclasses.replace(layers[keys[rng.randrange(len(keys))]], m=P * rng.randint(1, max_m // P))
             for _ in range(stream_calls)]

    def stream(selector) -> float:
        t0 = time.perf_counter()
        for s in calls:
            selector.select(s)
        return (time.perf_counter() - t0) / len(calls)

    without_tables = Selector.load(model, layer_tables=False)
    stream_direct = stream(without_tables)
    warm_selector = Selector.load(model)
    for s in layers.values():
        warm_selector.layer_table(s)
    first_pass, second_pass = stream(warm_selector), stream(warm_selector)

    # The table's decision against the direct path's (a selector without tables), every call.
    direct_sel = Selector.load(model, layer_tables=False)
    agree = sum(warm_selector.select(s) == direct_sel.select(s) for s in calls)
    return {
        "table_grid_steps_per_octave": GRID_STEPS_PER_OCTAVE, "table_layers": len(layers),
        "table_grid_points_mean": float(np.mean([len(sel.layer_table(s).grid) for s in layers.values()])),
        "table_kept_m_us": lookup_table * 1e6, "table_dict_lookup_us": bare * 1e6,
        "table_kept_m_over_lookup": lookup_table / bare,
        "select_kept_m_scenario_us": kept_scenario / len(objects) * 1e6,
        "select_kept_m_scenario_over_lookup": kept_scenario / loop_lookup,
        "select_kept_m_dict_us": kept_record / len(objects) * 1e6,
        "select_kept_m_dict_over_lookup": kept_record / loop_lookup,
        "table_first_ask_off_grid_us": first_ask * 1e6,
        "table_first_sight_ms_mean": 1e3 * float(np.mean(builds)), "table_first_sight_ms_max": 1e3 * max(builds),
        "stream_calls": len(calls), "stream_distinct_calls": len(set(calls)),
        "stream_without_tables_us_per_call": stream_direct * 1e6,
        "stream_first_pass_us_per_call": first_pass * 1e6, "stream_second_pass_us_per_call": second_pass * 1e6,
        "table_agrees_with_direct": agree / len(calls),
    }


if __name__ == "__main__":
    main()
