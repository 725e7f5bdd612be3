"""The data stage's commands: measure, catalog, simulate, and `ficco dataset ...`.

Each parses its options, calls one function of the data stage, and prints the result.
Heavy imports (pandas, torch, `data`) stay inside the commands: `ficco --help` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ficco_select.cli.output import (
    finishing,
    json_option,
    naming,
    naming_rows_of,
    refuse_existing_out,
    refuse_input_as_out,
    reported,
    show,
)


@click.command()
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
@json_option("Print a JSON summary instead of the table.")
@click.option("--shard", default=None, metavar="i/N",
              help="Measure only shard i of N (0 <= i < N; by scenario id): one node's part of a cluster sweep, "
                   "resumable on its own; `ficco dataset merge` joins the shards.")
@click.option("--fabric", default=None, metavar="RATE",
              help="cpu only: run the ranks in a private network namespace whose loopback tc shapes to RATE "
                   "(e.g. 500mbit, 2gbit); rows are on the machine cpu-RATE, profiled once per --out.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def measure(scenarios_path, backend, ranks, out, reps, warmup, min_rep_s, timeout_s, shard, fabric, as_json,
            no_progress) -> None:
    """Time every legal schedule of every scenario on real ranks and verify each result.

    cpu: under torchrun (`torchrun --nproc-per-node P --no-python ficco measure ...`) this
    process is one rank; otherwise it spawns the ranks itself, one job per world size.

    cuda: one process, the P ranks of each scenario virtual on the local GPU (loopback), or
    with --ranks node a process per GPU (rank r on GPU r).
    """
    from ficco_select.data.measure.config import MeasureConfig, MeasureError
    from ficco_select.data.measure.sweep import measure_table, parse_shard, summary_table, sweep_summary
    from ficco_select.data.scenarios import DEFAULT_SCENARIOS, packaged
    from ficco_select.scenario import ScenarioError

    path = scenarios_path or packaged(DEFAULT_SCENARIOS)
    refuse_input_as_out(out, {"--scenarios": [path]})
    given = {"reps": reps, "min_rep_s": min_rep_s}  # None: MeasureConfig's default
    on = enter_fabric(fabric, backend) if fabric is not None else None  # re-executes inside it, once
    with reported(ScenarioError, ValueError, MeasureError, message=naming_rows_of(path)), finishing(out):
        config = MeasureConfig(warmup=warmup, timeout_s=timeout_s, **{k: v for k, v in given.items() if v is not None})
        df = measure_table(path, backend=backend, ranks=ranks, config=config, out=out, progress=not no_progress,
                           shard=parse_shard(shard) if shard is not None else None, fabric=on)
    if df is None:  # a non-zero torchrun rank
        return
    table = summary_table(df)
    sweep = df.attrs.get("sweep", {})
    # A failed scenario exits 1: the dataset is written, failures and all; a script must still notice.
    show(as_json, sweep_summary(df, table, out), lambda: _sweep_lines(df, table, sweep, out),
         exit_code=1 if sweep.get("failed") else 0)


def enter_fabric(rate: str, backend: str):
    """The fabric this process measures on: outside it, refuse what cannot run there, then
    become this same command inside a namespace shaped to it (``ficco_select.data.measure.fabric``)."""
    from ficco_select.data.measure.fabric import FabricError, exec_inside, inside, parse_fabric
    from ficco_select.data.measure.gloo import under_torchrun

    with reported(FabricError):
        fabric = parse_fabric(rate)
        if inside() == fabric:
            return fabric
        if backend != "cpu" or under_torchrun():
            raise FabricError(f"--fabric {rate}: a shaped fabric carries the cpu backend's spawned gloo ranks "
                              "(not --backend cuda, nor a torchrun job)")
        if "--fabric" not in " ".join(sys.argv):
            raise FabricError(f"--fabric {rate}: re-running this command inside the fabric needs its command "
                              "line (run `ficco measure|adapt ... --fabric RATE`)")
        exec_inside(fabric, [sys.executable, "-m", "ficco_select.cli.main", *sys.argv[1:]])


def _sweep_lines(df, table, sweep: dict, out) -> list[str]:
    lines = [table.to_string(index=False, float_format=lambda x: f"{x:.3f}"),
             (f"\n{len(df)} rows ({int(df['verified'].sum())} verified) for "
              f"{df['scenario_id'].nunique()} scenarios -> {out}"),
             ("measured {measured}, skipped (already done) {skipped}, failed {failed}, "
              "noisy rows {noisy_rows}").format(**sweep)]
    if sweep.get("kept_from_out"):
        lines.append(f"{out} already held {sweep['kept_from_out']} scenarios: kept; those of this table were "
                     "not re-measured (delete the file to measure them again)")
    if sweep.get("other_parts_kept"):
        lines.append(f"{sweep['other_parts_kept']} committed parts of scenarios not in this table were left "
                     f"in {out}.parts (an interrupted sweep of another table: rerun it to finish)")
    return lines + [f"  failed: {failure}" for failure in sweep.get("failures", [])]


@click.command("catalog")
@click.option("--scale", type=click.Choice(["cpu", "fabric", "full"]), default="cpu", show_default=True,
              help="cpu: shapes scaled down for the 2-core gloo backend; fabric: scaled down less in the dims "
                   "and more in the tokens, for gloo ranks on a shaped fabric (measure --fabric); full: "
                   "published shapes.")
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="Scenario table to write (.csv or .parquet); an existing file is refused.")
@click.option("--world-sizes", default=None, help="Comma-separated world sizes (default: 2,3,4 cpu; 2,4,8 full).")
@click.option("--models", default=None, help="Comma-separated model names (default: all).")
@click.option("--dtype", default=None,
              help="Every row in this dtype (default: what jobs run on the machine: float32 on cpu; on GPUs "
                   "bfloat16 for every shape plus shares in float16, fp8 where the GPU has it, and float32).")
@click.option("--hardware", default=None, help="Hardware column (default: cpu / h100-nvswitch).")
@click.option("--sample", type=float, default=None,
              help="Keep this share of the rows (0 < share <= 1), drawn by scenario id: a larger share keeps every "
                   "row of a smaller one.")
@json_option("Print a JSON summary.")
def catalog_cmd(scale, out, world_sizes, models, dtype, hardware, sample, as_json) -> None:
    """Write a scenario table from real layer shapes of public model families."""
    from ficco_select.data.catalog import catalog_to_file
    from ficco_select.scenario import ScenarioError

    refuse_existing_out(out, {})
    with reported(ValueError, ScenarioError):
        summary = catalog_to_file(scale, out, dtype=dtype, hardware=hardware,
                                  world_sizes=tuple(int(x) for x in world_sizes.split(",")) if world_sizes else None,
                                  models=models.split(",") if models else None, sample=sample)
    show(as_json, summary, lambda: f"{summary['scenarios']} scenarios "
         f"({', '.join(f'{k}: {v}' for k, v in summary['by_op'].items())}; "
         f"{', '.join(f'{k}: {v}' for k, v in summary['by_dtype'].items())}) "
         f"from {len(summary['models'])} models -> {out}")


@click.command()
@click.option("--scenarios", "scenarios_path", type=click.Path(dir_okay=False), required=True,
              help="Scenario table (CSV or Parquet).")
@click.option("--hardware", default=None,
              help="Preset name or spec file; default: each row's hardware column.")
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="Parquet dataset to write; an existing file is refused.")
@click.option("--noise", type=float, default=0.0, show_default=True,
              help="Log-normal sigma of simulated measurement noise (0: exact predictions).")
@click.option("--seed", type=int, default=0, show_default=True)
@json_option("Print a JSON summary.")
def simulate(scenarios_path, hardware, out, noise, seed, as_json) -> None:
    """Predict every legal schedule's time on hardware we do not have (backend=sim)."""
    from ficco_select.data.dataset import write_parquet_atomic
    from ficco_select.data.simulate import simulate_table
    from ficco_select.hardware import HardwareError, machines
    from ficco_select.scenario import ScenarioError

    refuse_existing_out(out, {"--scenarios": [scenarios_path], "--hardware": [hardware]})
    with reported(ScenarioError, HardwareError, ValueError):
        df, specs = simulate_table(scenarios_path, hardware=hardware, noise=noise, seed=seed)
    with machines(specs):  # the file carries the specs of machines that are not shipped
        write_parquet_atomic(df, out)
    names = [spec.name for spec in specs]
    summary = {"out": out, "scenarios": int(df["scenario_id"].nunique()), "rows": len(df), "hardware": names}
    show(as_json, summary, lambda: f"{summary['rows']} rows for {summary['scenarios']} scenarios on "
         f"{', '.join(names)} -> {out}")


