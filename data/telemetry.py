"""Telemetry lines (``ficco_select.runtime.telemetry``) -> labeled dataset rows (``ficco_select.data.dataset`` schema).

A job that records telemetry times the schedules it really ran, on every rank, every
call. ``read_telemetry`` turns those lines into one dataset row per (scenario, schedule):

- a call's time is the slowest rank's: the max over the ranks' lines of that call. A call
  with fewer ranks than the (scenario, schedule)'s fullest call is dropped (a job killed
  mid-call: the missing rank may have been the slowest);
- ``times_s`` are the calls' times in call order, ``time_s`` their median, ``time_spread``
  their interquartile range / median (``ficco_select.data.labels.summarize``), ``attempts`` the
  number of calls, ``noisy`` as in the harness;
- ``verified`` is True only if at least one rank's check passed and none failed; a failed
  check makes the row ``status='failed'`` with the rank, call and relative error in
  ``error``, so it is never a label;
- ``is_best`` / ``near_best`` among the scenario's verified rows, by the rule every source
  labels with (``ficco_select.data.labels.best_labels``);
- signature columns are NaN (a job does not measure them), ``threads_per_rank`` is 0,
  provenance: ``backend`` from the lines, ``hardware_fingerprint`` ``telemetry:<hardware>``
  (these rows came from a job, not a controlled sweep), ``created_at`` the last line's
  time; the lines do not say host, torch or ficco version (empty).

These rows are not a complete dataset: a job runs one or two schedules per scenario, not
every candidate, and often fewer than five calls. ``ficco_select.data.dataset.validate`` reports both;
training uses them only as extra rows (``ficco_select.train.training_data.telemetry_training_rows``).

Malformed lines (not JSON, a truncated last line of a killed job, a missing field, a field
of the wrong type, an invalid scenario or schedule, a rank outside the job's world size)
are skipped with one warning per file naming the lines and fields; a file with no usable
line is an error naming its first such line. Two jobs appending to one file both count calls
from 0: the n-th repeat of a (scenario, schedule, call, rank) is taken as the n-th job.

A machine's learned record (``ficco_select.runtime.learned``) is read here too, by content:
its rows come from ``ficco_select.data.learned``.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from ficco_select.data.dataset import COLUMNS, SCHEMA_VERSION, dataset_row, row_hardware_problem
from ficco_select.data.labels import label_columns
from ficco_select.data.learned import LearnedRecordError, learned_record, learned_rows
from ficco_select.data.measure.config import TimingPolicy
from ficco_select.runtime.telemetry import TELEMETRY_VERSION
from ficco_select.scenario import REQUIRED_COLUMNS, Scenario, ScenarioError
from ficco_select.schedule import BACKENDS, ScheduleError, is_legal, parse

log = logging.getLogger("ficco_select.data.telemetry")

LINE_FIELDS = (*REQUIRED_COLUMNS, "scenario_id", "schedule", "source", "rank", "call", "time_s",
               "verified", "rel_error", "backend", "ts")
"""Fields every line must have (``imbalance`` may be omitted: 1.0)."""
FIELD_TYPES = {
    **dict.fromkeys(("group", "op", "dtype", "hardware", "scenario_id", "schedule", "source", "backend", "ts"),
                    "a string"),
    **dict.fromkeys(("m", "n", "k", "world_size", "rank", "call"), "an integer"),
    **dict.fromkeys(("imbalance", "time_s"), "a number"),
    "verified": "true, false or null", "rel_error": "a number or null",
}
"""The JSON type of each field, as the runtime's writer writes it: a line with another is
skipped, naming the field (read as text, a list or a number would pass for another value)."""
POLICY = TimingPolicy()
"""The harness's noise and tie thresholds, so telemetry rows are labeled like measured ones."""
SHOWN_PROBLEMS = 5
"""Skipped lines named in a file's warning; the rest are counted."""


class TelemetryError(ValueError):
    """A telemetry file cannot be used at all (missing, no usable line, another version)."""


class _BadLine(ValueError):
    """One line is skipped; the message says which field is wrong."""


