"""The GPU path's CPU-reachable parts: argument checks, error paths and bookkeeping.

Everything here runs the real code on this machine's stand-ins (``device="cpu"``, the
host peer memory over a one-rank gloo group, the profiler's CPU rehearsal). What only a
GPU can run (streams, events, NCCL, symmetric memory) is not touched; one test fakes
``torch.cuda.is_available`` / ``get_device_name`` to reach the profiler's pure-Python
preset check, which stops before any CUDA work.
"""

import copy
import json
import logging
import math
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.scenarios import correctness_set

from ficco_select.data.gpu_profile import copies, gemm, realized, runner
from ficco_select.data.gpu_profile import run as gp
from ficco_select.data.gpu_profile.read import (ProfileError, dil_vs_model, fit_latency_bw, profiled_spec, read_profile,
                                   validate_profile, write_profiled_spec)
from ficco_select.data.measure.loopback import (HostLanes, LoopbackComm, LoopbackError, LoopbackTimeout, Rendezvous,
                                   VirtualRanks, make_lanes, run_loopback)
from ficco_select.data.measure.node import NodeOptions, init_rank
from ficco_select.executor.peer import (CudaPeerMemory, EngineComm, HostPeerMemory, PeerCopyComm, PeerTimeout,
                                        byte_view)