@click.group()
def dataset() -> None:
    """Inspect and check labeled datasets."""


@dataset.command()
@click.argument("path", type=click.Path(dir_okay=False))
@json_option("Print the problems as JSON.")
def validate(path, as_json) -> None:
    """Check a dataset's schema and invariants; exit 1 and name row and column if broken."""
    from ficco_select.data.dataset import DatasetError, dataset_machines, read_dataset
    from ficco_select.data.dataset import validate as check
    from ficco_select.hardware import HardwareError, machines

    with reported(DatasetError, HardwareError):
        df = read_dataset(path)
        with machines(dataset_machines(path)):
            problems = check(df)
    show(as_json, {"path": path, "valid": not problems, "problems": problems},
         lambda: problems or [f"{path}: valid"], exit_code=1 if problems else 0)


@dataset.command()
@click.argument("path", type=click.Path(dir_okay=False))
@json_option("Print the summary as JSON.")
def info(path, as_json) -> None:
    """Summarise a dataset: scenarios, how often each schedule is fastest, speedups, noise."""
    from ficco_select.data.dataset import DatasetError, read_dataset
    from ficco_select.data.dataset_info import info as summarize

    with reported(DatasetError, message=naming(path)):
        summary = summarize(read_dataset(path))
    show(as_json, summary, lambda: _nested_lines(summary))


