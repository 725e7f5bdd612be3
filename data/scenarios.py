"""Scenario tables (CSV or Parquet) -> validated Scenario objects.

Columns: group, op, m, n, k, dtype, world_size, hardware, and for a2a_gemm imbalance
(see ficco_select.scenario). Errors name the file, the row (1-based, header excluded)
and the column.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pandas as pd

from ficco_select.scenario import REQUIRED_COLUMNS, Scenario, ScenarioError
from ficco_select.schedule import backend_problem, candidates

DEFAULT_SCENARIOS = "small.csv"
"""The default small scenario set shipped in data/scenarios/."""


def packaged(name: str) -> Path:
    return Path(str(resources.files("data") / "scenarios" / name))


def read_table(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    if not path.exists():
        raise ScenarioError(f"{path}: no such scenario file")
    if path.suffix == ".parquet":
        return pd.read_parquet(path)
    if path.suffix == ".csv":
        return pd.read_csv(path, dtype=str, keep_default_na=False)
    raise ScenarioError(f"{path}: scenario tables are .csv or .parquet files")


def read_scenarios(path: str | Path, *, backend: str | None = None) -> list[Scenario]:
    """Read and validate a scenario table; with `backend`, also check it can run every row."""
    table = read_table(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise ScenarioError(f"{path}: column '{missing[0]}' is missing (need {', '.join(REQUIRED_COLUMNS)})")
    if table.empty:
        raise ScenarioError(f"{path}: the table has no rows")
    scenarios: list[Scenario] = []
    seen: dict[str, int] = {}
    for i, record in enumerate(table.to_dict("records"), start=1):
        s = Scenario.from_record(record, row=i)
        if backend is not None:
            problem = backend_problem(s, backend)
            if problem:
                raise ScenarioError(f"{path}: row {i}, {problem}")
            if not candidates(s, backend):
                raise ScenarioError(f"{path}: row {i}: no legal schedule on the {backend} backend")
        if s.scenario_id in seen:
            raise ScenarioError(f"{path}: row {i} repeats row {seen[s.scenario_id]} (same scenario)")
        seen[s.scenario_id] = i
        scenarios.append(s)
    return scenarios
