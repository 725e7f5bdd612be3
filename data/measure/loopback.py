"""Loopback mode: P virtual ranks in one process, their peers are buffers on one device.

The cuda backend's single-GPU mode (DESIGN.md, "Where the labels come from"): every
virtual rank runs in its own Python thread and builds its own operator (``ficco_select/executor/operators/``,
unchanged) on a ``LoopbackComm``. The comms of one scenario share a ``Rendezvous`` that
matches the two ends of a transfer by (run, src rank, dst rank, tag):

- ``start`` posts each end and never blocks. Whichever end is posted second issues the
  copy dst <- src, with the schedule's engine (``cuda.COPIES``).
- ``wait`` returns once the copy of each work is issued and ordered before what the
  caller does next: on CPU the copy is synchronous, so it has finished; on CUDA the copy
  was enqueued on a comm stream of the issuing rank after events recorded on both ends'
  compute streams at post time, and ``wait`` makes the caller's compute stream wait on
  its done event instead of blocking the host.

What differs between devices sits behind a small "lanes" interface (``on_rank``,
``ready``, ``copy``, ``join``, ``synchronize``, ``timer``): ``HostLanes`` below (a copy
is synchronous on the issuing thread) and ``cuda.CudaLanes`` (streams and events). The
rendezvous and comm code is the same for both. Every wait and barrier has a timeout; a rank
that fails or times out aborts the others, and the error names the scenario, the
schedule, the rank and (for a transfer) the peer and tag.

``run_loopback`` verifies every schedule on every virtual rank against a float32
reference computed centrally from all virtual ranks' inputs, then times it (slowest
virtual rank per repetition: CUDA events on CUDA, ``perf_counter`` on CPU).

Status: verified on CPU only (tests/test_loopback.py), with copies landing as early
(synchronous) and as late (at the first wait on either end) as the protocol allows, which
brackets where a CUDA stream may land them. The CUDA path itself (streams, events, copy
engines) is written for a GPU but has not been run on one; its tests skip without CUDA.
Times on CPU include the GIL and thread scheduling of P ranks on shared cores: they check
the plumbing, they are not labels.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ficco_select.executor.comm import Comm, Transfer
from ficco_select.executor.cuda import COPIES, CudaLanes, HostTimer
from ficco_select.executor.operators import TOLERANCE, Operator, build_operator, relative_error
from ficco_select.scenario import Scenario
from ficco_select.schedule import ENGINES, Schedule, is_legal


class LoopbackError(RuntimeError):
    """A loopback run failed: a virtual rank raised, hung, or left a transfer unmatched."""


class LoopbackTimeout(LoopbackError, TimeoutError):
    """A virtual rank waited too long for a peer (the message names rank, peer and tag)."""


class _Aborted(LoopbackError):
    """Raised in the other ranks once one rank has failed (never the error reported)."""


# -- the rendezvous --------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Work:
    """One posted end of a transfer; `done` once its copy is issued by either end."""

    kind: str
    """``send`` or ``recv``."""
    rank: int
    """The virtual rank that posted it."""
    peer: int
    tag: int
    buf: torch.Tensor
    ready: Any
    """Marker of the poster's compute stream at post time (a CUDA event; None on CPU)."""
    done: bool = False
    finished: Any = None
    """Completes when the copy has landed (a CUDA event; None on CPU: already landed)."""

    def describe(self) -> str:
        direction = "to" if self.kind == "send" else "from"
        return f"rank {self.rank}'s {self.kind} {direction} rank {self.peer} (tag {self.tag})"