def _nested_lines(summary: dict) -> list[str]:
    """`key: value` per line; a dict value as an indented `key: value` block under its key."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, dict):
            lines += [f"{key}:", *(f"  {k}: {v}" for k, v in value.items())]
        else:
            lines.append(f"{key}: {value}")
    return lines


@dataset.command("merge")
@click.argument("paths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="The merged dataset (Parquet). An existing file is refused unless it is one of the inputs.")
@json_option("Print the summary as JSON.")
def merge_cmd(paths, out, as_json) -> None:
    """Join the shards of one sweep (`ficco measure --shard i/N`) into one dataset; refuses
    an invalid input (as `ficco dataset validate` finds it), other backends, machines or
    timing settings (--reps, --min-rep-s, --warmup), and a scenario measured twice with
    different results."""
    from ficco_select.data.dataset import DatasetError, dataset_machines, read_timing, write_parquet_atomic
    from ficco_select.data.dataset_merge import merge
    from ficco_select.data.locks import OutputLocked, output_lock
    from ficco_select.hardware import HardwareError, machines

    resolved = {str(Path(p).resolve()) for p in paths}
    if Path(out).exists() and str(Path(out).resolve()) not in resolved:
        raise click.ClickException(f"--out {out}: exists and is not one of the inputs; nothing is overwritten: "
                                   "choose another --out, or list it among the inputs to add to it")
    with reported(DatasetError, HardwareError, OutputLocked):
        with output_lock(out, "ficco dataset merge"):
            df = merge(list(paths))
            with machines([known for p in paths for known in dataset_machines(p)]):  # the inputs' machines
                write_parquet_atomic(df, out, timing=read_timing(paths[0]))  # every input's: merge refuses others
    summary = {"out": out, "inputs": len(paths), "scenarios": int(df["scenario_id"].nunique()), "rows": len(df)}
    show(as_json, summary, lambda: f"{out}: {summary['scenarios']} scenarios, {summary['rows']} rows "
                                   f"from {len(paths)} datasets")


@dataset.command("compare")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@json_option("Print the summary and every scenario as JSON.")
def compare_cmd(a, b, as_json) -> None:
    """Two independent sweeps of the same scenarios: do the labels repeat?

    Per scenario both measured: Kendall tau of the schedule times, whether each sweep's best
    is a tie of the other's, the repeat capture (B's best / B's time of A's best), median
    spreads, and whether the best speedup exceeds the ideal beyond its spread.
    """
    from ficco_select.data.compare import compare
    from ficco_select.data.dataset import DatasetError, read_valid_dataset

    with reported(DatasetError, ValueError):
        summary, per = compare(read_valid_dataset(a), read_valid_dataset(b))
    show(as_json, {"a": a, "b": b, **summary, "per_scenario": per.to_dict("records")}, lambda: [
        *(f"{key}: {value}" for key, value in summary.items() if key != "by_world_size"),
        *(f"P={P}: " + ", ".join(f"{k} {v}" for k, v in block.items())
          for P, block in summary["by_world_size"].items())])


COMMANDS = [measure, catalog_cmd, simulate, dataset]
