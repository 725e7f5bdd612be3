"""The `ficco` command line: one subcommand per stage, each a thin wrapper.

Each subcommand parses its options, builds a config, calls one function of its stage
and prints the result (a table, or JSON with --json).
"""

from __future__ import annotations

import json
import logging
import sys

import click

from ficco_select.scenario import Scenario, ScenarioError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log lines on stderr (-v: info, -vv: debug).")
def main(verbose: int) -> None:
    """ficco-select: measure, learn and select compute-communication overlap schedules."""
    # The one place logging is set up: every stage only logs to its module's logger.
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@main.command()
@click.option("--scenarios", "scenarios_path", type=click.Path(dir_okay=False), default=None,
              help="Scenario table (CSV or Parquet). Default: the shipped small set.")
@click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Backend that executes the schedules: cpu (gloo ranks) or cuda (loopback: "
                   "virtual ranks on this machine's GPU; hardware column = the GPU's preset).")
@click.option("--ranks", type=click.Choice(["loopback", "node"]), default="loopback", show_default=True,
              help="cuda only: loopback (the P ranks virtual on one GPU) or node (a process per GPU: "
                   "NCCL for sm, copy engines for dma; needs P GPUs).")
@click.option("--out", type=click.Path(dir_okay=False), default="out/measured.parquet",
              show_default=True, help="Parquet file to write (atomically).")
