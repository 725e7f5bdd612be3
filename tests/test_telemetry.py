"""Telemetry lines written by the runtime's writer -> dataset rows -> extra training rows."""

import json
import logging
import math
from pathlib import Path

import pandas as pd
import pytest
from helpers.cli import refused

from ficco_select.data.dataset import COLUMNS, SCHEMA_VERSION, write_parquet_atomic
from ficco_select.data.telemetry import TelemetryError, read_telemetry
from ficco_select import Scenario
from ficco_select.runtime.telemetry import Telemetry
from ficco_select.train.training_data import telemetry_training_rows

# Tier: end to end (training, MLflow, evaluation); deselect with -m "not slow"
pytestmark = pytest.mark.slow

SCENARIO = Scenario(group="tele", op="ag_gemm", m=64, n=32, k=16, dtype="float32", world_size=2, hardware="cpu")
BASE, SHARD, FICCO = "none.sm", "shard.ring.sm", "ficco.d2.ring.gemm_per_piece.m.sm"
# Per schedule: each call's time on rank 0 and rank 1 (seconds).
TIMES = {
    BASE: [(0.010, 0.011), (0.012, 0.010), (0.011, 0.013)],
    SHARD: [(0.008, 0.009), (0.009, 0.008), (0.007, 0.008), (0.008, 0.010)],
    FICCO: [(0.005, 0.006), (0.005, 0.005)],
}
FAILED_CHECK = (FICCO, 1)
"""Rank 1's first run of this schedule does not match the reference."""