class Rendezvous:
    """Where the virtual ranks' transfers meet (thread-safe; one per scenario)."""

    def __init__(self, lanes: Any) -> None:
        self.lanes = lanes
        self._cond = threading.Condition()
        # (run, src, dst, tag, kind) -> posted ends waiting for their partner, in post
        # order (as with gloo, same-key messages match first-posted first).
        self._open: dict[tuple, collections.deque[Work]] = {}
        self.failure: str | None = None
        self.last_progress = time.monotonic()

    def post(self, work: Work, run: int, engine: str) -> None:
        src, dst = (work.rank, work.peer) if work.kind == "send" else (work.peer, work.rank)
        other_kind = "recv" if work.kind == "send" else "send"
        with self._cond:
            self.check_alive()
            self.last_progress = time.monotonic()
            waiting = self._open.get((run, src, dst, work.tag, other_kind))
            if not waiting:
                self._open.setdefault((run, src, dst, work.tag, work.kind), collections.deque()).append(work)
                return
            partner = waiting.popleft()
            if not waiting:
                del self._open[(run, src, dst, work.tag, other_kind)]
        # Posted second: this rank issues the copy (outside the lock: a CPU copy takes time).
        send, recv = (work, partner) if work.kind == "send" else (partner, work)
        if send.buf.shape != recv.buf.shape or send.buf.dtype != recv.buf.dtype:
            raise LoopbackError(
                f"{send.describe()} is {tuple(send.buf.shape)} {send.buf.dtype} but "
                f"{recv.describe()} is {tuple(recv.buf.shape)} {recv.buf.dtype}")
        finished = self.lanes.copy(recv.buf, send.buf, engine, issuer=work.rank, peer=partner.rank,
                                   after=[w.ready for w in (send, recv) if w.ready is not None])
        with self._cond:
            for w in (send, recv):
                w.done, w.finished = True, finished
            self.last_progress = time.monotonic()
            self._cond.notify_all()

    def wait(self, work: Work, deadline: float) -> bool:
        """Block the host until work's copy is issued (True) or the deadline (False).

        Raises if another rank failed meanwhile.
        """
        with self._cond:
            self._cond.wait_for(lambda: work.done or self.failure is not None,
                                timeout=max(0.0, deadline - time.monotonic()))
            if not work.done:
                self.check_alive()
            return work.done

    def abort(self, reason: str) -> None:
        """Wake every waiting rank with an error (the first reason is kept)."""
        with self._cond:
            if self.failure is None:
                self.failure = reason
            self._cond.notify_all()

    def unmatched(self) -> list[str]:
        """Posted ends nobody matched (then forgotten: a later run never matches them)."""
        with self._cond:
            left = [w.describe() for q in self._open.values() for w in q]
            self._open.clear()
        return left

    def check_alive(self) -> None:
        if self.failure is not None:
            raise _Aborted(f"aborted: {self.failure}")


# -- one virtual rank's comm -------------------------------------------------------------------
class LoopbackComm(Comm):
    """The operators' comm interface (``start``/``wait``/``exchange``) for one virtual rank.

    ``begin_run`` namespaces the tags of one run of a schedule: every virtual rank calls
    it with the same run number, so tags never collide across consecutive runs.
    """

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, *, timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.rendezvous = rendezvous
        self.timeout_s = timeout_s
        self.run = 0
        self.engine = "sm"

    def begin_run(self, run: int, engine: str) -> None:
        """Tags from now on belong to `run`; transfers use `engine`'s copy function."""
        if engine not in COPIES:
            raise ValueError(f"engine {engine!r} not in {tuple(COPIES)}")
        self.run, self.engine = run, engine

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list[Work]:
        """Post every transfer of one step; receives first, then sends (as P2PComm).

        Both ends of a transfer post it with the same tag; empty buffers are skipped on
        both ends (their sizes are known to both).
        """
        ready = self.rendezvous.lanes.ready()  # one marker for the whole step
        works = []
        for kind, transfers in (("recv", recvs), ("send", sends)):
            for buf, peer in transfers:
                if not 0 <= peer < self.world_size or peer == self.rank:
                    raise ValueError(f"rank {self.rank}: {kind} with invalid peer {peer} (tag {tag})")
                if buf.numel():
                    work = Work(kind, self.rank, peer, tag, buf, ready)
                    self.rendezvous.post(work, self.run, self.engine)
                    works.append(work)
        return works

    def wait(self, works: Sequence[Work]) -> None:
        """Return once every work's data is in place for what the caller does next."""
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            if not self.rendezvous.wait(work, deadline):
                other = "recv" if work.kind == "send" else "send"
                raise LoopbackTimeout(f"{work.describe()} timed out after {self.timeout_s:g} s: "
                                      f"rank {work.peer} never posted the matching {other}")
            self.rendezvous.lanes.join(work.finished)


