"""The data stage against hostile input and faults: `ficco dataset merge` / `compare` refuse
what is not one sweep's valid data, `measure` refuses settings it cannot time with, the
writers never replace what is at `--out`, and one output has one lock however it is named.
Each refusal is one line naming the file and the row, column, option or setting."""

import json
import math
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers.cli import FICCO, refused, table

from ficco_select.data.dataset import DatasetError, read_dataset, read_timing, write_parquet_atomic
from ficco_select.data.locks import OutputLocked, output_lock
from ficco_select.data.measure.config import MeasureConfig
from ficco_select.data.measure.sweep import shard_of
from ficco_select.data.scenarios import read_scenarios
from ficco_select.cli.main import main

MEASURED = Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet"
A_ROW = "t,ag_gemm,64,64,64,float32,2,cpu,"


@pytest.fixture(scope="module")
def shipped():
    return read_dataset(MEASURED)


def two_shards(tmp_path: Path, df) -> tuple[Path, Path]:
    """Two valid datasets of five scenarios each, cut from `df`."""
    ids = list(dict.fromkeys(df["scenario_id"]))
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_parquet_atomic(df[df["scenario_id"].isin(ids[:5])], a)
    write_parquet_atomic(df[df["scenario_id"].isin(ids[5:10])], b)
    return a, b


