"""What a finished ``ficco adapt`` run reports and where it goes (the tracking stage).

``run_summary`` (``summary.json``: the machine, each round's headline scores, where the
adapted spec is) and ``summary_curve`` (a summary as learning-curve rows); ``track_run``
logs a run to MLflow (experiment ``EXPERIMENT``: the options, near-opt@2% per round, the
curve's plot, the output folder); ``register_adapted`` trains on the measured rows and
registers, promotes and exports by the pipeline's rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ficco_select.train.adapt.machines import Machine
from ficco_select.train.adapt.state import Round

EXPERIMENT = "ficco-adapt"


def headline(scores: dict) -> dict:
    """A round's scores as the summary shows them (nothing for a round without scores)."""
    if not scores:
        return {}
    # Capture and slowdowns too: on measured rows, judged on a second sweep, they are what
    # reads against the repeat oracle (the ceiling) and the fixed rules.
    return {"near_opt_2": scores["near_opt_2"], "speedup": scores["speedup"],
            "oracle_capture": scores["oracle_capture"], "slower_than_baseline": scores["slower_than_baseline"],
            "simulator_near_opt_2": scores["simulator"]["near_opt_2"],
            "ceiling_near_opt_2": scores["ceiling"]["near_opt_2"],
            "ceiling_oracle_capture": scores["ceiling"]["oracle_capture"],
            "ceiling_slower_than_baseline": scores["ceiling"]["slower_than_baseline"]}


def run_summary(machine: Machine, done: Sequence[Round], out: Path, *, hardware: str, backend: str,
                strategy: str) -> dict:
    """A finished run's summary: the machine, its grid's size, each round's headline scores,
    the adapted spec's file and the output folder."""
    return {"machine": machine.name, "hardware": hardware, "backend": backend, "strategy": strategy,
            "grid": len(machine.grid),
            "rounds": [{"fraction": r.fraction, "measured": r.measured, **headline(r.scores)} for r in done],
            "spec": str(out / "spec.yaml"), "out_dir": str(out)}


def summary_curve(summary: dict) -> pd.DataFrame:
    """A run's summary as learning-curve rows (``ficco_select.train.report.adapt_curve``): one per round, the
    machine and backend as the preset, the round's headline scores."""
    return pd.DataFrame([{"preset": f"{summary['machine']} on {summary['backend']}", "strategy": summary["strategy"],
                          **r} for r in summary["rounds"]])


def track_run(summary: dict, out: Path, params: dict) -> str:
    """One MLflow run: the options, near-opt@2% per round (step: scenarios measured), the
    curve's plot and the output folder."""
    import mlflow

    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name=f"adapt-{summary['machine']}") as run:
        mlflow.log_params(params)
        for r in summary["rounds"]:
            for key in ("near_opt_2", "speedup", "simulator_near_opt_2", "ceiling_near_opt_2"):
                if key in r:
                    mlflow.log_metric(key, float(r[key]), step=int(r["measured"]))
        curve = summary_curve(summary)
        if "near_opt_2" in curve:
            from ficco_select.train.report import plot_curve

            plot_curve(curve, out / "curve.png")
        mlflow.log_artifacts(str(out), artifact_path="adapt")
        return run.info.run_id


def register_adapted(out_dir: str | Path, *, export_to: str | Path | None = None, debug: bool = False,
                     progress: bool = True) -> dict:
    """Train on the default training data plus an adapt run's measured rows (``measured.parquet``
    in `out_dir`, which carries the adapted spec): the pipeline's grouped evaluation, MLflow
    run and registration, and its promotion rule (``ficco_select.train.run``: the champion moves only if
    what ships beats the heuristic on both grouped hold-outs and is not worse than the
    champion), exporting a new champion to `export_to`. The pipeline's output goes to
    ``<out_dir>/pipeline``. `debug`: the pipeline's tiny slice (tests). Returns the version,
    whether it was promoted, and where it was exported."""
    from ficco_select.train.pipeline import run_pipeline

    measured = Path(out_dir) / "measured.parquet"
    if not measured.exists():
        raise ValueError(f"{measured}: nothing measured yet, nothing to register (a budget of 0 scenarios?)")
    done = run_pipeline(datasets=[measured], out_dir=Path(out_dir) / "pipeline", progress=progress, debug=debug,
                        export_to=export_to)
    return {k: done[k] for k in ("version", "promoted", "run_id", "report", "exported", "export_error") if k in done}