def read_telemetry(paths: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """Dataset rows (columns ``ficco_select.data.dataset.COLUMNS``), one per (scenario, schedule) in the lines.

    Pass every rank's file of a job together (``{rank}`` paths): a call's time is the
    slowest rank's only if all ranks' lines are there. A machine's learned record
    (``ficco_select.runtime.learned``, detected by content) gives one row per (scenario,
    arm) (``ficco_select.data.learned``); where it holds a scenario that telemetry lines
    hold too, its rows are kept and the lines' are not (one row per (scenario, schedule)).
    """
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not paths:
        raise TelemetryError("no telemetry file given")
    records = {path: record for path in paths if (record := learned_record(path)) is not None}
    lines = [line for path in paths if path not in records for line in _read_lines(path)]
    rows = _aggregate(pd.DataFrame(lines)) if lines else None
    if not records:
        return rows
    try:
        learned = learned_rows(records)
    except LearnedRecordError as e:
        raise TelemetryError(str(e)) from None
    if rows is None or rows.empty:
        return learned
    both = set(rows["scenario_id"]) & set(learned["scenario_id"])
    if both:
        log.warning("%d scenario(s) are both in telemetry lines and in a learned record (e.g. %s): the record's "
                    "rows are kept", len(both), min(both))
    kept = [frame for frame in (rows[~rows["scenario_id"].isin(both)], learned) if len(frame)]
    return pd.concat(kept, ignore_index=True) if kept else learned


# -- reading -----------------------------------------------------------------------------
def _read_lines(path: Path) -> list[dict]:
    """The usable lines of one file, each tagged with its file and line number."""
    if not path.is_file():
        raise TelemetryError(f"{path}: no such telemetry file")
    good, problems, backend_of = [], [], {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                line = _parse(text, path, number)
                # One scenario, one backend: its candidates and legality depend on it.
                first = backend_of.setdefault(line["scenario_id"], (line["backend"], number))
                if first[0] != line["backend"]:
                    raise _BadLine(f"field 'backend': {line['backend']!r}, but line {first[1]} recorded this "
                                   f"scenario on {first[0]!r}")
            except _BadLine as e:
                problems.append(f"line {number}: {e}")
                continue
            good.append({**line, "file": str(path), "line": number})
    if not good:
        first = f"; {problems[0]}" if problems else " (the file is empty)"
        raise TelemetryError(f"{path}: no usable telemetry line{first}")
    if problems:
        more = f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        log.warning("%s: skipped %d malformed telemetry line(s): %s%s", path, len(problems),
                    "; ".join(problems[:SHOWN_PROBLEMS]), more)
    return good


def _parse(text: str, path: Path, number: int) -> dict:
    """One line -> a checked, normalized dict; raises _BadLine naming the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadLine(f"not JSON ({e.msg}; a truncated line of a killed job?)") from None
    if not isinstance(raw, dict):
        raise _BadLine("not a JSON object")
    if raw.get("v") != TELEMETRY_VERSION:
        # Another format version is not a damaged line: refuse rather than guess its fields.
        raise TelemetryError(f"{path}: line {number}: telemetry version {raw.get('v')!r}; this ficco-select "
                             f"reads version {TELEMETRY_VERSION}")
    missing = [f for f in LINE_FIELDS if f not in raw]
    if missing:
        raise _BadLine(f"missing field '{missing[0]}'")
    for field, kind in FIELD_TYPES.items():
        if field in raw and not _IS[kind](raw[field]):
            raise _BadLine(f"field '{field}': must be {kind}, got {reprlib.repr(raw[field])}")
    try:
        scenario = Scenario.from_record(raw)
    except ScenarioError as e:
        raise _BadLine(f"invalid scenario: {e}") from None
    if raw["scenario_id"] != scenario.scenario_id:
        raise _BadLine(f"field 'scenario_id': {raw['scenario_id']!r} does not match its scenario columns "
                       f"(expected {scenario.scenario_id})")
    backend = raw["backend"]
    if backend not in BACKENDS:
        raise _BadLine(f"field 'backend': unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    why, _ = row_hardware_problem(scenario, backend)  # the rule `ficco dataset validate` applies
    if why:
        raise _BadLine(why.replace("column '", "field '", 1))
    try:
        schedule = parse(raw["schedule"])
    except (ScheduleError, TypeError) as e:
        raise _BadLine(f"field 'schedule': {e}") from None
    if not is_legal(schedule, scenario, backend):
        raise _BadLine(f"field 'schedule': {schedule.name} is not a legal schedule of this scenario on the "
                       f"{backend} backend")
    if not 0 <= raw["rank"] < scenario.world_size:  # another job's line: its time is no rank's of this one
        raise _BadLine(f"field 'rank': {raw['rank']} is not a rank of this job (world_size {scenario.world_size}: "
                       f"ranks 0 to {scenario.world_size - 1})")
    if raw["call"] < 0:
        raise _BadLine(f"field 'call': must be a non-negative integer, got {raw['call']!r}")
    t = raw["time_s"]
    if not math.isfinite(t) or t <= 0:
        raise _BadLine(f"field 'time_s': must be a positive number of seconds, got {t!r}")
    return {**scenario.as_record(), "scenario_id": scenario.scenario_id, "schedule": schedule.name,
            "rank": raw["rank"], "call": raw["call"], "time_s": float(t), "verified": raw["verified"],
            "rel_error": math.nan if raw["rel_error"] is None else float(raw["rel_error"]),
            "backend": backend, "ts": str(raw["ts"])}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_IS = {"a string": lambda v: isinstance(v, str), "an integer": _is_int, "a number": _is_number,
       "true, false or null": lambda v: v is None or isinstance(v, bool),
       "a number or null": lambda v: v is None or _is_number(v)}
"""Each kind of ``FIELD_TYPES``: whether a JSON value is one."""


# -- aggregating -------------------------------------------------------------------------
def _aggregate(lines: pd.DataFrame) -> pd.DataFrame:
    """Lines (one per rank and call) -> rows (one per scenario and schedule)."""
    key = ["scenario_id", "schedule"]
    # The n-th repeat of (scenario, schedule, call, rank) comes from the n-th job that wrote it.
    lines = lines.assign(job=lines.groupby([*key, "call", "rank"]).cumcount())
    calls = (lines.groupby([*key, "job", "call"], sort=True)
             .agg(time_s=("time_s", "max"), ranks=("rank", "nunique")).reset_index())
    fullest = calls.groupby(key)["ranks"].transform("max")
    times_of = calls[calls["ranks"] == fullest].groupby(key)["time_s"].agg(list)  # in (job, call) order
    _warn_missing_ranks(lines)

    rows = []
    for _, scenario_lines in lines.groupby("scenario_id", sort=False):
        first = scenario_lines.iloc[0]
        scenario = Scenario.from_record(first.to_dict())
        pairs = list(scenario_lines.groupby(key, sort=False))
        verdicts = [_verdict(g) for _, g in pairs]
        times = [times_of[key_] for key_, _ in pairs]
        labels = label_columns(times, verified=[v["verified"] for v in verdicts],
                               rel_error=[v["rel_error"] for v in verdicts], attempts=[len(t) for t in times],
                               noisy_spread=POLICY.noisy_spread, tie_floor=POLICY.tie_floor)
        provenance = {"backend": first["backend"], "hardware_fingerprint": f"telemetry:{first['hardware']}",
                      "host": "", "torch_version": "", "ficco_version": "", "schema_version": SCHEMA_VERSION,
                      "created_at": max(scenario_lines["ts"])}
        rows += [dataset_row(scenario, schedule, {"status": v["status"], "error": v["error"], "time_model_s": math.nan,
                                                  **{c: column[i] for c, column in labels.items()}},
                             runs_per_rep=1, provenance=provenance)
                 for i, ((_, schedule), v) in enumerate(zip((k for k, _ in pairs), verdicts))]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _verdict(g: pd.DataFrame) -> dict:
    """One (scenario, schedule)'s verification from its lines `g` (every rank and call):
    failed when any line's output was wrong (the error names the first), verified when
    some line checked it and none failed."""
    failed = g[g["verified"].eq(False)]
    error = ""
    if len(failed):
        bad = failed.iloc[0]
        error = (f"verification failed: relative error {bad['rel_error']:.3g} on rank {bad['rank']}, "
                 f"call {bad['call']} ({bad['file']}, line {bad['line']})")
    return {"status": "failed" if len(failed) else "ok", "error": error,
            "verified": bool(g["verified"].eq(True).any() and not len(failed)),
            "rel_error": float(g["rel_error"].max()) if g["rel_error"].notna().any() else math.nan}


def _warn_missing_ranks(lines: pd.DataFrame) -> None:
    """Times from fewer ranks than the world size are not the slowest rank's: say so once."""
    ranks = lines.groupby(["scenario_id", "schedule"]).agg(ranks=("rank", "nunique"), P=("world_size", "first"))
    short = ranks[ranks["ranks"] < ranks["P"]]
    if len(short):
        sid, name = short.index[0]
        log.warning("telemetry of %d (scenario, schedule) pair(s) has lines from fewer ranks than the world "
                    "size (e.g. %s %s: %d of %d); pass every rank's file, or those times may miss the "
                    "slowest rank", len(short), sid, name, short.iloc[0]["ranks"], short.iloc[0]["P"])
