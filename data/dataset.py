"""The labeled dataset format: one Parquet row per (scenario, schedule).

Columns (schema version ``SCHEMA_VERSION``):
- scenario: ``group, op, m, n, k, dtype, world_size, hardware, imbalance, scenario_id``
- label: ``schedule, status`` (``ok`` | ``failed``), ``error`` (reason when failed),
  ``time_s`` (median of ``times_s``, each the slowest rank's), ``time_model_s`` (sim rows:
  the model's noise-free time, which metrics score against; NaN for measured rows),
  ``time_spread``
  (interquartile range / median), ``times_s``, ``attempts`` (timing rounds),
  ``noisy`` (spread still above the limit after re-measuring), ``verified`` (output
  equals the reference on every rank), ``rel_error``, ``is_best`` (fastest verified),
  ``near_best`` (within measurement noise of the fastest verified: a tie)
- signature (per scenario, repeated on its rows): see
  ``ficco_select.signatures.SIGNATURE_COLUMNS``
- provenance: ``backend, hardware_fingerprint, host, torch_version, ficco_version,
  schema_version, created_at``, ``threads_per_rank`` and ``runs_per_rep`` (runs timed
  back to back per repetition; ``times_s`` holds their means; 0 for failed and sim rows). A cuda fingerprint ends with the
  mode that measured it (``-loopback`` or ``-node``).
A file's schema version is also in its Parquet metadata; reading another version is an
error, never a silent mix. So are the hardware specs of its machines that are not presets
(``ficco_hardware``: name -> every spec field): a dataset simulated on a user's spec file
is read back, trained on and validated by name, in any process
(``ficco_select.hardware``'s registry); and, in a measured file, the timing settings its
rows were taken with (``ficco_timing``: ``ficco_select.data.measure.config.TimingPolicy``'s fields), so
that rows timed otherwise are never joined to them (``ficco_select.data.dataset_merge``, a resumed ``ficco measure``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ficco_select import __version__
from ficco_select.hardware import (
    HardwareError,
    HardwareSpec,
    load_hardware,
    machines,
    refuse_shipped_name,
    shipped_names,
    spec_as_dict,
    spec_from_dict,
)
from ficco_select.scenario import SCENARIO_COLUMNS, Scenario, ScenarioError
from ficco_select.schedule import BACKENDS, ScheduleError, engine_candidates, engines_on, hardware_problem, parse
from ficco_select.signatures import SIGNATURE_COLUMNS

SCHEMA_VERSION = 3
"""Version of the dataset columns; readers refuse other versions."""

LABEL_COLUMNS = ("scenario_id", "schedule", "status", "error", "time_s", "time_model_s", "time_spread", "times_s",
                 "attempts", "noisy", "verified", "rel_error", "is_best", "near_best")
PROVENANCE_COLUMNS = ("backend", "hardware_fingerprint", "host", "torch_version", "ficco_version",
                      "schema_version", "created_at")
COLUMNS = (*SCENARIO_COLUMNS, *LABEL_COLUMNS, *SIGNATURE_COLUMNS, "threads_per_rank", "runs_per_rep",
           *PROVENANCE_COLUMNS)
METADATA_KEY = b"ficco_schema_version"
HARDWARE_KEY = b"ficco_hardware"
"""Parquet metadata: JSON {name: spec fields} of the file's machines that are not presets."""
TIMING_KEY = b"ficco_timing"
"""Parquet metadata of a measured file: JSON {setting: value} of the timing policy its rows
were taken with (reps, min_rep_s, ...). Files written before it was recorded lack it."""


def dataset_row(scenario: Scenario, schedule: str, label: dict, *, signature: dict | None = None,
                threads_per_rank: int = 0, runs_per_rep: int = 0, provenance: dict | None = None) -> dict:
    """One row of the dataset: the scenario's columns and id, the schedule, its label
    columns (``label`` holds every ``LABEL_COLUMNS`` entry but the first two:
    ``ficco_select.data.labels.label_columns`` and ``failed_label`` make them), the scenario's signature
    (NaN where it has none), how it was timed, and, when given, its provenance."""
    signature = signature or {}
    return {**scenario.as_record(), "scenario_id": scenario.scenario_id, "schedule": schedule,
            **{c: label[c] for c in LABEL_COLUMNS[2:]}, **{c: signature.get(c, math.nan) for c in SIGNATURE_COLUMNS},
            "threads_per_rank": threads_per_rank, "runs_per_rep": runs_per_rep, **(provenance or {})}


class DatasetError(ValueError):
    """A dataset file cannot be read as this schema version."""