from ficco_select.hardware import load_hardware
from ficco_select.schedule import BASELINE
from helpers.profiles import EXAMPLE

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank (this process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- executor/peer.py and measure/node.py ------------------------------------------------------
def test_byte_view_refuses_a_strided_buffer_and_views_a_contiguous_one():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with pytest.raises(ValueError, match=r"contiguous buffers only, got shape \(3, 2\) strides \(1, 3\)"):
        byte_view(t.t())
    view = byte_view(t)
    assert view.dtype == torch.uint8 and view.numel() == 24 and view.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("slots, slot_bytes, needle", [(0, 8, "slots: 1..8"), (9, 8, "slots: 1..8"),
                                                       (2, 0, "slot_bytes: must be >= 1")])
def test_cuda_peer_memory_checks_its_slots_before_any_cuda_call(slots, slot_bytes, needle):
    # No process group, no CUDA here: the check must come first to be reached at all.
    with pytest.raises(ValueError, match=needle):
        CudaPeerMemory(slots=slots, slot_bytes=slot_bytes)


def test_engine_comm_needs_at_least_one_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        EngineComm({})


def test_all_gather_step_must_name_every_peer_once(one_rank_group):
    memory = HostPeerMemory(slots=1, slot_bytes=16, timeout_s=5)
    try:
        comm = PeerCopyComm(memory)
        with pytest.raises(ValueError, match=r"rank 0: an all-gather step receives from every peer once, "
                                             r"got peers \[0\] \(tag 5\)"):
            comm.start_all_gather(torch.ones(2), [(torch.empty(2), 0)], tag=5)
        # A world of one: the step has no peer, and the piece is still staged in the broadcast slot.
        send = torch.tensor([1.5, -2.0, 3.25])
        comm.wait(comm.start_all_gather(send, [], tag=6))
        assert torch.equal(memory.slot(0, None, 0)[:12].view(torch.float32), send)
    finally:
        memory.close()


def test_a_transfer_that_never_finishes_times_out(one_rank_group):
    memory = HostPeerMemory(slots=1, slot_bytes=8, timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"rank 0: a transfer did not finish in 0.2 s"):
            memory.join(threading.Event())
        assert time.monotonic() - t0 >= 0.2
    finally:
        memory.close()


def test_node_cuda_mode_refuses_a_job_larger_than_the_visible_gpus(tmp_path):
    world = torch.cuda.device_count() + 1  # one more rank than GPUs, whatever this machine has
    with pytest.raises(RuntimeError, match=rf"a node job of {world} ranks needs {world} GPUs; "
                                           rf"{world - 1} visible"):
        init_rank(0, world, f"file://{tmp_path}/store", 5.0, NodeOptions())
    assert not dist.is_initialized()  # refused before joining any process group


# -- measure/loopback.py -----------------------------------------------------------------------
def test_loopback_arguments_are_checked_before_any_work():
    s = correctness_set(2)[0]
    with pytest.raises(ValueError, match="device 'meta': loopback runs on 'cpu' or 'cuda'"):
        make_lanes("meta", 2)
    with pytest.raises(ValueError, match="timeout_s: must be > 0, got 0"):
        VirtualRanks(s, timeout_s=0)
    with pytest.raises(ValueError, match="warmup: must be >= 0, got -1"):
        run_loopback(s, [BASELINE], warmup=-1)
    comm = LoopbackComm(0, 2, Rendezvous(HostLanes()), timeout_s=1.0)
    with pytest.raises(ValueError, match=r"engine 'nvlink' not in \('dma', 'sm'\)"):
        comm.begin_run(1, "nvlink")
    for peer in (0, 2, -1):
        with pytest.raises(ValueError, match=rf"rank 0: send with invalid peer {peer} \(tag 3\)"):
            comm.start([(torch.ones(2), peer)], [], tag=3)
    assert comm.rendezvous.unmatched() == []  # nothing was posted by the refused steps


def test_mismatched_ends_of_a_transfer_fail_the_run_and_retire_the_ranks():
    world = VirtualRanks(correctness_set(2)[0], timeout_s=2.0)

    def mismatched(r):
        comm = world.comms[r]
        comm.begin_run(1, "sm")
        if r == 0:
            comm.wait(comm.start([(torch.ones(3), 1)], [], tag=4))
        else:
            comm.wait(comm.start([], [(torch.empty(4), 0)], tag=4))

    with pytest.raises(LoopbackError) as info:
        world.each(mismatched, what="mismatch")
    msg = str(info.value)
    assert "rank 0's send to rank 1 (tag 4) is (3,) torch.float32 but rank 1's recv from rank 0 (tag 4) is (4,)" in msg
    assert not isinstance(info.value, LoopbackTimeout)
    with pytest.raises(LoopbackError, match="an earlier run of these virtual ranks failed; build new ones"):
        world.each(lambda r: r, what="again")


def test_a_rank_stuck_outside_the_comm_trips_the_no_progress_backstop():
    world = VirtualRanks(correctness_set(2)[0], timeout_s=0.5)
    release = threading.Event()
    try:
        t0 = time.monotonic()
        with pytest.raises(LoopbackTimeout, match=r"stuck: rank\(s\) \[0\] made no progress for 1 s"):
            world.each(lambda r: release.wait(30) if r == 0 else None, what="stuck")
        assert 1.0 <= time.monotonic() - t0 < 10
    finally:
        release.set()


def test_a_rank_missing_at_the_barrier_is_named():
    world = VirtualRanks(correctness_set(2)[0], timeout_s=1.0)
    with pytest.raises(LoopbackTimeout, match=r"rank 0 failed: LoopbackTimeout: rank 0 waited 1.5 s at the barrier "
                                              r"before a repetition: another rank never arrived"):
        world.each(lambda r: world.sync_point(r) if r == 0 else None, what="one at the barrier")


# -- gpu_profile: the profiler's CPU rehearsal and its out-of-time paths -------------------------
def cpu_run(tmp_path, **kw) -> runner.Run:
    state = {k: v for k, v in copy.deepcopy(EXAMPLE).items() if k not in ("fitted", "measurements")}
    state.update(fitted={}, measurements={}, sections={})
    return runner.Run(out=tmp_path, deadline=time.monotonic() + 120, state=state, device="cpu", tiny=True, **kw)


def test_profile_rehearsal_on_cpu_writes_a_valid_partial_profile(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    try:
        run, returned = gp.profile(tmp_path / "p", budget_s=60, preset=None, preset_name=None,
                                   sections=["copy_dma", "copy_h2d"], device="cpu", tiny=True)
    finally:
        signal.signal(signal.SIGTERM, before)  # profile() installs a handler that os._exit()s
    assert returned is True
    profile = read_profile(tmp_path / "p" / "profile.json")
    assert profile.device_name.startswith("cpu (") and profile.device_name.endswith("rehearsal)")
    assert profile.data["device"]["count_visible"] == 0 and profile.data["budget_s"] == 60
    sections = profile.data["sections"]
    assert sections["copy_dma"]["status"] == "ok"
    assert sections["copy_h2d"]["status"] == "skipped"  # needs a GPU
    assert sections["gemm_peak"] == {"status": "skipped", "message": "skipped: not in --sections"}
    assert profile.data["complete"] is False  # not every wanted section was ok
    assert [p["bytes"] for p in profile.data["measurements"]["copy_dma"]] == list(copies.TINY_COPY_SIZES)
    assert {"dma_latency_us", "dma_bw_gbps"} <= set(profile.fitted)


def test_profiler_rejects_a_non_positive_budget(capsys):
    with pytest.raises(SystemExit):
        gp.parse_args(["--out", "x", "--budget-s", "0"])
    assert "--budget-s must be positive" in capsys.readouterr().err


def test_profiler_stops_on_an_unknown_preset_before_measuring(tmp_path, monkeypatch, capsys):
    # Pretend a GPU is visible only to reach the preset check; nothing after it runs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    out = tmp_path / "o"
    assert gp.main(["--out", str(out), "--preset", "no-such-gpu"]) == 2
    assert "gpu_profile: --preset:" in capsys.readouterr().err
    assert not out.exists()  # nothing measured, nothing written


def test_sections_out_of_time_record_no_measurement(tmp_path):
    run = cpu_run(tmp_path)
    past = time.monotonic() - 1
    copies.section_copy_dma(run, past)
    copies.section_cil(run, past)
    gemm.section_gemm_peak(run, past)
    realized.section_loopback_realized(run, past)
    m = run.state["measurements"]
    assert m["copy_functions"] == copies.COPY_FUNCTIONS and "copy_dma" not in m
    assert set(m["cil"]) == {"gemm", "copy_bytes", "t_gemm_alone_us"}  # the GEMM alone; no engine timed
    assert "gemm_peak" not in m and "gemm_tiny" in m  # the tiny call is timed whatever is left
    assert set(run.state["fitted"]) == {"gemm_call_us"}
    assert "loopback" not in run.state
    # DIL: out of time before the first shape: no row (a deadline a few ms ahead made this
    # depend on how fast the machine timed the first GEMM).
    gemm.section_dil(run, past)
    assert "dil" not in m


def test_realized_section_records_a_scenario_it_cannot_run(tmp_path):
    run = cpu_run(tmp_path)
    run.device = "meta"  # GEMMs run (no data), loopback refuses the device
    realized.section_loopback_realized(run, time.monotonic() + 60)
    (row,) = run.state["loopback"]["realized"]
    assert row["error"] == "ValueError: device 'meta': loopback runs on 'cpu' or 'cuda'"
    assert row["t_comp_alone_s"] >= 0 and "schedules" not in row and row["scenario_id"]


def test_a_section_that_overruns_its_share_is_ok_but_flagged(tmp_path):
    run = cpu_run(tmp_path)
    assert runner.run_sections(run, [runner.Section("slow", 0.1, lambda r, until: time.sleep(0.4))], grace_s=5)
    entry = run.state["sections"]["slow"]
    assert entry["status"] == "ok" and entry["message"] == "ran out of its time share; results may be partial"


def test_a_failed_write_during_a_section_is_logged_and_measuring_goes_on(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    run = cpu_run(out)

    def loses_its_folder(r, until):
        shutil.rmtree(out)  # the next periodic write fails
        r.put("fitted", "dma_bw_gbps", value=123.0)
        time.sleep(1.2)
        out.mkdir()

    with caplog.at_level(logging.WARNING, logger=runner.__name__):
        assert runner.run_sections(run, [runner.Section("a", 10, loses_its_folder)], write_every_s=0.0)
    assert any("could not write" in r.getMessage() for r in caplog.records)
    assert read_profile(out / "profile.json").fitted == {"dma_bw_gbps": 123.0}


def test_non_finite_numbers_are_written_as_null(tmp_path):
    run = cpu_run(tmp_path)
    run.put("measurements", "copy_dma", value=[{"bytes": 4096, "t_us": float("nan"), "bw_gbps": float("inf")}])
    run.write()
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["measurements"]["copy_dma"] == [{"bytes": 4096, "t_us": None, "bw_gbps": None}]
    validate_profile(data)


SIGTERM_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from ficco_select.data.gpu_profile.runner import Run, write_on_term
state = {"sections": {"a": {"status": "ok", "message": ""}, "b": {"status": "running", "message": ""},
                      "c": {"status": "pending", "message": ""}}}
run = Run(out=Path(sys.argv[1]), deadline=time.monotonic() + 60, state=state, device="cpu")
write_on_term(run)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


def test_sigterm_marks_unfinished_sections_and_leaves_the_file(tmp_path):
    res = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    sections = json.loads((tmp_path / "profile.json").read_text())["sections"]
    assert sections == {"a": {"status": "ok", "message": ""},
                        "b": {"status": "interrupted", "message": f"signal {int(signal.SIGTERM)}"},
                        "c": {"status": "interrupted", "message": f"signal {int(signal.SIGTERM)}"}}


# -- gpu_profile/read.py -------------------------------------------------------------------------
def changed(path: str, value):
    data = copy.deepcopy(EXAMPLE)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return data


@pytest.mark.parametrize("path, value, needle", [
    ("device", "NVIDIA H200", "field 'device' must be an object"),
    ("preset", 7, "field 'preset' must be a preset name, got 7"),
    ("fitted.gemm_shape", [16384, 8192, 8192], "field 'fitted.gemm_shape' must map dtypes"),
    ("fitted.sm_copy_latency_us", -0.5, "field 'fitted.sm_copy_latency_us' must be >= 0, got -0.5"),
])
def test_more_bad_profiles_name_the_field(path, value, needle):
    with pytest.raises(ProfileError) as err:
        validate_profile(changed(path, value), "p.json")
    assert needle in str(err.value) and str(err.value).startswith("p.json: ")


def test_a_negative_latency_fit_is_clamped_to_zero_and_refit_through_the_origin():
    sizes = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    times = [s / 100e9 - 2e-6 for s in sizes]  # a line with a negative intercept (noise)
    latency, bw = fit_latency_bw(sizes, times)
    assert latency == 0.0
    assert 100e9 < bw < 110e9  # through the origin: a little faster than the line's slope
    assert math.isfinite(bw)


def test_a_spec_name_that_reads_as_a_path_is_a_profile_error():
    with pytest.raises(ProfileError, match="reads as a file path"):
        profiled_spec(validate_profile(EXAMPLE), load_hardware("h200-nvswitch"), name="specs/mine.yaml")


@pytest.mark.parametrize(("row", "field"), [
    ({"dtype": "int8", "m": 64, "n": 64, "k": 64, "split": "m", "d": 2, "dil": 0.1}, "dil[0].dtype"),
    ({"dtype": "bfloat16", "m": "many", "n": 64, "k": 64, "split": "m", "d": 2}, "dil[0].m"),
    ({"dtype": "bfloat16", "n": 64, "k": 64, "split": "m", "d": 2}, "dil[0].m"),
    ({"dtype": "bfloat16", "m": 64, "n": 64, "k": 64, "split": "m", "d": 0}, "dil[0].d"),
])
def test_dil_rows_the_model_cannot_read_are_refused_naming_the_field(row, field):
    data = copy.deepcopy(EXAMPLE)
    data["measurements"]["dil"] = [row, *data["measurements"]["dil"]]
    with pytest.raises(ProfileError, match=re.escape(f"measurements.{field}")):
        validate_profile(data)


def test_every_dil_row_of_a_valid_profile_is_compared_with_the_model():
    good = EXAMPLE["measurements"]["dil"]
    rows = dil_vs_model(validate_profile(copy.deepcopy(EXAMPLE)), load_hardware("h200-nvswitch"))
    assert [(r["m"], r["split"], r["d"]) for r in rows] == [(g["m"], g["split"], g["d"]) for g in good]


def test_from_profile_needs_a_base_when_the_profile_names_no_preset(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(changed("preset", None)))
    with pytest.raises(ProfileError, match="--base is required: the profile names no preset"):
        write_profiled_spec(path, base=None, out=tmp_path / "s.yaml", name=None)
    assert not (tmp_path / "s.yaml").exists()
