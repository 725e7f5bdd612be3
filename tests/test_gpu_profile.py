"""GPU profiles on the CPU: the format, profile -> spec, the CLI, and the profiler's CUDA-free parts.

The example profile below is hand-written (made-up but plausible H200 numbers), not a
measurement: no test here claims anything about a GPU.
"""

import copy
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.cli import refused
from helpers.profiles import EXAMPLE

from ficco_select.data.gpu_profile import copies, gemm, realized, runner
from ficco_select.data.gpu_profile import run as gp
from ficco_select.data.gpu_profile.read import (KEPT_FIELDS, ProfileError, dil_vs_model, fit_latency_bw, profiled_spec,
                                   read_profile, spec_overrides, validate_profile)
from ficco_select.data.measure.loopback import LoopbackResult
from ficco_select.cli.main import main
from ficco_select.costs import gemm_time
from ficco_select.hardware import load_hardware, preset_for_device
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates

ROOT = Path(__file__).resolve().parents[1]

def write(tmp_path: Path, data, name="profile.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# -- the format --------------------------------------------------------------------------------
def test_example_profile_reads(tmp_path):
    profile = read_profile(write(tmp_path, EXAMPLE))
    assert profile.device_name == "NVIDIA H200" and profile.preset == "h200-nvswitch"
    assert profile.fitted["dma_bw_gbps"] == 1480.0


def changed(path: str, value):
    data = copy.deepcopy(EXAMPLE)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize("path,value,needle", [
    ("schema", "something-else", "field 'schema'"),
    ("schema_version", KeyError, "field 'schema_version'"),
    ("schema_version", 2, "field 'schema_version' is 2"),
    ("created_utc", KeyError, "field 'created_utc'"),
    ("device.name", "", "field 'device.name'"),
    ("device.multiprocessor_count", 0, "field 'device.multiprocessor_count'"),
    ("software", KeyError, "field 'software.torch'"),
    ("fitted", KeyError, "field 'fitted'"),
    ("fitted.dma_bw_gbps", -3.0, "field 'fitted.dma_bw_gbps' must be positive"),
    ("fitted.dma_latency_us", "fast", "field 'fitted.dma_latency_us' must be a finite number"),
    ("fitted.cil_gemm_sm", -1.5, "field 'fitted.cil_gemm_sm'"),
    ("fitted.gemm_tflops", {"int8": 3.0}, "field 'fitted.gemm_tflops.int8': unknown dtype"),
    ("fitted.gemm_efficiency", {"bfloat16": 0}, "field 'fitted.gemm_efficiency.bfloat16'"),
    ("fitted.gemm_shape", {"bfloat16": [1, 2]}, "field 'fitted.gemm_shape.bfloat16'"),
    ("fitted.link_bw_gbps", 400.0, "unknown field 'fitted.link_bw_gbps'"),
    ("measurements", [], "field 'measurements'"),
])
def test_bad_profiles_name_the_field(tmp_path, path, value, needle):
    with pytest.raises(ProfileError, match=None) as err:
        read_profile(write(tmp_path, changed(path, value)))
    assert needle in str(err.value) and str(tmp_path) in str(err.value)


def test_not_json_or_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="not valid JSON"):
        read_profile(write(tmp_path, "{half"))
    with pytest.raises(ProfileError, match="no such profile"):
        read_profile(tmp_path / "absent.json")
    with pytest.raises(ProfileError, match="JSON object"):
        read_profile(write(tmp_path, "[1, 2]"))


