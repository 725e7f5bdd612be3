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
    if as_json:
        json.dump({
            "out": str(out), "scenarios": int(df["scenario_id"].nunique()), "rows": len(df),
            "verified": int(df["verified"].sum()), "unverified": int((~df["verified"]).sum()),
            "per_scenario": table.to_dict("records"),
        }, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    with_fmt = table.to_string(index=False, float_format=lambda x: f"{x:.3f}")
    click.echo(with_fmt)
    click.echo(f"\n{len(df)} rows ({int(df['verified'].sum())} verified) for "
               f"{df['scenario_id'].nunique()} scenarios -> {out}")


if __name__ == "__main__":
    main()