def write_job(path_of_rank, times=TIMES, *, failed_check=FAILED_CHECK, killed=True) -> None:
    """Two ranks of one job recording every call with the runtime's writer; if `killed`, the
    job dies after rank 0 has written its 5th shard call and rank 1 half of its line."""
    ranks = [Telemetry(path_of_rank, rank) for rank in (0, 1)]
    record = {**SCENARIO.as_record(), "scenario_id": SCENARIO.scenario_id}
    for call in range(max(len(t) for t in times.values())):
        for schedule, per_call in times.items():
            if call >= len(per_call):
                continue
            for rank, tel in enumerate(ranks):
                first = call == 0  # the writer's contract: only the first run is checked
                wrong = first and (schedule, rank) == failed_check
                call_no = tel.next_call(SCENARIO.scenario_id, schedule)
                tel.record(record, schedule=schedule, source="heuristic", call=call_no,
                           time_s=per_call[call][rank], verified=(not wrong) if first else None,
                           rel_error=(0.5 if wrong else 1e-7 * (rank + 1)) if first else None)
    if not killed:
        return
    ranks[0].record(record, schedule=SHARD, source="heuristic", call=4, time_s=0.001)
    line = json.dumps({"v": 1, **record, "schedule": SHARD, "source": "heuristic", "rank": 1, "call": 4,
                       "time_s": 0.001, "verified": None, "rel_error": None, "backend": "cpu", "ts": "x"})
    with open(ranks[1].path, "a") as f:
        f.write(line[: len(line) // 2])  # no newline: the process died inside its write


def add_malformed_lines(path: Path) -> list[int]:
    """Three bad lines in the middle of a file; returns their line numbers."""
    good = json.loads(path.read_text().splitlines()[0])
    no_time = {k: v for k, v in good.items() if k != "time_s"}
    bad_scenario = {**good, "m": -1}
    lines = path.read_text().splitlines(keepends=True)
    at = 4
    lines[at:at] = ["this is not json\n", json.dumps(no_time) + "\n", json.dumps(bad_scenario) + "\n"]
    path.write_text("".join(lines))
    return [at + 1, at + 2, at + 3]


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    write_job(path)
    bad = add_malformed_lines(path)
    return path, bad


def test_aggregation_takes_the_slowest_rank_per_call_and_the_median_over_calls(job, caplog):
    path, bad = job
    with caplog.at_level(logging.WARNING, logger="ficco_select.data.telemetry"):
        df = read_telemetry(path)
    assert list(df.columns) == list(COLUMNS)
    rows = df.set_index("schedule")
    assert set(rows.index) == {BASE, SHARD, FICCO} and (df["scenario_id"] == SCENARIO.scenario_id).all()

    base = rows.loc[BASE]
    assert base["times_s"] == [0.011, 0.012, 0.013]  # max over ranks, call order
    assert base["time_s"] == pytest.approx(0.012, rel=1e-12)
    assert base["time_spread"] == pytest.approx((0.0125 - 0.0115) / 0.012, rel=1e-9)  # IQR / median
    assert base["attempts"] == 3 and base["verified"] and base["status"] == "ok" and base["error"] == ""
    assert base["rel_error"] == pytest.approx(2e-7) and base["noisy"]  # 8.3% > the harness's 5% limit

    shard = rows.loc[SHARD]
    # call 4 lost rank 1's line to the kill: dropped, so 0.001 (rank 0 alone) is no label
    assert shard["times_s"] == [0.009, 0.009, 0.008, 0.010] and shard["attempts"] == 4
    assert shard["time_s"] == pytest.approx(0.009, rel=1e-12)
    assert shard["time_spread"] == pytest.approx((0.00925 - 0.00875) / 0.009, rel=1e-9)
    assert shard["noisy"]  # 5.6%
    assert shard["is_best"] and shard["near_best"]
    assert not base["is_best"] and not base["near_best"]  # 0.012 > 0.009 * (1 + 0.083)

    ficco = rows.loc[FICCO]  # the fastest, but rank 1's check failed: never a label
    assert ficco["status"] == "failed" and not ficco["verified"] and not ficco["is_best"]
    assert ficco["times_s"] == [0.006, 0.005] and ficco["rel_error"] == 0.5
    assert "rank 1, call 0" in ficco["error"] and str(path) in ficco["error"]

    first = df.iloc[0]
    assert first["backend"] == "cpu" and first["schema_version"] == SCHEMA_VERSION
    assert first["hardware_fingerprint"] == "telemetry:cpu" and first["threads_per_rank"] == 0
    assert math.isnan(first["t_comp_s"]) and math.isnan(first["cil_overlap_sm"])

    # one warning for the file, naming every skipped line and why
    (warning,) = [r for r in caplog.records if r.name == "ficco_select.data.telemetry"]
    text = warning.getMessage()
    n_lines = len(path.read_text().splitlines())
    assert str(path) in text and "4 malformed" in text
    assert f"line {bad[0]}: not JSON" in text and f"line {bad[1]}: missing field 'time_s'" in text
    assert f"line {bad[2]}: invalid scenario: column 'm'" in text and f"line {n_lines}: not JSON" in text


def test_per_rank_files_give_the_same_rows_as_one_shared_file(tmp_path):
    write_job(tmp_path / "shared.jsonl")
    write_job(str(tmp_path / "rank{rank}.jsonl"))
    shared = read_telemetry(tmp_path / "shared.jsonl")
    split = read_telemetry([tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"])
    cols = ["schedule", "time_s", "time_spread", "times_s", "attempts", "verified", "status", "is_best"]
    pd.testing.assert_frame_equal(shared[cols], split[cols])


def test_two_jobs_appending_to_one_file_count_as_more_calls(tmp_path):
    path = tmp_path / "t.jsonl"
    write_job(path, killed=False)
    write_job(path, killed=False)  # a second job: calls start at 0 again
    rows = read_telemetry(path).set_index("schedule")
    assert rows.loc[BASE, "times_s"] == [0.011, 0.012, 0.013] * 2 and rows.loc[BASE, "attempts"] == 6


def test_unusable_files_are_errors_naming_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TelemetryError, match=r"empty.jsonl: no usable telemetry line \(the file is empty\)"):
        read_telemetry(empty)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"v": 1, "op": "ag_gemm"\nnot json either\n')
    with pytest.raises(TelemetryError, match=r"garbage.jsonl: no usable telemetry line; line 1: not JSON"):
        read_telemetry(garbage)
    with pytest.raises(TelemetryError, match="missing.jsonl: no such telemetry file"):
        read_telemetry(tmp_path / "missing.jsonl")
    future = tmp_path / "future.jsonl"
    future.write_text(json.dumps({"v": 2, "anything": 1}) + "\n")
    with pytest.raises(TelemetryError, match="future.jsonl: line 1: telemetry version 2"):
        read_telemetry(future)


def test_training_keeps_verified_scenarios_with_a_baseline_not_already_measured(job):
    path, _ = job
    tele = read_telemetry(path)
    other = tele.assign(scenario_id="0" * 16)  # a dataset without this scenario
    kept = telemetry_training_rows(tele, other)
    assert sorted(kept["schedule"]) == [BASE, SHARD]  # the failed schedule is no label
    assert telemetry_training_rows(tele, tele).empty  # the complete measurement wins
    assert telemetry_training_rows(tele[tele["schedule"] != BASE], other).empty  # nothing to compare with


@pytest.fixture
def tiny_dataset(tmp_path):
    """36 simulated scenarios, two model families, on h100-nvswitch only."""
    from ficco_select.data.catalog import catalog
    from ficco_select.data.simulate import simulate
    from ficco_select.hardware import load_hardware

    recs = catalog("full", world_sizes=(2,), hardware="h100-nvswitch", models=["llama3-8b", "mixtral-8x7b"])
    data = simulate([Scenario.from_record(r) for r in recs], load_hardware("h100-nvswitch"), noise=0.03, seed=4)
    write_parquet_atomic(data, tmp_path / "tiny.parquet")
    return data, tmp_path / "tiny.parquet"


def test_training_fits_the_registered_model_on_telemetry_but_scores_only_the_dataset(job, tiny_dataset, tmp_path,
                                                                                     monkeypatch):
    """A real training in a real MLflow store, with small selectors (the CLI's full set takes
    about 20 s even on a tiny dataset; the option's wiring is tested below)."""
    import mlflow

    from ficco_select.train.config import TrainConfig
    from ficco_select.train.run import REGISTERED_MODEL, train
    from ficco_select.train.selectors import AlwaysBaseline, Heuristic, XGBTimeRegressor

    path, _ = job
    data, _ = tiny_dataset
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    extra = telemetry_training_rows(read_telemetry(path), data)
    config = TrainConfig(splits=("family",), out_dir=tmp_path / "out", progress=False,
                         selectors=lambda: [XGBTimeRegressor(n_estimators=20), Heuristic(tune=False), AlwaysBaseline()])
    summary = train(data, config, extra=extra)
    assert summary["tables"]["family"]["heuristic"]["n"] == data["scenario_id"].nunique()  # telemetry not scored
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["extra_rows"] == 2
    local = mlflow.artifacts.download_artifacts(f"models:/{REGISTERED_MODEL}/{summary['version']}")
    meta = json.loads(next(Path(local).rglob("selector.json")).read_text())
    # Only the telemetry has cpu hardware: the registered model was fitted on it, and the runtime
    # will decide for cpu scenarios instead of abstaining.
    assert "cpu" in meta["training_ranges"]["hardware"]


def test_ficco_train_fits_on_every_telemetry_file(job, tiny_dataset, tmp_path, monkeypatch):
    """The real command end to end (about 20 s): both files' calls reach the registered model."""
    from click.testing import CliRunner

    from ficco_select.cli.main import main

    path, _ = job
    _, dataset = tiny_dataset
    other = tmp_path / "other.jsonl"
    write_job(other, killed=False)  # a second job on the same scenario: more calls
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    res = CliRunner().invoke(main, ["train", "--dataset", str(dataset), "--telemetry", str(path),
                                    "--telemetry", str(other), "--splits", "family", "--out", str(tmp_path / "out"),
                                    "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["telemetry_rows"] == 2
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["extra_rows"] == 2


def test_ficco_train_refuses_telemetry_that_adds_nothing_before_training(job, tmp_path):
    from click.testing import CliRunner

    from ficco_select.cli.main import main

    from ficco_select.data.simulate import simulate
    from ficco_select.hardware import load_hardware

    path, _ = job
    # The dataset already holds the scenario, with every candidate (as a dataset to train on must).
    write_parquet_atomic(simulate([SCENARIO], load_hardware("cpu"), seed=0), tmp_path / "has_it.parquet")
    res = CliRunner().invoke(main, ["train", "--dataset", str(tmp_path / "has_it.parquet"),
                                    "--telemetry", str(path)])
    assert res.exit_code == 1 and "nothing to add to the training data" in res.output


def test_a_cpu_line_labelled_as_a_gpu_is_skipped_as_validate_refuses_it(job, caplog):
    # The rule `ficco dataset validate` applies (ficco_select.data.dataset.row_hardware_problem): cpu rows
    # never name a machine with copy engines.
    path, _ = job
    first = path.read_text().splitlines()[0]
    good = json.loads(first)
    gpu = Scenario.from_record({**good, "hardware": "h100-nvswitch"})
    lie = {**good, "hardware": "h100-nvswitch", "scenario_id": gpu.scenario_id}
    path = path.with_name("lie.jsonl")
    path.write_text(first + "\n" + json.dumps(lie) + "\n")
    rows = read_telemetry(path)
    assert "h100-nvswitch" not in set(rows["hardware"])
    assert any("field 'hardware'" in r.getMessage() and "is a GPU" in r.getMessage() for r in caplog.records)


# -- hostile lines ------------------------------------------------------------------------
MEASURED = Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog_ar_a2a.parquet"


@pytest.fixture
def telemetry(tmp_path):
    """A finished two-rank job's lines, and the rows they give."""
    path = tmp_path / "telemetry.jsonl"
    write_job(path, killed=False)
    return path, read_telemetry(path)


def with_line(path: Path, name: str, **changes) -> tuple[Path, int]:
    """A copy of `path` with its first line appended again, changed; returns it and that line's number."""
    lines = path.read_text().splitlines()
    out = path.with_name(name)
    out.write_text("\n".join([*lines, json.dumps({**json.loads(lines[0]), **changes})]) + "\n")
    return out, len(lines) + 1


@pytest.mark.parametrize("rank", [7, SCENARIO.world_size, -1])
def test_a_telemetry_line_of_a_rank_outside_the_job_is_skipped_naming_file_line_and_field(telemetry, rank,
                                                                                         caplog):
    path, rows = telemetry
    first = json.loads(path.read_text().splitlines()[0])
    bad, number = with_line(path, "rank.jsonl", rank=rank, time_s=4 * first["time_s"])
    with caplog.at_level(logging.WARNING, logger="ficco_select.data.telemetry"):
        again = read_telemetry(bad)
    assert again["times_s"].tolist() == rows["times_s"].tolist()  # the 4x time is no rank's
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "ficco_select.data.telemetry"]
    assert str(bad) in warning and f"line {number}: field 'rank'" in warning
    # A file of such lines alone is refused, naming the file, the line and the field.
    alone = bad.with_name("alone.jsonl")
    alone.write_text(bad.read_text().splitlines()[-1] + "\n")
    with pytest.raises(TelemetryError, match=r"alone.jsonl: no usable telemetry line; line 1: field 'rank'"):
        read_telemetry(alone)


WRONG_TYPES = {
    "backend": ["cpu"], "op": ["ag_gemm"], "dtype": {"float32": 4}, "group": ["tele"], "hardware": ["cpu"],
    "m": "64", "n": 32.5, "k": True, "world_size": 2.0, "imbalance": "1.0", "scenario_id": 12,
    "schedule": ["none.sm"], "source": 5, "rank": 0.0, "call": "0", "time_s": "0.01", "verified": 1,
    "rel_error": "1e-7", "ts": 1700000000,
}
"""One wrong-typed value per field of a telemetry line (``ficco_select.data.telemetry.LINE_FIELDS``)."""


def test_every_telemetry_field_is_checked_for_its_type():
    from ficco_select.data.telemetry import LINE_FIELDS

    assert set(WRONG_TYPES) == {*LINE_FIELDS, "imbalance"}


@pytest.mark.parametrize("field", sorted(WRONG_TYPES))
def test_a_telemetry_field_of_the_wrong_type_is_named_by_file_line_and_field(telemetry, field, caplog):
    path, rows = telemetry
    bad, number = with_line(path, "typed.jsonl", **{field: WRONG_TYPES[field]})
    with caplog.at_level(logging.WARNING, logger="ficco_select.data.telemetry"):
        again = read_telemetry(bad)
    assert again["times_s"].tolist() == rows["times_s"].tolist()
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "ficco_select.data.telemetry"]
    assert f"line {number}: field '{field}'" in warning
    alone = bad.with_name("alone.jsonl")
    alone.write_text(bad.read_text().splitlines()[-1] + "\n")
    with pytest.raises(TelemetryError, match=rf"alone.jsonl: no usable telemetry line; line 1: field '{field}'"):
        read_telemetry(alone)


def test_ficco_train_refuses_a_telemetry_file_of_a_list_valued_backend_in_one_line(telemetry, tmp_path,
                                                                                  monkeypatch):
    path, _ = telemetry
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps({**json.loads(path.read_text().splitlines()[0]), "backend": ["cpu"]}) + "\n")
    monkeypatch.chdir(tmp_path)  # an MLflow store, were one opened, stays here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    refused(["train", "--dataset", MEASURED, "--telemetry", alone, "--out", tmp_path / "train"],
            str(alone), "line 1", "field 'backend'", written=tmp_path / "train")


# -- on a GPU (runs under scripts/gpu_check.sh) ---------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_telemetry_times_calls_by_events_without_a_host_sync_per_call(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    from ficco_select.runtime import dispatch, torch_ops
    from ficco_select.runtime.decision import Decision
    from ficco_select.schedule import BASELINE

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch_ops.reset()
        torch_ops.configure(telemetry=tmp_path / "t.jsonl")
        syncs = []
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (syncs.append(a), real(*a)))
        s = Scenario(group="g", op="gemm_ar", m=2048, n=2048, k=2048, dtype="bfloat16", world_size=1,
                     hardware="h100-nvswitch")
        plan = dispatch.Plan(s, Decision(BASELINE, "model", 1.0, ""), native=True)
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            dispatch.run_native(plan, dispatch.context(dist.group.WORLD), a.device, torch.mm, a, a)
        assert not syncs  # the times wait on the GPU, not the host
        dispatch.flush_timings()
        lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
        assert [line["call"] for line in lines] == list(range(5)) and all(line["time_s"] > 0 for line in lines)
    finally:
        torch_ops.reset()
        dist.destroy_process_group()