@click.option("--reps", type=int, default=None, help="Timed repetitions per schedule (>= 5; default 10).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed runs before timing.")
@click.option("--min-rep-s", type=float, default=None,
              help="Shortest timed repetition in seconds (default 0.01); a repetition runs each schedule back "
                   "to back as often as the scenario's baseline needs to last this long (0: one run).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Abort when no schedule finishes for this many seconds (hung rank).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of the table.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def measure(scenarios_path, backend, ranks, out, reps, warmup, min_rep_s, timeout_s, as_json, no_progress) -> None:
    """Time every legal schedule of every scenario on real ranks and verify each result.

    cpu: under torchrun (`torchrun --nproc-per-node P --no-python ficco measure ...`) this
    process is one rank; otherwise it spawns the ranks itself, one job per world size.

    cuda: one process, the P ranks of each scenario virtual on the local GPU (loopback), or
    with --ranks node a process per GPU (rank r on GPU r).
    """
    from data.measure import measure as run_measure, summary_table
    from data.scenarios import DEFAULT_SCENARIOS, packaged, read_scenarios
    from ficco_select.executor.cpu import MeasureConfig, MeasureError

    path = scenarios_path or packaged(DEFAULT_SCENARIOS)
    try:
        given = {"reps": reps, "min_rep_s": min_rep_s}  # None: MeasureConfig's default
        config = MeasureConfig(warmup=warmup, timeout_s=timeout_s, **{k: v for k, v in given.items() if v is not None})
        scenarios = read_scenarios(path, backend=backend)
        if ranks == "node" and backend != "cuda":
            raise ValueError("--ranks node: a process per GPU is the cuda backend's mode; add --backend cuda")
        df = run_measure(scenarios, backend=backend, config=config, out=out, progress=not no_progress,
                         ranks=ranks)
    except (ScenarioError, ValueError, MeasureError) as e:
        raise click.ClickException(f"{path}: {e}" if str(e).startswith("row ") else str(e)) from None
    if df is None:  # a non-zero torchrun rank
        return
    table = summary_table(df)
    sweep = df.attrs.get("sweep", {})
    ok = df["status"] == "ok"
    if as_json:
        _echo_json({"out": str(out), **sweep, "verified": int(df["verified"].sum()),
                    "unverified": int((ok & ~df["verified"]).sum()), "per_scenario": table.to_dict("records")})
    else:
        click.echo(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        click.echo(f"\n{len(df)} rows ({int(df['verified'].sum())} verified) for "
                   f"{df['scenario_id'].nunique()} scenarios -> {out}")
        click.echo("measured {measured}, skipped (already done) {skipped}, failed {failed}, "
                   "noisy rows {noisy_rows}".format(**sweep))
        if sweep.get("kept_from_out"):
            click.echo(f"{out} already held {sweep['kept_from_out']} scenarios: kept; those of this table were "
                       "not re-measured (delete the file to measure them again)")
        if sweep.get("other_parts_kept"):
            click.echo(f"{sweep['other_parts_kept']} committed parts of scenarios not in this table were left "
                       f"in {out}.parts (an interrupted sweep of another table: rerun it to finish)")
        for failure in sweep.get("failures", []):
            click.echo(f"  failed: {failure}")
    if sweep.get("failed"):
        sys.exit(1)  # the dataset is written, failures and all; a script must still notice


@main.command("catalog")
@click.option("--scale", type=click.Choice(["cpu", "full"]), default="cpu", show_default=True,
              help="cpu: shapes scaled down for the 2-core gloo backend; full: published shapes.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Scenario table (.csv or .parquet).")
@click.option("--world-sizes", default=None, help="Comma-separated world sizes (default: 2,3,4 cpu; 2,4,8 full).")
@click.option("--models", default=None, help="Comma-separated model names (default: all).")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--hardware", default=None, help="Hardware column (default: cpu / h100-nvswitch).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def catalog_cmd(scale, out, world_sizes, models, dtype, hardware, as_json) -> None:
    """Write a scenario table from real layer shapes of public model families."""
    from data.catalog import MODELS, catalog, write_catalog

    try:
        sizes = tuple(int(x) for x in world_sizes.split(",")) if world_sizes else None
        records = catalog(scale, world_sizes=sizes, dtype=dtype, hardware=hardware,
                          models=models.split(",") if models else None)
        write_catalog(out, records)
    except (ValueError, ScenarioError) as e:
        raise click.ClickException(str(e)) from None
    counts: dict[str, int] = {}
    for r in records:
        counts[r["op"]] = counts.get(r["op"], 0) + 1
    summary = {"out": out, "scenarios": len(records), "by_op": counts,
               "families": sorted({r["group"] for r in records}),
               "models": sorted({r["model"] for r in records} & set(MODELS))}
    if as_json:
        _echo_json(summary)
    else:
        click.echo(f"{len(records)} scenarios ({', '.join(f'{k}: {v}' for k, v in counts.items())}) "
                   f"from {len(summary['models'])} models -> {out}")


@main.command()
@click.option("--scenarios", "scenarios_path", type=click.Path(dir_okay=False), required=True,
              help="Scenario table (CSV or Parquet).")
@click.option("--hardware", default=None,
              help="Preset name or spec file; default: each row's hardware column.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Parquet dataset to write.")
@click.option("--noise", type=float, default=0.0, show_default=True,
              help="Log-normal sigma of simulated measurement noise (0: exact predictions).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def simulate(scenarios_path, hardware, out, noise, seed, as_json) -> None:
    """Predict every legal schedule's time on hardware we do not have (backend=sim)."""
    from data.dataset import write_parquet_atomic
    from data.scenarios import read_scenarios
    from data.simulate import simulate as run_simulate
    from ficco_select.hardware import HardwareError, load_hardware

    try:
        scenarios = read_scenarios(scenarios_path, backend="sim", hardware=hardware)
        names = sorted({s.hardware for s in scenarios})
        frames = [run_simulate([s for s in scenarios if s.hardware == name], load_hardware(name),
                               noise=noise, seed=seed) for name in names]
    except (ScenarioError, HardwareError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    import pandas as pd

    df = pd.concat(frames, ignore_index=True)
    write_parquet_atomic(df, out)
    summary = {"out": out, "scenarios": int(df["scenario_id"].nunique()), "rows": len(df),
               "hardware": names}
    if as_json:
        _echo_json(summary)
    else:
        click.echo(f"{summary['rows']} rows for {summary['scenarios']} scenarios on {', '.join(names)} -> {out}")


@main.command()
@click.option("--dataset", "datasets", multiple=True, type=click.Path(dir_okay=False),
              help="Dataset(s) to evaluate on (default: the committed cpu dataset + the catalog "
                   "simulated on every GPU preset and, for training only, on machines sampled around them).")
@click.option("--splits", default="random,family,hardware,topology,world_size", show_default=True,
              help="Comma-separated: random, family (leave one model family out), hardware "
                   "(leave one hardware out), topology (leave one interconnect topology out), "
                   "world_size (train on smaller, test on the largest).")
@click.option("--json", "as_json", is_flag=True, help="Print every split's metrics as JSON.")
@click.option("--no-progress", is_flag=True)
def evaluate(datasets, splits, as_json, no_progress) -> None:
    """Train every selector and the heuristic on some groups, score them on unseen ones."""
    from data.dataset import DatasetError
    from train.evaluate import evaluate as run_evaluate, tables
    from train.metrics import format_table

    try:
        df = _training_data(datasets)
        results = run_evaluate(df, splits=[x.strip() for x in splits.split(",") if x.strip()],
                               progress=not no_progress)
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json(results)
        return
    for name, table in tables(results).items():
        split, _, backend = name.partition(".")
        folds = len(results["splits"][split]["folds"])
        how = f"{backend} scenarios, {folds} folds pooled" if backend else f"mean over {folds} folds"
        click.echo(f"\n== {name} ({how}) ==")
        click.echo(format_table(table))


@main.command("train")
@click.option("--dataset", "datasets", multiple=True, type=click.Path(dir_okay=False),
              help="Dataset(s) to train on (default: committed cpu dataset + simulated GPU presets and "
                   "machines sampled around them).")
@click.option("--splits", default="random,family,hardware,topology,world_size", show_default=True)
@click.option("--out", "out_dir", default="out/train", show_default=True, type=click.Path(file_okay=False),
              help="Folder for the comparison tables (also logged to MLflow).")
@click.option("--telemetry", "telemetry", multiple=True, type=click.Path(dir_okay=False),
              help="Telemetry file(s) of running jobs ($FICCO_TELEMETRY); repeatable. Their scenarios "
                   "join the registered model's training data, not the evaluation (they lack most schedules).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-progress", is_flag=True)
def train_cmd(datasets, splits, out_dir, telemetry, as_json, no_progress) -> None:
    """Evaluate every selector, track it in MLflow, register the best, promote it if it wins.

    Tracking store: $MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db here).
    """
    from data.dataset import DatasetError
    from train.config import TrainConfig
    from train.run import train

    try:
        config = TrainConfig(splits=tuple(x.strip() for x in splits.split(",") if x.strip()), out_dir=out_dir,
                             progress=not no_progress)  # checked before any data is read
        df = _training_data(datasets)
        extra = _telemetry_rows(telemetry, df) if telemetry else None
        summary = train(df, config, extra=extra)
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json({k: v for k, v in summary.items() if k != "text"}
                   | ({"telemetry_rows": len(extra)} if extra is not None else {}))
        return
    click.echo(summary["text"])
    if extra is not None:
        click.echo(f"\ntelemetry: {len(extra)} rows of {extra['scenario_id'].nunique()} scenarios added to the "
                   "registered model's training data (not scored)")
    click.echo(f"\nMLflow run {summary['run_id']}: registered {summary['chosen']} as ficco-selector "
               f"version {summary['version']}; champion {'moved to it' if summary['promoted'] else 'unchanged'}.")
    click.echo(f"report: {summary['report']}")


@main.command()
@click.option("--backend", type=click.Choice(["cpu", "sim"]), default=None,
              help="Add a machine's rows first: measure this one (cpu) or simulate one (sim).")
@click.option("--hardware", default=None, help="Preset name or spec file of the machine (with --backend sim).")
@click.option("--dataset", "datasets", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A measured dataset to add, e.g. a GPU's from `ficco measure --backend cuda` on that machine.")
@click.option("--out", "out_dir", default="out/pipeline", show_default=True, type=click.Path(file_okay=False))
@click.option("--debug", is_flag=True,
              help="Every stage on a tiny slice with tiny models (seconds): checks that it runs, not how well.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-progress", is_flag=True)
def pipeline(backend, hardware, datasets, out_dir, debug, as_json, no_progress) -> None:
    """The whole pipeline in one command: data, training, grouped evaluation, MLflow, report."""
    from train.pipeline import run_pipeline

    try:
        summary = run_pipeline(backend=backend, hardware=hardware, datasets=datasets, out_dir=out_dir,
                               progress=not no_progress, debug=debug)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json({k: v for k, v in summary.items() if k != "text"})
        return
    click.echo(summary["text"])
    click.echo(f"\nregistered {summary['chosen']} as ficco-selector version {summary['version']} "
               f"(champion {'moved to it' if summary['promoted'] else 'unchanged'}); MLflow run {summary['run_id']}")
    click.echo(f"report: {summary['report']}   tracking: `mlflow ui` in this folder")


@main.command("export")
@click.option("--model-uri", default="models:/ficco-selector@champion", show_default=True)
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder to write (default: where Selector.load() looks, $FICCO_SELECTOR or "
                   "~/.cache/ficco-select/selector).")
def export_cmd(model_uri, out) -> None:
    """Copy a registered selector out of MLflow into a runtime folder (XGBoost JSON + selector.json)."""
    from ficco_select.selector import DEFAULT_PATH
    from train.export import export

    try:
        path = export(out or DEFAULT_PATH, model_uri)
    except ValueError as e:  # ours: names the folder or the model
        raise click.ClickException(str(e)) from None
    except Exception as e:  # noqa: BLE001 - MLflow raises many kinds; say which model failed
        raise click.ClickException(f"{model_uri}: {e}") from None
    click.echo(str(path))


@main.command("select")
@click.option("--scenarios", "scenarios_path", type=click.Path(dir_okay=False), required=True,
              help="Scenario table (CSV or Parquet). Rows are not validated first: an invalid row gets "
                   "the baseline (source fallback) and a null scenario_id.")
@click.option("--model", "model_path", type=click.Path(file_okay=False), default=None,
              help="An exported selector folder (`ficco export`). Default: the exported champion "
                   "($FICCO_SELECTOR or ~/.cache/ficco-select/selector) if there is one, else the heuristic.")
@click.option("--heuristic-only", is_flag=True, help="No model: the hand heuristic decides every row.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one decision per row.")
def select_cmd(scenarios_path, model_path, heuristic_only, as_json) -> None:
    """Which schedule for each row of a scenario table: the runtime selector's decisions.

    One decision per row, in order: row (1-based, header excluded), scenario_id, schedule,
    source (model | heuristic | fallback), confidence, reason.
    """
    from data.scenarios import read_table
    from ficco_select.scenario import REQUIRED_COLUMNS
    from ficco_select.selector import Selector

    if model_path and heuristic_only:
        raise click.UsageError("--model and --heuristic-only exclude each other; drop one")
    try:
        table = read_table(scenarios_path)
    except ScenarioError as e:
        raise click.ClickException(str(e)) from None
    # A missing column is the wrong file, not a bad row: every row would silently fall back.
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise click.ClickException(f"{scenarios_path}: column '{missing[0]}' is missing "
                                   f"(need {', '.join(REQUIRED_COLUMNS)})")
    if heuristic_only:
        selector = Selector()
    else:
        selector = Selector.load(model_path)
        if model_path and selector.model is None:
            raise click.ClickException(f"--model {model_path}: no usable selector there (see the warning "
                                       "above); export one with `ficco export` or pass --heuristic-only")
    records = table.to_dict("records")
    # Each fallback's reason is in the output: no warning per bad row on top of it.
    quiet = logging.getLogger("ficco_select.selector")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        decisions = [_decision(i, record, selector) for i, record in enumerate(records, start=1)]
    finally:
        quiet.setLevel(level)
    if as_json:
        _echo_json(decisions)
        return
    _echo_decisions(decisions, records, selector, model_path)


@main.command()
@click.option("--dir", "folder", default="out/train", show_default=True, type=click.Path(file_okay=False),
              help="A training's output folder (what `ficco train` wrote).")
def report(folder) -> None:
    """Render a training's comparison tables and plots as one HTML file."""
    from train.report import write_report

    try:
        path = write_report(folder)
    except FileNotFoundError as e:
        raise click.ClickException(f"{folder}: not a training output folder ({e.filename} missing)") from None
    click.echo(str(path))


@main.group()
def sim() -> None:
    """Calibrate the simulator from measurements and check it against them."""


@sim.command("validate")
@click.option("--dataset", "dataset_path", type=click.Path(dir_okay=False), required=True,
              help="A measured dataset (cpu or cuda backend).")
@click.option("--devices", type=int, default=2, show_default=True,
              help="Devices of the measured machine (the cpu backend: its cores).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the scenario split.")
@click.option("--json", "as_json", is_flag=True)
def sim_validate(dataset_path, devices, seed, as_json) -> None:
    """Calibrate on half the scenarios, predict the other half, report the agreement."""
    from data.calibrate import validate_simulator
    from data.dataset import DatasetError, read_dataset

    try:
        report = validate_simulator(read_dataset(dataset_path), devices=devices, seed=seed)
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json(report)
        return
    for key, value in report.items():
        if key not in ("spec", "largest_errors"):
            click.echo(f"{key}: {value}")
    click.echo("largest errors:")
    for row in report["largest_errors"]:
        click.echo(f"  {row}")


@sim.command("calibrate")
@click.option("--dataset", "dataset_path", type=click.Path(dir_okay=False), required=True)
@click.option("--name", required=True, help="Name of the spec (and preset).")
@click.option("--devices", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="YAML spec file to write.")
def sim_calibrate(dataset_path, name, devices, out) -> None:
    """Fit a hardware spec's primitive costs to a measured dataset."""
    from pathlib import Path

    from data.calibrate import calibrate, spec_yaml
    from data.dataset import DatasetError, read_dataset

    try:
        spec = calibrate(read_dataset(dataset_path), name=name, devices=devices,
                         description=f"calibrated from {dataset_path}")
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    Path(out).write_text(spec_yaml(spec, f"ficco sim calibrate --dataset {dataset_path} --devices {devices}"))
    click.echo(f"{name} -> {out}")


@main.group()
def hardware() -> None:
    """Hardware specs: the presets shipped with ficco-select, or your own YAML file."""


@hardware.command("list")
def hardware_list() -> None:
    """Print the preset names."""
    from ficco_select.hardware import preset_names

    click.echo("\n".join(preset_names()))


@hardware.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def hardware_show(name, as_json) -> None:
    """Print one preset (or spec file), every field."""
    from ficco_select.hardware import HardwareError, load_hardware, spec_as_dict

    try:
        spec = spec_as_dict(load_hardware(name))
    except HardwareError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json(spec)
    else:
        width = max(map(len, spec))
        for key, value in spec.items():
            click.echo(f"{key:<{width}}  {value}")


@hardware.command("from-profile")
@click.argument("profile_path", metavar="PROFILE", type=click.Path(dir_okay=False))
@click.option("--base", default=None,
              help="Preset or spec file that keeps what one GPU cannot measure (links, topology, "
                   "devices). Default: the profile's 'preset'.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Spec YAML to write (.yaml).")
@click.option("--name", default=None, help="The new spec's name (default: <base>-profiled).")
@click.option("--json", "as_json", is_flag=True, help="Print the overrides as JSON.")
def hardware_from_profile(profile_path, base, out, name, as_json) -> None:
    """Turn a measured GPU profile (scripts/gpu_check.sh) into a hardware spec the simulator loads."""
    from pathlib import Path

    from data.calibrate import spec_yaml
    from ficco_select.hardware import HardwareError, load_hardware, spec_as_dict
    from ficco_select.profile import ProfileError, dil_vs_model, profiled_spec, read_profile

    if Path(out).suffix not in (".yaml", ".yml"):
        raise click.ClickException(f"--out {out!r}: a spec file name ends in .yaml")
    try:
        profile = read_profile(profile_path)
        base = base or profile.preset
        if not base:
            raise click.ClickException("--base is required: the profile names no preset")
        base_spec = load_hardware(base)
        spec, overrides = profiled_spec(profile, base_spec, name=name)
        Path(out).write_text(spec_yaml(spec, f"ficco hardware from-profile {profile_path} --base {base}"))
        load_hardware(out)  # what the simulator will do with it
    except (ProfileError, HardwareError) as e:
        raise click.ClickException(str(e)) from None
    before = spec_as_dict(base_spec)
    kept = [f for f in before if f not in overrides and f not in ("name", "description")]
    dil = [r for r in dil_vs_model(profile, spec) if isinstance(r["dil"], (int, float))]
    dil_err = sorted(abs(r["dil"] - r["dil_model"]) for r in dil)
    if as_json:
        _echo_json({"out": str(out), "name": spec.name, "base": base, "device": profile.device_name,
                    "overrides": {f: {"base": before[f], "profiled": v} for f, v in overrides.items()},
                    "kept": kept, "dil_rows": len(dil),
                    "dil_median_abs_error": dil_err[len(dil_err) // 2] if dil_err else None})
        return
    if profile.preset and profile.preset != base_spec.name:
        click.echo(f"note: the profile was measured against preset {profile.preset!r}, the base is {base_spec.name!r}")
    click.echo(f"{spec.name}: {base_spec.name} with {len(overrides)} fields measured on {profile.device_name}")
    for field, value in overrides.items():
        click.echo(f"  {field:<20} {before[field]} -> {value}")
    click.echo(f"  kept from {base_spec.name}: {', '.join(kept)}")
    if dil_err:
        click.echo(f"  DIL, measured vs simulated on {len(dil)} rows: median |error| {dil_err[len(dil_err) // 2]:.3f}")
    click.echo(f"-> {out}")


@main.group()
def dataset() -> None:
    """Inspect and check labeled datasets."""


@dataset.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the problems as JSON.")
def validate(path, as_json) -> None:
    """Check a dataset's schema and invariants; exit 1 and name row and column if broken."""
    from data.dataset import DatasetError, read_dataset, validate as check

    try:
        problems = check(read_dataset(path))
    except DatasetError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json({"path": path, "valid": not problems, "problems": problems})
    else:
        click.echo("\n".join(problems) if problems else f"{path}: valid")
    if problems:
        sys.exit(1)


@dataset.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def info(path, as_json) -> None:
    """Summarise a dataset: scenarios, how often each schedule is fastest, speedups, noise."""
    from data.dataset import DatasetError, info as summarize, read_dataset

    try:
        df = read_dataset(path)
        summary = summarize(df)
    except DatasetError as e:
        raise click.ClickException(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from None
    if as_json:
        _echo_json(summary)
        return
    for key, value in summary.items():
        if isinstance(value, dict):
            click.echo(f"{key}:")
            for k, v in value.items():
                click.echo(f"  {k}: {v}")
        else:
            click.echo(f"{key}: {value}")


@dataset.command("compare")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary and every scenario as JSON.")
def compare_cmd(a, b, as_json) -> None:
    """Two independent sweeps of the same scenarios: do the labels repeat?

    Per scenario both measured: Kendall tau of the schedule times, whether each sweep's best
    is a tie of the other's, the repeat capture (B's best / B's time of A's best), median
    spreads, and whether the best speedup exceeds the ideal beyond its spread.
    """
    from data.compare import compare
    from data.dataset import DatasetError, read_dataset

    try:
        summary, per = compare(read_dataset(a), read_dataset(b))
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _echo_json({"a": a, "b": b, **summary, "per_scenario": per.to_dict("records")})
        return
    for key, value in summary.items():
        if key != "by_world_size":
            click.echo(f"{key}: {value}")
    for P, block in summary["by_world_size"].items():
        click.echo(f"P={P}: " + ", ".join(f"{k} {v}" for k, v in block.items()))


def _training_data(datasets):
    """The given datasets, or the default training data (cpu measured + GPU presets simulated)."""
    import pandas as pd

    from data.dataset import read_dataset
    from train.training_data import default_training_data

    if not datasets:
        return default_training_data()
    return pd.concat([read_dataset(p) for p in datasets], ignore_index=True)


def _telemetry_rows(paths, df):
    """Telemetry as extra training rows beside `df`; refuses files that add nothing."""
    from data.telemetry import read_telemetry
    from train.training_data import telemetry_training_rows

    rows = telemetry_training_rows(read_telemetry(paths), df)
    if rows.empty:
        raise ValueError(f"{', '.join(paths)}: no telemetry scenario has a verified baseline and another "
                         "verified schedule outside the dataset; nothing to add to the training data")
    return rows


def _decision(row: int, record: dict, selector) -> dict:
    """The selector's decision on one raw table row (never raises: a bad row is a fallback)."""
    from ficco_select.hardware import HardwareError, hardware_name

    try:  # the id `ficco simulate` and `ficco measure` give the row: a spec file becomes its name
        named = {**record, "hardware": hardware_name(str(record.get("hardware", "")).strip())}
        scenario_id = Scenario.from_record(named).scenario_id
    except (ScenarioError, HardwareError):
        scenario_id = None
    d = selector.select(record)
    return {"row": row, "scenario_id": scenario_id, "schedule": d.schedule.name, "source": d.source,
            "confidence": d.confidence, "reason": d.reason}


def _echo_decisions(decisions: list[dict], records: list[dict], selector, model_path) -> None:
    """A left-aligned table, one line per row, then the count per source."""
    header = ("row", "scenario_id", "op", "m,n,k", "P", "hardware", "schedule", "source", "confidence", "reason")
    lines = [header] + [(str(d["row"]), d["scenario_id"] or "-", str(r.get("op")),
                         f"{r.get('m')},{r.get('n')},{r.get('k')}", str(r.get("world_size")), str(r.get("hardware")),
                         d["schedule"], d["source"], f"{d['confidence']:.3f}", d["reason"])
                        for d, r in zip(decisions, records)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    counts = {s: sum(d["source"] == s for d in decisions) for s in ("model", "heuristic", "fallback")}
    model = (f"model {selector.meta.get('selector', '?')} from {model_path or 'the default export'}"
             if selector.model is not None else "heuristic only")
    click.echo(f"\n{len(decisions)} rows: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({model})")


def _echo_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
