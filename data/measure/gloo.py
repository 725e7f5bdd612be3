"""The cpu backend: one process per rank over torch.distributed (gloo).

Two ways to start the ranks, one rank loop (``measure_rank``):
- ``measure_spawned``: the executor spawns world_size processes on this machine, watches
  them, and kills every one of them if a rank dies or makes no progress for
  ``timeout_s`` (then raises ``MeasureError``). The ranks rendezvous over a TCPStore that
  the launcher hosts on loopback, so a job leaves nothing on disk, even when the launcher
  is killed with SIGKILL; ranks die with their launcher (Linux), even one killed while
  they were still starting.
- ``measure_in_group``: the caller is already one rank of a process group (``torchrun``).

Per scenario the ranks compute the float32 reference, time compute alone and
communication alone, then for every legal schedule: run once on poisoned buffers and
check the output against the reference on every rank, then warm up and time ``reps``
runs. A run's time is the slowest rank's (max over ranks of each repetition).
Rank 0 reports one row per (scenario, schedule).

The cuda backend's node mode (``node.py``: a process per GPU, both engines) uses the same
launcher and rank loop with ``node=NodeOptions(...)``.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ficco_select.data.measure.config import MeasureConfig, MeasureError
from ficco_select.data.measure.harness import measure_scenario
from ficco_select.data.measure.node import NodeOptions, engine_comm, init_rank, rank_device
from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators import build_operator
from ficco_select.scenario import Scenario

Emit = Callable[[str, Any], None]
"""emit(kind, payload): rank 0's channel to the caller: ("progress", schedules done),
("scenario", rows) and ("alive", None) as a scenario's work advances (a hung rank stops
rank 0 in its next collective, so the heartbeats stop too)."""


def measure_rank(scenarios: Sequence[Scenario], config: MeasureConfig, emit: Emit, *,
                 comm: Any = None, backend: str = "cpu", device: str = "cpu") -> None:
    """The loop every rank runs, inside an initialised process group.

    comm: the rank's comm (default: gloo point-to-point, the cpu backend's ``sm``);
    backend: whose candidates are measured; device: where the operators live.
    """
    comm = comm or P2PComm()
    fault_kind, _, fault_arg = (config.fault or "").partition("@")
    fault_rank, _, fault_group = fault_arg.partition("/")
    for scenario in scenarios:
        if (fault_kind in ("exit", "hang") and int(fault_rank) == comm.rank
                and fault_group in ("", scenario.group)):
            if fault_kind == "exit":
                os._exit(3)
            time.sleep(1e9)
        op = build_operator(scenario, comm, seed=config.seed, device=device)
        rows = measure_scenario(op, scenario, config, backend=backend,
                                corrupt=fault_arg if fault_kind == "corrupt" else None,
                                heartbeat=lambda: emit("alive", None))
        emit("progress", len(rows))
        emit("scenario", rows)


def measure_in_group(scenarios: Sequence[Scenario], config: MeasureConfig, emit: Emit) -> None:
    """Measure as one rank of an existing process group (e.g. under torchrun).

    Every rank must be given the same scenarios; only rank 0's `emit` is called.
    """
    P = dist.get_world_size()
    bad = [s for s in scenarios if s.world_size != P]
    if bad:
        raise MeasureError(f"scenario {bad[0].scenario_id} has world_size={bad[0].world_size} "
                           f"but the process group has {P} ranks")
    torch.set_num_threads(config.threads(P))
    rank0 = dist.get_rank() == 0
    measure_rank(scenarios, config, emit if rank0 else (lambda kind, payload: None))


def init_from_env(timeout_s: float) -> None:
    """Join the process group torchrun describes in the environment (gloo)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


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


