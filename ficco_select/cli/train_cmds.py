"""The training stage's commands: evaluate, train, pipeline, export, report.

Each parses its options, builds a config, calls one function of `train`, and prints the
result. Heavy imports (pandas, MLflow, `train`) stay inside the commands: `ficco --help`
stays fast.
"""

from __future__ import annotations

from pathlib import Path

import click

from ficco_select.cli.output import finishing, json_option, reported, show

SPLITS = "random,family,hardware,topology,world_size"
SELECTOR_SET_NAMES = ("shipping", "all", "fast", "debug")
"""``ficco_select.train.config.SELECTOR_SETS``' names (that module is heavy to import for --help)."""
SELECTORS_HELP = ("The selectors fitted: shipping (what ships and what it is read against), all (with the ranker, "
                  "HGB classifier and random forest, which never ship), fast (what `ficco pipeline` evaluates), or "
                  "debug (tiny models).")


def _names(text: str) -> list[str]:
    """A comma-separated option as its non-empty, stripped items."""
    return [x.strip() for x in text.split(",") if x.strip()]


@click.command()
@click.option("--dataset", "datasets", multiple=True, type=click.Path(dir_okay=False),
              help="Dataset(s) to evaluate on (default: the committed cpu dataset + the catalog "
                   "simulated on every GPU preset and, for training only, on machines sampled around them).")
@click.option("--splits", default=SPLITS, show_default=True,
              help="Comma-separated: random, family (leave one model family out), hardware "
                   "(leave one hardware out), topology (leave one interconnect topology out), "
                   "world_size (train on smaller, test on the largest).")
@click.option("--selectors", default="shipping", show_default=True, type=click.Choice(list(SELECTOR_SET_NAMES)),
              help=SELECTORS_HELP)
@json_option("Print every split's metrics as JSON.")
@click.option("--no-progress", is_flag=True)
def evaluate(datasets, splits, selectors, as_json, no_progress) -> None:
    """Train the selectors and the heuristic on some groups, score them on unseen ones."""
    from ficco_select.data.dataset import DatasetError
    from ficco_select.train.config import SELECTOR_SETS
    from ficco_select.train.evaluate import evaluate as run_evaluate
    from ficco_select.hardware import machines
    from ficco_select.train.training_data import load_training_data, training_machines

    with reported(DatasetError, ValueError):
        df = load_training_data(datasets)
        with machines(training_machines(datasets)):
            results = run_evaluate(df, splits=_names(splits), make_selectors=SELECTOR_SETS[selectors],
                                   progress=not no_progress)
    show(as_json, results, lambda: _evaluation_lines(results))


def _evaluation_lines(results: dict) -> list[str]:
    """Each comparison table under a heading that says how its folds were combined."""
    from ficco_select.train.evaluate import tables
    from ficco_select.train.metrics import format_table

    lines = []
    for name, table in tables(results).items():
        split, _, backend = name.partition(".")
        folds = len(results["splits"][split]["folds"])
        how = f"{backend} scenarios, {folds} folds pooled" if backend else f"mean over {folds} folds"
        lines += [f"\n== {name} ({how}) ==", format_table(table)]
    return lines


@click.command("train")
@click.option("--dataset", "datasets", multiple=True, type=click.Path(dir_okay=False),
              help="Dataset(s) to train on (default: committed cpu dataset + simulated GPU presets and "
                   "machines sampled around them). Each is refused, before any work, if `ficco dataset validate` "
                   "finds a problem or a scenario lacks some of its candidate schedules.")
@click.option("--splits", default=SPLITS, show_default=True)
@click.option("--selectors", default="shipping", show_default=True, type=click.Choice(list(SELECTOR_SET_NAMES)),
              help=SELECTORS_HELP)
@click.option("--out", "out_dir", default="out/train", show_default=True, type=click.Path(file_okay=False),
              help="Folder for the comparison tables (also logged to MLflow).")
@click.option("--telemetry", "telemetry", multiple=True, type=click.Path(dir_okay=False),
              help="Telemetry file(s) of running jobs ($FICCO_TELEMETRY) or a machine's learned record "
                   "($FICCO_LEARN_DIR/*.json); repeatable. Their scenarios join the registered model's training "
                   "data, not the evaluation (they lack most schedules).")
