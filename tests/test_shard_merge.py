"""A sweep across a cluster: `ficco measure --shard i/N` splits a scenario table, each shard
resumable on its own, and `ficco dataset merge` joins the shards into the dataset one run
would make; a merge refuses other backends, other machines and disagreeing duplicates, shards
measured with other settings and (as `dataset compare` does) files that are not valid datasets."""

import json
import subprocess
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ficco_select.cli.main import main
from ficco_select.data.dataset import DatasetError, read_dataset, read_timing, write_parquet_atomic
from ficco_select.data.dataset_merge import merge
from ficco_select.data.measure.sweep import parse_shard, shard_of
from ficco_select.data.scenarios import packaged, read_scenarios
from ficco_select.data.simulate import simulate
from ficco_select.hardware import load_hardware

from helpers.cli import DECOY, FICCO, decoy_folder, refused, table
from helpers.datasets import two_shards
MEASURED = "data/measured/cpu_catalog.parquet"
A_ROW = "t,ag_gemm,64,64,64,float32,2,cpu,"


@pytest.fixture(scope="module")
def shipped():
    return read_dataset(MEASURED)


def test_shards_partition_a_table_the_same_way_every_time():
    scenarios = read_scenarios(packaged("catalog_cpu.csv"), backend="cpu")
    shards = [shard_of(scenarios, i, 3) for i in range(3)]
    ids = [[s.scenario_id for s in shard] for shard in shards]
    assert sorted(sum(ids, [])) == sorted(s.scenario_id for s in scenarios)  # each scenario once
    assert all(len(shard) > len(scenarios) / 4 for shard in shards)  # none starved
    # A grown table moves nobody: the first 100 scenarios fall where they fell in the whole table.
    assert [s.scenario_id for s in shard_of(scenarios[:100], 1, 3)] == [i for i in ids[1] if i in
                                                                        {s.scenario_id for s in scenarios[:100]}]
    assert parse_shard("2/3") == (2, 3)
    for bad in ("3/3", "-1/3", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="i/N"):
            parse_shard(bad)


def split_by_scenario(tmp_path, df, parts):
    ids = list(dict.fromkeys(df["scenario_id"]))
    paths = []
    for i in range(parts):
        path = tmp_path / f"shard{i}.parquet"
        write_parquet_atomic(df[df["scenario_id"].isin(ids[i::parts])], path)
        paths.append(path)
    return paths


def test_a_merge_of_a_dataset_s_shards_is_that_dataset(tmp_path):
    whole = read_dataset(MEASURED)
    paths = split_by_scenario(tmp_path, whole, 3)
    merged = merge(paths)
    key = ["scenario_id", "schedule"]
    pd.testing.assert_frame_equal(merged.sort_values(key).reset_index(drop=True),
                                  whole.sort_values(key).reset_index(drop=True))
    # The same measurement twice (a shard copied again) is kept once.
    assert len(merge([*paths, paths[0]])) == len(whole)


def test_a_merge_refuses_other_machines_backends_and_disagreeing_duplicates(tmp_path):
    whole = read_dataset(MEASURED)
    a, b = split_by_scenario(tmp_path, whole, 2)
    other_machine = tmp_path / "other.parquet"
    write_parquet_atomic(read_dataset(b).assign(hardware_fingerprint="x86_64-other-64cores"), other_machine)
    with pytest.raises(DatasetError, match="other.parquet: hardware_fingerprint x86_64-other-64cores"):
        merge([a, other_machine])
    simulated = tmp_path / "sim.parquet"
    write_parquet_atomic(simulate(read_scenarios(packaged("catalog_cpu.csv"), backend="sim")[:3],
                                  load_hardware("cpu")), simulated)
    with pytest.raises(DatasetError, match="sim.parquet: backend sim"):
        merge([a, simulated])
    remeasured = read_dataset(a)
    sid = remeasured["scenario_id"].iloc[0]
    slower = remeasured["scenario_id"] == sid  # a valid file: every time of the scenario 1.5x
    remeasured.loc[slower, "time_s"] *= 1.5
    remeasured.loc[slower, "times_s"] = remeasured.loc[slower, "times_s"].map(lambda t: t * 1.5)
    again = tmp_path / "again.parquet"
    write_parquet_atomic(remeasured, again)
    with pytest.raises(DatasetError, match=f"again.parquet: scenario {sid} is also in .*shard0.parquet"):
        merge([a, again])
    with pytest.raises(DatasetError, match="nothing to merge"):
        merge([])