def provenance(backend: str, ranks: str | None = None) -> dict:
    """Where rows come from. ranks: the cuda backend's ``loopback`` or ``node`` mode, which
    the fingerprint ends with (the same GPUs give different labels in the two modes)."""
    fingerprint = _fingerprint(backend)
    return {
        "backend": backend,
        "hardware_fingerprint": f"{fingerprint}-{ranks}" if ranks else fingerprint,
        "host": platform.node(),
        "torch_version": importlib.metadata.version("torch"),  # without importing it: reading needs no torch
        "ficco_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _fingerprint(backend: str) -> str:
    host = f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}cores"
    if backend != "cuda":
        return host
    import torch  # a cuda measurement has it loaded already

    if torch.cuda.is_available():  # the GPU is what was measured
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()}-sm{major}{minor}-{torch.cuda.device_count()}gpu-cuda{torch.version.cuda}"
    return host


def write_parquet_atomic(df: pd.DataFrame, path: str | Path, *, timing: dict | None = None) -> None:
    """Write `df` with the schema version (and, for measured rows, the `timing` settings they
    were taken with) in its metadata; readers never see a partial file. A symlink at `path`
    is followed: the file it names is the one replaced."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = {**(table.schema.metadata or {}), METADATA_KEY: str(SCHEMA_VERSION).encode()}
    specs = user_specs(df)
    if specs:
        meta[HARDWARE_KEY] = json.dumps(specs, sort_keys=True).encode()
    if timing is not None:
        meta[TIMING_KEY] = json.dumps(timing, sort_keys=True).encode()
    table = table.replace_schema_metadata(meta)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def user_specs(df: pd.DataFrame) -> dict[str, dict]:
    """name -> every spec field, for `df`'s machines that are not shipped ones, as the job
    knows them (``machines``): what a dataset file and a model carry so that the names
    resolve elsewhere. A name the job does not know is left out (``validate`` names it)."""
    if "hardware" not in df.columns:
        return {}
    presets = shipped_names()
    specs = {}
    for name in sorted(set(df["hardware"].dropna().astype(str)) - presets):
        try:
            specs[name] = spec_as_dict(load_hardware(name))
        except HardwareError:
            pass  # unknown here: `validate` names it; nothing to carry
    return specs


def attach_repeat(df: pd.DataFrame, repeat: pd.DataFrame) -> pd.DataFrame:
    """`df` with ``time_repeat_s`` and ``near_best_repeat``: each row's time and tie label in
    `repeat`, an independent second sweep of some of its scenarios (NaN / False where
    `repeat` has no usable row for it). Metrics score a measured row on them
    (``ficco_select.train.metrics``): a selector is then judged on times it never learned from, and the
    ceiling is the repeat oracle."""
    ok = repeat[(repeat["status"] == "ok") & repeat["verified"].eq(True)]
    by_row = ok.set_index(["scenario_id", "schedule"])
    if by_row.index.has_duplicates:
        raise DatasetError("the repeat sweep has a (scenario_id, schedule) twice; one sweep per file")
    key = pd.MultiIndex.from_frame(df[["scenario_id", "schedule"]])
    return df.assign(time_repeat_s=by_row["time_s"].reindex(key).to_numpy(float),
                     near_best_repeat=by_row["near_best"].reindex(key).eq(True).to_numpy())


def read_dataset(path: str | Path) -> pd.DataFrame:
    """Read a dataset, refusing files of another schema version or with unusable machine
    specs. Its rows name machines; the job that works on them knows the file's own with
    ``machines(dataset_machines(path))``: reading changes what no name means."""
    dataset_machines(path)  # a file whose specs are unusable is refused on reading
    try:
        return pd.read_parquet(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{path}: unreadable Parquet file ({e})") from None


def dataset_machines(path: str | Path) -> list[tuple[HardwareSpec, str]]:
    """The specs a dataset carries for its machines that are not shipped ones (its Parquet
    metadata, ``user_specs``), each with where it came from: what ``machines`` takes.
    DatasetError if the file is not a dataset of this schema version, or a spec is unusable."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such dataset file")
    if not path.is_file():
        raise DatasetError(f"{path}: not a file (a dataset is a Parquet file)")
    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{path}: not a Parquet file ({e})") from None
    version = meta.get(METADATA_KEY)
    if version is None:
        raise DatasetError(f"{path}: no ficco schema version in its metadata; not a ficco dataset")
    try:
        version = int(version)
    except ValueError:
        raise DatasetError(f"{path}: metadata {METADATA_KEY.decode()} is {version.decode(errors='replace')!r}, "
                           "not a schema version number; not a ficco dataset") from None
    if version != SCHEMA_VERSION:
        raise DatasetError(f"{path}: schema version {version}, this ficco-select reads version "
                           f"{SCHEMA_VERSION}; re-measure or convert it")
    try:
        specs = json.loads(meta.get(HARDWARE_KEY, b"{}"))
        if not isinstance(specs, dict):
            raise HardwareError("not a mapping of machine names to specs")
        known = [(spec_from_dict(fields, f"hardware spec {name!r}"), f"{path}: hardware spec {name!r}")
                 for name, fields in specs.items()]
        for spec, where in known:
            refuse_shipped_name(spec, where)
        return known
    except (ValueError, HardwareError) as e:
        raise DatasetError(f"{path}: its hardware specs (metadata {HARDWARE_KEY.decode()}) are unusable: {e}") from None


