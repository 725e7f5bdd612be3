"""What a finished ``ficco adapt`` run reports and where it goes (the tracking stage).

``run_summary`` (``summary.json``: the machine, each round's headline scores, where the
adapted spec is) and ``summary_curve`` (a summary as learning-curve rows); ``tracked``
keeps a run in MLflow (``AdaptRun``, experiment ``EXPERIMENT``: the options, near-opt@2% per
round, the curve's plot, the output folder; FINISHED only when the summary was written);
``register_adapted`` trains on the measured rows and registers, promotes and exports by
the pipeline's rules.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd

from ficco_select.data.locks import write_json_atomic

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


RUN_FILE = "mlflow_run.json"
"""The folder's latest MLflow run: a run killed outright (no exception to end it) is found
RUNNING there by the next one, which marks it KILLED."""


class AdaptRun:
    """One ``ficco adapt`` run in MLflow (experiment ``EXPERIMENT``), open from its first round
    to its summary: the options, near-opt@2% per round as each finishes (step: scenarios
    measured), then the curve's plot, the folder's files and the registered version. Its
    status says how the run ended (``tracked``). Opened with MLflow's client, not as the
    active run: the register step's pipeline opens its own run meanwhile."""

    def __init__(self, machine: str, params: dict, out: Path):
        import mlflow

        self.client, self.out = mlflow.MlflowClient(), out
        self._end_killed_predecessor()
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(EXPERIMENT)
        self.run_id = self.client.create_run(experiment_id, run_name=f"adapt-{machine}").info.run_id
        write_json_atomic(out / RUN_FILE, {"run_id": self.run_id})
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)

    def _end_killed_predecessor(self) -> None:
        """The folder's previous run, still RUNNING though no run holds the folder: KILLED."""
        try:
            earlier = self.client.get_run(json.loads((self.out / RUN_FILE).read_text())["run_id"])
        except Exception:  # noqa: BLE001 - none recorded, or not in this store (MLflow raises its own kinds)
            return
        if earlier.info.status == "RUNNING":
            self.client.set_terminated(earlier.info.run_id, "KILLED")

    def log_round(self, r: Round) -> None:
        scores = headline(r.scores)
        for key in ("near_opt_2", "speedup", "simulator_near_opt_2", "ceiling_near_opt_2"):
            if key in scores:
                self.client.log_metric(self.run_id, key, float(scores[key]), step=int(r.measured))

    def log_outputs(self, summary: dict) -> None:
        """The curve's plot, the folder's own files (the register step's pipeline folder is its
        own run's) and the version registered: before ``summary.json``, which ``log_summary``
        adds once written."""
        curve = summary_curve(summary)
        if "near_opt_2" in curve:
            from ficco_select.train.report import plot_curve

            plot_curve(curve, self.out / "curve.png")
        for path in sorted(self.out.iterdir()):
            if path.is_file() and path.name != "summary.json":
                self.client.log_artifact(self.run_id, str(path), artifact_path="adapt")
        if summary.get("registered"):
            self.client.set_tag(self.run_id, "ficco.registered_version", summary["registered"]["version"])

    def log_summary(self) -> None:
        self.client.log_artifact(self.run_id, str(self.out / "summary.json"), artifact_path="adapt")

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


@contextlib.contextmanager
def tracked(machine: str, params: dict, out: Path, *, enabled: bool = True) -> Iterator[AdaptRun | None]:
    """An ``AdaptRun`` for the block (None when not `enabled`), ended FINISHED when the block
    ends, FAILED when it raises (KILLED on an interrupt): a run that did not finish never reads
    as one that did."""
    if not enabled:
        yield None
        return
    run = AdaptRun(machine, params, out)
    try:
        yield run
    except KeyboardInterrupt:
        run.end("KILLED")
        raise
    except BaseException:
        run.end("FAILED")
        raise
    run.end("FINISHED")


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
