"""Ranks on this machine: the one launcher the measurement harness, the fabric profile, the
benchmarks and the tests share.

    outcomes = launch(fn, world_size, args)          # fn(rank, world_size, *args) on every rank
    values = run_ranks(fn, world_size, args)         # the same; RankError if any rank failed

Each rank is a fresh process (spawned unless told: ``START_METHOD``). It joins a process
group (gloo by default; ``group=None`` leaves that to `fn`, which finds the rendezvous in
``rendezvous()``) over a TCPStore this process hosts on loopback, so a job leaves nothing
on disk however it ends. Ranks die with their launcher (Linux), even one killed while they
were still starting. A rank talks to the
launcher while it works with ``report(kind, payload)`` (``on_report`` receives it), and its
return value comes back in its ``RankOutcome``.

The launcher watches: a rank that dies, raises, or a job that reports nothing for
``timeout_s`` ends the job, every rank process killed, with a ``RankError`` naming the rank
(``stop_on_error``), or with every rank's outcome for callers that judge them (a rank that
hangs has ``exitcode`` None).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue as queue_mod
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_DEAD_GRACE_S = 0.2
"""How long a rank seen exited without a word stays unjudged: one more read of the queue. A
rank's messages are in the pipe before its process exits (``_rank_main`` flushes the queue
before it leaves), so nothing it sent can arrive later than that read."""
_PEER_GRACE_S = 0.5
"""How long a failed rank's peers get to show which of them died first (a peer that gloo
aborted is gone by the time its socket closes, so this is a margin for a loaded host)."""


START_METHOD = "spawn"
"""How ``launch`` starts ranks unless its caller says: a fresh interpreter per rank (seconds
of importing torch each), which dies with its launcher. A process that starts many short
jobs (a test session) may make it ``forkserver``, with its preloads, once at its start."""


class RankError(RuntimeError):
    """A job of ranks failed: the message names the rank and how."""


@dataclasses.dataclass
class RankOutcome:
    rank: int
    value: Any = None
    """What `fn` returned on this rank."""
    error: str | None = None
    """What `fn` raised (type, message, traceback), or how the process ended without a word."""
    exitcode: int | None = None
    """The process's exit code; None where it still ran when the launcher gave up (a hang)."""
    seconds: float = 0.0
    """From the launch until this rank's outcome was known."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout_s: float = 600.0,
           group: str | None = "gloo", group_timeout_s: float | None = None, threads: int | None = 1,
           pin_cores: bool = False, on_report: Callable[[str, Any], None] | None = None,
           stop_on_error: bool = True, start_method: str | None = None) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on `world_size` fresh processes; every rank's outcome.

    group: the backend of the process group each rank joins before `fn` (and leaves after a
    barrier), or None (`fn` joins one itself, from ``rendezvous()``). group_timeout_s: that
    group's timeout (default: twice `timeout_s`, a backstop behind the launcher's watch).
    threads: torch's threads per rank (None: torch's default); pin_cores: each rank on its own
    `threads` cores, before its group starts its threads (``pin_rank_to_cores``). timeout_s: the longest the job
    may go without a rank reporting, returning or failing. start_method: ``spawn``, or
    ``forkserver`` for callers that start many short jobs (its preloads are the caller's);
    default: ``START_METHOD``.
    """
    start_method = start_method or START_METHOD
    ctx = torch.multiprocessing.get_context(start_method)
    events = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
    # Port 0: the OS picks a free one. The store lives in this process, not in a file: it goes
    # when the launcher goes, however it ends.
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    # A forkserver's children are the server's: they die with it, and it with the launcher.
    parent = os.getpid() if start_method == "spawn" else None
    setup = _Setup(parent, store.port, group, group_timeout_s or 2 * timeout_s, threads, pin_cores)
    procs = []
    t0 = time.monotonic()
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, daemon=True, args=(rank, world_size, setup, fn, tuple(args), events))
            p.start()
            procs.append(p)
        return _watch(procs, events, t0, timeout_s, on_report, stop_on_error)
    finally:
        _kill_all(procs)


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), **kw) -> list[Any]:
    """``launch``, then each rank's return value, in rank order."""
    return [o.value for o in launch(fn, world_size, args, **kw)]


# -- inside a rank -------------------------------------------------------------------------------
_events = None
_store = None


def report(kind: str, payload: Any = None) -> None:
    """From inside a rank: send (kind, payload) to the launcher's ``on_report``; also tells
    the launcher the job is alive."""
    if _events is not None:
        _events.put(("report", kind, payload))


def rendezvous() -> dist.Store:
    """From inside a rank: the launcher's store, for a `fn` that joins its own process group."""
    if _store is None:
        raise RuntimeError("rendezvous() is for code running in a rank that launch() started")
    return _store


