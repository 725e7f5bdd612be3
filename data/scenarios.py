"""Scenario tables (CSV or Parquet) -> validated Scenario objects.

Columns: group, op, m, n, k, dtype, world_size, hardware, and for a2a_gemm imbalance
(see ficco_select.scenario). Errors name the file, the row (1-based, header excluded)
and the column.

A ``hardware`` cell is a machine's name (a preset, e.g. ``h100-nvswitch``) or a spec file
(``./my-node.yaml``, relative to the working directory). A file becomes the ``name`` it
declares, so a scenario's id and every row written from it are the same whether the table
named the machine or its file.
"""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import pandas as pd
import pyarrow as pa

from ficco_select.hardware import HardwareError, HardwareSpec, Known, is_spec_path, load_hardware
from ficco_select.scenario import REQUIRED_COLUMNS, Scenario, ScenarioError
from ficco_select.schedule import backend_problem, candidates, hardware_problem

DEFAULT_SCENARIOS = "small.csv"
"""The default small scenario set shipped in data/scenarios/."""


def packaged(name: str) -> Path:
    return Path(str(resources.files("ficco_select.data") / "scenarios" / name))


def read_table(path: str | Path) -> pd.DataFrame:
    """The raw rows of a scenario table (CSV cells as strings); refuses an unreadable,
    empty or truncated file, naming it (and the row)."""
    path = Path(path)
    if not path.exists():
        raise ScenarioError(f"{path}: no such scenario file")
    if not path.is_file():
        raise ScenarioError(f"{path}: not a file (a scenario table is a .csv or .parquet file)")
    if path.suffix == ".parquet":
        try:
            table = pd.read_parquet(path)
        except (pa.ArrowException, OSError) as e:
            raise ScenarioError(f"{path}: not a readable Parquet file ({e})") from None
    elif path.suffix == ".csv":
        table = _read_csv(path)
    else:
        raise ScenarioError(f"{path}: scenario tables are .csv or .parquet files")
    if table.empty:
        raise ScenarioError(f"{path}: the table has no rows")
    return table


def _read_csv(path: Path) -> pd.DataFrame:
    # The csv module, not pandas: a short row (a file cut off mid-write) must be an error
    # naming the row, where pandas would fill the missing cells with blanks.
    try:
        with path.open(newline="", encoding="utf-8") as f:
            lines = [line for line in csv.reader(f) if line]
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not a text (UTF-8) file; a scenario table is CSV text") from None
    except (csv.Error, OSError) as e:
        raise ScenarioError(f"{path}: not a readable CSV file ({e})") from None
    if not lines:
        raise ScenarioError(f"{path}: the file is empty; a scenario table starts with a header line "
                            f"({','.join(REQUIRED_COLUMNS)})")
    header = [c.strip() for c in lines[0]]
    for i, line in enumerate(lines[1:], start=1):
        if len(line) != len(header):
            raise ScenarioError(f"{path}: row {i} has {len(line)} fields, the header has {len(header)} "
                                "(a truncated or malformed file?)")
    return pd.DataFrame(lines[1:], columns=header, dtype=str)


def read_scenarios(path: str | Path, *, backend: str | None = None, hardware: str | None = None) -> list[Scenario]:
    """Read and validate a scenario table; with `backend`, also check it can run every row,
    on a known machine that suits the backend (``schedule.hardware_problem``).

    hardware: a machine (name or spec file) that replaces every row's. Spec-file hardware
    becomes the spec's name.
    """
    scenarios: list[Scenario] = []
    seen: dict[str, int] = {}
    for i, record in enumerate(read_rows(path), start=1):
        machine = hardware or str(record["hardware"]).strip()
        spec = None
        if is_spec_path(machine) or backend is not None:
            record, spec = _under_spec_name(path, i, record, machine, hardware)
        s = _scenario(path, i, record)
        if backend is not None:
            problem = backend_problem(s, backend) or hardware_problem(s, backend, spec)
            if problem:
                raise ScenarioError(f"{path}: row {i}, {problem}")
            if not candidates(s, backend):
                raise ScenarioError(f"{path}: row {i}: no legal schedule on the {backend} backend")
        if s.scenario_id in seen:
            raise ScenarioError(f"{path}: row {i} repeats row {seen[s.scenario_id]} (same scenario)")
        seen[s.scenario_id] = i
        scenarios.append(s)
    return scenarios


def table_machines(path, hardware: str | None = None) -> Known:
    """The spec files a scenario table's hardware column names (or `hardware`, which replaces
    it), read, for ``machines``: a job that works on the table's rows names those machines.
    Read the table with ``read_scenarios`` first: it names a bad row."""
    values = {hardware} if hardware else {str(r["hardware"]).strip() for r in read_rows(path)}
    return [(load_hardware(v), v) for v in sorted(values) if is_spec_path(v)]


def read_rows(path) -> list[dict]:
    """The raw rows of the scenario table `path`, unvalidated (``ficco select`` decides each,
    bad ones included); refuses a file that lacks a required column (the wrong file, not a
    bad row: every row would silently fall back). Raises ScenarioError."""
    table = read_table(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise ScenarioError(f"{path}: column '{missing[0]}' is missing (need {', '.join(REQUIRED_COLUMNS)})")
    return table.to_dict("records")


def read_layers(path) -> list[Scenario]:
    """The layers of a scenario table (``ficco export --layers``): its rows with ``m``
    ignored (set to the world size, valid for every op), validated, spec-file hardware under
    its spec's name, one scenario per distinct layer. Raises ScenarioError naming the row."""
    layers: dict[tuple, Scenario] = {}
    for i, record in enumerate(read_rows(path), start=1):
        machine = str(record["hardware"]).strip()
        if is_spec_path(machine):
            record, _ = _under_spec_name(path, i, record, machine)
        s = _scenario(path, i, {**record, "m": record.get("world_size")})
        layers.setdefault(s.layer, s)
    return list(layers.values())


def _under_spec_name(path, row: int, record: dict, machine: str, given: str | None = None) -> tuple[dict, HardwareSpec]:
    """`record` with its hardware under the spec's name, and the spec of `machine` (a name
    or a spec file); ScenarioError naming the row, or `given` (--hardware) if it was given."""
    try:
        spec = load_hardware(machine)
    except HardwareError as e:
        where = f"--hardware {given}" if given else f"row {row}, column 'hardware'"
        raise ScenarioError(f"{path}: {where}: {e}") from None
    return {**record, "hardware": spec.name}, spec


def _scenario(path, row: int, record: dict) -> Scenario:
    try:
        return Scenario.from_record(record, row=row)
    except ScenarioError as e:
        raise ScenarioError(f"{path}: {e}") from None
