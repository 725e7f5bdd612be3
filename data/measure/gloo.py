"""The cpu backend: one process per rank over torch.distributed (gloo).

Two ways to start the ranks, one rank loop (``measure_rank``):
- ``measure_spawned``: world_size processes on this machine, started and watched by the
  rank launcher (``ficco_select.executor.ranks``), which kills every one of them if a rank
  dies or makes no progress for ``timeout_s`` (then this raises ``MeasureError``); a job
  leaves nothing on disk, even when the launcher is killed with SIGKILL.
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
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ficco_select.data.measure.config import MeasureConfig, MeasureError
from ficco_select.data.measure.harness import measure_scenario
from ficco_select.data.measure.node import NodeOptions, engine_comm, init_rank, rank_device
from ficco_select.executor import ranks
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


# -- spawned ranks -------------------------------------------------------------------------
def _measure_spawned_rank(rank: int, world_size: int, records: list[dict], config: MeasureConfig,
                          node: NodeOptions | None) -> None:
    scenarios = [Scenario.from_record(r) for r in records]
    emit = ranks.report if rank == 0 else (lambda kind, payload: None)
    if node is None:  # the launcher's gloo group
        measure_rank(scenarios, config, emit)
        return
    init_rank(rank, world_size, ranks.rendezvous(), config.timeout_s * 2, node)
    comm, memory = engine_comm(node, config.timeout_s)
    try:
        measure_rank(scenarios, config, emit, comm=comm, backend="cuda", device=rank_device(node))
    finally:
        memory.close()
    dist.barrier()
    dist.destroy_process_group()


def measure_spawned(scenarios: Sequence[Scenario], config: MeasureConfig, *,
                    on_scenario: Callable[[list[dict]], None],
                    on_progress: Callable[[int], None] = lambda n: None,
                    node: NodeOptions | None = None) -> None:
    """Spawn world_size ranks for `scenarios` (all of one world size) and measure them
    (``ficco_select.executor.ranks``: every rank process gone however the job ends).

    node: None for the cpu backend (gloo ranks); options of the cuda backend's node mode
    (``node.py``: a rank per GPU, both engines) otherwise.

    Calls on_scenario(rows) as each scenario finishes and on_progress(n) with the number
    of schedules it measured. Raises MeasureError if a rank fails or no progress is seen for
    config.timeout_s seconds.
    """
    if not scenarios:
        return
    sizes = {s.world_size for s in scenarios}
    if len(sizes) != 1:
        raise ValueError(f"one world size per job, got {sorted(sizes)}")

    def on_report(kind: str, payload) -> None:
        if kind == "progress":
            on_progress(payload)
        elif kind == "scenario":
            on_scenario(payload)
        # "alive": the launcher's watch saw the job advance; nothing else to do

    P = sizes.pop()
    try:
        ranks.launch(_measure_spawned_rank, P, ([s.as_record() for s in scenarios], config, node),
                     timeout_s=config.timeout_s, group="gloo" if node is None else None,
                     threads=config.threads(P), pin_cores=config.pin_cores, on_report=on_report)
    except ranks.RankError as e:
        raise MeasureError(f"{e}; measurement aborted") from None


# -- self-check: does communication progress while the caller computes? --------------------
def background_progress_rank(rank: int, world_size: int, elements: int) -> tuple[int, int, bool, bool]:
    """Two ranks of a gloo group (``executor.ranks.launch``): rank 1 sends `elements` floats;
    rank 0 posts the receive into a NaN buffer and runs GEMMs, without ever calling wait(),
    until the data has landed.

    Returns (rank, gemms_run, landed, data right). landed=True with wait() never called
    shows that gloo moves the bytes on its own threads while the caller computes: the
    overlap the cpu backend's schedules rely on is real, not sequential.
    """
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
    return rank, gemms, landed, bool(torch.equal(buf, torch.arange(elements, dtype=torch.float32)))
