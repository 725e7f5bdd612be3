"""Calibration recovers known primitive costs; validation reports agreement figures."""

import dataclasses
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers.cli import FICCO, refused

from ficco_select.data.calibrate import calibrate, measurement_self_agreement, pool_sweeps, validate_simulator
from ficco_select.data.simulate import simulate
from ficco_select import Scenario
from ficco_select.hardware import load_hardware


def synthetic_cpu_dataset(noise=0.0):
    """A dataset simulated on a known cpu-like spec: calibration must recover its numbers."""
    truth = dataclasses.replace(load_hardware("cpu"), peak_tflops={"float32": 0.1}, link_bw_gbps=2.0,
                                sm_comm_latency_us=50.0, gemm_launch_us=10.0)
    scenarios = [Scenario(group=f"g{i % 3}", op=op, m=m, n=n, k=k, dtype="float32", world_size=P, hardware="cpu")
                 for i, (op, m, n, k, P) in enumerate(
                     (op, m * P, n * P, k * P, P) for op in ("ag_gemm", "gemm_rs") for P in (2, 4)
                     for m in (16, 64, 256) for n in (32, 128) for k in (64, 256))]
    return truth, simulate(scenarios, truth, noise=noise, seed=3)


def test_calibration_recovers_the_primitive_costs():
    truth, df = synthetic_cpu_dataset()
    spec = calibrate(df, name="fit", devices=truth.devices)
    assert np.isclose(spec.peak_tflops["float32"], 0.1, rtol=0.05)
    assert np.isclose(spec.link_bw_gbps, 2.0, rtol=0.1)
    assert np.isclose(spec.sm_comm_latency_us, 50.0, rtol=0.2)


def test_validation_on_its_own_model_agrees_and_on_noise_degrades():
    _, exact = synthetic_cpu_dataset()
    report = validate_simulator(exact, devices=2)
    assert report["mape"] < 0.1 and report["kendall_tau_median"] > 0.9
    _, noisy = synthetic_cpu_dataset(noise=0.3)
    worse = validate_simulator(noisy, devices=2)
    assert worse["mape"] > report["mape"]
    assert set(report) >= {"measurement_self_tau_median", "sim_best_is_measured_best", "largest_errors"}


def test_self_agreement_of_identical_repetitions_is_perfect():
    df = pd.DataFrame({"scenario_id": ["a"] * 3, "times_s": [[1.0] * 6, [2.0] * 6, [3.0] * 6]})
    assert measurement_self_agreement(df) == (1.0, 0.0)


def test_sweeps_pooled_count_each_label_once_at_the_geometric_mean_of_its_times():
    truth, a = synthetic_cpu_dataset(noise=0.3)
    b = simulate(sorted({Scenario.from_record(r) for r in a.to_dict("records")}, key=lambda s: s.scenario_id),
                 truth, noise=0.3, seed=4)
    pooled = pool_sweeps([a, b])
    assert len(pooled) == len(a[(a["status"] == "ok") & a["verified"]].drop_duplicates(["scenario_id", "schedule"]))
    row = pooled.iloc[0]
    times = [d.set_index(["scenario_id", "schedule"]).loc[(row["scenario_id"], row["schedule"]), "time_s"] for d in (a, b)]
    assert np.isclose(row["time_s"], np.sqrt(times[0] * times[1]))
    # A sweep pooled with itself is that sweep: the same spec.
    same, alone = (dataclasses.asdict(calibrate(df, name="fit", devices=2)) for df in (pool_sweeps([a, a]), a))
    assert same.pop("peak_tflops") == pytest.approx(alone.pop("peak_tflops"))
    numbers = [k for k, v in alone.items() if isinstance(v, float)]
    assert [same[k] for k in numbers] == pytest.approx([alone[k] for k in numbers], rel=1e-9)
    assert {k: v for k, v in same.items() if k not in numbers} == {k: v for k, v in alone.items() if k not in numbers}


# -- sim calibrate's --out -----------------------------------------------------------------
REPO = Path(__file__).parents[1]
MEASURED = REPO / "data" / "measured" / "fabric_1gbit.parquet"  # small, with the ring rows the link is fitted to


def test_sim_calibrate_refuses_an_existing_out_and_its_own_input(tmp_path):
    dataset = tmp_path / "measured.parquet"
    shutil.copy(MEASURED, dataset)
    kept = tmp_path / "spec.yaml"
    kept.write_text("# a spec fitted last week\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (dataset, kept)}

    calibrate = ["sim", "calibrate", "--dataset", dataset, "--name", "mine", "--out"]
    refused([*calibrate, kept], f"--out {kept}: exists", "nothing is overwritten")
    # The input itself, spelled another way: compared as resolved paths.
    (tmp_path / "sub").mkdir()
    other_spelling = tmp_path / "sub" / ".." / "measured.parquet"
    refused([*calibrate, other_spelling], f"--out {other_spelling}: is the --dataset input")
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (dataset, kept)} == before

    res = subprocess.run([*FICCO, *map(str, calibrate), tmp_path / "new.yaml"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and (tmp_path / "new.yaml").read_text().startswith("# Calibrated"), res.stderr


@pytest.mark.parametrize("devices, needle", [
    ("0", "--devices must be a positive integer"),
    ("1", "field 'devices' must be at least 2"),
    ("100000", "field 'devices' must lie in"),
])
def test_sim_calibrate_refuses_a_device_count_no_spec_holds_and_writes_nothing(tmp_path, devices, needle):
    # 0 divided by zero; 1 and 100000 wrote a spec that every later command refused to load.
    out = tmp_path / "mine.yaml"
    refused(["sim", "calibrate", "--dataset", MEASURED, "--name", "mine", "--devices", devices, "--out", out],
            needle, written=out)
    assert list(tmp_path.iterdir()) == []


def test_sim_calibrate_without_the_rows_the_link_is_fitted_to_says_so_and_writes_nothing(tmp_path):
    # A dataset of all-reduces and all-to-alls only wrote link_bw_gbps: .nan, a spec no command loads.
    out = tmp_path / "mine.yaml"
    refused(["sim", "calibrate", "--dataset", REPO / "data" / "measured" / "cpu_catalog_ar_a2a.parquet", "--name",
             "mine", "--out", out], "at least 2 measured ag_gemm or gemm_rs scenarios", "gemm_a2a, gemm_ar",
            written=out)
