"""The machine's learned record (ficco_select/runtime/learned.py): written by real processes
at once and killed mid-write, read back by the next job and as training rows."""

import json
import logging
import random
import subprocess
import sys
import time

import pytest
import torch

import ficco_select
from ficco_select import Scenario
from ficco_select.data.telemetry import TelemetryError, read_telemetry
from ficco_select.runtime.learned import KIND, LearnedRecord, RecordKey, record_key

KEY = RecordKey("0123456789abcdef", "cpu", {"torch": "2.13.0", "ficco": "0.1.0"})
SCENARIO = Scenario(group="learn", op="ag_gemm", m=64, n=32, k=16, dtype="float32", world_size=2, hardware="cpu")
BASE, SHARD, FICCO = "none.sm", "shard.ring.sm", "ficco.d2.ring.gemm_per_piece.m.sm"
ARMS = {BASE: [0.010, 0.011, 0.012], SHARD: [0.008, 0.009, 0.008], FICCO: [0.005, 0.005]}
"""Per arm, its round times: the fused schedule is fastest, but its check failed."""


def entry(scenario=SCENARIO, arms=ARMS, verified=None, settled=SHARD) -> dict:
    """A shape's entry as the learner writes it."""
    verified = verified if verified is not None else {BASE: True, SHARD: True, FICCO: False}
    return {"record": scenario.as_record(), "schedule": settled, "arms": arms, "verified": verified,
            "backend": "cpu", "rounds": 3, "explored_calls": 8, "cost_s": 0.01,
            "settled_at": "2026-12-07T10:00:00+00:00", "extra": {"kept": True}}


# A writer process: puts one shape per call, printing each id once its put has returned.
WRITER = """
import sys
from ficco_select.runtime.learned import LearnedRecord, RecordKey
folder, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
record = LearnedRecord(RecordKey("0123456789abcdef", "cpu", {"torch": "2.13.0", "ficco": "0.1.0"}), folder)
e = {"record": {}, "schedule": "none.sm", "arms": {"none.sm": [0.01]}, "verified": {"none.sm": True}}
i = 0
while count < 0 or i < count:
    if not record.put({f"{prefix}{i}": e}):
        sys.exit(f"put {prefix}{i} failed")
    print(f"{prefix}{i}", flush=True)
    i += 1
"""


