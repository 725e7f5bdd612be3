"""Loopback mode: P virtual ranks in one process, peers are buffers on one device.

CPU tests run everywhere (synchronous copies). The CUDA tests run the same checks with
streams, events and both engines; they skip without a GPU and have not been run yet.
"""

import dataclasses
import threading
import time

import pytest
import torch

from ficco_select import Scenario, candidates
from ficco_select.data.measure import loopback
from ficco_select.executor.cuda import COPIES, copy_dma, copy_sm
from ficco_select.data.measure.loopback import (
    HostLanes, LoopbackComm, LoopbackError, LoopbackTimeout, VirtualRanks, run_loopback,
)
from ficco_select.executor.operators import TOLERANCE
from helpers.scenarios import correctness_set
from ficco_select.schedule import BASELINE, SHARD

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


odd_scenarios = correctness_set


def scenario_id(s: Scenario) -> str:
    return f"{s.op}-{s.dtype}-P{s.world_size}-imb{s.imbalance:g}"


# -- faults, injected through the comm (real transfers, one of them broken) ----------------
class ZeroOneReceive(LoopbackComm):
    """Rank 1 zeroes the first piece it receives in every run, after the copy landed."""

    def begin_run(self, run, engine):
        super().begin_run(run, engine)
        self.fired = False

    def wait(self, works):
        super().wait(works)
        for w in works:
            if self.rank == 1 and w.kind == "recv" and not self.fired:
                w.buf.zero_()
                self.fired = True


class DropOneSend(LoopbackComm):
    """Rank 1 never posts its first send: its peer's receive can never be matched."""

    dropped = False

    def start(self, sends, recvs, tag):
        if self.rank == 1 and sends and not self.dropped:
            self.dropped = True
            sends = sends[1:]
        return super().start(sends, recvs, tag)


class ForgetsToJoin(LoopbackComm):
    """A comm bug: wait returns when the copy is issued without ordering the caller after it."""

    def wait(self, works):
        deadline = time.monotonic() + self.timeout_s
        for w in works:
            assert self.rendezvous.wait(w, deadline)


# -- asynchronous copies, emulated on CPU ------------------------------------------------------
class LatestCopyLanes(HostLanes):
    """Copies land as late as the protocol allows: at the first wait on either end.

    The synchronous HostLanes land every copy as early as possible (when both ends have
    posted); CUDA streams land it anywhere in between. A schedule or comm that reads a
    receive slot before waiting it, or overwrites a send buffer before its send is
    waited, passes with the first and fails with this one.
    """

    def copy(self, dst, src, engine, *, issuer, peer, after):
        return PendingCopy(lambda: COPIES[engine](dst, src))

    def join(self, done):
        done.land()


class PendingCopy:
    def __init__(self, copy):
        self._copy, self._lock = copy, threading.Lock()

    def land(self):
        with self._lock:
            if self._copy is not None:
                self._copy()
                self._copy = None


@pytest.fixture
def latest_copies(monkeypatch):
    monkeypatch.setattr(loopback, "make_lanes", lambda device, world_size: LatestCopyLanes())


# -- CPU -----------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_candidate_schedule_is_verified_on_every_virtual_rank(P):
    for s in odd_scenarios(P):
        schedules = candidates(s, "cpu")
        results = run_loopback(s, schedules, reps=2, warmup=0)
        assert [r.schedule for r in results] == schedules
        bad = {r.schedule.name: r.rel_error for r in results if not r.verified}
        assert not bad, f"{scenario_id(s)}: wrong results {bad}"
        for r in results:
            assert len(r.rank_errors) == P and r.rel_error == max(r.rank_errors)
            assert len(r.times_s) == 2 and all(t > 0 for t in r.times_s)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_schedule_is_verified_when_copies_land_as_late_as_allowed(P, latest_copies):
    for s in odd_scenarios(P):
        results = run_loopback(s, candidates(s, "cpu"), reps=1, warmup=0)
        assert all(r.verified for r in results), (scenario_id(s), [r.schedule.name for r in results
                                                                   if not r.verified])