def read_valid_dataset(path: str | Path) -> pd.DataFrame:
    """``read_dataset``, refusing a file in which ``validate`` finds a problem: the first one,
    naming the file, row and column."""
    df = read_dataset(path)
    with machines(dataset_machines(path)):
        refuse_invalid(df, path)
    return df


def refuse_invalid(df: pd.DataFrame, path: str | Path) -> None:
    """DatasetError naming `path` and the first problem ``validate`` finds in `df` (its row
    and column), if any."""
    problems = validate(df, max_problems=1)
    if problems:
        raise DatasetError(f"{path}: {problems[0]}; `ficco dataset validate {path}` lists every problem")


def read_timing(path: str | Path) -> dict | None:
    """The timing settings a measured file records (``TIMING_KEY``), or None if it records none."""
    try:
        raw = (pq.read_schema(path).metadata or {}).get(TIMING_KEY)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{path}: not a Parquet file ({e})") from None
    if raw is None:
        return None
    try:
        timing = json.loads(raw)
    except ValueError as e:
        raise DatasetError(f"{path}: metadata {TIMING_KEY.decode()} is not JSON ({e})") from None
    if not isinstance(timing, dict):
        raise DatasetError(f"{path}: metadata {TIMING_KEY.decode()} is not a mapping of settings to values")
    return timing


def unlike_timing(timing: dict | None, other: dict | None, other_name: str) -> str | None:
    """Why rows timed with `timing` are not timed like `other_name`'s (timed with `other`):
    the settings that differ, or that only one of them records its settings (unknown
    settings are never taken to be equal). None if they are alike, or if neither records
    any (files written before the settings were recorded: nothing to compare)."""
    if timing is None and other is None:
        return None
    if timing is None or other is None:
        lacking = "it records" if timing is None else f"{other_name} records"
        return (f"{lacking} no timing settings (written before ficco recorded them), so their rows cannot be "
                "shown to be timed alike")
    differ = [k for k in sorted(timing.keys() | other.keys()) if timing.get(k) != other.get(k)]
    if not differ:
        return None
    return (f"measured with {', '.join(f'{k} {timing.get(k)}' for k in differ)}, {other_name} with "
            f"{', '.join(f'{k} {other.get(k)}' for k in differ)}")


