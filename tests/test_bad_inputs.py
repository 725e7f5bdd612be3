"""Ordinary mistakes and hostile files, command by command: a one-line error that names the
file and the row, column or field; a non-zero exit; no traceback; nothing written.

Then the data-safety cases of `ficco measure` on real gloo ranks: an existing dataset is
never replaced by another, parts of another table are never deleted, a finished `--out`
counts as done, and a sweep with failures exits non-zero.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from ficco_select.data.dataset import read_dataset, validate, write_parquet_atomic
from ficco_select.cli.main import main
from ficco_select.hardware import presets_dir
from ficco_select.scenario import Scenario
from helpers.cli import FICCO, HEADER, refused, table

def spec_file(tmp_path: Path, name: str = "bad.yaml", base: str = "h100-nvswitch", **changes) -> Path:
    spec = yaml.safe_load((presets_dir() / f"{base}.yaml").read_text())
    spec.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


# -- scenario tables: ficco select / measure / simulate ----------------------------------
def hostile_tables(tmp_path: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    header_only = tmp_path / "header.csv"
    header_only.write_text(HEADER)
    truncated = tmp_path / "truncated.csv"
    truncated.write_text(HEADER + "t,ag_gemm,64,64,64,float32,2,cpu,\nt,ag_gemm,128,64")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 8)
    cut_parquet = tmp_path / "cut.parquet"
    cut_parquet.write_bytes(b"PAR1" + b"\0" * 100)
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    no_column = tmp_path / "nocol.csv"
    no_column.write_text("group,op,m,n,k,dtype,world_size\nt,ag_gemm,64,64,64,float32,2\n")
    return {
        "empty": (empty, ("empty.csv", "empty")),
        "header only": (header_only, ("header.csv", "no rows")),
        "truncated": (truncated, ("truncated.csv", "row 2", "fields")),
        "binary": (binary, ("binary.csv", "not a text")),
        "cut parquet": (cut_parquet, ("cut.parquet", "Parquet")),
        "a directory": (folder, ("folder.csv",)),  # click itself says "is a directory"
        "missing column": (no_column, ("nocol.csv", "column 'hardware'")),
    }


@pytest.mark.parametrize("case", ["empty", "header only", "truncated", "binary", "cut parquet", "a directory",
                                  "missing column"])
@pytest.mark.parametrize("command", ["select", "measure", "simulate"])
def test_hostile_scenario_tables_are_refused_by_every_reader(tmp_path, command, case):
    path, needles = hostile_tables(tmp_path)[case]
    out = tmp_path / "out.parquet"
    args = {"select": ["select", "--scenarios", path, "--heuristic-only"],
            "measure": ["measure", "--scenarios", path, "--out", out, "--no-progress"],
            "simulate": ["simulate", "--scenarios", path, "--out", out]}[command]
    refused(args, *needles, written=out)


def test_a_bool_is_not_a_number():
    with pytest.raises(ValueError, match="column 'imbalance'"):
        Scenario.from_record(dict(group="g", op="a2a_gemm", m=8, n=8, k=8, dtype="float32", world_size=2,
                                  hardware="cpu", imbalance=True))
    with pytest.raises(ValueError, match="column 'm'"):
        Scenario.from_record(dict(group="g", op="ag_gemm", m=True, n=8, k=8, dtype="float32", world_size=2,
                                  hardware="cpu"))


# -- measured rows carry only the machine they ran on ------------------------------------
@pytest.mark.parametrize("hardware,needles", [
    ("h100-nvswitch", ("row 1", "column 'hardware'", "is a GPU")),
    ("tpu-v9", ("row 1", "column 'hardware'", "unknown hardware 'tpu-v9'")),
])
def test_the_cpu_backend_refuses_gpu_and_unknown_machines(tmp_path, hardware, needles):
    path = table(tmp_path, f"t,ag_gemm,64,64,64,float32,2,{hardware},")
    out = tmp_path / "m.parquet"
    refused(["measure", "--scenarios", path, "--out", out, "--no-progress"], "scenarios.csv", *needles, written=out)
    assert not Path(f"{out}.parts").exists()


def test_a_shape_that_cannot_fit_is_refused_before_any_rank_starts(tmp_path):
    path = table(tmp_path, "t,ag_gemm,64,64,64,float32,2,cpu,", "t,ag_gemm,2000000000,60000,64,float32,2,cpu,")
    out = tmp_path / "m.parquet"
    line = refused(["measure", "--scenarios", path, "--out", out, "--no-progress"],
                   "row 2", "column 'm'", "PiB", "free", written=out)
    assert "TiB" in line  # per rank, beside the total
    assert not Path(f"{out}.parts").exists()  # not even the first, small scenario ran


def test_validate_refuses_cpu_rows_labelled_as_a_gpu(tmp_path):
    df = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet")
    sid = df["scenario_id"].iloc[0]
    one = df[df["scenario_id"] == sid].copy()
    relabelled = Scenario.from_record({**one.iloc[0].to_dict(), "hardware": "h100-nvswitch"})
    one["hardware"], one["scenario_id"] = "h100-nvswitch", relabelled.scenario_id
    problems = validate(one)
    assert any("column 'hardware'" in p and "is a GPU" in p for p in problems), problems
    one["hardware"] = "tpu-v9"
    one["scenario_id"] = Scenario.from_record({**one.iloc[0].to_dict()}).scenario_id
    assert any("unknown hardware 'tpu-v9'" in p for p in validate(one))


# -- datasets: ficco dataset info / validate -----------------------------------------------
def test_dataset_readers_name_the_file_and_the_column(tmp_path):
    df = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet").head(40)
    write_parquet_atomic(df.drop(columns=["near_best"]), tmp_path / "nocol.parquet")
    refused(["dataset", "info", tmp_path / "nocol.parquet"], "nocol.parquet", "column 'near_best' is missing")
    bad_id = df.copy()
    bad_id.loc[0, "scenario_id"] = "bogus"
    write_parquet_atomic(bad_id, tmp_path / "badid.parquet")
    res = CliRunner().invoke(main, ["dataset", "info", str(tmp_path / "badid.parquet"), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["scenarios_without_baseline"] == 1
    res = CliRunner().invoke(main, ["dataset", "validate", str(tmp_path / "badid.parquet")])
    assert res.exit_code == 1 and "column 'scenario_id'" in res.output
    (tmp_path / "text.parquet").write_text("hello")
    for command in ("info", "validate"):
        refused(["dataset", command, tmp_path / "text.parquet"], "text.parquet", "not a Parquet file")


# -- hardware specs: ficco hardware show ------------------------------------------------------
@pytest.mark.parametrize("field", ["gemm_efficiency", "sm_comm_units", "dma_mem_contention", "devices",
                                   "mem_bw_gbps", "copy_engines"])
def test_a_string_in_a_numeric_field_names_the_field(tmp_path, field):
    refused(["hardware", "show", spec_file(tmp_path, **{field: "fast"})], "bad.yaml", f"field '{field}'")


def test_unreadable_spec_files_name_the_file_and_echo_nothing(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 8)
    refused(["hardware", "show", binary], "binary.yaml", "not a text file")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    refused(["hardware", "show", folder], "folder.yaml", "not a file")
    secret = tmp_path / "notes.yaml"
    secret.write_text("password: hunter2\n  broken: [indent\n")
    line = refused(["hardware", "show", secret], "notes.yaml", "not valid YAML", "line")
    assert "hunter2" not in line
    refused(["hardware", "show", spec_file(tmp_path, name="h100-nvswitch", devices=4)], "a preset's")


# -- simulate: every output validates; impossible rows are refused -------------------------
def test_simulating_a_machine_without_copy_engines_writes_a_valid_dataset(tmp_path):
    path = table(tmp_path, "t,ag_gemm,64,64,64,float32,2,cpu,", "t,gemm_rs,64,64,64,float32,2,cpu,",
                 "t,a2a_gemm,16,64,64,float32,2,cpu,1.5")
    out = tmp_path / "sim.parquet"
    res = CliRunner().invoke(main, ["simulate", "--scenarios", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert validate(read_dataset(out)) == []
    assert not read_dataset(out)["schedule"].str.endswith(".dma").any()


def test_simulate_refuses_more_ranks_than_the_machine_has(tmp_path):
    path = table(tmp_path, "t,ag_gemm,64,64,64,float32,16,mi300x-8,")
    out = tmp_path / "sim.parquet"
    refused(["simulate", "--scenarios", path, "--out", out], "row 1", "column 'world_size'", "8 devices", written=out)
    refused(["simulate", "--scenarios", table(tmp_path, "t,ag_gemm,64,64,64,float32,2,cpu,"), "--hardware",
             tmp_path / "nope.yaml", "--out", out], "nope.yaml", "no such hardware spec file", written=out)


# -- ficco measure never loses or mixes data (real gloo ranks) ----------------------------
A_ROW = "t,ag_gemm,64,64,64,float32,2,cpu,"
B_ROW = "t,gemm_rs,64,64,64,float32,2,cpu,"


def measure(path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(FICCO + ["measure", "--scenarios", str(path), "--out", str(out), "--no-progress",
                                   "--warmup", "0", "--min-rep-s", "0", "--json", *extra], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.gloo
def test_measure_keeps_earlier_scenarios_and_other_tables_parts(tmp_path):
    a, b = table(tmp_path, A_ROW, name="a.csv"), table(tmp_path, B_ROW, name="b.csv")
    a_only = tmp_path / "a.parquet"
    assert measure(a, a_only).returncode == 0
    sid_a = read_dataset(a_only)["scenario_id"].iloc[0]
    # An interrupted sweep of table a into m.parquet left its committed part behind.
    out = tmp_path / "m.parquet"
    parts = Path(f"{out}.parts")
    parts.mkdir()
    shutil.copy(a_only, parts / f"{sid_a}.parquet")

    res = measure(b, out)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (parts / f"{sid_a}.parquet").exists(), "a part of another table was deleted"
    assert json.loads(res.stdout)["other_parts_kept"] == 1
    sid_b = read_dataset(out)["scenario_id"].iloc[0]

    res = measure(a, out)  # resumes table a: its part counts as done; b stays in the dataset
    summary = json.loads(res.stdout)
    assert res.returncode == 0 and summary["measured"] == 0 and summary["skipped"] == 1
    assert set(read_dataset(out)["scenario_id"]) == {sid_a, sid_b}
    assert not parts.exists()

    before = out.stat().st_mtime_ns
    res = measure(table(tmp_path, A_ROW, B_ROW, name="ab.csv"), out)  # a finished out counts as done
    summary = json.loads(res.stdout)
    assert res.returncode == 0 and summary["skipped"] == 2 and summary["measured"] == 0
    assert out.stat().st_mtime_ns == before, "a finished dataset was rewritten"
    assert validate(read_dataset(out)) == []


def test_measure_refuses_an_out_of_another_machine_or_not_a_dataset(tmp_path):
    path = table(tmp_path, A_ROW)
    sim = tmp_path / "sim.parquet"
    assert CliRunner().invoke(main, ["simulate", "--scenarios", str(path), "--out", str(sim)]).exit_code == 0
    before = sim.read_bytes()
    refused(["measure", "--scenarios", path, "--out", sim, "--no-progress"], "sim.parquet", "backend sim")
    assert sim.read_bytes() == before
    notes = tmp_path / "notes.parquet"
    notes.write_text("my notes")
    refused(["measure", "--scenarios", path, "--out", notes, "--no-progress"], "notes.parquet", "not a dataset")
    assert notes.read_text() == "my notes"


@pytest.mark.gloo
def test_a_sweep_with_failures_exits_non_zero(tmp_path):
    out = tmp_path / "m.parquet"
    res = measure(table(tmp_path, A_ROW), out, "--timeout", "0.05")  # no rank can start in time
    assert res.returncode == 1, res.stdout + res.stderr[-2000:]
    summary = json.loads(res.stdout)
    assert summary["failed"] == 1
    assert set(read_dataset(out)["status"]) == {"failed"}  # what failed is on record, with its reason


def test_what_the_system_refuses_ends_in_one_line_naming_the_file(tmp_path, monkeypatch):
    # An output under a file (or read-only, or past a file-size limit: the same OSError path).
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(["catalog", "--scale", "cpu", "--out", blocker / "catalog.csv"], str(blocker))
    refused(["sim", "validate", "--dataset", "data/measured/cpu_catalog.parquet", "--devices", "0"],
            "--devices must be a positive integer")
    # A spec of one device: no scenario (P >= 2) fits it.
    refused(["hardware", "show", spec_file(tmp_path, devices=1)], "field 'devices' must be at least 2")
    # An MLflow store that is not one.
    (tmp_path / "mlflow.db").write_text("not sqlite")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    refused(["pipeline", "--debug", "--no-progress"], "MLflow tracking store", "not a database")


def test_sim_validate_refuses_simulated_rows(tmp_path):
    from ficco_select.data.simulate import simulate
    from ficco_select.hardware import load_hardware

    rows = simulate([Scenario(group="g", op="ag_gemm", m=64, n=64, k=64, dtype="bfloat16", world_size=2,
                              hardware="h100-nvswitch")], load_hardware("h100-nvswitch"))
    write_parquet_atomic(rows, tmp_path / "sim.parquet")
    refused(["sim", "validate", "--dataset", tmp_path / "sim.parquet"], "column 'backend': 'sim'")


def test_validate_refuses_a_file_that_mixes_backends(tmp_path):
    from ficco_select.data.simulate import simulate
    from ficco_select.hardware import load_hardware

    measured = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet")
    measured = measured[measured["scenario_id"] == measured["scenario_id"].iloc[0]]
    simulated = simulate([Scenario(group="g", op="ag_gemm", m=64, n=64, k=64, dtype="bfloat16", world_size=2,
                                   hardware="h100-nvswitch")], load_hardware("h100-nvswitch"))
    mixed = pd.concat([measured, simulated], ignore_index=True)
    assert validate(measured) == [] and validate(simulated) == []
    problems = validate(mixed)
    assert any("column 'backend'" in p and "one backend's rows" in p for p in problems), problems


def test_simulate_accepts_the_rows_the_cpu_backend_measures(tmp_path):
    # The cpu backend's ranks are processes: it measures P = 3 and 4 on a 2-core machine, and
    # the simulator predicts those rows (time-shared), as `ficco sim validate` needs.
    out = tmp_path / "sim.parquet"
    path = table(tmp_path, "t,ag_gemm,96,48,32,float32,3,cpu,", "t,gemm_rs,64,32,64,float32,4,cpu,")
    res = CliRunner().invoke(main, ["simulate", "--scenarios", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = read_dataset(out)
    assert set(df["world_size"]) == {3, 4} and validate(df) == []