# -- CPU lanes: the synchronous counterpart of cuda.CudaLanes ----------------------------------
class HostLanes:
    """CPU: a copy is done on the thread that issues it, so there is nothing to order."""

    def on_rank(self, rank: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def ready(self) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, engine: str, *, issuer: int, peer: int,
             after: Sequence[Any]) -> None:
        COPIES[engine](dst, src)

    def join(self, done: None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def timer(self) -> HostTimer:
        return HostTimer()


def make_lanes(device: str, world_size: int) -> HostLanes | CudaLanes:
    kind = torch.device(device).type
    if kind == "cpu":
        return HostLanes()
    if kind == "cuda":
        return CudaLanes(world_size, device)
    raise ValueError(f"device {device!r}: loopback runs on 'cpu' or 'cuda'")


# -- P virtual ranks -------------------------------------------------------------------------
class VirtualRanks:
    """The P virtual ranks of one scenario: comms, operators, and a way to run on all.

    ``each(fn)`` runs fn(rank) in one thread per rank, with that rank's compute stream
    current, and returns the results by rank; it raises ``LoopbackError`` (or
    ``LoopbackTimeout``) naming what ran and the failing rank if any rank fails, hangs, or
    leaves a transfer unmatched.
    """

    def __init__(self, scenario: Scenario, *, device: str = "cpu", seed: int = 0,
                 timeout_s: float = 60.0, comm_type: type[LoopbackComm] = LoopbackComm) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.scenario, self.device, self.timeout_s = scenario, device, timeout_s
        P = scenario.world_size
        self.lanes = make_lanes(device, P)
        self.rendezvous = Rendezvous(self.lanes)
        # Longer than a transfer's wait, so that a rank stuck in a transfer reports its own
        # timeout (the root cause) before its peers give up at the barrier; shorter than the
        # no-progress backstop (2x).
        self.barrier_timeout_s = 1.5 * timeout_s
        self.barrier = threading.Barrier(P, timeout=self.barrier_timeout_s)
        self.comms = [comm_type(r, P, self.rendezvous, timeout_s=timeout_s) for r in range(P)]
        self._runs = 0
        self.ops: list[Operator] = self.each(
            lambda r: build_operator(scenario, self.comms[r], seed=seed, device=device),
            what="building operators")
        self.lanes.synchronize()  # inputs are on the device before anyone reads them

    @property
    def world_size(self) -> int:
        return self.scenario.world_size

    def next_runs(self, n: int) -> int:
        """Reserve n run numbers (tag namespaces); returns the first."""
        first = self._runs + 1
        self._runs += n
        return first

    def each(self, fn: Callable[[int], Any], *, what: str) -> list[Any]:
        P = self.world_size
        s = self.scenario
        label = f"scenario {s.scenario_id} ({s.op}, P={P}, {s.dtype}), {what}"
        if self.rendezvous.failure is not None:
            raise LoopbackError(f"{label}: an earlier run of these virtual ranks failed; build new ones")
        results: list[Any] = [None] * P
        errors: list[tuple[int, BaseException]] = []  # in the order they happened

        def rank_main(r: int) -> None:
            try:
                with self.lanes.on_rank(r):
                    results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
                errors.append((r, e))
                self.rendezvous.abort(f"rank {r} failed")
                self.barrier.abort()

        self.rendezvous.last_progress = time.monotonic()
        # Each virtual rank runs in a copy of the caller's context: the machines its job knows.
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(rank_main, r), daemon=True,
                                    name=f"loopback-rank{r}") for r in range(P)]
        for t in threads:
            t.start()
        self._join(threads, label)
        if errors:
            self.rendezvous.unmatched()
            # Report the root cause: the first rank that failed on its own, not one aborted by it.
            r, err = next(((r, e) for r, e in errors if not isinstance(e, _Aborted)), errors[0])
            cls = LoopbackTimeout if isinstance(err, LoopbackTimeout) else LoopbackError
            raise cls(f"{label}: rank {r} failed: {type(err).__name__}: {err}") from err
        left = self.rendezvous.unmatched()
        if left:
            raise LoopbackError(f"{label}: transfers never matched: {'; '.join(left)}")
        return results

    def _join(self, threads: list[threading.Thread], label: str) -> None:
        # Every comm wait and barrier has its own timeout; this is the backstop for a rank
        # stuck elsewhere (e.g. a device sync): no progress for twice the timeout.
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.05)
            stalled = time.monotonic() - self.rendezvous.last_progress > 2 * self.timeout_s
            if stalled and any(t.is_alive() for t in threads):
                self.rendezvous.abort("no progress")
                self.barrier.abort()
                stuck = [r for r, t in enumerate(threads) if t.is_alive()]
                raise LoopbackTimeout(f"{label}: rank(s) {stuck} made no progress for "
                                      f"{2 * self.timeout_s:g} s")

    def sync_point(self, rank: int) -> None:
        """All ranks' work so far is done (device too) before any rank goes on."""
        self.lanes.synchronize()
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.rendezvous.check_alive()  # another rank failed: it is the one to report
            raise LoopbackTimeout(f"rank {rank} waited {self.barrier_timeout_s:g} s at the barrier "
                                  "before a repetition: another rank never arrived") from None
        self.rendezvous.last_progress = time.monotonic()

    def run_once(self, schedule: Schedule, *, compute: bool = True, comm: bool = True) -> list[torch.Tensor]:
        """One run of `schedule` on every rank (optionally a skeleton); outputs by rank."""
        run = self.next_runs(1)

        def one(r: int) -> torch.Tensor:
            self.comms[r].begin_run(run, schedule.engine)
            with self.ops[r].skeleton(compute=compute, comm=comm):
                out = self.ops[r].run(schedule)
            self.lanes.synchronize()
            return out

        return self.each(one, what=f"schedule {schedule.name}")