@dataclasses.dataclass(frozen=True)
class _Setup:
    launcher_pid: int | None
    """The rank's parent, which it dies with (None: a forkserver's child)."""
    port: int
    group: str | None
    group_timeout_s: float
    threads: int | None
    pin_cores: bool


def _rank_main(rank: int, world_size: int, setup: _Setup, fn, args: tuple, events) -> None:
    global _events, _store
    if setup.launcher_pid is not None:
        _die_with_launcher(setup.launcher_pid)
    _events = events
    code = 0
    try:
        if setup.pin_cores:
            pin_rank_to_cores(rank, world_size, setup.threads or 1)
        if setup.threads:
            torch.set_num_threads(setup.threads)
        timeout = datetime.timedelta(seconds=setup.group_timeout_s)
        _store = dist.TCPStore("127.0.0.1", setup.port, is_master=False, timeout=timeout)
        if setup.group:
            dist.init_process_group(setup.group, store=_store, rank=rank, world_size=world_size, timeout=timeout)
        value = fn(rank, world_size, *args)
        if setup.group:
            dist.barrier()
            dist.destroy_process_group()
        events.put(("result", rank, value))
    except BaseException as e:  # noqa: BLE001 - the launcher says what failed, on which rank
        events.put(("error", rank, f"rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        code = 1
    # Leave without the interpreter's teardown, where gloo's threads can abort the process
    # (std::terminate, seen once in CI); the queue's last message is flushed first.
    events.close()
    events.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def pin_rank_to_cores(rank: int, world_size: int, threads: int) -> None:
    """Give each rank its own cores, as each GPU has its own SMs.

    gloo's transport threads then run on the rank's cores: communication takes compute
    from its own rank's GEMMs (the `sm` engine), and the OS does not migrate ranks onto
    each other's cores. With more ranks than cores, pinning would load some cores more
    than others, so the OS places the ranks.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if world_size * threads > len(cores):
        return
    os.sched_setaffinity(0, set(cores[rank * threads:(rank + 1) * threads]))


def _die_with_launcher(launcher_pid: int) -> None:
    # Linux: if the launcher is killed (even kill -9) its ranks get SIGKILL too.
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # The signal only covers a launcher dying from now on; this rank got here after
    # seconds of importing torch, so the launcher may already be gone (the rank was
    # reparented). Its peers and store may be gone with it: leave at once.
    if os.getppid() != launcher_pid:
        os._exit(1)


# -- the launcher's watch -------------------------------------------------------------------------
def _watch(procs, events, t0: float, timeout_s: float, on_report, stop_on_error: bool) -> list[RankOutcome]:
    outcomes: dict[int, RankOutcome] = {}
    silent_since: dict[int, float] = {}  # exited without a word, since when
    hung: list[int] = []  # still running when the job stalled: killed, exit code None
    last = time.monotonic()
    while len(outcomes) < len(procs):
        try:
            kind, *message = events.get(timeout=0.2)
        except queue_mod.Empty:
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in outcomes and p.exitcode is not None:
                    since = silent_since.setdefault(rank, now)
                    if now - since >= _DEAD_GRACE_S:
                        outcomes[rank] = RankOutcome(rank, error=f"rank {rank} died (exit code {p.exitcode})",
                                                     exitcode=p.exitcode, seconds=now - t0)
                        if stop_on_error:
                            raise RankError(f"{outcomes[rank].error}; the job aborted")
            if now - last > timeout_s:
                hung = [r for r in range(len(procs)) if r not in outcomes]
                if stop_on_error:
                    raise RankError(f"no progress for {timeout_s:.0f} s: rank(s) {', '.join(map(str, hung))} hang; "
                                    "the job aborted")
                for rank in hung:
                    outcomes[rank] = RankOutcome(rank, error=f"rank {rank} hung", seconds=now - t0)
                break  # the hung ones are killed (``_kill_all``): exit code None
            continue
        last = time.monotonic()
        if kind == "report":
            if on_report is not None:
                on_report(*message)
            continue
        rank, payload = message
        if kind == "result":
            outcomes[rank] = RankOutcome(rank, value=payload, seconds=last - t0)
        else:
            outcomes[rank] = RankOutcome(rank, error=payload.strip(), seconds=last - t0)
            if stop_on_error:
                # Peers of a dead rank fail with connection errors: name the dead one instead.
                time.sleep(_PEER_GRACE_S)
                raise RankError(_dead_rank(procs) or payload.strip())
    for rank, p in enumerate(procs):
        if outcomes[rank].exitcode is None and rank not in hung:
            p.join(timeout=30)
            outcomes[rank].exitcode = p.exitcode
    return [outcomes[r] for r in range(len(procs))]


def _dead_rank(procs) -> str | None:
    # Exit code 1 is a rank that reported a Python error; anything else died on its own.
    dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0, 1)]
    if not dead:
        return None
    rank, code = dead[0]
    return f"rank {rank} died (exit code {code}); the job aborted"


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