def validate(df: pd.DataFrame, *, max_problems: int = 50) -> list[str]:
    """Check schema and invariants; return problems naming row (0-based) and column."""
    problems: list[str] = []

    def problem(msg: str) -> bool:
        problems.append(msg)
        return len(problems) >= max_problems

    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        return [f"column '{c}' is missing" for c in missing]
    bad_version = df.index[df["schema_version"] != SCHEMA_VERSION]
    if len(bad_version):
        return [f"row {bad_version[0]}, column 'schema_version': {df.loc[bad_version[0], 'schema_version']}"
                f" != {SCHEMA_VERSION}"]
    backends = df["backend"].dropna().unique()
    if len(backends) > 1:  # measured and simulated labels answer different questions: one file, one source
        other = df.index[df["backend"] != df["backend"].iloc[0]][0]
        problem(f"row {other}, column 'backend': {df.at[other, 'backend']!r}, but row {df.index[0]} is "
                f"{df['backend'].iloc[0]!r}: a dataset holds one backend's rows (keep them in separate files)")
    dup = df.duplicated(["scenario_id", "schedule"], keep="first")
    for i in df.index[dup]:
        if problem(f"row {i}: (scenario_id, schedule) = ({df.at[i, 'scenario_id']}, {df.at[i, 'schedule']}) repeats"):
            return problems
    for sid, g in df.groupby("scenario_id", sort=False):
        first = g.index[0]
        try:
            scenario = Scenario.from_record(g.loc[first, list(SCENARIO_COLUMNS)].to_dict(), row=first)
        except ScenarioError as e:
            if problem(str(e)):
                return problems
            continue
        if scenario.scenario_id != sid:
            if problem(f"row {first}, column 'scenario_id': {sid} does not match its columns "
                       f"(expected {scenario.scenario_id})"):
                return problems
        for col in SCENARIO_COLUMNS:
            if g[col].nunique(dropna=False) > 1:
                if problem(f"row {g.index[1]}, column '{col}': differs within scenario {sid}"):
                    return problems
        backend = g.at[first, "backend"]
        if backend not in BACKENDS:
            if problem(f"row {first}, column 'backend': unknown backend {backend!r}; expected one of "
                       f"{', '.join(BACKENDS)}"):
                return problems
            continue
        wrong_machine, engines = row_hardware_problem(scenario, backend)
        if wrong_machine and problem(f"row {first}, {wrong_machine}"):
            return problems
        expected = {s.name for s in engine_candidates(scenario, backend, engines)}
        for i, name in g["schedule"].items():
            try:
                parse(name)
            except ScheduleError as e:
                if problem(f"row {i}, column 'schedule': {e}"):
                    return problems
        if set(g["schedule"]) != expected:
            lacking = sorted(expected - set(g["schedule"]))
            extra = sorted(set(g["schedule"]) - expected)
            if problem(f"row {first}, column 'schedule': scenario {sid} lacks {lacking[:3]} / has illegal "
                       f"{extra[:3]} on backend {backend}"):
                return problems
        for msg in _check_labels(g):
            if problem(msg):
                return problems
    return problems


def row_hardware_problem(s: Scenario, backend: str) -> tuple[str | None, tuple[str, ...]]:
    """Whether rows of `backend` may carry `s.hardware` (None if so; ``schedule.hardware_problem``),
    and the engines its candidates use."""
    try:
        spec = load_hardware(s.hardware)
    except HardwareError:
        return (f"column 'hardware': unknown hardware {s.hardware!r}: not a preset, and the file carries no "
                "spec for it", tuple(e for e in BACKENDS[backend].engines if e != "switch"))  # no spec: no switch
    return hardware_problem(s, backend, spec), engines_on(backend, spec)


def _check_labels(g: pd.DataFrame) -> list[str]:
    out = []
    status = set(g["status"])
    if not status <= {"ok", "failed"} or len(status) != 1:
        return [f"row {g.index[0]}, column 'status': {sorted(map(str, status))}; expected all 'ok' or all 'failed'"]
    if status == {"failed"}:
        if (g["error"] == "").any():
            out.append(f"row {g.index[0]}, column 'error': a failed scenario needs its reason")
        return out
    for i, r in g.iterrows():
        t = r["time_s"]
        if not (isinstance(t, float) and math.isfinite(t) and t > 0):
            out.append(f"row {i}, column 'time_s': {t!r} is not a positive time")
            continue
        truth = r["time_model_s"]
        if (r["backend"] == "sim") != (isinstance(truth, float) and math.isfinite(truth) and truth > 0):
            out.append(f"row {i}, column 'time_model_s': {truth!r}; a positive time on sim rows (the model's "
                       "noise-free time), NaN on measured rows")
        times = np.asarray(r["times_s"], dtype=float)
        if len(times) < 5:
            out.append(f"row {i}, column 'times_s': {len(times)} repetitions, need at least 5")
        elif not math.isclose(float(np.median(times)), t, rel_tol=1e-9):
            out.append(f"row {i}, column 'time_s': is not the median of times_s")
        if not r["time_spread"] >= 0:
            out.append(f"row {i}, column 'time_spread': {r['time_spread']} < 0")
        if r["is_best"] and not r["verified"]:
            out.append(f"row {i}, column 'is_best': an unverified schedule is labelled best")
        if r["is_best"] and not r["near_best"]:
            out.append(f"row {i}, column 'near_best': the best must be a near-best")
    ok = g[g["verified"]]
    if len(ok):
        best = g[g["is_best"]]
        if len(best) < 1 or best["time_s"].min() != ok["time_s"].min():
            out.append(f"row {g.index[0]}, column 'is_best': does not mark the fastest verified schedule")
    first = g.iloc[0]
    if not (first["t_comp_s"] > 0 and first["t_comm_s"] > 0):
        out.append(f"row {g.index[0]}, column 't_comp_s': compute and communication times must be positive")
    elif not 1.0 <= first["ideal_speedup"] <= 2.0 + 1e-9:
        out.append(f"row {g.index[0]}, column 'ideal_speedup': {first['ideal_speedup']} outside [1, 2]")
    return out
