"""Where one hold-out fold of ``ficco pipeline`` spends its time: the pipeline's training
frame, one fold of a split fitted and scored by the pipeline's selectors in this process
under cProfile, its time split by what the fold does.

    python benchmarks/profile_fold.py                       # the second hardware fold
    python benchmarks/profile_fold.py --split family --fold 0 --top 40
    python benchmarks/profile_fold.py --json

The pipeline runs ~20 such folds, two at a time on 2 cores (``--workers``); ``ficco
pipeline`` prints each stage's seconds on its ``stages:`` line. cProfile slows Python code
more than XGBoost's C++, so the Python shares here are upper bounds. Run nothing else
beside it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

from ficco_select.hardware import machines
from ficco_select.train.evaluate import _fold, folds
from ficco_select.train.selector_sets import fast_selectors
from ficco_select.train.selectors import with_features
from ficco_select.train.training_data import SAMPLED_PER_PRESET, default_training_data, training_machines

PARTS = {
    "shipped policy's fit": "shipped.py:*(fit)",
    "  its abstention rule": "abstention_fit.py:*(fit_abstention)",
    "  its rule for unseen machines": "unseen_fit.py:*(fit_unseen_hardware)",
    "  validation outcomes": "validation_outcomes.py:*(_validation_outcomes)",
    "XGBoost fits": "xgboost/sklearn.py:*(fit)",
    "  boosting rounds": "xgboost/core.py:*(update)",
    "  quantile matrices": "xgboost/core.py:*(_init)",
    "heuristic's estimates": "train/selectors.py:*(_prepare)",
    "cost model's times (simulate_rows)": "data/simulate.py:*(simulate_rows)",
    "fallbacks' picks (the runtime's)": "runtime/fallbacks.py:*(run_fallback)",
}
"""Parts of a fold, by the function whose cumulative time they are (parts overlap)."""


def cumulative(stats: pstats.Stats, pattern: str) -> float:
    """The cumulative seconds of the functions matching `pattern` ("file:*(name)"), the
    outermost call of each counted once (cProfile's cumulative time excludes recursion)."""
    where, name = pattern.split(":*")
    return sum(v[3] for (file, _, func), v in stats.stats.items()
               if file.endswith(where) and f"({func})" == name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="hardware", choices=("family", "hardware", "topology"))
    parser.add_argument("--fold", type=int, default=1, help="which fold of the split (in the pipeline's order)")
    parser.add_argument("--top", type=int, default=0, help="also print the N functions of most cumulative time")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    df = default_training_data(sampled_per_preset=SAMPLED_PER_PRESET)
    df = with_features(df.drop_duplicates(["scenario_id", "schedule"], keep="last"))
    name, train, test = folds(df, args.split)[args.fold]
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.runcall(_fold, df[train], df[test], fast_selectors)
    wall = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    parts = {part: round(cumulative(stats, pattern), 2) for part, pattern in PARTS.items()}
    if args.json:
        print(json.dumps({"fold": name, "wall_s": round(wall, 2), "parts_s": parts}, indent=2))
        return
    print(f"{name}: {wall:.1f} s under cProfile")
    for part, seconds in parts.items():
        print(f"  {part:<38} {seconds:7.1f} s  {seconds / wall:5.0%}")
    if args.top:
        stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    with machines(training_machines()):  # the machines the training data names
        main()