def test_fit_latency_bw_recovers_a_line():
    sizes = [4096 * 4 ** i for i in range(10)]
    times = [10e-6 + s / 200e9 for s in sizes]
    latency, bw = fit_latency_bw(sizes, times)
    assert latency == pytest.approx(10e-6, rel=1e-6) and bw == pytest.approx(200e9, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        fit_latency_bw([4096], [1e-5])


# -- profile -> spec ---------------------------------------------------------------------------
def test_overrides_map_the_measured_fields_and_keep_the_links():
    base = load_hardware("h200-nvswitch")
    o = spec_overrides(validate_profile(EXAMPLE), base)
    assert o["dma_latency_us"] == 9.5 and o["dma_bw_gbps"] == 1480.0
    assert o["sm_comm_latency_us"] == 3.1 and o["gemm_launch_us"] == 7.9 and o["compute_units"] == 132
    assert o["sm_comm_units"] == pytest.approx(1 - 1 / 1.35, abs=1e-6)
    assert o["dma_mem_contention"] == pytest.approx(0.08)
    assert not set(o) & set(KEPT_FIELDS)
    # gemm_time on the profiled spec reproduces the measured big GEMMs, per dtype.
    spec = dataclasses.replace(base, **o)
    for dtype, (m, n, k) in EXAMPLE["fitted"]["gemm_shape"].items():
        measured = 2 * m * n * k / (EXAMPLE["fitted"]["gemm_tflops"][dtype] * 1e12)
        b = 4 if dtype == "float32" else 2
        assert float(gemm_time(spec, m, n, k, b, spec.peak_tflops[dtype] * 1e12)) == pytest.approx(measured, rel=1e-3)
    # bf16 sets the one efficiency; float32 (no TF32) got its own effective peak, far below TF32's.
    assert 0 < o["gemm_efficiency"] <= 1
    assert o["peak_tflops"]["bfloat16"] == pytest.approx(base.peak_tflops["bfloat16"], rel=1e-3)
    assert o["peak_tflops"]["float32"] < base.peak_tflops["float32"] / 5


def test_partial_profile_overrides_only_what_it_measured():
    data = changed("fitted", {"cil_gemm_dma": 0.05})
    del data["device"]["multiprocessor_count"]
    assert spec_overrides(data, load_hardware("h200-nvswitch")) == {"dma_mem_contention": 0.05}


def test_no_dma_overrides_when_the_base_has_no_copy_engines():
    o = spec_overrides(EXAMPLE, load_hardware("cpu"))
    assert "dma_latency_us" not in o and "dma_bw_gbps" not in o


def test_profiled_spec_writes_a_loadable_spec(tmp_path):
    from ficco_select.data.calibrate import spec_yaml

    base = load_hardware("h200-nvswitch")
    spec, overrides = profiled_spec(validate_profile(EXAMPLE), base)
    path = tmp_path / "h200-profiled.yaml"
    path.write_text(spec_yaml(spec, "test"))
    loaded = load_hardware(path)
    assert loaded == spec and loaded.name == "h200-nvswitch-profiled"
    assert loaded.link_bw_gbps == base.link_bw_gbps and loaded.topology == base.topology
    assert loaded.dma_bw_gbps == 1480.0


def test_dil_vs_model_rows():
    rows = dil_vs_model(validate_profile(EXAMPLE), load_hardware("h200-nvswitch"))
    assert [(r["split"], r["d"]) for r in rows] == [("m", 8), ("n", 2)]
    assert all(math.isfinite(r["dil_model"]) and r["dil_model"] > -0.5 for r in rows)


# -- the CLI -----------------------------------------------------------------------------------
def test_cli_from_profile(tmp_path):
    out = tmp_path / "spec.yaml"
    res = CliRunner().invoke(main, ["hardware", "from-profile", str(write(tmp_path, EXAMPLE)),
                                    "--base", "h200-nvswitch", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    base = load_hardware("h200-nvswitch").dma_bw_gbps
    assert report["overrides"]["dma_bw_gbps"] == {"base": base, "profiled": 1480.0}
    assert "link_bw_gbps" in report["kept"]
    spec = load_hardware(out)
    assert spec.dma_latency_us == 9.5 and spec.link_bw_gbps == 450
    # Base from the profile's preset; a table, not JSON.
    res = CliRunner().invoke(main, ["hardware", "from-profile", str(write(tmp_path, EXAMPLE)),
                                    "--out", str(tmp_path / "b.yaml"), "--name", "mine"])
    assert res.exit_code == 0, res.output
    assert "dma_bw_gbps" in res.output and "kept from h200-nvswitch" in res.output
    assert load_hardware(tmp_path / "b.yaml").name == "mine"


def test_cli_from_profile_errors_name_the_field(tmp_path):
    bad = write(tmp_path, changed("fitted.dma_bw_gbps", 0))
    res = CliRunner().invoke(main, ["hardware", "from-profile", str(bad), "--base", "h200-nvswitch",
                                    "--out", str(tmp_path / "s.yaml")])
    assert res.exit_code != 0 and "fitted.dma_bw_gbps" in res.output
    res = CliRunner().invoke(main, ["hardware", "from-profile", str(write(tmp_path, EXAMPLE)),
                                    "--base", "h200-nvswitch", "--out", str(tmp_path / "s.txt")])
    assert res.exit_code != 0 and ".yaml" in res.output
    res = CliRunner().invoke(main, ["hardware", "from-profile", str(write(tmp_path, EXAMPLE)),
                                    "--base", "no-such-gpu", "--out", str(tmp_path / "s.yaml")])
    assert res.exit_code != 0 and "unknown hardware" in res.output


# -- the profiler without CUDA -----------------------------------------------------------------
def run_py(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_profiler_help_works_without_cuda():
    res = run_py("-m", "ficco_select.data.gpu_profile.run", "--help")
    assert res.returncode == 0 and "--budget-s" in res.stdout


def test_profiler_exits_clearly_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the profiler would run")
    res = run_py("-m", "ficco_select.data.gpu_profile.run", "--out", str(tmp_path / "o"), "--budget-s", "5")
    assert res.returncode == 2
    assert "no CUDA device" in res.stderr and "Nothing was measured" in res.stderr


def test_profiler_rejects_unknown_sections():
    with pytest.raises(SystemExit):
        gp.parse_args(["--out", "x", "--sections", "gemm_peak,warp_drive"])


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0


def test_gpu_check_runs_every_file_that_holds_cuda_tests():
    # The script names the files (a GPU image may lack mlflow/xgboost that others import).
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    named = set(re.findall(r"tests/test_\w+\.py", script))
    marked = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if re.search(r"^@pytest\.mark\.cuda$", p.read_text(), re.M)}
    assert marked and named == marked


def test_sections_are_guarded_time_boxed_and_written(tmp_path):
    """A failing section is recorded and the next runs; a Skip is a skip; a hung one stops the run; the file is valid."""

    def ok(run, until):
        run.put("fitted", "dma_bw_gbps", value=100.0)

    def boom(run, until):
        raise RuntimeError("kernel exploded")

    def hang(run, until):
        time.sleep(5)

    run = runner.Run(out=tmp_path, deadline=time.monotonic() + 30, state=dict(copy.deepcopy(EXAMPLE), fitted={}),
                     device="cpu")
    sections = [runner.Section("a", 5, ok), runner.Section("b", 5, boom),
                runner.Section("copy_h2d", 5, copies.section_copy_h2d),  # needs a GPU: raises Skip on cpu
                runner.Section("c", 0.2, hang), runner.Section("d", 5, ok)]
    assert runner.run_sections(run, sections, grace_s=0.5) is False
    status = {k: v["status"] for k, v in run.state["sections"].items() if k in "a b c d copy_h2d"}
    assert status == {"a": "ok", "b": "error", "copy_h2d": "skipped", "c": "timeout", "d": "skipped"}
    assert "kernel exploded" in run.state["sections"]["b"]["message"]
    assert run.state["sections"]["copy_h2d"]["message"] == "skipped: host-to-device copies need a GPU"
    profile = read_profile(tmp_path / "profile.json")  # partial, still a valid profile
    assert profile.fitted == {"dma_bw_gbps": 100.0}


def test_budget_exhausted_skips(tmp_path):
    run = runner.Run(out=tmp_path, deadline=time.monotonic() + 1, state=copy.deepcopy(EXAMPLE))
    assert runner.run_sections(run, [runner.Section("a", 5, lambda r, u: None)]) is True
    assert run.state["sections"]["a"] == {"status": "skipped", "message": "skipped: time budget exhausted"}


def loopback_result(schedule, verified=True, rel_error=1e-3, times_s=(1.0,)):
    return LoopbackResult(schedule=schedule, verified=verified, rel_error=rel_error, rank_errors=[rel_error],
                          times_s=list(times_s))


def test_realized_fractions_against_the_engines_baseline():
    s = Scenario(group="g", op="ag_gemm", m=64, n=64, k=32, dtype="bfloat16", world_size=4, hardware="h200-nvswitch")
    scheds = [x for x in candidates(s, "cuda") if x.engine == "dma"][:3]
    names = [x.name for x in scheds]
    assert names[0] == "none.dma"
    results = {names[0]: loopback_result(scheds[0], times_s=[1.0, 1.0, 1.0]),
               names[1]: loopback_result(scheds[1], rel_error=2e-3, times_s=[0.8, 0.8]),
               names[2]: loopback_result(scheds[2], verified=False, rel_error=0.5, times_s=[0.5])}
    rows = {r["schedule"]: r for r in realized.realized_fractions(results, t_comp_s=0.6)}
    assert names[2] not in rows  # a wrong result is never counted
    # T_comp 0.6, T_comm 1.0 - 0.6 = 0.4: ideal 1/0.6; realized 1/0.8 -> fraction 0.25/0.6667.
    r = rows[names[1]]
    assert r["ideal_from"] == "estimate" and r["ideal_speedup"] == pytest.approx(1 / 0.6, abs=1e-4)
    assert r["realized_speedup"] == pytest.approx(1.25) and r["time_s"] == pytest.approx(0.8)
    assert r["realized_fraction"] == pytest.approx(0.25 / (1 / 0.6 - 1), abs=1e-3)
    # Without T_comp there is no ideal to compare with; without its baseline a schedule has no row.
    r = {x["schedule"]: x for x in realized.realized_fractions(results, t_comp_s=None)}[names[1]]
    assert r["ideal_speedup"] is None and r["realized_fraction"] is None and r["ideal_from"] is None
    assert realized.realized_fractions({names[1]: results[names[1]]}, t_comp_s=0.6) == []


def test_best_by_engine_picks_each_engines_fastest_verified_schedule():
    per = [{"schedule": "none.sm", "time_s": 1.0, "realized_speedup": 1.0, "realized_fraction": 0.0},
           {"schedule": "shard.ring.sm", "time_s": 0.9, "realized_speedup": 1.11, "realized_fraction": 0.2},
           {"schedule": "none.dma", "time_s": 1.0, "realized_speedup": 1.0, "realized_fraction": 0.0},
           {"schedule": "ficco.d2.ring.gemm_per_piece.m.dma", "time_s": 0.7, "realized_speedup": 1.43,
            "realized_fraction": 0.6}]
    best = realized.best_by_engine(per)
    assert best["sm"]["schedule"] == "shard.ring.sm" and best["dma"]["realized_fraction"] == 0.6


def test_correctness_records_failed_schedules_and_errors(tmp_path, monkeypatch):
    """One wrong schedule fails its scenario; a scenario whose loopback raises is recorded and the next runs."""
    specs = (dict(op="gemm_rs", m=24, n=8, k=12, dtype="float32", world_size=2),
             dict(op="ag_gemm", m=36, n=8, k=12, dtype="float32", world_size=2))
    monkeypatch.setattr(realized, "CORRECTNESS_SCENARIOS", specs)
    calls = []

    def fake_loopback(scenario, schedules, *, device, reps, warmup):
        calls.append((scenario.op, device, reps, warmup))
        if scenario.op == "gemm_rs":
            raise RuntimeError("rank 1 hung")
        return [loopback_result(x, verified=i != 1, rel_error=0.5 if i == 1 else 1e-6)
                for i, x in enumerate(schedules)]

    monkeypatch.setattr(realized, "run_loopback", fake_loopback)
    run = runner.Run(out=tmp_path, deadline=time.monotonic() + 60, state=copy.deepcopy(EXAMPLE), device="cpu")
    realized.section_loopback_correctness(run, time.monotonic() + 60)
    assert calls == [("gemm_rs", "cpu", 1, 0), ("ag_gemm", "cpu", 1, 0)]
    err, ok = run.state["loopback"]["correctness"]
    assert err["error"] == "RuntimeError: rank 1 hung" and "verified" not in err
    second = candidates(realized.scenario_for(specs[1], "h200-nvswitch"), "cuda")[1].name
    assert ok["failed"] == [second] and ok["missing"] == [] and ok["verified"] == ok["schedules"] - 1
    assert ok["max_rel_error"] == 0.5 and ok["per_schedule"][second] == [False, 0.5]
    assert run.state["loopback"]["correctness_summary"] == {"scenarios": 2, "schedules": err["schedules"]
                                                           + ok["schedules"], "all_verified": False}


def test_rank_gemms_time_every_ranks_whole_gemm():
    ag = Scenario(group="g", op="ag_gemm", m=64, n=32, k=16, dtype="bfloat16", world_size=4, hardware="x")
    assert ag.rank_gemms() == [(64, 8, 16)] * 4
    rs = Scenario(group="g", op="gemm_rs", m=64, n=32, k=16, dtype="bfloat16", world_size=4, hardware="x")
    assert rs.rank_gemms() == [(64, 32, 4)] * 4
    a2a = Scenario(group="g", op="a2a_gemm", m=40, n=32, k=16, dtype="float32", world_size=4, hardware="x",
                   imbalance=2.0)
    shapes = a2a.rank_gemms()
    assert sum(m for m, _, _ in shapes) == 4 * 40 and shapes[0][0] == 80
    assert realized._ranks_gemm_time(a2a, "cpu") > 0  # host clock on CPU: runs, says nothing about a GPU


def test_shipped_scenarios_are_valid_and_have_candidates():
    for spec in realized.CORRECTNESS_SCENARIOS + realized.REALIZED_SCENARIOS:
        s = realized.scenario_for(spec, "h200-nvswitch")
        assert len(candidates(s, "cuda")) > 2
    assert len(realized.REALIZED_SCENARIOS) >= 6
    assert preset_for_device("NVIDIA H200") == "h200-nvswitch" and preset_for_device("Tesla T4") is None
    assert preset_for_device("AMD Instinct MI300X") == "mi300x-8"
    assert copies.COPY_SIZES[0] == 4096 and copies.COPY_SIZES[-1] == 1 << 30


def test_loopback_sections_drive_the_real_loopback_on_cpu(tmp_path, monkeypatch):
    """The glue against the real run_loopback, on CPU threads: says nothing about a GPU."""
    monkeypatch.setattr(realized, "CORRECTNESS_SCENARIOS", (
        dict(op="ag_gemm", m=36, n=8, k=12, dtype="float32", world_size=2),))
    monkeypatch.setattr(realized, "REALIZED_SCENARIOS", (
        dict(op="gemm_rs", m=32, n=16, k=16, dtype="float32", world_size=2),))
    run = runner.Run(out=tmp_path, deadline=time.monotonic() + 120, state=copy.deepcopy(EXAMPLE), device="cpu")
    sections = [runner.Section("loopback_correctness", 60, realized.section_loopback_correctness),
                runner.Section("loopback_realized", None, realized.section_loopback_realized)]
    assert runner.run_sections(run, sections)
    assert {k: run.state["sections"][k]["status"] for k in ("loopback_correctness", "loopback_realized")} == \
        {"loopback_correctness": "ok", "loopback_realized": "ok"}, run.state["sections"]
    lb = read_profile(tmp_path / "profile.json").data["loopback"]
    assert lb["correctness_summary"]["all_verified"], lb["correctness"]
    assert lb["correctness"][0]["verified"] == lb["correctness"][0]["schedules"] > 2
    assert all(v is True and e < 1e-4 for v, e in lb["correctness"][0]["per_schedule"].values())
    realized_row = lb["realized"][0]
    assert "error" not in realized_row, realized_row
    assert realized_row["t_comp_alone_s"] > 0 and realized_row["unverified"] == []
    names = {r["schedule"] for r in realized_row["schedules"]}
    assert {"none.sm", "none.dma"} <= names and realized_row["best"] in names
    assert {r["ideal_from"] for r in realized_row["schedules"]} == {"estimate"}


def test_every_section_dry_runs_on_cpu_into_a_valid_profile(tmp_path, monkeypatch):
    """The sections' logic on tiny CPU shapes (host clock, no streams): a dry run, not a measurement."""
    monkeypatch.setattr(gemm, "GEMM_PEAK_SHAPES", ((64, 64, 64), (96, 64, 32), (128, 64, 64)))
    monkeypatch.setattr(gemm, "DIL_SHAPES", ((64, 64, 64), (128, 96, 32)))
    monkeypatch.setattr(copies, "COPY_SIZES", (4096, 16384, 65536))
    monkeypatch.setattr(copies, "CIL_GEMM", (64, 64, 64))
    monkeypatch.setattr(copies, "CIL_COPY_BYTES", 16384)
    monkeypatch.setattr(realized, "CORRECTNESS_SCENARIOS",
                        (dict(op="gemm_rs", m=24, n=8, k=12, dtype="float32", world_size=2),))
    monkeypatch.setattr(realized, "REALIZED_SCENARIOS",
                        (dict(op="ag_gemm", m=32, n=16, k=16, dtype="float32", world_size=2),))
    state = {key: value for key, value in copy.deepcopy(EXAMPLE).items() if key not in ("fitted", "measurements")}
    state.update(fitted={}, sections={})
    run = runner.Run(out=tmp_path, deadline=time.monotonic() + 300, state=state, device="cpu",
                     preset=load_hardware("h200-nvswitch"))
    assert runner.run_sections(run, gp.SECTIONS)
    status = {k: v["status"] for k, v in run.state["sections"].items()}
    expected = {s.name: "ok" for s in gp.SECTIONS} | {"copy_h2d": "skipped"}
    assert status == expected, run.state["sections"]
    profile = read_profile(tmp_path / "profile.json")
    m = profile.data["measurements"]
    assert len(m["dil"]) == 2 * len(gemm.DIL_DEGREES) * 2 and {r["split"] for r in m["dil"]} == {"m", "n"}
    assert [p["bytes"] for p in m["copy_dma"]] == list(copies.COPY_SIZES) == [p["bytes"] for p in m["copy_sm"]]
    assert m["copy_functions"] == "ficco_select.executor.cuda.COPIES"
    assert set(profile.fitted) >= {"gemm_tflops", "gemm_efficiency", "gemm_shape", "gemm_call_us", "dma_latency_us",
                                   "dma_bw_gbps", "sm_copy_latency_us", "sm_copy_bw_gbps", "cil_gemm_dma",
                                   "cil_gemm_sm", "cil_copy_dma", "cil_copy_sm"}
    assert set(profile.fitted["gemm_shape"]) == {"bfloat16", "float16", "float32"}
    assert m["cil"]["dma"]["gemm_fully_overlapped"] is False  # nothing ran beside it on the CPU
    # On the machine it ran on: a GPU's spec would take the CPU's dtype ratios, noise at these
    # shapes (bf16 2000x slower than fp16 under load made an fp16 peak past any GPU's).
    cpu = load_hardware("cpu")
    spec, overrides = profiled_spec(profile, cpu)
    assert overrides and spec.link_bw_gbps == cpu.link_bw_gbps


def test_hardware_from_profile_refuses_an_existing_out_its_profile_and_its_base(tmp_path):
    from ficco_select.hardware import presets_dir

    profile = tmp_path / "profile.yaml"  # JSON is YAML: a profile may carry either name
    profile.write_text(json.dumps(EXAMPLE))
    base = tmp_path / "base.yaml"
    shutil.copy(presets_dir() / "h200-nvswitch.yaml", base)
    kept = tmp_path / "spec.yaml"
    kept.write_text("# a spec fitted last week\n")
    before = {p: p.read_bytes() for p in (profile, base, kept)}

    command = ["hardware", "from-profile", profile, "--base", base, "--out"]
    refused([*command, kept], f"--out {kept}: exists", "nothing is overwritten")
    refused([*command, profile], f"--out {profile}: is the PROFILE input")
    refused([*command, base], f"--out {base}: is the --base input")
    assert {p: p.read_bytes() for p in (profile, base, kept)} == before


# -- what a user's profile may hold: refused before anything is written ------------------------
REAL_PROFILE = ROOT / "data" / "profiles" / "h100-2026-12-05.json"


def from_profile(tmp_path: Path, text: str, *extra: str) -> tuple[list, Path]:
    """The `ficco hardware from-profile` command line for a profile of `text`, and its --out."""
    path = tmp_path / "profile.json"
    path.write_text(text)
    out = tmp_path / "spec.yaml"
    return ["hardware", "from-profile", path, "--out", out, *extra], out


def test_a_dil_row_whose_size_overflows_is_refused_naming_the_row_and_nothing_is_written(tmp_path):
    text = REAL_PROFILE.read_text().replace('"m": 1024,', '"m": 1e400,', 1)  # JSON reads 1e400 as inf
    command, out = from_profile(tmp_path, text)
    refused(command, "profile.json", "field 'measurements.dil[0].m'", written=out)
    refused(command, "profile.json", "measurements.dil[0].m", written=out)  # a rerun says the same


def test_a_gemm_throughput_past_any_gpu_is_refused_naming_the_dtype(tmp_path):
    data = json.loads(REAL_PROFILE.read_text())
    data["fitted"]["gemm_tflops"]["bfloat16"] = 1e308
    command, out = from_profile(tmp_path, json.dumps(data))
    refused(command, "profile.json", "field 'fitted.gemm_tflops.bfloat16'", written=out)


def test_a_multiprocessor_count_past_any_gpu_is_refused(tmp_path):
    data = json.loads(REAL_PROFILE.read_text())
    data["device"]["multiprocessor_count"] = 10 ** 30
    command, out = from_profile(tmp_path, json.dumps(data))
    refused(command, "profile.json", "field 'device.multiprocessor_count'", written=out)


def test_a_refused_name_leaves_no_spec_behind(tmp_path):
    command, out = from_profile(tmp_path, REAL_PROFILE.read_text(), "--name", "h100-nvswitch")
    refused(command, "profile.json", "--name h100-nvswitch", "name 'h100-nvswitch' is a preset's", written=out)
    refused(command, "name 'h100-nvswitch' is a preset's", written=out)  # a rerun says the same, not "--out exists"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]  # no partial file either


@pytest.mark.parametrize("field, value", [
    ("fitted.dma_bw_gbps", 1e308), ("fitted.gemm_call_us", 1e300), ("fitted.cil_gemm_sm", 1e30),
    ("fitted.gemm_shape.bfloat16", [2 ** 40, 1, 1]), ("measurements.dil[1].d", 0), ("measurements.dil[2].split", "k"),
    ("measurements.dil[0].dil", "fast"), ("measurements.dil[0].dtype", "int4"),
])
def test_a_profile_number_past_any_gpu_is_refused_naming_the_field(tmp_path, field, value):
    data = json.loads(REAL_PROFILE.read_text())
    *parents, last = [int(key) if key.isdigit() else key for key in re.split(r"[.\[\]]+", field) if key]
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    command, out = from_profile(tmp_path, json.dumps(data))
    refused(command, "profile.json", f"field '{field}", written=out)


# -- every number from-profile reads, fuzzed ------------------------------------------------------
READ_FIELDS = [("device", "multiprocessor_count"), ("fitted", "gemm_tflops", "bfloat16"),
               ("fitted", "gemm_shape", "bfloat16", 0), ("fitted", "gemm_call_us"), ("fitted", "dma_latency_us"),
               ("fitted", "dma_bw_gbps"), ("fitted", "sm_copy_latency_us"), ("fitted", "cil_gemm_sm"),
               ("fitted", "cil_gemm_dma"), ("measurements", "dil", 0, "m"), ("measurements", "dil", 0, "d")]
"""The profile's numbers a spec is made from (data/profiles/README.md, "fitted"), and a DIL row's."""
ZERO_ACCEPTED = {("fitted", "dma_latency_us"), ("fitted", "sm_copy_latency_us"), ("fitted", "cil_gemm_sm"),
                 ("fitted", "cil_gemm_dma")}
"""Documented acceptances: a latency fit's intercept may be 0 (the spec takes 0.01 us), and a
GEMM that ran no slower beside copies has 0 interference."""


@pytest.mark.parametrize("field", READ_FIELDS, ids=lambda f: ".".join(map(str, f)))
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 1e308, "many"], ids=str)
def test_every_number_from_profile_reads_is_refused_naming_it_or_documented(tmp_path, field, value):
    data = json.loads(REAL_PROFILE.read_text())
    node = data
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    command, out = from_profile(tmp_path, json.dumps(data), "--name", "fuzz-node")
    if value == 0 and field in ZERO_ACCEPTED:
        assert CliRunner().invoke(main, [str(a) for a in command]).exit_code == 0 and out.exists()
        return
    # The field as its error names it: dotted, a list's row as [i] (a GEMM shape is named whole).
    named = ".".join(map(str, field[:-1] if field[-1] == 0 else field)).replace(".dil.0.", ".dil[0].")
    refused(command, "profile.json", f"field '{named}'", written=out)
