"""A machine's learned record (``ficco_select.runtime.learned``) -> labeled dataset rows.

Online learning times a shape's contending schedules ("arms") in rounds, each round's time
already the slowest rank's, and keeps them in the machine's record. ``learned_rows`` turns
each (scenario, arm) into one dataset row the way ``ficco_select.data.telemetry`` turns a
(scenario, schedule)'s calls into one:

- ``times_s`` the arm's round times (files in the order given, each file's in round order),
  ``time_s`` their median, ``time_spread``, ``attempts``, ``noisy`` as in the harness;
- ``verified`` from the entry's ``verified``: false makes the row ``status='failed'`` (never a
  label), null or absent leaves it unverified (not a label either); ``rel_error`` NaN (the
  record keeps none);
- ``is_best`` / ``near_best`` among the scenario's verified arms, by the rule every source
  labels with (``ficco_select.data.labels.best_labels``);
- provenance: ``backend`` from the entry, ``hardware_fingerprint`` ``learned:<machine>``
  (machines joined by ``+`` where two records hold the scenario), ``torch_version`` and
  ``ficco_version`` from the record's key, ``created_at`` the latest ``settled_at``.

An arm with no round time is no row, unless its check failed (a failed row: the schedule is
wrong there). A record is detected by content (``learned_record``): one JSON object with
``"kind": "ficco-learned"``. Bad content is an error naming the file, the scenario and the field.
"""

from __future__ import annotations

import json
import math
import reprlib
from pathlib import Path

import pandas as pd

from ficco_select.data.dataset import COLUMNS, SCHEMA_VERSION, dataset_row, row_hardware_problem
from ficco_select.data.labels import failed_label, label_columns
from ficco_select.data.measure.config import TimingPolicy
from ficco_select.runtime.learned import KIND, RECORD_VERSION
from ficco_select.scenario import Scenario, ScenarioError
from ficco_select.schedule import BACKENDS, ScheduleError, is_legal, parse

POLICY = TimingPolicy()
"""The harness's noise and tie thresholds, so learned rows are labeled like measured ones."""


class LearnedRecordError(ValueError):
    """A learned record holds something unusable; says the file, the scenario and the field."""


def learned_record(path: str | Path) -> dict | None:
    """The record `path` holds if it is one (a whole-file JSON object of kind ``ficco-learned``), else None."""
    path = Path(path)
    if not path.is_file():
        return None
    with path.open(encoding="utf-8", errors="replace") as f:
        first = f.readline()
        try:  # a telemetry file's first line is a whole object; the runtime writes a record on one line
            data = json.loads(first)
        except json.JSONDecodeError:
            try:  # a record laid out on many lines (by hand, or pretty-printed)
                data = json.loads(first + f.read())
            except json.JSONDecodeError:
                return None
    return data if isinstance(data, dict) and data.get("kind") == KIND else None


def learned_rows(records: dict[Path, dict]) -> pd.DataFrame:
    """Dataset rows (``ficco_select.data.dataset.COLUMNS``), one per (scenario, arm) of the
    records (path -> ``learned_record``'s object); raises LearnedRecordError."""
    scenarios: dict[str, dict] = {}
    for path, data in records.items():
        machine, versions = _key(path, data)
        for sid, entry in data["shapes"].items():
            _add(scenarios, path, str(sid), entry, machine, versions)
    rows = []
    for s in scenarios.values():
        rows += _rows(s)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _key(path: Path, data: dict) -> tuple[str, dict]:
    """The record's machine and versions; its format checked."""
    if data.get("v") != RECORD_VERSION:
        raise LearnedRecordError(f"{path}: learned record version {data.get('v')!r}; this ficco-select reads "
                                 f"version {RECORD_VERSION}")
    key = data.get("key")
    if not isinstance(key, dict):
        raise LearnedRecordError(f"{path}: field 'key': must be an object")
    if not isinstance(key.get("machine"), str) or not key["machine"]:
        raise LearnedRecordError(f"{path}: field 'key.machine': must be a non-empty string")
    if not isinstance(key.get("versions"), dict):
        raise LearnedRecordError(f"{path}: field 'key.versions': must be an object")
    if not isinstance(data.get("shapes"), dict) or not data["shapes"]:
        raise LearnedRecordError(f"{path}: field 'shapes': must be an object holding at least one shape")
    return key["machine"], key["versions"]