# -- reference --------------------------------------------------------------------------------
def loopback_reference(ops: Sequence[Operator]) -> list[torch.Tensor]:
    """Each rank's expected output in float32, from all virtual ranks' inputs, by rank.

    The operators' own ``reference()`` uses torch.distributed collectives; here every
    rank's inputs are at hand, so each collective is a concatenation or a sum. Computed
    in float64 (on CUDA, immune to a TF32 setting) and rounded to float32. Read before
    any schedule runs (an ag_gemm rank's own shard is never overwritten).
    """
    op = ops[0].scenario.op
    if op == "ag_gemm":  # out_r = [A_0; ...; A_{P-1}] @ W_r
        A = torch.cat([o.shard(o.r) for o in ops]).double()
        return [(A @ o.W.double()).float() for o in ops]
    if op == "gemm_rs":  # out_r = row block r of sum_q A_q @ W_q
        C = sum(o.A.double() @ o.W.double() for o in ops)
        return [C[o.block(o.r)].float() for o in ops]
    if op == "a2a_gemm":  # out_r = (chunks every rank q routes to r, in q order) @ W_r
        return [(torch.cat([q.send_chunk(o.r) for q in ops]).double() @ o.W.double()).float() for o in ops]
    if op == "gemm_ar":  # out_r = sum_q A_q @ W_q, on every rank
        C = sum(o.A.double() @ o.W.double() for o in ops)
        return [C.float() for _ in ops]
    if op == "gemm_a2a":  # out_r = (what every expert q computes for r's tokens, in q order)
        return [torch.cat([(q.X_recv[q.expert_rows(o.r)].double() @ q.W.double()) for q in ops]).float()
                for o in ops]
    raise ValueError(f"no loopback reference for op {op!r}")