@json_option()
@click.option("--no-progress", is_flag=True)
def train_cmd(datasets, splits, selectors, out_dir, telemetry, as_json, no_progress) -> None:
    """Evaluate every selector, track it in MLflow, register the best, promote it if it wins.

    Tracking store: $MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db here).
    """
    from ficco_select.data.dataset import DatasetError
    from ficco_select.train.config import TrainConfig
    from ficco_select.train.run import train_from_files

    with reported(DatasetError, ValueError):
        config = TrainConfig(splits=tuple(_names(splits)), selectors=selectors, out_dir=out_dir,
                             progress=not no_progress)  # checked before any data is read
        summary, extra = train_from_files(config, datasets, telemetry)
    added = {"telemetry_rows": len(extra)} if extra is not None else {}
    show(as_json, {k: v for k, v in summary.items() if k != "text"} | added, lambda: _training_lines(summary, extra))


def _training_lines(summary: dict, extra) -> list[str]:
    """The comparison tables, the telemetry rows added, what was registered and promoted."""
    lines = [summary["text"]]
    if extra is not None:
        lines.append(f"\ntelemetry: {len(extra)} rows of {extra['scenario_id'].nunique()} scenarios added to "
                     "the registered model's training data (not scored)")
    return lines + [(f"\nMLflow run {summary['run_id']}: registered {summary['chosen']} as ficco-selector "
                     f"version {summary['version']}; champion {_champion(summary)}."),
                    f"report: {summary['report']}"]


def _champion(summary: dict) -> str:
    return "moved to it" if summary["promoted"] else "unchanged"


@click.command()
@click.option("--backend", type=click.Choice(["cpu", "sim"]), default=None,
              help="Add a machine's rows first: measure this one (cpu) or simulate one (sim).")
@click.option("--hardware", default=None, help="Preset name or spec file of the machine (with --backend sim).")
@click.option("--dataset", "datasets", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A measured dataset to add, e.g. a GPU's from `ficco measure --backend cuda` on that machine; "
                   "refused, before any work, as `ficco train --dataset` refuses one.")
@click.option("--out", "out_dir", default="out/pipeline", show_default=True, type=click.Path(file_okay=False))
@click.option("--debug", is_flag=True,
              help="Every stage on a tiny slice with tiny models (seconds): checks that it runs, not how well.")
@click.option("--export-to", default=None, type=click.Path(file_okay=False),
              help="Where a new champion is exported for the runtime (default: where Selector.load() looks, "
                   "$FICCO_SELECTOR or ~/.cache/ficco-select/selector).")
@click.option("--no-export", is_flag=True, help="Leave the runtime's model as it is, even if the champion moves.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Hold-out folds fitted at once, each in a process of its own (default: one per CPU core, "
                   "at most 4; the tables do not depend on it).")
@json_option()
@click.option("--no-progress", is_flag=True)
def pipeline(backend, hardware, datasets, out_dir, debug, export_to, no_export, workers, as_json,
             no_progress) -> None:
    """The whole pipeline in one command: data, training, grouped evaluation, MLflow, report,
    and, when the champion moves, its export to the runtime folder."""
    from ficco_select.runtime.selector import DEFAULT_PATH
    from ficco_select.train.pipeline import run_pipeline

    with reported(ValueError):
        summary = run_pipeline(backend=backend, hardware=hardware, datasets=datasets, out_dir=out_dir,
                               progress=not no_progress, debug=debug, workers=workers,
                               export_to=None if no_export else export_to or DEFAULT_PATH)
    show(as_json, {k: v for k, v in summary.items() if k != "text"}, lambda: [
        summary["text"],
        (f"\nregistered {summary['chosen']} as ficco-selector version {summary['version']} "
         f"(champion {_champion(summary)}); MLflow run {summary['run_id']}"),
        *_export_lines(summary, debug),
        "stages: " + ", ".join(f"{stage} {s:.1f} s" for stage, s in summary["seconds"].items()),
        f"report: {summary['report']}   tracking: `mlflow ui` in this folder"])


def _export_lines(summary: dict, debug: bool) -> list[str]:
    if "exported" in summary:
        return [f"exported the champion to {summary['exported']}: Selector.load() and `ficco select` use it now"]
    if "export_error" in summary:
        return [f"not exported ({summary['export_error']}); `ficco export --out DIR` copies it"]
    if debug and summary["promoted"]:
        return ["not exported: a --debug model never reaches the runtime"]
    return []


@click.command("export")
@click.option("--model-uri", default="models:/ficco-selector@champion", show_default=True)
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder to write (default: where Selector.load() looks, $FICCO_SELECTOR or "
                   "~/.cache/ficco-select/selector).")
