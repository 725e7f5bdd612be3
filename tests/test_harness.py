"""The measurement harness: failed scenarios, noise flags, signatures, dataset schema checks.

One measured sweep for the module (P=2 and P=3, one scenario hanging on purpose)."""

import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ficco_select.data.dataset import SCHEMA_VERSION, DatasetError, read_dataset, validate, write_parquet_atomic
from ficco_select.data.dataset_info import info
from ficco_select.data.measure.gloo import MeasureConfig
from ficco_select.data.measure.sweep import measure
from ficco_select.cli.main import main
from ficco_select import Scenario
from ficco_select.signatures import SIGNATURE_COLUMNS

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo


def scenarios():
    common = dict(dtype="float32", hardware="cpu")
    return [
        Scenario(group="ok2", op="ag_gemm", m=96, n=32, k=48, world_size=2, **common),
        Scenario(group="stuck", op="gemm_rs", m=96, n=40, k=48, world_size=2, **common),
        Scenario(group="ok2", op="a2a_gemm", m=40, n=24, k=32, world_size=2, imbalance=1.5, **common),
        Scenario(group="ok3", op="gemm_rs", m=96, n=40, k=48, world_size=3, **common),
    ]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "d.parquet"
    config = MeasureConfig(warmup=1, reps=5, min_rep_s=0.0, timeout_s=6, fault="hang@1/stuck")
    df = measure(scenarios(), config=config, out=out, progress=False)
    return out, df


def test_a_hung_scenario_is_recorded_failed_and_the_sweep_goes_on(sweep):
    out, df = sweep
    status = df.groupby("group")["status"].agg(set).to_dict()
    assert status == {"ok2": {"ok"}, "stuck": {"failed"}, "ok3": {"ok"}}
    failed = df[df["status"] == "failed"]
    assert failed["error"].str.contains("no progress").all()
    assert df.attrs["sweep"]["failed"] == 1 and df.attrs["sweep"]["measured"] == 3
    # every scenario exactly once, in input order
    assert list(dict.fromkeys(df["scenario_id"])) == [s.scenario_id for s in scenarios()]


def test_signatures_are_measured(sweep):
    _, df = sweep
    for _, g in df[df["status"] == "ok"].groupby("scenario_id"):
        r = g.iloc[0]
        assert r["t_comp_s"] > 0 and r["t_comm_s"] > 0
        assert 1 <= r["ideal_speedup"] <= 2
        for col in ("dil_shard", "dil_d2", "chunk_loss_shard", "chunk_loss_d2", "cil_gemm_sm", "cil_overlap_sm"):
            assert math.isfinite(r[col]) and r[col] > -1, col
        assert (g[list(SIGNATURE_COLUMNS)].nunique(dropna=False) == 1).all()  # one signature per scenario


def test_best_and_near_ties_are_marked(sweep):
    _, df = sweep
    for _, g in df[df["status"] == "ok"].groupby("scenario_id"):
        best = g[g["is_best"]]
        assert len(best) >= 1 and best["time_s"].min() == g["time_s"].min()
        assert g.loc[g["is_best"], "near_best"].all()


def test_noisy_schedules_are_remeasured_then_flagged():
    s = [Scenario(group="n", op="ag_gemm", m=48, n=16, k=32, dtype="float32", world_size=2, hardware="cpu")]
    # One run per repetition (min_rep_s 0): what is checked is how repetitions pool, not their length.
    always = measure(s, config=MeasureConfig(warmup=0, reps=5, noisy_spread=0.0, max_remeasure=2, min_rep_s=0.0),
                     progress=False)
    assert (always["attempts"] == 3).all() and (always["times_s"].map(len) == 15).all()  # pooled
    assert always["noisy"].sum() == (always["time_spread"] > 0).sum()
    never = measure(s, config=MeasureConfig(warmup=0, reps=5, noisy_spread=1e9, min_rep_s=0.0), progress=False)
    assert (never["attempts"] == 1).all() and not never["noisy"].any()


def test_a_remeasure_round_times_every_schedule_of_the_scenario(sweep):
    # The labels compare schedules: a round that re-timed only the noisy ones would compare
    # times taken in different phases of the machine.
    _, df = sweep
    for sid, g in df[df["status"] == "ok"].groupby("scenario_id"):
        assert g["attempts"].nunique() == 1 and g["times_s"].map(len).nunique() == 1, sid
    assert (df.loc[df["status"] == "ok", "attempts"] > 1).any()  # the sweep did re-measure


def test_the_measured_dataset_validates_and_summarises(sweep):
    out, _ = sweep
    df = read_dataset(out)
    assert validate(df) == []
    summary = info(df)
    assert summary["scenarios"] == 4 and summary["failed_scenarios"] == 1
    assert sum(summary["fastest_count"].values()) == 3
    result = CliRunner().invoke(main, ["dataset", "validate", str(out)])
    assert result.exit_code == 0 and "valid" in result.output


@pytest.mark.parametrize("breakage,needle", [
    (lambda df: df.drop(columns=["time_spread"]), "column 'time_spread' is missing"),
    (lambda df: pd.concat([df, df.iloc[[0]]], ignore_index=True), "repeats"),
    (lambda df: df.drop(index=1).reset_index(drop=True), "lacks"),
    (lambda df: df.assign(m=df["m"].where(df.index != 0, 98)), "scenario_id"),
    (lambda df: df.assign(time_s=df["time_s"].where(df.index != 0, -1.0)), "row 0, column 'time_s'"),
    (lambda df: df.assign(schedule=df["schedule"].where(df.index != 0, "ficco.d9.x")), "column 'schedule'"),
])
def test_validate_names_row_and_column_of_broken_data(sweep, breakage, needle):
    out, _ = sweep
    df = read_dataset(out)
    df = df[df["status"] == "ok"].reset_index(drop=True)
    problems = validate(breakage(df))
    assert problems and any(needle in p for p in problems), problems


def test_another_schema_version_is_refused(tmp_path, sweep):
    out, _ = sweep
    table = pq.read_table(out)
    old = table.replace_schema_metadata({b"ficco_schema_version": str(SCHEMA_VERSION - 1).encode()})
    pq.write_table(old, tmp_path / "old.parquet")
    with pytest.raises(DatasetError, match=f"schema version {SCHEMA_VERSION - 1}"):
        read_dataset(tmp_path / "old.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "alien.parquet")
    with pytest.raises(DatasetError, match="not a ficco dataset"):
        read_dataset(tmp_path / "alien.parquet")
    result = CliRunner().invoke(main, ["dataset", "info", str(tmp_path / "old.parquet")])
    assert result.exit_code != 0 and "schema version" in result.output


def test_write_is_atomic_and_tagged(tmp_path):
    path = tmp_path / "x.parquet"
    write_parquet_atomic(pd.DataFrame({"a": [1]}), path)
    assert pq.read_schema(path).metadata[b"ficco_schema_version"] == str(SCHEMA_VERSION).encode()
    assert [p.name for p in tmp_path.iterdir()] == ["x.parquet"]
