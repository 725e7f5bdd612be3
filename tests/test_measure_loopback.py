"""`measure` with the loopback executor as its row source: the cuda backend's sweep.

On the CPU the loopback row source runs with device='cpu' on cpu-hardware scenarios (the
cpu backend's candidates): same writer, parts and resume as the gloo path. The CUDA test
skips without a GPU (not run yet).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import ficco_select.data.measure.loopback_scenario as scenario_mod
from ficco_select.data.dataset import SCHEMA_VERSION, read_dataset, validate
from ficco_select.data.measure.gloo import MeasureConfig
from ficco_select.data.measure.loopback import LoopbackError
from ficco_select.data.measure.loopback_scenario import loopback_rows
from ficco_select.data.measure.resume import parts_dir
from ficco_select.data.measure.sweep import measure
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates
from ficco_select.signatures import SIGNATURE_COLUMNS

REPO = Path(__file__).resolve().parents[1]
from helpers.cli import FICCO
CONFIG = MeasureConfig(reps=5, warmup=1, timeout_s=30.0, min_rep_s=0.0)  # reps >= 5: what a dataset needs
HEADER = "group,op,m,n,k,dtype,world_size,hardware,imbalance\n"


def tiny(hardware: str = "cpu") -> list[Scenario]:
    return [
        Scenario(group="mlp", op="ag_gemm", m=48, n=16, k=32, dtype="float32", world_size=2, hardware=hardware),
        Scenario(group="mlp", op="gemm_rs", m=48, n=24, k=24, dtype="bfloat16", world_size=3, hardware=hardware),
        Scenario(group="moe", op="a2a_gemm", m=40, n=16, k=16, dtype="float32", world_size=3,
                 hardware=hardware, imbalance=2.0),
        Scenario(group="attn", op="ag_gemm", m=64, n=16, k=16, dtype="float32", world_size=4, hardware=hardware),
    ]


def check_dataset(df: pd.DataFrame, scenarios: list[Scenario], backend: str) -> None:
    assert validate(df) == []
    assert df["scenario_id"].nunique() == len(scenarios)
    assert not df.duplicated(["scenario_id", "schedule"]).any()
    assert (df["status"] == "ok").all() and df["verified"].all()
    assert (df.groupby("scenario_id")["is_best"].sum() == 1).all()
    assert (df["backend"] == backend).all() and (df["schema_version"] == SCHEMA_VERSION).all()
    for s in scenarios:
        g = df[df["scenario_id"] == s.scenario_id]
        assert set(g["schedule"]) == {c.name for c in candidates(s, backend)}
        assert (g["times_s"].map(len) >= CONFIG.reps).all()
    assert (df["t_comp_s"] > 0).all() and (df["t_comm_s"] > 0).all()
    assert df["dil_shard"].notna().all() and df["chunk_loss_shard"].notna().all()
    # The contended run: the GEMM beside the collective, and that pair's time.
    assert (df["cil_gemm_sm"] > -1).all() and (df["cil_overlap_sm"] > -1).all()


def test_loopback_sweep_writes_a_valid_dataset(tmp_path):
    scenarios = tiny()
    out = tmp_path / "d.parquet"
    df = measure(scenarios, backend="cpu", device="cpu", config=CONFIG, out=out, progress=False)
    on_disk = read_dataset(out)
    check_dataset(on_disk, scenarios, "cpu")
    assert len(on_disk) == len(df) and not parts_dir(out).exists()
    assert df.attrs["sweep"]["measured"] == 4 and df.attrs["sweep"]["failed"] == 0
    assert (on_disk["threads_per_rank"] == torch.get_num_threads()).all()


def test_loopback_rows_signature_per_granularity():
    s = tiny()[3]  # P=4, m/P=16: shard, d2, d4 and dP (= d4) are all legal
    rows = loopback_rows(s, CONFIG, backend="cpu", device="cpu")
    first = rows[0]
    assert set(SIGNATURE_COLUMNS) <= set(first)
    for g in ("shard", "d2", "d4", "dP"):
        assert first[f"dil_{g}"] > -1 and first[f"chunk_loss_{g}"] > -1
    assert first["dil_dP"] == first["dil_d4"]  # the same skeleton, timed once
    assert 1 <= first["ideal_speedup"] <= 2
    assert all(r[c] == first[c] or (r[c] != r[c] and first[c] != first[c])
               for r in rows for c in SIGNATURE_COLUMNS)  # repeated on every row (NaN == NaN)


def test_a_failing_scenario_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    scenarios = tiny()[:3]
    bad = scenarios[1].scenario_id
    real = scenario_mod.run_loopback

    def flaky(scenario, schedules, **kw):
        if scenario.scenario_id == bad:
            raise LoopbackError(f"scenario {bad}: rank 1 failed: injected")
        return real(scenario, schedules, **kw)

    monkeypatch.setattr(scenario_mod, "run_loopback", flaky)
    out = tmp_path / "d.parquet"
    df = measure(scenarios, backend="cpu", device="cpu", config=CONFIG, out=out, progress=False)
    sweep = df.attrs["sweep"]
    assert sweep["failed"] == 1 and sweep["measured"] == 2 and bad in sweep["failures"][0]
    on_disk = read_dataset(out)
    assert validate(on_disk) == []
    failed = on_disk[on_disk["scenario_id"] == bad]
    assert (failed["status"] == "failed").all() and failed["error"].str.contains("injected").all()
    assert (on_disk.loc[on_disk["scenario_id"] != bad, "status"] == "ok").all()


RUN_SWEEP = """
import sys, time
import ficco_select.data.measure.sweep as m
from ficco_select.data.scenarios import read_scenarios
from ficco_select.data.measure.gloo import MeasureConfig