def _add(scenarios: dict, path: Path, sid: str, entry, machine: str, versions: dict) -> None:
    """One shape's entry, checked, joined into `scenarios` (scenario_id -> its arms so far)."""
    def bad(field: str, why: str) -> LearnedRecordError:
        return LearnedRecordError(f"{path}: scenario {sid}: field '{field}': {why}")

    if not isinstance(entry, dict):
        raise bad("shapes", "the entry must be an object")
    if not isinstance(entry.get("record"), dict):
        raise bad("record", "must be an object of the scenario's columns")
    try:
        scenario = Scenario.from_record(entry["record"])
    except ScenarioError as e:
        raise bad("record", f"invalid scenario: {e}") from None
    if scenario.scenario_id != sid:
        raise bad("record", f"its columns are scenario {scenario.scenario_id}, not the id it is kept under")
    backend = entry.get("backend")
    if backend not in BACKENDS:
        raise bad("backend", f"unknown backend {reprlib.repr(backend)}; expected one of {', '.join(BACKENDS)}")
    why, _ = row_hardware_problem(scenario, backend)  # the rule `ficco dataset validate` applies
    if why:
        raise bad("record", why)
    _schedule(entry.get("schedule"), scenario, backend, bad, "schedule")
    for field, kind in (("arms", dict), ("verified", dict), ("settled_at", str)):
        if field in entry and not isinstance(entry[field], kind):
            raise bad(field, f"must be {'a string' if kind is str else 'an object'}, got {reprlib.repr(entry[field])}")
    if not isinstance(entry.get("arms"), dict):
        raise bad("arms", "missing: the schedules' round times")
    verified = entry.get("verified", {})
    s = scenarios.setdefault(sid, {"scenario": scenario, "backend": (backend, path), "arms": {}, "machines": [],
                                   "versions": [], "settled_at": ""})
    if s["backend"][0] != backend:
        raise bad("backend", f"{backend!r}, but {s['backend'][1]} recorded this scenario on {s['backend'][0]!r}")
    for name, times in entry["arms"].items():
        field = f"arms.{name}"
        schedule = _schedule(name, scenario, backend, bad, field)
        if not isinstance(times, list) or not all(_is_time(t) for t in times):
            raise bad(field, f"must be a list of positive numbers of seconds, got {reprlib.repr(times)}")
        check = verified.get(name)
        if check is not None and not isinstance(check, bool):
            raise bad(f"verified.{name}", f"must be true, false or null, got {reprlib.repr(check)}")
        arm = s["arms"].setdefault(schedule, {"times": [], "checks": []})
        arm["times"] += [float(t) for t in times]
        arm["checks"].append((check, path))
    for seen, value in (("machines", machine), ("versions", versions)):
        if value not in s[seen]:
            s[seen].append(value)
    s["settled_at"] = max(s["settled_at"], entry.get("settled_at", ""))


def _schedule(name, scenario: Scenario, backend: str, bad, field: str) -> str:
    """`name` as a legal schedule of the scenario; raises naming `field`."""
    try:
        schedule = parse(name)
    except (ScheduleError, TypeError) as e:
        raise bad(field, str(e)) from None
    if not is_legal(schedule, scenario, backend):
        raise bad(field, f"{schedule.name} is not a legal schedule of this scenario on the {backend} backend")
    return schedule.name


def _is_time(t) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0


def _rows(s: dict) -> list[dict]:
    """One scenario's rows: its timed arms labeled together, its failed untimed arms as failures."""
    scenario = s["scenario"]
    provenance = {"backend": s["backend"][0], "hardware_fingerprint": "learned:" + "+".join(s["machines"]),
                  "host": "", "torch_version": _joined(s["versions"], "torch"),
                  "ficco_version": _joined(s["versions"], "ficco"), "schema_version": SCHEMA_VERSION,
                  "created_at": s["settled_at"]}
    timed, rows = [], []
    for name, arm in s["arms"].items():
        failed = next((path for check, path in arm["checks"] if check is False), None)
        verified = failed is None and any(check is True for check, _ in arm["checks"])
        error = f"verification failed: the learner's check of this schedule failed ({failed})" if failed else ""
        if arm["times"]:
            timed.append((name, arm["times"], verified, error))
        elif failed:
            rows.append(dataset_row(scenario, name, failed_label(error), provenance=provenance))
    if not timed:
        return rows
    labels = label_columns([t for _, t, _, _ in timed], verified=[v for _, _, v, _ in timed],
                           rel_error=[math.nan] * len(timed), attempts=[len(t) for _, t, _, _ in timed],
                           noisy_spread=POLICY.noisy_spread, tie_floor=POLICY.tie_floor)
    return [dataset_row(scenario, name, {"status": "failed" if error else "ok", "error": error,
                                         "time_model_s": math.nan, **{c: column[i] for c, column in labels.items()}},
                        runs_per_rep=1, provenance=provenance)
            for i, (name, _, _, error) in enumerate(timed)] + rows


def _joined(versions: list[dict], name: str) -> str:
    """The records' `name` versions, distinct, joined by '+' ("" where none says)."""
    return "+".join(dict.fromkeys(str(v[name]) for v in versions if v.get(name)))