# -- spawned ranks -------------------------------------------------------------------------
def _spawned_rank(rank: int, world_size: int, launcher_pid: int, store_port: int, records: list[dict],
                  config: MeasureConfig, events, node: NodeOptions | None = None) -> None:
    try:
        _die_with_launcher(launcher_pid)
        if config.pin_cores:
            pin_rank_to_cores(rank, world_size, config.threads(world_size))
        torch.set_num_threads(config.threads(world_size))
        scenarios = [Scenario.from_record(r) for r in records]
        emit = (lambda kind, payload: events.put((kind, payload))) if rank == 0 else (lambda k, p: None)
        # The launcher kills hung jobs first; the process group's own timeout is a backstop.
        timeout = datetime.timedelta(seconds=config.timeout_s * 2)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        if node is None:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
            measure_rank(scenarios, config, emit)
        else:
            init_rank(rank, world_size, store, config.timeout_s * 2, node)
            comm, memory = engine_comm(node, config.timeout_s)
            try:
                measure_rank(scenarios, config, emit, comm=comm, backend="cuda", device=rank_device(node))
            finally:
                memory.close()
        dist.barrier()
        if rank == 0:
            events.put(("done", None))
        dist.destroy_process_group()
    except BaseException as e:
        events.put(("error", f"rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        raise SystemExit(1)


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


def measure_spawned(scenarios: Sequence[Scenario], config: MeasureConfig, *,
                    on_scenario: Callable[[list[dict]], None],
                    on_progress: Callable[[int], None] = lambda n: None,
                    node: NodeOptions | None = None) -> None:
    """Spawn world_size ranks for `scenarios` (all of one world size) and measure them.

    node: None for the cpu backend (gloo ranks); options of the cuda backend's node mode
    (``node.py``: a rank per GPU, both engines) otherwise.

    Calls on_scenario(rows) as each scenario finishes and on_progress(n) with the number
    of schedules it measured. Raises MeasureError, with every rank process gone, if a rank fails or no
    progress is seen for config.timeout_s seconds.
    """
    if not scenarios:
        return
    sizes = {s.world_size for s in scenarios}
    if len(sizes) != 1:
        raise ValueError(f"one world size per job, got {sorted(sizes)}")
    P = sizes.pop()
    ctx = torch.multiprocessing.get_context("spawn")
    events = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
    records = [s.as_record() for s in scenarios]
    # The rendezvous lives in this process, not in a file: it goes when the launcher goes,
    # however it ends. Port 0: the OS picks a free one.
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(P):
            p = ctx.Process(target=_spawned_rank, daemon=True,
                            args=(rank, P, os.getpid(), store.port, records, config, events, node))
            p.start()
            procs.append(p)
        _watch(procs, events, config.timeout_s, on_scenario, on_progress)
    finally:
        _kill_all(procs)


def _watch(procs, events, timeout_s, on_scenario, on_progress) -> None:
    last = time.monotonic()
    while True:
        try:
            kind, payload = events.get(timeout=0.2)
        except queue_mod.Empty:
            dead = _dead_rank_message(procs)
            if dead:
                raise MeasureError(dead)
            if time.monotonic() - last > timeout_s:
                raise MeasureError(f"no progress for {timeout_s:.0f} s: a rank hangs; measurement aborted")
            continue
        last = time.monotonic()
        if kind == "alive":
            continue  # `last` is reset: slow but advancing is not hung
        if kind == "progress":
            on_progress(payload)
        elif kind == "scenario":
            on_scenario(payload)
        elif kind == "error":
            # Peers of a dead rank fail with connection errors: name the dead one instead.
            time.sleep(1.0)
            raise MeasureError(_dead_rank_message(procs) or payload.strip())
        elif kind == "done":
            for p in procs:
                p.join(timeout=30)
            return


def _dead_rank_message(procs) -> str | None:
    # Exit code 1 is a rank that reported a Python error; anything else died on its own.
    dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0, 1)]
    if not dead:
        return None
    rank, code = dead[0]
    return f"rank {rank} died (exit code {code}); measurement aborted"


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


# -- self-check: does communication progress while the caller computes? --------------------
def background_progress_rank(rank: int, store: str, elements: int, results) -> None:
    """Two ranks: rank 1 sends `elements` floats; rank 0 posts the receive into a NaN buffer
    and runs GEMMs, without ever calling wait(), until the data has landed.

    Puts (rank, gemms_run, landed) on `results`. landed=True with wait() never called shows
    that gloo moves the bytes on its own threads while the caller computes: the overlap
    the cpu backend's schedules rely on is real, not sequential.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    buf = torch.full((elements,), float("nan")) if rank == 0 else torch.arange(elements, dtype=torch.float32)
    dist.barrier()
    work = dist.irecv(buf, 1, tag=7) if rank == 0 else dist.isend(buf, 0, tag=7)
    a = torch.randn(256, 256)
    gemms, deadline = 0, time.monotonic() + 30
    landed = rank == 1
    while not landed and time.monotonic() < deadline:
        a @ a
        gemms += 1
        landed = not bool(torch.isnan(buf[-1])) and not bool(torch.isnan(buf[0]))
    work.wait()
    results.put((rank, gemms, landed, bool(torch.equal(buf, torch.arange(elements, dtype=torch.float32)))))
    dist.barrier()
    dist.destroy_process_group()
