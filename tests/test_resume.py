"""A sweep survives kill -9: rerunning the same command resumes, every scenario exactly once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo


def children_of(pid: int) -> list[int]:
    kids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            kids.append(int(status.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state


def test_kill_9_then_rerun_measures_each_scenario_exactly_once(tmp_path):
    rows = [f"g{i},ag_gemm,1024,256,512,float32,2,cpu," for i in range(6)]
    scenarios = tmp_path / "s.csv"
    scenarios.write_text("group,op,m,n,k,dtype,world_size,hardware,imbalance\n" + "\n".join(rows) + "\n")
    out = tmp_path / "d.parquet"
    parts = tmp_path / "d.parquet.parts"
    cmd = [sys.executable, "-m", "ficco_select.cli.main", "measure", "--scenarios", str(scenarios),
           "--out", str(out), "--no-progress", "--reps", "9", "--min-rep-s", "0"]  # one run per repetition: fast
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (parts.is_dir() and any(parts.glob("*.parquet"))) and time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.05)
    ranks = children_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = {p.stem: pd.read_parquet(p) for p in parts.glob("*.parquet")}
    assert 1 <= len(committed) < 6 and not out.exists()
    t0 = time.monotonic()
    while any(alive(pid) for pid in ranks) and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks), "rank processes outlived the killed launcher"

    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    df = pd.read_parquet(out)
    assert df.groupby("scenario_id")["schedule"].apply(lambda s: s.is_unique).all()
    assert df["scenario_id"].nunique() == 6 and df["verified"].all()
    assert not parts.exists()
    for sid, before in committed.items():  # finished work is kept, not measured again
        after = df[df["scenario_id"] == sid].reset_index(drop=True)
        assert after["times_s"].map(list).tolist() == before["times_s"].map(list).tolist()
