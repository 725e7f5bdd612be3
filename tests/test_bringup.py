"""`ficco bring-up`: a new GPU node in one command, rehearsed end to end on this machine's
CPU stand-ins (tiny profile, the cuda path's stand-in, the pipeline's debug slice, a
registry of its own); without CUDA and without --rehearse it stops in one line. Under
faults and hostile files: one writer per folder, a profile killed mid-section, a kill
between the registry and registered.json, the status file while a step runs, a rerun of a
finished bring-up, a full disk, a hand-edited registered.json.

Everything runs for real: the rehearsal (``--rehearse``: every step on this machine's CPU,
an MLflow SQLite store of its own), processes killed with SIGKILL, a tmpfs that fills up.
One finished rehearsal (the module's fixture, minutes) is read, and copied for the tests
that resume a finished folder."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from helpers.cli import DECOY, FICCO, decoy_folder, refused
from ficco_select.train.bringup import STEPS

REHEARSE = ["--rehearse", "--budget", "0.01"]
ROOT = Path(__file__).resolve().parents[1]


def bring_up(out: Path, cwd: Path, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(FICCO + ["bring-up", "--out", str(out), *REHEARSE, *extra], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def start(out: Path, cwd: Path) -> subprocess.Popen:
    """A bring-up in its own process group (to be killed whole, its children too)."""
    log = open(cwd / f"{out.name}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - the process writes it
    return subprocess.Popen(FICCO + ["bring-up", "--out", str(out), *REHEARSE], stdout=log, stderr=log, cwd=cwd,
                            start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_for(condition, proc: subprocess.Popen | None, timeout: float = 600, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert proc is None or proc.poll() is None, f"exited {proc.returncode} first"
        time.sleep(every)
    raise AssertionError(f"not seen within {timeout} s")


def one_line_error(res: subprocess.CompletedProcess) -> str:
    said = f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 1, said
    assert "Traceback" not in res.stderr, said
    errors = [line for line in res.stderr.strip().splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, said
    return errors[0]


def summary_of(out: Path) -> dict:
    return json.loads((out / "bring_up.json").read_text())


def model_versions(out: Path) -> list:
    from mlflow import MlflowClient

    uri = f"sqlite:///{out / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri).search_model_versions("name = 'ficco-selector'")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished rehearsal (its MLflow artifacts beside it, in the folder it ran in: one with a
    user's generic top-level names, which no step, nor any process a step starts, imports)."""
    base = decoy_folder(tmp_path_factory.mktemp("finished"))
    # A learning curve where benchmarks/adapt_curve.py writes it: the registered model's report shows it.
    (base / "out" / "adapt_curve").mkdir(parents=True)
    (base / "out" / "adapt_curve" / "curve.csv").write_text(
        "preset,strategy,fraction,near_opt_2\nmi300x-8,active,0.05,0.97\nmi300x-8,random,0.05,0.93\n"
        "mi300x-8,full,0.8,0.99\n")
    res = bring_up(base / "node", base, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert DECOY not in res.stdout + res.stderr
    assert json.loads(res.stdout)["ok"]
    return base / "node"


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "node"
    shutil.copytree(finished, out, symlinks=True)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    res = subprocess.run(FICCO + ["bring-up", "--out", str(tmp_path / "node")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "CUDA is not available here" in res.stderr and "--rehearse" in res.stderr
    assert not (tmp_path / "node").exists()


@pytest.mark.slow
def test_the_rehearsal_runs_every_step(finished):
    summary = summary_of(finished)  # a rerun keeps every step: test_a_rerun_of_a_finished_bring_up_...
    assert summary["ok"] and [s["step"] for s in summary["steps"]] == list(STEPS)
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["spec"]["name"] == "cpu-profiled" and steps["spec"]["overrides"]
    assert steps["adapt"]["measured"] >= 1
    assert steps["register"]["version"] == "1" and (finished / "mlflow.db").exists()  # its own registry
    assert "exported" not in steps["register"]  # registering exports nothing: the export step does
    # The pipeline trained and scored on the measured machine's rows (they carry its adapted
    # spec's name), and its report shows the learning curve.
    pipeline = finished / "adapt" / "pipeline"
    assert steps["spec"]["name"] in set(pd.read_parquet(pipeline / "choices.parquet")["hardware"])
    assert "ficco adapt's learning curve" in (pipeline / "report.html").read_text()
    assert (pipeline / "adapt_curve.png").exists()
    assert (finished / "selector" / "selector.json").exists()
    assert 0 < steps["benchmark"]["hooked_speedup"] < 10 and steps["benchmark"]["best_fixed"]


# -- one writer per folder -----------------------------------------------------------------
@pytest.mark.slow
def test_a_second_bring_up_into_the_same_folder_refuses_at_once_naming_the_first(tmp_path):
    out = tmp_path / "node"
    first = start(out, tmp_path)
    try:
        wait_for(out.exists, first, timeout=300)
        started = time.monotonic()
        second = bring_up(out, tmp_path, timeout=120)
        line = one_line_error(second)
        assert f"pid {first.pid}" in line and "ficco bring-up" in line, line
        assert time.monotonic() - started < 120
        assert first.poll() is None  # the first one goes on
    finally:
        kill(first)


# -- a profile killed mid-section ----------------------------------------------------------
def kill_mid_profile(folder: Path) -> None:
    """Run the profile bring-up runs (full-size shapes on the CPU: slow enough to catch) and
    SIGKILL it once profile.json says a section is running: what `kill -9` leaves."""
    code = ("import sys; from pathlib import Path; from ficco_select.data.gpu_profile.run import profile; "
            "from ficco_select.hardware import load_hardware; "
            "profile(Path(sys.argv[1]), budget_s=300, preset=load_hardware('cpu'), preset_name='cpu', device='cpu')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def mid_section() -> bool:
        try:
            sections = json.loads((folder / "profile.json").read_text())["sections"]
        except (OSError, ValueError):
            return False
        return any(s["status"] == "running" for s in sections.values())

    try:
        wait_for(mid_section, proc, timeout=300, every=0.05)
    finally:
        kill(proc)


@pytest.mark.slow
@pytest.mark.parametrize("left", ["killed mid-section", "truncated"])
def test_a_profile_left_partial_is_profiled_again_and_the_spec_built_from_the_whole_one(tmp_path, left):
    from ficco_select.data.gpu_profile.read import write_profiled_spec

    out = tmp_path / "node"
    kill_mid_profile(out / "profile")
    partial = out / "profile" / "profile.json"
    assert json.loads(partial.read_text())["fitted"] == {}
    if left == "truncated":
        partial.write_text(partial.read_text()[:300])
    rerun = start(out, tmp_path)
    try:
        wait_for((out / "spec.yaml").exists, rerun, timeout=300)
        time.sleep(1)  # spec.yaml is written in one go: let it land
    finally:
        kill(rerun)
    profile = json.loads(partial.read_text())
    assert all(s["status"] in ("ok", "skipped", "error", "timeout") for s in profile["sections"].values()), \
        profile["sections"]
    assert profile["fitted"]
    from_whole, _, _ = write_profiled_spec(partial, base="cpu", out=tmp_path / "expected.yaml", name=None)
    assert yaml.safe_load((out / "spec.yaml").read_text()) == yaml.safe_load((tmp_path / "expected.yaml").read_text())
    assert from_whole["overrides"]


# -- a kill between the registry and registered.json ---------------------------------------
@pytest.mark.slow
def test_a_registration_whose_registered_json_was_lost_is_found_in_the_registry_not_made_twice(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    recorded = json.loads((out / "adapt" / "registered.json").read_text())
    (out / "adapt" / "registered.json").unlink()  # kill -9 after MLflow registered, before the file
    res = bring_up(out, finished.parent, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads(res.stdout)["steps"]}
    assert steps["register"]["status"] == "kept" and steps["register"]["version"] == recorded["version"]
    assert [str(v.version) for v in model_versions(out)] == [recorded["version"]]
    again = json.loads((out / "adapt" / "registered.json").read_text())
    assert {k: again[k] for k in ("version", "promoted", "run_id")} == \
        {k: recorded[k] for k in ("version", "promoted", "run_id")}


# -- the status file while a step runs -----------------------------------------------------
@pytest.mark.slow
def test_while_a_step_is_redone_the_status_file_says_it_is_running_not_ok(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    (out / "benchmark.json").unlink()
    rerun = start(out, finished.parent)

    def benchmark_running() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"e2e_tp.py") for a in args) and str(out / "selector").encode() in args:
                return True
        return False

    try:
        wait_for(benchmark_running, rerun, timeout=300, every=0.1)
        during = summary_of(out)
        assert during.get("ok") is False, during
        assert during["steps"][-1]["step"] == "benchmark" and during["steps"][-1]["status"] == "running", during
        assert rerun.wait(timeout=600) == 0
    finally:
        kill(rerun)
    after = summary_of(out)
    assert after["ok"] and after["steps"][-1]["status"] == "done" and after["steps"][-1]["hooked_speedup"] > 0


# -- a rerun of a finished bring-up --------------------------------------------------------
@pytest.mark.slow
def test_a_rerun_of_a_finished_bring_up_repeats_nothing_and_keeps_the_benchmark_figures(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    before = summary_of(out)
    exported = os.readlink(out / "selector")
    res = bring_up(out, finished.parent, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert {s["step"]: s["status"] for s in json.loads(res.stdout)["steps"]} == {s: "kept" for s in STEPS}
    assert os.readlink(out / "selector") == exported
    assert sorted(p.name for p in out.glob(".selector.v*")) == sorted(p.name for p in finished.glob(".selector.v*"))
    figures = ("hooked_speedup", "best_fixed", "best_fixed_speedup", "oracle_speedup")
    after = summary_of(out)
    assert after["ok"]
    assert {k: after["steps"][-1][k] for k in figures} == {k: before["steps"][-1][k] for k in figures}
    assert "best fixed schedule" in bring_up(out, finished.parent).stdout  # the text line shows them too


# -- a full disk ---------------------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path):
    """A 600 KiB tmpfs (root only; skipped where mounting is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_disk_full_at_the_mlflow_store_ends_in_one_line_naming_the_step(finished, tiny_disk, tmp_path):
    # A bring-up whose profile, spec and adapt steps are done (the finished rehearsal's, a
    # few hundred KiB) resumes at the register step, whose MLflow store outgrows the disk.
    out = tiny_disk / "node"
    out.mkdir()
    shutil.copytree(finished / "profile", out / "profile")
    shutil.copy(finished / "spec.yaml", out / "spec.yaml")
    shutil.copytree(finished / "adapt", out / "adapt", ignore=shutil.ignore_patterns("pipeline", "registered.json",
                                                                                        "training_run.json"))
    line = one_line_error(bring_up(out, tmp_path))
    assert line.startswith(f"Error: {out}: No space left on device (step register)"), line
    summary = summary_of(out)
    assert summary["ok"] is False and [s["status"] for s in summary["steps"]] == ["kept"] * 3 + ["failed"]


def test_a_disk_already_full_ends_in_one_line(tiny_disk, tmp_path):
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill it to the last byte
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    out = tiny_disk / "node"
    line = one_line_error(bring_up(out, tmp_path, timeout=300))
    assert line.startswith(f"Error: {out}: No space left on device"), line


# -- a hand-edited registered.json ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("edit", "needle"), [
    (lambda r: '{"version": "1", "prom', "not valid JSON"),
    (lambda r: json.dumps({k: v for k, v in r.items() if k != "version"}), "'version'"),
    (lambda r: json.dumps({**r, "promoted": "yes"}), "'promoted'"),
    (lambda r: json.dumps({**r, "version": 1}), "'version'"),
    (lambda r: json.dumps([r]), "a JSON object"),
], ids=["not-json", "no-version", "promoted-a-string", "version-a-number", "a-list"])
def test_a_hand_edited_registered_json_is_refused_in_one_line_naming_the_field(finished, tmp_path, monkeypatch,
                                                                               edit, needle):
    out = copy_of(finished, tmp_path)
    monkeypatch.chdir(finished.parent)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///unused.db")  # the rehearsal sets it in this process
    path = out / "adapt" / "registered.json"
    path.write_text(edit(json.loads(path.read_text())))
    before = (out / "bring_up.json").read_bytes()
    refused(["bring-up", "--out", out, *REHEARSE], str(path), needle)
    assert (out / "bring_up.json").read_bytes() == before
    assert len(model_versions(out)) == 1


# -- folders not to resume -----------------------------------------------------------------
@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """An in-process bring-up that went ahead would write MLflow runs in the working folder
    and set the rehearsal's store in this process's environment: both kept to the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'unused.db'}")


def test_a_folder_bring_up_did_not_write_is_refused_before_any_work(tmp_path, in_tmp):
    out = tmp_path / "node"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    refused(["bring-up", "--out", out, *REHEARSE], str(out), "notes.txt", written=out / "profile")


def test_a_step_to_redo_under_later_results_made_from_its_old_output_is_refused(tmp_path, in_tmp):
    out = tmp_path / "node"
    (out / "profile").mkdir(parents=True)
    (out / "profile" / "profile.json").write_text('{"schema": "ficco-gpu-prof')  # cut short
    (out / "spec.yaml").write_text("name: made-from-the-old-profile\n")
    refused(["bring-up", "--out", out, *REHEARSE], "step profile", str(out / "spec.yaml"))
    assert (out / "profile" / "profile.json").read_text() == '{"schema": "ficco-gpu-prof'
