"""The `ficco` command line: one subcommand per stage, each a thin wrapper.

Each subcommand parses its options, builds a config, calls one function of its stage
and prints the result (a table, or JSON with --json).
"""

from __future__ import annotations

import json
import sys

import click

from ficco_select.scenario import ScenarioError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """ficco-select: measure, learn and select compute-communication overlap schedules."""


@main.command()
@click.option("--scenarios", "scenarios_path", type=click.Path(dir_okay=False), default=None,
              help="Scenario table (CSV or Parquet). Default: the shipped small set.")
@click.option("--backend", type=click.Choice(["cpu"]), default="cpu", show_default=True,
              help="Backend that executes the schedules.")
@click.option("--out", type=click.Path(dir_okay=False), default="out/measured.parquet",
              show_default=True, help="Parquet file to write (atomically).")
@click.option("--reps", type=int, default=5, show_default=True, help="Timed repetitions per schedule (>= 5).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed runs before timing.")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Abort when no schedule finishes for this many seconds (hung rank).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of the table.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def measure(scenarios_path, backend, out, reps, warmup, timeout_s, as_json, no_progress) -> None:
    """Time every legal schedule of every scenario on real ranks and verify each result.

    Under torchrun (`torchrun --nproc-per-node P --no-python ficco measure ...`) this
    process is one rank; otherwise it spawns the ranks itself, one job per world size.
    """
    from data.measure import measure as run_measure, summary_table
    from data.scenarios import DEFAULT_SCENARIOS, packaged, read_scenarios
    from ficco_select.executor.cpu import MeasureConfig, MeasureError

    path = scenarios_path or packaged(DEFAULT_SCENARIOS)
    try:
        config = MeasureConfig(reps=reps, warmup=warmup, timeout_s=timeout_s)
        scenarios = read_scenarios(path, backend=backend)
        df = run_measure(scenarios, backend=backend, config=config, out=out, progress=not no_progress)
    except (ScenarioError, ValueError, MeasureError) as e:
        raise click.ClickException(str(e)) from None
    if df is None:  # a non-zero torchrun rank
        return
    table = summary_table(df)
    sweep = df.attrs.get("sweep", {})
    ok = df["status"] == "ok"
    if as_json:
        _echo_json({"out": str(out), **sweep, "verified": int(df["verified"].sum()),
                    "unverified": int((ok & ~df["verified"]).sum()), "per_scenario": table.to_dict("records")})
        return
    click.echo(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    click.echo(f"\n{len(df)} rows ({int(df['verified'].sum())} verified) for "
               f"{df['scenario_id'].nunique()} scenarios -> {out}")
    click.echo("measured {measured}, skipped (already done) {skipped}, failed {failed}, "
               "noisy rows {noisy_rows}".format(**sweep))
    for failure in sweep.get("failures", []):
        click.echo(f"  failed: {failure}")


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
        summary = summarize(read_dataset(path))
    except DatasetError as e:
        raise click.ClickException(str(e)) from None
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


def _echo_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