def test_late_copies_catch_a_wait_that_does_not_order_the_caller(latest_copies):
    for s in odd_scenarios(3)[:3]:
        results = run_loopback(s, candidates(s, "cpu"), reps=1, warmup=0, comm_type=ForgetsToJoin)
        assert not any(r.verified for r in results), scenario_id(s)


def test_the_dma_engine_runs_every_schedule_and_says_so():
    # On CPU both engines are a synchronous copy; this checks engine plumbing and that
    # every transfer of every schedule is contiguous (copy_dma refuses strided buffers).
    for s in odd_scenarios(3):
        results = run_loopback(s, candidates(s, "cpu"), engine="dma", reps=1, warmup=0)
        assert all(r.schedule.engine == "dma" and r.schedule.name.endswith(".dma") for r in results)
        assert all(r.verified for r in results), [r.schedule.name for r in results if not r.verified]


@pytest.mark.parametrize("s", [s for s in odd_scenarios(3) if s.imbalance < 3], ids=scenario_id)
def test_a_corrupted_transfer_is_caught(s):
    results = run_loopback(s, candidates(s, "cpu"), reps=1, warmup=0, comm_type=ZeroOneReceive)
    caught = {r.schedule.name: r.verified for r in results}
    assert not any(caught.values()), f"zeroed piece not caught by {[n for n, ok in caught.items() if ok]}"
    for r in results:
        assert r.rel_error > TOLERANCE[s.dtype]


def test_a_receive_nobody_sends_times_out_naming_rank_peer_and_tag():
    s = odd_scenarios(3)[0]
    world = VirtualRanks(s, timeout_s=0.5)

    def rank0_waits_for_rank1(r):
        if r == 0:
            comm = world.comms[0]
            comm.wait(comm.start([], [(torch.empty(4), 1)], tag=7))

    t0 = time.monotonic()
    with pytest.raises(LoopbackTimeout, match=r"rank 0's recv from rank 1 \(tag 7\) timed out.*rank 1 never "
                                               r"posted the matching send"):
        world.each(rank0_waits_for_rank1, what="mismatch")
    assert time.monotonic() - t0 < 5


def test_a_dropped_send_fails_the_run_naming_scenario_schedule_and_rank():
    # gemm_rs, P=2, shard ring: only rank 0 waits for rank 1's first (dropped) send.
    s = odd_scenarios(2)[1]
    t0 = time.monotonic()
    with pytest.raises(LoopbackTimeout) as info:
        run_loopback(s, [SHARD], reps=1, warmup=0, timeout_s=1.0, comm_type=DropOneSend)
    msg = str(info.value)
    assert s.scenario_id in msg and "shard.ring.sm" in msg and "rank 0 failed" in msg
    assert "rank 0's recv from rank 1 (tag 0) timed out" in msg
    assert time.monotonic() - t0 < 10


def test_an_unmatched_send_is_reported_and_never_matches_a_later_run():
    s = odd_scenarios(2)[0]
    world = VirtualRanks(s, timeout_s=0.5)

    def rank0_sends_without_waiting(r):
        world.comms[r].begin_run(1, "sm")
        if r == 0:
            world.comms[0].start([(torch.ones(3), 1)], [], tag=0)

    with pytest.raises(LoopbackError, match=r"never matched: rank 0's send to rank 1 \(tag 0\)"):
        world.each(rank0_sends_without_waiting, what="leftover")
    # The same tag in the next run is a fresh transfer.
    got = torch.zeros(3)

    def next_run(r):
        comm = world.comms[r]
        comm.begin_run(2, "sm")
        if r == 0:
            comm.wait(comm.start([(torch.full((3,), 2.0), 1)], [], tag=0))
        else:
            comm.wait(comm.start([], [(got, 0)], tag=0))

    world.each(next_run, what="next run")
    assert torch.equal(got, torch.full((3,), 2.0))