def writer(folder, prefix: str, count: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(folder), prefix, str(count)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def whole_file(record: LearnedRecord) -> dict:
    data = json.loads(record.path.read_text())
    assert data["v"] == 1 and data["kind"] == KIND and isinstance(data["shapes"], dict)
    return data


# -- the record --------------------------------------------------------------------------
def test_put_then_load_gives_the_shapes_back_with_every_field(tmp_path):
    record = LearnedRecord(KEY, tmp_path)
    assert record.load() == {}  # no file yet
    assert record.put({SCENARIO.scenario_id: entry()})
    assert record.put({"other": entry(settled=BASE)})  # merged, not replaced
    again = LearnedRecord(KEY, tmp_path).load()  # the next job's view
    assert again == {SCENARIO.scenario_id: entry(), "other": entry(settled=BASE)}
    assert record.path == tmp_path / "cpu-0123456789abcdef.json"
    assert whole_file(record)["key"] == {"machine": KEY.machine, "hardware": "cpu",
                                         "versions": {"torch": "2.13.0", "ficco": "0.1.0"}}


def test_another_torch_version_invalidates_the_record_and_its_next_put_replaces_it(tmp_path, caplog):
    LearnedRecord(KEY, tmp_path).put({"old": entry()})
    newer = RecordKey(KEY.machine, KEY.hardware, {"torch": "2.14.0", "ficco": "0.1.0"})
    record = LearnedRecord(newer, tmp_path)
    assert record.path == LearnedRecord(KEY, tmp_path).path  # the machine names the file; versions are inside
    with caplog.at_level(logging.INFO, logger="ficco_select.runtime.learned"):
        assert record.load() == {}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "invalidated" in said and "versions.torch: 2.13.0 -> 2.14.0" in said
    assert record.put({"new": entry()})
    assert whole_file(record)["key"]["versions"]["torch"] == "2.14.0"
    assert record.load() == {"new": entry()}  # the old job's shape is gone with its stack
    assert LearnedRecord(KEY, tmp_path).load() == {}  # and the old stack no longer reads it


def test_record_key_is_stable_and_names_the_hardware_and_the_stack():
    first, second = record_key("cpu", torch.device("cpu")), record_key("cpu", "cpu")
    assert first == second and hash(first) == hash(second)
    other = record_key("h100-nvswitch", "cpu")
    assert other.machine != first.machine and other.hardware == "h100-nvswitch"
    assert record_key("not-a-preset", "cpu").machine != first.machine  # no spec: the name alone
    versions = dict(first.versions)
    assert versions["torch"] == torch.__version__ and versions["ficco"] == ficco_select.__version__
    assert len(first.machine) == 16 and int(first.machine, 16) >= 0
    assert RecordKey("m", "h", {"b": 1, "a": 2}) == RecordKey("m", "h", (("a", "2"), ("b", "1")))


def test_a_hardware_name_that_is_no_file_name_is_made_one(tmp_path):
    record = LearnedRecord(RecordKey("abc", "../my node/x", {}), tmp_path)
    assert record.path.parent == tmp_path and "/" not in record.path.name and not record.path.name.startswith(".")
    assert record.put({"s": entry()}) and record.load() == {"s": entry()}


def test_a_corrupt_file_reads_as_no_record_with_one_warning_and_the_next_put_repairs_it(tmp_path, caplog):
    record = LearnedRecord(KEY, tmp_path)
    record.put({"a": entry()})
    record.path.write_text(record.path.read_text()[:40])  # a torn file, as no writer of ours leaves one
    with caplog.at_level(logging.WARNING, logger="ficco_select.runtime.learned"):
        assert record.load() == {}
        assert record.load() == {}
        assert record.put({"b": entry()})
    (said,) = [r.getMessage() for r in caplog.records]
    assert str(record.path) in said and "corrupt" in said and "not JSON" in said
    assert record.load() == {"b": entry()} and whole_file(record)["shapes"].keys() == {"b"}


def test_a_shape_the_learner_cannot_read_is_skipped_naming_its_field(tmp_path, caplog):
    record = LearnedRecord(KEY, tmp_path)
    record.put({"good": entry(), "bad": {**entry(), "arms": [0.1]}})
    with caplog.at_level(logging.WARNING, logger="ficco_select.runtime.learned"):
        assert record.load() == {"good": entry()}
    assert "shape bad skipped: field 'arms'" in caplog.text


def test_an_unwritable_folder_is_a_false_put_and_one_warning_never_an_exception(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    record = LearnedRecord(KEY, tmp_path / "file" / "below")  # a folder under a file: every write fails
    with caplog.at_level(logging.WARNING, logger="ficco_select.runtime.learned"):
        assert record.put({"a": entry()}) is False
        assert record.put({"b": entry()}) is False
        assert record.load() == {}
    assert len(caplog.records) == 1 and "not written" in caplog.records[0].getMessage()  # once per file


def test_an_entry_json_cannot_hold_is_a_false_put_and_the_file_is_kept(tmp_path):
    record = LearnedRecord(KEY, tmp_path)
    record.put({"a": entry()})
    assert record.put({"b": {**entry(), "record": object()}}) is False
    assert record.load() == {"a": entry()}
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


# -- real processes ----------------------------------------------------------------------
def test_two_jobs_writing_at_once_keep_both_jobs_shapes(tmp_path):
    jobs = [writer(tmp_path, prefix, 200) for prefix in ("a", "b")]
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        assert len(out.split()) == 200
    shapes = whole_file(LearnedRecord(KEY, tmp_path))["shapes"]
    assert set(shapes) == {f"{p}{i}" for p in "ab" for i in range(200)}


def test_a_writer_killed_at_any_moment_leaves_a_whole_file_with_every_acknowledged_shape(tmp_path):
    record = LearnedRecord(KEY, tmp_path)
    rng = random.Random(7)
    acknowledged: set[str] = set()
    for kill in range(6):
        job = writer(tmp_path, f"k{kill}-", -1)
        first = job.stdout.readline().strip()  # it is writing: now kill it somewhere in its loop
        assert first, job.stderr.read()
        time.sleep(rng.uniform(0.0, 0.2))
        job.kill()  # SIGKILL: no handler, no cleanup
        rest, _ = job.communicate(timeout=60)
        ids = {first, *rest.split()}
        assert len(ids) >= 1
        acknowledged |= ids
        shapes = whole_file(record)["shapes"]  # parses whole after every kill
        assert acknowledged <= set(shapes), sorted(acknowledged - set(shapes))[:5]
    assert record.put({"after": entry()})  # the next writer clears what a killed one left mid-write
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []
    assert acknowledged | {"after"} <= set(record.load())


# -- training rows -----------------------------------------------------------------------
def write_record(path, shapes: dict, machine: str = "feedfacefeedface", torch_version: str = "2.13.0") -> None:
    """A record file as ``LearnedRecord.put`` writes it."""
    key = RecordKey(machine, "cpu", {"torch": torch_version, "ficco": "0.1.0"})
    record = LearnedRecord(key, path.parent)
    assert record.put(shapes)
    record.path.rename(path)


def test_a_record_gives_one_row_per_scenario_and_arm_labeled_like_telemetry(tmp_path):
    path = tmp_path / "record.json"
    write_record(path, {SCENARIO.scenario_id: entry()})
    rows = read_telemetry(path).set_index("schedule")
    assert sorted(rows.index) == sorted(ARMS) and (rows["scenario_id"] == SCENARIO.scenario_id).all()
    shard = rows.loc[SHARD]  # the settled schedule: the fastest verified arm
    assert shard["is_best"] and shard["near_best"] and shard["verified"] and shard["status"] == "ok"
    assert shard["times_s"] == [0.008, 0.009, 0.008] and shard["time_s"] == 0.008 and shard["attempts"] == 3
    assert not rows.loc[BASE, "is_best"] and rows.loc[BASE, "time_s"] == 0.011
    ficco = rows.loc[FICCO]  # fastest, but its check failed: never a label
    assert ficco["status"] == "failed" and not ficco["verified"] and not ficco["is_best"]
    assert "verification failed" in ficco["error"] and str(path) in ficco["error"]
    assert set(rows["hardware_fingerprint"]) == {"learned:feedfacefeedface"}
    assert set(rows["torch_version"]) == {"2.13.0"} and set(rows["ficco_version"]) == {"0.1.0"}
    assert set(rows["created_at"]) == {"2026-12-07T10:00:00+00:00"} and set(rows["backend"]) == {"cpu"}


def test_an_unchecked_arm_is_no_label_and_an_untimed_one_no_row(tmp_path):
    path = tmp_path / "record.json"
    arms = {BASE: [0.010, 0.011], SHARD: [0.004], FICCO: []}
    write_record(path, {SCENARIO.scenario_id: entry(arms=arms, verified={BASE: True, SHARD: None})})
    rows = read_telemetry(path).set_index("schedule")
    assert sorted(rows.index) == [BASE, SHARD]
    assert rows.loc[SHARD, "status"] == "ok" and not rows.loc[SHARD, "verified"] and not rows.loc[SHARD, "is_best"]
    assert rows.loc[BASE, "is_best"]  # the only verified arm


def test_two_machines_records_of_one_scenario_make_one_row_per_arm(tmp_path):
    write_record(tmp_path / "one.json", {SCENARIO.scenario_id: entry()})
    write_record(tmp_path / "two.json", {SCENARIO.scenario_id: entry()}, machine="beefbeefbeefbeef",
                 torch_version="2.14.0")
    rows = read_telemetry([tmp_path / "one.json", tmp_path / "two.json"]).set_index("schedule")
    assert len(rows) == 3 and rows.loc[SHARD, "times_s"] == ARMS[SHARD] * 2
    assert rows.loc[SHARD, "hardware_fingerprint"] == "learned:feedfacefeedface+beefbeefbeefbeef"
    assert rows.loc[SHARD, "torch_version"] == "2.13.0+2.14.0"


@pytest.mark.parametrize(("change", "field"), [
    ({"arms": {BASE: [0.01, -1.0]}}, f"arms.{BASE}"),
    ({"arms": {"ficco.d9.bogus": [0.01]}}, "arms.ficco.d9.bogus"),
    ({"verified": {BASE: "yes"}}, f"verified.{BASE}"),
    ({"record": {**SCENARIO.as_record(), "m": 65}}, "record"),
    ({"backend": "tpu"}, "backend"),
    ({"schedule": 3}, "schedule"),
])
def test_a_record_with_a_bad_field_is_an_error_naming_the_file_scenario_and_field(tmp_path, change, field):
    path = tmp_path / "bad.json"
    write_record(path, {SCENARIO.scenario_id: {**entry(), **change}})
    with pytest.raises(TelemetryError) as e:
        read_telemetry(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and SCENARIO.scenario_id in message
    assert f"field '{field}'" in message


def test_telemetry_lines_and_a_record_read_together(tmp_path):
    from ficco_select.runtime.telemetry import Telemetry

    other = Scenario(**{**SCENARIO.as_record(), "m": 128})
    lines = tmp_path / "job.jsonl"
    for s in (SCENARIO, other):  # one job's telemetry of both scenarios, both ranks
        for rank in (0, 1):
            Telemetry(lines, rank).record({**s.as_record(), "scenario_id": s.scenario_id}, schedule=BASE,
                                          source="heuristic", call=0, time_s=0.02, verified=True)
    write_record(tmp_path / "record.json", {SCENARIO.scenario_id: entry()})
    rows = read_telemetry([lines, tmp_path / "record.json"])
    assert not rows.duplicated(["scenario_id", "schedule"]).any()
    mine = rows[rows["scenario_id"] == SCENARIO.scenario_id]  # the record's rows win its scenario
    assert set(mine["hardware_fingerprint"]) == {"learned:feedfacefeedface"} and len(mine) == 3
    assert rows.loc[rows["scenario_id"] == other.scenario_id, "hardware_fingerprint"].tolist() == ["telemetry:cpu"]


def test_the_record_is_on_the_runtime_path_and_loads_no_offline_tool(tmp_path):
    code = ("import sys\nfrom ficco_select.runtime.learned import LearnedRecord, record_key\n"
            f"r = LearnedRecord(record_key('cpu', 'cpu'), {str(tmp_path)!r})\n"
            "assert r.put({'s': {'record': {}, 'schedule': 'none.sm', 'arms': {}}}) and r.load()\n"
            "print(' '.join(sorted(sys.modules)))")
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not mods & {"pandas", "sklearn", "mlflow", "xgboost", "ficco_select.data", "ficco_select.train",
                       "ficco_select.cli"}
