"""`ficco bring-up`: a new GPU node in one command, rehearsed end to end on this machine's
CPU stand-ins (tiny profile, the cuda path's stand-in, the pipeline's debug slice, a
registry of its own); without CUDA and without --rehearse it stops in one line."""

import json
import subprocess
import sys

import pytest
import torch

from ficco_select.train.bringup import STEPS

FICCO = [sys.executable, "-m", "ficco_select.cli.main"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    res = subprocess.run(FICCO + ["bring-up", "--out", str(tmp_path / "node")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "CUDA is not available here" in res.stderr and "--rehearse" in res.stderr
    assert not (tmp_path / "node").exists()


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts of the rehearsal stay in it
    out = tmp_path / "node"
    res = subprocess.run(FICCO + ["bring-up", "--out", str(out), "--rehearse", "--budget", "0.01", "--json"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["ok"] and [s["step"] for s in summary["steps"]] == list(STEPS)
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["spec"]["name"] == "cpu-profiled" and steps["spec"]["overrides"]
    assert steps["adapt"]["measured"] >= 1
    assert steps["register"]["version"] == "1" and (out / "mlflow.db").exists()  # its own registry
    assert (out / "selector" / "selector.json").exists()
    assert 0 < steps["benchmark"]["hooked_speedup"] < 10 and steps["benchmark"]["best_fixed"]
    assert json.loads((out / "bring_up.json").read_text())["ok"]
    # A second run finds every step's result and keeps it.
    again = subprocess.run(FICCO + ["bring-up", "--out", str(out), "--rehearse", "--budget", "0.01", "--json"],
                           capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    statuses = {s["step"]: s["status"] for s in json.loads(again.stdout)["steps"]}
    assert statuses == {s: "kept" for s in STEPS}