real, pause = m.loopback_rows, float(sys.argv[3])

def paced(scenario, *args, **kw):  # report what is measured; give the kill a window
    rows = real(scenario, *args, **kw)
    print(scenario.scenario_id, flush=True)
    time.sleep(pause)
    return rows

m.loopback_rows = paced
m.measure(read_scenarios(sys.argv[1], backend="cpu"), backend="cpu", device="cpu",
          config=MeasureConfig(reps=5, warmup=1, timeout_s=30.0), out=sys.argv[2], progress=False)
"""


def test_kill_9_then_rerun_measures_each_scenario_exactly_once(tmp_path):
    scenarios = tmp_path / "s.csv"
    scenarios.write_text(HEADER + "".join(f"g{i},ag_gemm,{32 + 8 * i},16,16,float32,2,cpu,\n" for i in range(6)))
    script = tmp_path / "sweep.py"
    script.write_text(RUN_SWEEP)
    out, parts = tmp_path / "d.parquet", tmp_path / "d.parquet.parts"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(scenarios), str(out), "1.0"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (parts.is_dir() and any(parts.glob("*.parquet"))) and time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = {p.stem: pd.read_parquet(p) for p in parts.glob("*.parquet")}
    assert 1 <= len(committed) < 6 and not out.exists()

    res = subprocess.run([sys.executable, str(script), str(scenarios), str(out), "0"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    remeasured = res.stdout.split()
    assert not set(remeasured) & set(committed) and len(remeasured) == 6 - len(committed)
    df = read_dataset(out)
    assert validate(df) == [] and df["scenario_id"].nunique() == 6 and df["verified"].all()
    assert not df.duplicated(["scenario_id", "schedule"]).any() and not parts.exists()
    for sid, before in committed.items():  # finished work is kept, not measured again
        after = df[df["scenario_id"] == sid].reset_index(drop=True)
        assert after["times_s"].map(list).tolist() == before["times_s"].map(list).tolist()


def test_cuda_refuses_cpu_hardware_naming_the_row():
    scenarios = tiny("h100-nvswitch")[:1] + tiny("cpu")[1:2]
    with pytest.raises(ValueError, match=r"row 2 \(scenario .*gemm_rs.*column 'hardware': 'cpu'"):
        measure(scenarios, backend="cuda", config=CONFIG, progress=False)


@pytest.mark.parametrize("backend, device", [("cpu", "cuda"), ("cuda", "cpu"), ("sim", None)])
def test_backend_and_device_must_match(backend, device):
    with pytest.raises(ValueError, match="backend|device"):
        measure(tiny("h100-nvswitch")[:1], backend=backend, device=device, config=CONFIG, progress=False)


def run_cli(tmp_path: Path, hardware: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{hardware}.csv"
    path.write_text(HEADER + f"mlp,ag_gemm,48,16,32,float32,2,{hardware},\n")
    return subprocess.run(FICCO + ["measure", "--backend", "cuda", "--scenarios", str(path),
                                   "--out", str(tmp_path / "x.parquet"), "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # no CUDA, GPU or not


def test_cli_cuda_without_cuda_exits_with_a_message(tmp_path):
    res = run_cli(tmp_path, "h100-nvswitch")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "CUDA is not available" in res.stderr and "--backend cpu" in res.stderr
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "x.parquet.parts").exists()


def test_cli_cuda_refuses_cpu_hardware(tmp_path):
    res = run_cli(tmp_path, "cpu")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "cpu.csv: row 1" in res.stderr and "column 'hardware'" in res.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sweep_on_the_gpu(tmp_path):
    scenarios = tiny("h100-nvswitch")
    out = tmp_path / "g.parquet"
    measure(scenarios, backend="cuda", config=CONFIG, out=out, progress=False)
    df = read_dataset(out)
    assert validate(df) == [] and df["verified"].all()
    assert (df["backend"] == "cuda").all() and (df["hardware"] == "h100-nvswitch").all()
    assert df["hardware_fingerprint"].str.endswith("-loopback").all()
    assert (df["threads_per_rank"] == 0).all()
    assert df["schedule"].str.endswith(".dma").any()  # both engines on the cuda backend


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_an_earlier_scenario_left_cached_counts_as_free():
    """An adapt run on an H100 refused its second round ("11.2 GiB free" of 80): the
    caching allocator still held the first round's buffers."""
    from ficco_select.data.measure.preflight import free_bytes

    before = free_bytes(True, None)
    held = torch.empty(int(0.25 * before), dtype=torch.uint8, device="cuda")
    del held  # freed, but kept reserved by the caching allocator
    assert torch.cuda.memory_reserved() > 0.2 * before
    assert free_bytes(True, None) > 0.9 * before