def measure(path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(FICCO + ["measure", "--scenarios", str(path), "--out", str(out), "--no-progress",
                                   "--warmup", "0", "--min-rep-s", "0", "--json", *extra],
                          capture_output=True, text=True, timeout=300)


# -- merge: one sweep, measured alike --------------------------------------------------------
@pytest.mark.gloo
def test_merge_refuses_shards_measured_with_other_settings(tmp_path, shipped):
    rows = [A_ROW, "t,gemm_rs,64,64,64,float32,2,cpu,", "t,ag_gemm,96,64,64,float32,2,cpu,"]
    path = table(tmp_path, *rows)
    scenarios = read_scenarios(path, backend="cpu")
    assert shard_of(scenarios, 0, 2) and shard_of(scenarios, 1, 2)
    s0, s1, s1_again = tmp_path / "s0.parquet", tmp_path / "s1.parquet", tmp_path / "s1_again.parquet"
    assert measure(path, s0, "--shard", "0/2", "--reps", "5").returncode == 0
    assert measure(path, s1, "--shard", "1/2", "--reps", "6").returncode == 0
    assert read_timing(s0)["reps"] == 5 and read_timing(s1)["reps"] == 6
    out = tmp_path / "all.parquet"
    line = refused(["dataset", "merge", s0, s1, "--out", out], "s0.parquet", "s1.parquet", "reps 6", "reps 5",
                   written=out)
    assert "min_rep_s" not in line  # the setting that differs, not every setting

    # The same settings merge, and the merged file records them.
    assert measure(path, s1_again, "--shard", "1/2", "--reps", "5").returncode == 0
    # Nor does a resume mix settings in one file.
    refused(["measure", "--scenarios", path, "--out", s1_again, "--shard", "1/2", "--reps", "6", "--no-progress"],
            "s1_again.parquet", "reps 5", "reps 6")
    res = CliRunner().invoke(main, ["dataset", "merge", str(s0), str(s1_again), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert read_timing(out) == read_timing(s0) and json.loads(res.output)["scenarios"] == 3

    # A file that records no settings (written before they were recorded) cannot be checked.
    old = tmp_path / "old.parquet"
    write_parquet_atomic(read_dataset(s1_again), old)
    assert read_timing(old) is None
    refused(["dataset", "merge", s0, old, "--out", tmp_path / "x.parquet"], "old.parquet", "records no",
            written=tmp_path / "x.parquet")


def test_merge_refuses_negative_times_and_unknown_schedules(tmp_path, shipped):
    a, b = two_shards(tmp_path, shipped)
    out = tmp_path / "m.parquet"
    broken = read_dataset(b)
    broken.loc[3, "time_s"] = -1.0
    write_parquet_atomic(broken, tmp_path / "negative.parquet")
    refused(["dataset", "merge", a, tmp_path / "negative.parquet", "--out", out],
            "negative.parquet", "row 3", "column 'time_s'", written=out)
    broken = read_dataset(b)
    broken.loc[2, "schedule"] = "warp.d9.zigzag"
    write_parquet_atomic(broken, tmp_path / "unknown.parquet")
    refused(["dataset", "merge", tmp_path / "unknown.parquet", a, "--out", out],
            "unknown.parquet", "row 2", "column 'schedule'", written=out)


# -- measure: options it cannot time with ------------------------------------------------------
@pytest.mark.parametrize("option,value", [("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-1"),
                                          ("--timeout", "0"), ("--min-rep-s", "inf"), ("--min-rep-s", "nan"),
                                          ("--min-rep-s", "-0.01")])
def test_measure_refuses_non_finite_or_negative_seconds(tmp_path, option, value):
    out = tmp_path / "m.parquet"
    refused(["measure", "--scenarios", table(tmp_path, A_ROW), "--out", out, "--no-progress", option, value],
            option, value, written=out)
    assert not Path(f"{out}.parts").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_simulate_refuses_a_noise_that_is_not_a_finite_sigma(tmp_path, value):
    out = tmp_path / "sim.parquet"
    refused(["simulate", "--scenarios", table(tmp_path, A_ROW), "--out", out, "--noise", value], "--noise", value,
            written=out)


def test_a_measure_config_refuses_non_finite_seconds():
    for field, value in (("timeout_s", math.nan), ("timeout_s", math.inf), ("min_rep_s", math.inf),
                         ("min_rep_s", math.nan)):
        with pytest.raises(ValueError, match=field):
            MeasureConfig(**{field: value})


# -- writers never replace what is at --out ----------------------------------------------------
def test_simulate_and_catalog_refuse_an_existing_out_and_their_input(tmp_path, shipped):
    path = table(tmp_path, A_ROW)
    scenarios = path.read_bytes()
    a, _ = two_shards(tmp_path, shipped)
    measured = a.read_bytes()
    refused(["simulate", "--scenarios", path, "--out", a], "--out", "a.parquet", "exists")
    assert a.read_bytes() == measured, "a measured dataset was replaced by simulated rows"
    refused(["simulate", "--scenarios", path, "--out", path], "--out", "scenarios.csv", "--scenarios")
    os.symlink(path, tmp_path / "link.csv")
    refused(["simulate", "--scenarios", tmp_path / "link.csv", "--out", tmp_path / "." / "scenarios.csv"],
            "--out", "--scenarios")
    assert path.read_bytes() == scenarios, "the scenario table was replaced by Parquet bytes"
    refused(["catalog", "--scale", "cpu", "--out", path], "--out", "scenarios.csv", "exists")
    assert path.read_bytes() == scenarios


def test_measure_refuses_its_scenario_table_as_out(tmp_path):
    path = table(tmp_path, A_ROW)
    before = path.read_bytes()
    refused(["measure", "--scenarios", path, "--out", tmp_path / "." / "scenarios.csv", "--no-progress"],
            "--out", "--scenarios")
    assert path.read_bytes() == before


# -- one output, one lock, whatever its name -------------------------------------------------
def test_the_lock_is_the_real_file_s_through_any_symlink(tmp_path):
    real_dir = tmp_path / "disk"
    real_dir.mkdir()
    real = real_dir / "m.parquet"
    os.symlink(real, tmp_path / "link.parquet")  # the output may not exist yet
    os.symlink(real_dir, tmp_path / "dirlink")
    with output_lock(real, "ficco measure"):
        for other_name in (tmp_path / "link.parquet", tmp_path / "dirlink" / "m.parquet"):
            with pytest.raises(OutputLocked, match="ficco measure"):
                with output_lock(other_name, "ficco measure"):
                    pass
        # The command refuses at once, before any rank starts; nothing is written.
        refused(["measure", "--scenarios", table(tmp_path, A_ROW), "--out", tmp_path / "link.parquet",
                 "--no-progress"], "link.parquet", "is writing it", written=real)
        assert not Path(f"{real}.parts").exists()


# -- Parquet files that are not datasets ---------------------------------------------------------
def test_a_non_integer_schema_version_is_one_line(tmp_path, shipped):
    a, _ = two_shards(tmp_path, shipped)
    t = pq.read_table(a)
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"ficco_schema_version": b"three"}),
                   tmp_path / "v.parquet")
    with pytest.raises(DatasetError, match="v.parquet.*ficco_schema_version"):
        read_dataset(tmp_path / "v.parquet")
    for args in (["dataset", "info", tmp_path / "v.parquet"], ["dataset", "validate", tmp_path / "v.parquet"],
                 ["dataset", "merge", a, tmp_path / "v.parquet", "--out", tmp_path / "m.parquet"],
                 ["dataset", "compare", a, tmp_path / "v.parquet"]):
        refused(args, "v.parquet", "ficco_schema_version", "'three'")


@pytest.mark.parametrize("column", ["scenario_id", "time_s"])
def test_merge_and_compare_name_a_missing_column(tmp_path, shipped, column):
    a, b = two_shards(tmp_path, shipped)
    lacking = tmp_path / "lacking.parquet"
    write_parquet_atomic(read_dataset(b).drop(columns=[column]), lacking)
    out = tmp_path / "m.parquet"
    refused(["dataset", "merge", a, lacking, "--out", out], "lacking.parquet", f"column '{column}'", written=out)
    refused(["dataset", "compare", a, lacking], "lacking.parquet", f"column '{column}'")
    refused(["dataset", "compare", lacking, a], "lacking.parquet", f"column '{column}'")
