"""`ficco measure` end to end: spawned ranks and torchrun, P=2 and P=3 rows, the Parquet file;
the settings and outputs it refuses before any rank starts, and one output's one lock by any name."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from ficco_select.cli.main import main
from ficco_select.data.dataset import SCHEMA_VERSION
from ficco_select.data.locks import OutputLocked, output_lock
from ficco_select.data.measure.config import MeasureConfig

# Tier: the tests on real ranks (processes over gloo) are marked gloo; deselect with -m "not gloo".
# The refusals before any rank starts are unit tests.

REQUIRED = ["scenario_id", "group", "op", "m", "n", "k", "dtype", "world_size", "hardware", "schedule",
            "time_s", "time_spread", "verified", "backend"]
from helpers.cli import FICCO, refused, table

A_ROW = "t,ag_gemm,64,64,64,float32,2,cpu,"


def scenario_file(tmp_path: Path, rows: list[str]) -> Path:
    p = tmp_path / "scenarios.csv"
    p.write_text("group,op,m,n,k,dtype,world_size,hardware,imbalance\n" + "\n".join(rows) + "\n")
    return p


@pytest.mark.gloo
def test_measure_p2_and_p3_writes_every_schedule_verified(tmp_path):
    path = scenario_file(tmp_path, [
        "mlp,ag_gemm,96,32,48,float32,2,cpu,",
        "mlp,gemm_rs,96,40,48,bfloat16,3,cpu,",
        "moe,a2a_gemm,40,24,32,float32,3,cpu,2.0",
    ])
    out = tmp_path / "m.parquet"
    res = subprocess.run(FICCO + ["measure", "--scenarios", str(path), "--out", str(out), "--json",
                                  "--no-progress", "--warmup", "1", "--min-rep-s", "0"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout)
    df = pd.read_parquet(out)
    assert set(REQUIRED) <= set(df.columns)
    assert summary["rows"] == len(df) and summary["unverified"] == 0
    assert df["verified"].all() and (df["backend"] == "cpu").all()
    assert set(df["world_size"]) == {2, 3} and df["scenario_id"].nunique() == 3
    assert df.groupby("scenario_id")["schedule"].apply(lambda s: s.is_unique).all()
    assert (df["schema_version"] == SCHEMA_VERSION).all()


@pytest.mark.gloo
@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed beside this python")
def test_measure_runs_under_torchrun(tmp_path):
    path = scenario_file(tmp_path, ["mlp,ag_gemm,64,32,32,float32,2,cpu,", "out,gemm_rs,64,16,32,float32,2,cpu,"])
    out = tmp_path / "t.parquet"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "--no-python",
                          *FICCO, "measure", "--scenarios", str(path), "--out", str(out), "--no-progress",
                          "--warmup", "1", "--min-rep-s", "0"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    df = pd.read_parquet(out)
    assert df["verified"].all() and df["scenario_id"].nunique() == 2


@pytest.mark.gloo
def test_min_rep_s_times_several_runs_per_repetition(tmp_path):
    path = scenario_file(tmp_path, ["mlp,ag_gemm,64,32,48,float32,2,cpu,"])
    out = tmp_path / "m.parquet"
    res = subprocess.run(FICCO + ["measure", "--scenarios", str(path), "--out", str(out), "--no-progress",
                                  "--warmup", "0", "--reps", "5", "--min-rep-s", "0.02"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    df = pd.read_parquet(out)
    assert df["verified"].all() and (df["runs_per_rep"] > 1).all() and df["runs_per_rep"].nunique() == 1


@pytest.mark.gloo
def test_two_measure_runs_into_one_out_never_lose_a_scenario(tmp_path):
    # The second writer refuses at once, naming the first, which finishes untouched; run again
    # afterwards, the second table's scenarios are added beside the first's.
    # Four scenarios, one run per repetition: the first run holds the lock for seconds, well
    # past the second's start.
    first = scenario_file(tmp_path, ["mlp,ag_gemm,96,32,48,float32,2,cpu,", "mlp,gemm_rs,64,16,32,float32,2,cpu,",
                                     "mlp,ag_gemm,128,32,48,float32,2,cpu,", "mlp,gemm_rs,128,16,32,float32,2,cpu,"])
    second = tmp_path / "second.csv"
    second.write_text("group,op,m,n,k,dtype,world_size,hardware,imbalance\nout,ag_gemm,64,32,32,float32,2,cpu,\n")
    out = tmp_path / "m.parquet"
    cmd = FICCO + ["measure", "--out", str(out), "--no-progress", "--warmup", "1", "--min-rep-s", "0", "--scenarios"]
    a = subprocess.Popen(cmd + [str(first)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".m.parquet.lock"
    for _ in range(600):  # until the first run holds the lock
        if lock.exists() and lock.read_text():
            break
        import time
        time.sleep(0.05)
    # The second writer and the rerun: this test's own process (a writer apart from the first).
    refused(cmd[len(FICCO):] + [str(second)], "ficco measure (pid", "is writing it")
    assert a.wait(timeout=600) == 0, a.stderr.read()[-2000:]
    assert pd.read_parquet(out)["scenario_id"].nunique() == 4
    again = CliRunner().invoke(main, cmd[len(FICCO):] + [str(second)])
    assert again.exit_code == 0, again.output[-2000:]
    assert pd.read_parquet(out)["scenario_id"].nunique() == 5


# -- measure: options it cannot time with ------------------------------------------------------
@pytest.mark.parametrize("option,value", [("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-1"),
                                          ("--timeout", "0"), ("--min-rep-s", "inf"), ("--min-rep-s", "nan"),
                                          ("--min-rep-s", "-0.01")])
def test_measure_refuses_non_finite_or_negative_seconds(tmp_path, option, value):
    out = tmp_path / "m.parquet"
    refused(["measure", "--scenarios", table(tmp_path, A_ROW), "--out", out, "--no-progress", option, value],
            option, value, written=out)
    assert not Path(f"{out}.parts").exists()


def test_a_measure_config_refuses_non_finite_seconds():
    for field, value in (("timeout_s", math.nan), ("timeout_s", math.inf), ("min_rep_s", math.inf),
                         ("min_rep_s", math.nan)):
        with pytest.raises(ValueError, match=field):
            MeasureConfig(**{field: value})


def test_a_sweep_that_ends_with_status_0_before_its_file_exits_1(tmp_path, monkeypatch):
    # A stray exit with status 0 inside the sweep is not success: the file was not written.
    import ficco_select.data.measure.sweep as sweep

    monkeypatch.setattr(sweep, "measure_table", lambda *args, **kwargs: sys.exit(0))
    out = tmp_path / "m.parquet"
    refused(["measure", "--scenarios", table(tmp_path, A_ROW), "--out", out, "--no-progress"],
            f"before {out} was written", "rerun the same command", written=out)


# -- measure never replaces what is at --out ---------------------------------------------------
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
