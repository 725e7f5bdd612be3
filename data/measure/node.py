"""The cuda backend across the GPUs of one node: one process per GPU.

The ranks are started, watched and killed exactly as the cpu backend's
(``cpu.measure_spawned(..., backend="cuda")``, or under ``torchrun``); each rank:

1. binds GPU ``rank`` and joins a process group with NCCL for CUDA tensors and gloo for
   the few CPU scalars the harness reduces (``cuda:nccl,cpu:gloo``);
2. builds an ``EngineComm``: ``sm`` = ``NcclComm`` (NCCL kernels), ``dma`` =
   ``PeerCopyComm`` over ``CudaPeerMemory`` (copy engines through symmetric memory);
3. runs the same measure loop as the cpu backend over the cuda backend's candidates
   (both engines): verification against a float32 NCCL reference, timing with the
   device synchronized around every run, slowest rank per repetition.

``device="cpu"`` runs the same path in CPU processes (gloo; ``HostPeerMemory``): it is
how the CPU tests cover this module. Such rows are checks of the plumbing, not labels.

Status: written for, and not yet run on, a node with several GPUs.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from ficco_select.executor.peer import CudaPeerMemory, EngineComm, HostPeerMemory, NcclComm, PeerCopyComm, PeerMemory


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeOptions:
    device: str = "cuda"
    """``cuda``: rank r on GPU r. ``cpu``: the host stand-ins (tests)."""
    dma_slots: int = 4
    """Staging slots per ordered pair of ranks (``peer.PeerCopyComm``)."""
    dma_slot_bytes: int = 32 << 20
    """Bytes per staging slot; a larger transfer goes as several."""


def init_rank(rank: int, world_size: int, rendezvous: str | dist.Store, timeout_s: float,
              options: NodeOptions) -> None:
    """Join the process group of a node job as `rank` (before any CUDA work on the rank).

    rendezvous: a store the ranks share (the launcher's), or an ``init_method`` URL.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    meet = {"store": rendezvous} if isinstance(rendezvous, dist.Store) else {"init_method": rendezvous}
    if options.device == "cpu":
        dist.init_process_group("gloo", **meet, rank=rank, world_size=world_size, timeout=timeout)
        return
    if torch.cuda.device_count() < world_size:
        raise RuntimeError(f"a node job of {world_size} ranks needs {world_size} GPUs; "
                           f"{torch.cuda.device_count()} visible")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo", **meet, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device)


def engine_comm(options: NodeOptions, timeout_s: float) -> tuple[EngineComm, PeerMemory]:
    """Both engines' comms of this rank (collective: every rank calls it)."""
    memory_type = HostPeerMemory if options.device == "cpu" else CudaPeerMemory
    memory = memory_type(slots=options.dma_slots, slot_bytes=options.dma_slot_bytes, timeout_s=timeout_s)
    return EngineComm({"sm": NcclComm(), "dma": PeerCopyComm(memory)}), memory


def rank_device(options: NodeOptions) -> str:
    return "cpu" if options.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