@click.option("--layers", "layers_path", default=None, type=click.Path(dir_okay=False),
              help="A scenario table (m ignored) whose layers get precompiled decision tables (layers.json).")
def export_cmd(model_uri, out, layers_path) -> None:
    """Copy a registered selector out of MLflow into a runtime folder (XGBoost JSON + selector.json,
    and with --layers the decision tables of those layers over every m)."""
    from ficco_select.data.scenarios import read_layers
    from ficco_select.runtime.selector import DEFAULT_PATH
    from ficco_select.scenario import ScenarioError
    from ficco_select.train.export import export

    with reported(ScenarioError):
        layers = read_layers(layers_path) if layers_path else []
    # A ValueError is ours and names the folder or the model; MLflow raises many kinds: say which model failed.
    with reported(Exception, message=lambda e: str(e) if isinstance(e, ValueError) else f"{model_uri}: {e}"):
        path = export(out or DEFAULT_PATH, model_uri, layers)
    click.echo(str(path) + (f" (tables for {len(layers)} layers: layers.json)" if layers else ""))


@click.command()
@click.option("--dir", "folder", default="out/train", show_default=True, type=click.Path(file_okay=False),
              help="A training's output folder (what `ficco train` wrote).")
def report(folder) -> None:
    """Render a training's comparison tables and plots as one HTML file."""
    from ficco_select.train.report import write_report

    with reported(FileNotFoundError,
                  message=lambda e: f"{folder}: not a training output folder ({e.filename} missing)"):
        path = write_report(folder)
    click.echo(str(path))




@click.command("adapt")
@click.option("--hardware", required=True, help="The new machine: a preset name or a spec file (.yaml).")
@click.option("--backend", type=click.Choice(["sim", "cpu", "cuda"]), default="sim", show_default=True,
              help="How to measure: sim (the spec simulated with noise, for experiments), cpu (this machine's "
                   "gloo ranks, for real; --hardware cpu), cuda (this node's GPUs, for real, through `ficco measure "
                   "--backend cuda`; --hardware names the GPU's spec).")
@click.option("--ranks", type=click.Choice(["loopback", "node"]), default="loopback", show_default=True,
              help="With --backend cuda: every scenario's ranks virtual on one GPU, or a process per GPU.")
@click.option("--fabric", default=None, metavar="RATE",
              help="With --backend cpu --hardware cpu: adapt to a shaped fabric of this host (tc's rate, e.g. "
                   "500mbit; `ficco measure --fabric`): every round measured inside it, starting from its profile.")
@click.option("--start", default=None, help="The spec to start from (a preset or a file; default: --hardware's).")
@click.option("--budget", type=float, default=0.1, show_default=True, help="Fraction of the machine's grid to measure.")
@click.option("--rounds", type=int, default=4, show_default=True, help="Rounds the budget is spent in.")
@click.option("--strategy", type=click.Choice(["active", "random"]), default="active", show_default=True,
              help="active: where the model is least sure, spread over operators and sizes; random: a draw.")
@click.option("--perturb", type=float, default=1.0, show_default=True,
              help="How far the spec to start from is off, at most, per number: on sim the measured machine "
                   "is --hardware's spec perturbed so; on cpu the spec to start from is.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/adapt", show_default=True,
              help="State (resumable), adapted spec, summary.")
@click.option("--no-track", is_flag=True, help="Do not log the run to MLflow.")
@click.option("--register", is_flag=True,
              help="Then train on the default data plus the measured rows, register the model and move the "
                   "champion by the usual rules (the pipeline's; a few minutes), exporting a new champion.")
@click.option("--export-to", type=click.Path(file_okay=False), default=None,
              help="With --register: where a new champion is exported (default: where Selector.load() looks, "
                   "$FICCO_SELECTOR or ~/.cache/ficco-select/selector).")
@click.option("--debug", is_flag=True,
              help="The model learns from the pipeline's debug slice with tiny models, and --register runs the "
                   "pipeline's --debug (seconds): checks that the flow runs, not how well.")