@pytest.mark.parametrize("s", odd_scenarios(3)[:3], ids=scenario_id)
def test_skeletons_run_in_loopback(s):
    world = VirtualRanks(s)
    for schedule in candidates(s, "cpu"):
        world.run_once(schedule, comm=False)  # compute skeleton: NullComm, no transfers
        world.run_once(schedule, compute=False)  # communication skeleton: transfers only
    assert all(isinstance(c, LoopbackComm) for c in (op.comm for op in world.ops))
    if s.op == "ag_gemm":  # the communication skeleton alone completes the all-gather
        full = torch.cat([op.shard(op.r) for op in world.ops])
        assert all(torch.equal(op.A_full, full) for op in world.ops)


def test_copy_functions_copy_exactly():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        src = torch.tensor([1.5, -0.0, float("inf"), float("nan"), 3e-3, -7.25], dtype=dtype)
        for copy in (copy_sm, copy_dma):
            dst = torch.full_like(src, 42)
            copy(dst, src)
            assert torch.equal(dst.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               src.view(torch.int16 if dtype != torch.float32 else torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        copy_dma(torch.empty(3, 2).t(), torch.empty(2, 3))


def test_bad_arguments_fail_before_any_work():
    s = odd_scenarios(2)[0]
    with pytest.raises(ValueError, match="reps"):
        run_loopback(s, [BASELINE], reps=0)
    with pytest.raises(ValueError, match="engine"):
        run_loopback(s, [BASELINE], engine="nvlink")
    illegal = dataclasses.replace(SHARD, granularity="ficco", degree=3, compute="gemm_per_piece", split="n")
    with pytest.raises(ValueError, match="not legal"):
        run_loopback(s, [illegal])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        run_loopback(odd_scenarios(2)[0], [BASELINE], device="cuda")


# -- CUDA (not run yet: no GPU where this was written) ---------------------------------------
@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["sm", "dma"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_cuda_every_candidate_schedule_is_verified(P, engine):
    for s in odd_scenarios(P):
        schedules = [c for c in candidates(s, "cuda") if c.engine == engine]
        results = run_loopback(s, schedules, device="cuda", reps=2, warmup=1)
        bad = {r.schedule.name: r.rel_error for r in results if not r.verified}
        assert not bad, f"{scenario_id(s)} on cuda: wrong results {bad}"
        assert all(len(r.times_s) == 2 and min(r.times_s) > 0 for r in results)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["sm", "dma"])
def test_cuda_a_corrupted_transfer_is_caught(engine):
    for s in odd_scenarios(3)[:3]:
        results = run_loopback(s, candidates(s, "cpu"), engine=engine, device="cuda", reps=1, warmup=0,
                               comm_type=ZeroOneReceive)
        assert not any(r.verified for r in results), scenario_id(s)


@needs_cuda
@pytest.mark.cuda
def test_cuda_a_dropped_send_times_out_instead_of_hanging():
    s = odd_scenarios(2)[1]
    with pytest.raises(LoopbackTimeout, match="shard.ring.dma"):
        run_loopback(s, [SHARD], engine="dma", device="cuda", reps=1, warmup=0, timeout_s=1.0,
                     comm_type=DropOneSend)


@needs_cuda
@pytest.mark.cuda
def test_cuda_dma_is_a_memcpy_and_sm_is_a_kernel():
    from torch.profiler import ProfilerActivity, profile

    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    seen = {}
    for name, copy in (("dma", copy_dma), ("sm", copy_sm)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            copy(dst, src)
            torch.cuda.synchronize()
        gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        seen[name] = gpu
        assert torch.equal(dst, src)
    assert seen["dma"] and all("memcpy" in n.lower() for n in seen["dma"]), seen["dma"]
    assert seen["sm"] and not any("memcpy" in n.lower() for n in seen["sm"]), seen["sm"]
