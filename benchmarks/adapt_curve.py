"""The learning curve of ``ficco adapt`` on simulated machines (issue 17's benchmark).

Each GPU preset held out in turn: a machine whose true numbers are the preset's, each off by
up to +-30% (``ficco_select.train.adapt.perturbed``), measured on ``sim`` with 3% noise; the run starts
from the preset's data sheet and a model trained without the preset's family. Near-opt@2% on
the noise-free truth of the grid's unmeasured rest, against the fraction measured (0 =
zero-shot), for the active and the random choice, beside the full retrain (5-fold
cross-fitting over the whole grid measured) and the simulator's own pick on the adapted spec.
A quality benchmark: its seconds are not a result.

    python benchmarks/adapt_curve.py [--presets a,b] [--out out/adapt_curve] [--json]
    python benchmarks/adapt_curve.py --presets none --runs out/adapt-cpu-active out/adapt-cpu-random

``--runs``: finished ``ficco adapt`` output folders (their ``summary.json``), whose rounds join
the curve as measured (the cpu backend's real curve, scored against its committed sweep,
with its repeat-oracle ceiling); ``--presets none`` draws them alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="", help="Comma-separated GPU presets (default: every GPU preset; none: no "
                                                  "simulated machine).")
    ap.add_argument("--runs", nargs="*", default=[], help="Finished `ficco adapt` output folders to add to the curve.")
    ap.add_argument("--spread", type=float, default=1.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/adapt_curve")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-track", action="store_true", help="Do not log the curve to MLflow (experiment ficco-adapt).")
    args = ap.parse_args()

    import pandas as pd

    from ficco_select.hardware import machines, preset_names
    from ficco_select.train.adapt_curve import curve_from_runs, learning_curve
    from ficco_select.train.report import curve_table, plot_curve
    from ficco_select.train.selectors import with_features
    from ficco_select.train.training_data import default_training_data, training_machines

    presets = ([] if args.presets == "none" else [p for p in args.presets.split(",") if p]
               or [p for p in preset_names() if p != "cpu"])
    t0 = time.perf_counter()
    curves = [curve_from_runs(args.runs)] if args.runs else []
    if presets:
        with machines(training_machines()):  # the machines the training data names
            df = with_features(default_training_data())
            curves.insert(0, learning_curve(df, presets, spread=args.spread, seed=args.seed,
                                            progress=lambda msg: print(f"[{time.perf_counter() - t0:5.0f} s] {msg}",
                                                                       flush=True)))
    if not curves:
        raise SystemExit("nothing to draw: --presets none and no --runs")
    curve = pd.concat(curves, ignore_index=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curve.to_csv(out / "curve.csv", index=False)
    plot_curve(curve, out / "curve.png")
    table = curve_table(curve).round(3)
    if not args.no_track:
        _track(curve, out, vars(args))
    if args.json:
        print(json.dumps(curve.to_dict("records"), indent=1))
    else:
        print(table.to_string())
        print(f"\nwrote {out / 'curve.csv'} and {out / 'curve.png'} ({time.perf_counter() - t0:.0f} s)")


def _track(curve, out: Path, params: dict) -> None:
    """One MLflow run (experiment ``ficco-adapt``, run ``learning-curve``): the options, each
    (preset, strategy)'s near-opt@2% by fraction measured (step: per mille), the table and plot."""
    import mlflow

    from ficco_select.train.adapt import EXPERIMENT

    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name="learning-curve"):
        mlflow.log_params({k: v for k, v in params.items() if k != "json"})
        for r in curve.itertuples():
            mlflow.log_metric(f"{r.preset}.{r.strategy}.near_opt_2", float(r.near_opt_2), step=round(1000 * r.fraction))
        mlflow.log_artifacts(str(out), artifact_path="adapt_curve")


if __name__ == "__main__":
    main()