def measure_args(path: Path, out: Path, *extra: str) -> list[str]:
    """`ficco measure` of the table at `path` into `out`: one run a repetition, JSON out."""
    return ["measure", "--scenarios", str(path), "--out", str(out), "--no-progress", "--warmup", "0",
            "--min-rep-s", "0", "--json", *extra]


def measure(path: Path, out: Path, *extra: str):
    """`ficco measure` run in this process (its ranks' server is started once): click's result."""
    return CliRunner().invoke(main, measure_args(path, out, *extra))


@pytest.mark.gloo
def test_three_shards_measured_apart_merge_into_what_one_run_makes(tmp_path):
    # Run from a folder with a user's generic top-level names: the ranks, started by module
    # name, never import them.
    work = decoy_folder(tmp_path / "work")
    table = tmp_path / "t.csv"
    table.write_text("group,op,m,n,k,dtype,world_size,hardware,imbalance\n"
                     "t,ag_gemm,64,32,48,float32,2,cpu,\nt,gemm_rs,64,32,48,float32,2,cpu,\n"
                     "t,ag_gemm,96,32,48,float32,2,cpu,\n")
    scenarios = read_scenarios(table, backend="cpu")
    assert all(shard_of(scenarios, i, 3) for i in range(3))  # one scenario per shard

    def measured(out, *extra, in_decoy_folder=False) -> dict:
        if not in_decoy_folder:
            res = measure(table, out, "--reps", "5", *extra)
            assert res.exit_code == 0, res.output[-2000:]
            return json.loads(res.output)
        res = subprocess.run(FICCO + measure_args(table, out, "--reps", "5", *extra), capture_output=True, text=True,
                             timeout=600, cwd=work)
        assert res.returncode == 0, res.stderr[-2000:]
        assert DECOY not in res.stdout + res.stderr
        return json.loads(res.stdout)

    shards = [tmp_path / f"shard{i}.parquet" for i in range(3)]
    for i, out in enumerate(shards):
        assert measured(out, "--shard", f"{i}/3", in_decoy_folder=i == 0)["scenarios"] == 1
    assert measured(shards[0], "--shard", "0/3")["skipped"] == 1  # a shard resumes on its own
    one = read_dataset(tmp_path / "one.parquet") if measured(tmp_path / "one.parquet") else None
    res = subprocess.run(FICCO + ["dataset", "merge", *map(str, shards), "--out", str(tmp_path / "all.parquet"),
                                  "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["scenarios"] == 3
    merged = read_dataset(tmp_path / "all.parquet")
    assert set(zip(merged["scenario_id"], merged["schedule"])) == set(zip(one["scenario_id"], one["schedule"]))
    assert list(merged.columns) == list(one.columns) and (merged.dtypes == one.dtypes).all()
    assert merged["verified"].all()
    # The merged file is not overwritten by a merge that does not read it.
    res = subprocess.run(FICCO + ["dataset", "merge", str(shards[0]), "--out", str(tmp_path / "all.parquet")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "exists and is not one of the inputs" in res.stderr


# -- merge: one sweep, measured alike --------------------------------------------------------
@pytest.mark.gloo
def test_merge_refuses_shards_measured_with_other_settings(tmp_path, shipped):
    rows = [A_ROW, "t,gemm_rs,64,64,64,float32,2,cpu,", "t,ag_gemm,96,64,64,float32,2,cpu,"]
    path = table(tmp_path, *rows)
    scenarios = read_scenarios(path, backend="cpu")
    assert shard_of(scenarios, 0, 2) and shard_of(scenarios, 1, 2)
    s0, s1, s1_again = tmp_path / "s0.parquet", tmp_path / "s1.parquet", tmp_path / "s1_again.parquet"
    assert measure(path, s0, "--shard", "0/2", "--reps", "5").exit_code == 0
    assert measure(path, s1, "--shard", "1/2", "--reps", "6").exit_code == 0
    assert read_timing(s0)["reps"] == 5 and read_timing(s1)["reps"] == 6
    out = tmp_path / "all.parquet"
    line = refused(["dataset", "merge", s0, s1, "--out", out], "s0.parquet", "s1.parquet", "reps 6", "reps 5",
                   written=out)
    assert "min_rep_s" not in line  # the setting that differs, not every setting

    # The same settings merge, and the merged file records them.
    assert measure(path, s1_again, "--shard", "1/2", "--reps", "5").exit_code == 0
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