# -- verify and time schedules -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopbackResult:
    schedule: Schedule
    """The schedule as run (its ``engine`` is the copy function that was used)."""
    verified: bool
    """Every virtual rank's output is within ``TOLERANCE[dtype]`` of the reference."""
    rel_error: float
    """Worst relative error over virtual ranks (inf: wrong shape or unwritten/NaN output)."""
    rank_errors: list[float]
    """Relative error of each virtual rank."""
    times_s: list[float]
    """Per timed repetition: the slowest virtual rank's time, seconds."""


def run_loopback(scenario: Scenario, schedules: Sequence[Schedule], *, device: str = "cpu",
                 engine: str | None = None, reps: int = 5, warmup: int = 1, seed: int = 0,
                 timeout_s: float = 60.0, comm_type: type[LoopbackComm] = LoopbackComm
                 ) -> list[LoopbackResult]:
    """Verify and time each schedule of `scenario` on P virtual ranks; results in order.

    engine: None runs each schedule with its own ``engine``; ``sm`` or ``dma`` runs every
    schedule with that engine instead (the result's schedule says which). On CPU both
    engines are a synchronous copy by the issuing thread. comm_type: a LoopbackComm
    subclass (tests inject faults with it). Raises LoopbackError / LoopbackTimeout naming
    the scenario, schedule and rank if a run fails or hangs.
    """
    if reps < 1:
        raise ValueError(f"reps: at least 1 timed repetition, got {reps}")
    if warmup < 0:
        raise ValueError(f"warmup: must be >= 0, got {warmup}")
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"engine: {engine!r} not in {ENGINES} (or None for each schedule's own)")
    if engine is not None:
        schedules = [dataclasses.replace(s, engine=engine) for s in schedules]
    for s in schedules:  # the cuda backend's space: both engines, every dtype
        if not is_legal(s, scenario, "cuda"):
            raise ValueError(f"schedule {s.name} is not legal for scenario {scenario.scenario_id}")

    world = VirtualRanks(scenario, device=device, seed=seed, timeout_s=timeout_s, comm_type=comm_type)
    refs = loopback_reference(world.ops)
    world.lanes.synchronize()
    return [_verify_and_time(world, refs, s, reps, warmup) for s in schedules]


def _verify_and_time(world: VirtualRanks, refs: list[torch.Tensor], schedule: Schedule,
                     reps: int, warmup: int) -> LoopbackResult:
    first = world.next_runs(1 + warmup + reps)

    def rank_main(r: int) -> tuple[float, list[float]]:
        op, comm = world.ops[r], world.comms[r]
        # Verification: one run on NaN-poisoned buffers, so stale data cannot pass.
        op.poison()
        comm.begin_run(first, schedule.engine)
        error = relative_error(op.run(schedule), refs[r])  # .item() waits for this stream
        timers = []
        for i in range(warmup + reps):
            world.sync_point(r)  # every rank starts a repetition on an idle device
            timer = world.lanes.timer()
            timer.start()
            comm.begin_run(first + 1 + i, schedule.engine)
            op.run(schedule)
            timer.stop()
            timers.append(timer)
        world.lanes.synchronize()
        return error, [t.seconds() for t in timers[warmup:]]

    per_rank = world.each(rank_main, what=f"schedule {schedule.name}")
    errors = [e for e, _ in per_rank]
    times = [max(ts[i] for _, ts in per_rank) for i in range(reps)]
    worst = max(errors)
    return LoopbackResult(schedule=schedule, verified=worst <= TOLERANCE[world.scenario.dtype],
                          rel_error=worst, rank_errors=errors, times_s=times)
