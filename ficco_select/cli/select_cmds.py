"""`ficco select`: the runtime selector's decision on every row of a scenario table.

Parses its options, loads the selector, calls one function for the decisions and prints
them (a table, or JSON with --json). Heavy imports stay inside the command.
"""

from __future__ import annotations

import click

from ficco_select.cli.output import json_option, reported, show

COLUMNS = ("row", "scenario_id", "op", "m,n,k", "P", "hardware", "schedule", "source", "confidence", "reason")


@click.command("select")
@click.option("--scenarios", "scenarios_path", type=click.Path(dir_okay=False), default=None,
              help="Scenario table (CSV or Parquet). Rows are not validated first: an invalid row gets "
                   "the baseline (source fallback) and a null scenario_id. Default with --truth: its scenarios.")
@click.option("--truth", "truth_path", type=click.Path(dir_okay=False), default=None,
              help="A labeled dataset of these scenarios (`ficco simulate`, `ficco measure`): score the decisions "
                   "on it beside the heuristic's and the ceiling, over all rows and per dtype. Refused if a "
                   "scenario lacks some of its candidate schedules (its best would be unknown).")
@click.option("--model", "model_path", type=click.Path(file_okay=False), default=None,
              help="An exported selector folder (`ficco export`). Default: the exported champion "
                   "($FICCO_SELECTOR or ~/.cache/ficco-select/selector) if there is one, else the heuristic.")
@click.option("--heuristic-only", is_flag=True, help="No model: the hand heuristic decides every row.")
@json_option("Print a JSON list, one decision per row.")
def select_cmd(scenarios_path, truth_path, model_path, heuristic_only, as_json) -> None:
    """Which schedule for each row of a scenario table: the runtime selector's decisions.

    One decision per row, in order: row (1-based, header excluded), scenario_id, schedule,
    source (model | heuristic | fallback), confidence, reason. Each layer of the table is
    decided once over its grid of m (its layer table), then every row of it looked up.
    With --truth, the decisions are scored on that dataset instead of listed.
    """
    from ficco_select.data.scenarios import read_rows
    from ficco_select.runtime.batch import decide_rows
    from ficco_select.scenario import ScenarioError

    if model_path and heuristic_only:
        raise click.UsageError("--model and --heuristic-only exclude each other; drop one")
    if not scenarios_path and not truth_path:
        raise click.UsageError("give --scenarios FILE, or --truth DATASET to decide and score its scenarios")
    truth = _truth(truth_path) if truth_path else None
    with reported(ScenarioError):
        records = read_rows(scenarios_path) if scenarios_path else _scenario_records(truth)
    selector = _selector(model_path, heuristic_only)
    if truth is None:
        decisions = decide_rows(selector, records)
        show(as_json, decisions, lambda: _decision_lines(decisions, records, selector, model_path))
        return
    from ficco_select.data.dataset import dataset_machines
    from ficco_select.hardware import machines

    with machines(dataset_machines(truth_path)):  # the truth's machines, as its rows name them
        _score(truth, truth_path, records, selector, as_json)


def _score(truth, truth_path, records: list[dict], selector, as_json: bool) -> None:
    """``ficco select --truth``: the selector's decisions on the truth's scenarios, scored beside
    the heuristic's and the ceiling, over all rows and per dtype."""
    from ficco_select.runtime.batch import decide_rows
    from ficco_select.runtime.selector import Selector
    from ficco_select.train.evaluate import scores_by_dtype
    from ficco_select.train.metrics import format_table

    chosen = {d["scenario_id"]: d["schedule"] for d in decide_rows(selector, records) if d["scenario_id"] is not None}
    heuristic = {d["scenario_id"]: d["schedule"] for d in decide_rows(Selector(), records) if d["scenario_id"]}
    with reported(ValueError, message=lambda e: f"{truth_path}: {e}"):
        tables = scores_by_dtype(truth, {_selector_name(selector): chosen, "heuristic": heuristic})
    show(as_json, {name: table.to_dict("index") for name, table in tables.items()},
         lambda: [line for name, table in tables.items()
                  for line in (f"\n== {name} ({truth_path}) ==", format_table(table))])


def _truth(path):
    """The labeled dataset at `path`, refused before any decision if a scenario lacks some of
    its candidates: its best would be unknown."""
    from ficco_select.data.dataset import DatasetError, read_dataset
    from ficco_select.train.metrics import require_every_candidate

    with reported(DatasetError):
        truth = read_dataset(path)
    with reported(ValueError, message=lambda e: f"--truth {path}: {e}"):
        require_every_candidate(truth)
    return truth


def _scenario_records(truth) -> list[dict]:
    """The scenario rows of a dataset, one per scenario."""
    from ficco_select.scenario import SCENARIO_COLUMNS

    return truth.drop_duplicates("scenario_id")[list(SCENARIO_COLUMNS)].to_dict("records")


def _selector_name(selector) -> str:
    return "shipped" if selector.model is not None else "heuristic only"


def _selector(model_path, heuristic_only: bool):
    """The heuristic alone, the selector exported at `model_path`, or the default one."""
    from ficco_select.runtime.selector import Selector

    if heuristic_only:
        return Selector()
    selector = Selector.load(model_path)
    if model_path and selector.model is None:
        raise click.ClickException(f"--model {model_path}: no usable selector there (see the warning "
                                   "above); export one with `ficco export` or pass --heuristic-only")
    return selector


def _decision_lines(decisions: list[dict], records: list[dict], selector, model_path) -> list[str]:
    """A left-aligned table, one line per row, then the count per source."""
    lines = [COLUMNS] + [(str(d["row"]), d["scenario_id"] or "-", str(r.get("op")),
                          f"{r.get('m')},{r.get('n')},{r.get('k')}", str(r.get("world_size")),
                          str(r.get("hardware")), d["schedule"], d["source"], f"{d['confidence']:.3f}", d["reason"])
                         for d, r in zip(decisions, records)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    counts = {s: sum(d["source"] == s for d in decisions) for s in ("model", "heuristic", "cost_model", "fallback")}
    rules = selector.rules
    run = f" of training run {rules.run_id}" if rules.run_id else ""
    model = (f"model {rules.name}{run} from {model_path or 'the default export'}"
             if selector.model is not None else "heuristic only")
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines] + [
        f"\n{len(decisions)} rows: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({model})"]


COMMANDS = [select_cmd]