@json_option("Print the summary as JSON.")
def adapt_cmd(hardware, backend, ranks, fabric, start, budget, rounds, strategy, perturb, seed, out_dir, no_track,
              register, export_to, debug, as_json) -> None:
    """Adapt the selector to a new machine in a few measurements, round by round."""
    from ficco_select.cli.data_cmds import enter_fabric
    from ficco_select.runtime.selector import DEFAULT_PATH
    from ficco_select.train.adapt import run_adapt

    if fabric is not None:
        enter_fabric(fabric, backend)  # re-executes this command inside it, once

    def line(r) -> None:
        if not as_json:
            s = r.scores
            click.echo(f"{100 * r.fraction:5.1f}% measured ({r.measured:4d} scenarios): " + (
                f"near-opt@2% {s['near_opt_2']:.3f} (simulator on the adapted spec {s['simulator']['near_opt_2']:.3f}; "
                f"ceiling {s['ceiling']['near_opt_2']:.3f}), capture {s['oracle_capture']:.3f} (ceiling "
                f"{s['ceiling']['oracle_capture']:.3f})"
                if s else "no truth to score against"))

    with reported(ValueError), finishing(Path(out_dir) / "summary.json"):
        summary = run_adapt(hardware=hardware, backend=backend, start=start, budget=budget, rounds=rounds,
                            strategy=strategy, perturb=perturb, seed=seed, out_dir=out_dir, track=not no_track,
                            register=register, export_to=(export_to or DEFAULT_PATH) if register else None,
                            on_round=line, ranks=ranks, fabric=fabric, debug=debug)
    run = f"; MLflow run {summary['mlflow_run_id']}" if "mlflow_run_id" in summary else ""
    show(as_json, summary, lambda: [f"adapted spec: {summary['spec']}; state and summary in {summary['out_dir']}{run}",
                                    *_registered_lines(summary.get("registered"), debug)])


def _registered_lines(registered: dict | None, debug: bool) -> list[str]:
    if not registered:
        return []
    return [f"registered ficco-selector version {registered['version']} (champion {_champion(registered)}); "
            f"MLflow run {registered['run_id']}; report: {registered['report']}", *_export_lines(registered, debug)]


@click.command("bring-up")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/bring-up", show_default=True,
              help="Every step's output and the summary (bring_up.json); a rerun resumes.")
@click.option("--base", default=None, help="The preset the profile refines (default: the one matching the GPU).")
@click.option("--budget", type=float, default=0.02, show_default=True,
              help="Fraction of the GPU's catalog that adapt measures.")
@click.option("--rounds", type=int, default=2, show_default=True, help="Rounds the budget is spent in.")
@click.option("--ranks", type=click.Choice(["loopback", "node"]), default="loopback", show_default=True,
              help="Adapt's measurements: every scenario's ranks virtual on one GPU, or a process per GPU.")
@click.option("--export-to", type=click.Path(file_okay=False), default=None,
              help="The runtime's folder (default: where Selector.load() looks; DIR/selector with --rehearse).")
@click.option("--profile-s", type=float, default=300.0, show_default=True, help="Seconds for the profile.")
@click.option("--rehearse", is_flag=True,
              help="Every step on this machine's CPU stand-ins, tiny and with a registry of its own (CI).")
@json_option("Print the summary as JSON.")
def bring_up_cmd(out_dir, base, budget, rounds, ranks, export_to, profile_s, rehearse, as_json) -> None:
    """A new GPU node in one command: profile, spec, adapt, register, export, benchmark."""
    from ficco_select.train.bringup import bring_up

    def line(step: dict) -> None:
        if not as_json:
            detail = step.get("error") or step.get("reason") or step.get("output", "")
            click.echo(f"{step['step']:<10} {step['status']:<8} {step['seconds']:>7.1f} s  {detail}")

    with reported(ValueError), finishing(Path(out_dir) / "bring_up.json"):
        summary = bring_up(out_dir, base=base, budget=budget, rounds=rounds, ranks=ranks, export_to=export_to,
                           profile_s=profile_s, rehearse=rehearse, on_step=line)
    bench = next((s for s in summary["steps"] if s["step"] == "benchmark" and "hooked_speedup" in s), None)
    show(as_json, summary, lambda: [
        f"{'ready' if summary['ok'] else 'NOT ready'}: summary in {Path(out_dir) / 'bring_up.json'}"
        + (f"; training step hooked x{bench['hooked_speedup']} over unhooked PyTorch, best fixed schedule "
           f"({bench['best_fixed']}) x{bench['best_fixed_speedup']}" if bench else "")],
         exit_code=0 if summary["ok"] else 1)


COMMANDS = [evaluate, train_cmd, pipeline, export_cmd, report, adapt_cmd, bring_up_cmd]
