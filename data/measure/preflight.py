"""What a sweep refuses before any work starts (machines, ranks mode, device, memory), and
which scenarios fit in free memory as ``ficco_select.data.measure.sweep.measure`` would run them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ficco_select.data.measure.gloo import under_torchrun
from ficco_select.data.measure.node import NodeOptions
from ficco_select.executor.operators import rank_buffer_bytes
from ficco_select.hardware import HardwareError, load_hardware
from ficco_select.scenario import Scenario
from ficco_select.schedule import hardware_problem


def check_machines(scenarios: Sequence[Scenario], backend: str) -> None:
    """Rows carry only the machine they ran on: refused, before any work starts, is a
    scenario whose hardware is unknown or does not suit the backend (a GPU preset on the
    cpu backend, the cpu on the cuda backend; ``schedule.hardware_problem``)."""
    for i, s in enumerate(scenarios, start=1):
        try:
            problem = hardware_problem(s, backend, load_hardware(s.hardware))
        except HardwareError as e:
            problem = f"column 'hardware': {e}"
        if problem:
            raise ValueError(f"row {i} (scenario {s.scenario_id}: {describe(s)}), {problem}")


MEMORY_SHARE = 0.8
"""Share of the free memory a scenario's buffers may take; a larger one is refused."""


def check_memory(scenarios: Sequence[Scenario], backend: str, device: str | None, node: NodeOptions | None,
                 local_ranks: int | None) -> None:
    """Refuse, before any rank starts, a scenario whose buffers cannot fit in this machine's
    free memory (host memory for gloo ranks and CPU loopback, the GPU's for cuda), naming
    the row, the largest dimension and the bytes needed (``ops.rank_buffer_bytes``).

    local_ranks: ranks of a scenario on this machine (None: all of them, as when spawned
    or virtual; torchrun's LOCAL_WORLD_SIZE under torchrun).
    """
    on_gpu = backend == "cuda" and device is not None or node is not None
    free = free_bytes(on_gpu, device)
    if free is None:
        return
    for i, s in enumerate(scenarios, start=1):
        ranks_here = 1 if node is not None else local_ranks or s.world_size
        need = ranks_here * rank_buffer_bytes(s)
        if need > MEMORY_SHARE * free:
            col = max(("m", "n", "k"), key=lambda c: getattr(s, c))
            where = "the GPU" if on_gpu else "this machine"
            raise ValueError(f"row {i} (scenario {s.scenario_id}: {describe(s)}), column '{col}': its buffers need {_size(need)} "
                             f"({ranks_here} rank(s) x {_size(need // ranks_here)}), {where} has "
                             f"{_size(free)} free; shrink {col}")


def free_bytes(on_gpu: bool, device: str | None) -> int | None:
    """Free memory where the buffers go: the GPU's, or the host's; None where it is unknown
    (no CUDA: refused elsewhere with its own message)."""
    if on_gpu:
        if not torch.cuda.is_available():
            return None
        # The caching allocator keeps an earlier scenario's buffers reserved, which
        # mem_get_info counts as used: handed back first, they are free for this one.
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device or 0)[0]
    return _host_available_bytes()


def fitting(scenarios: Sequence[Scenario], *, backend: str, device: str | None = None,
            ranks: str = "loopback") -> list[Scenario]:
    """The scenarios whose buffers fit in free memory as ``measure`` would run them (its
    check's rule: every rank of a loopback scenario on the one device, one rank per GPU in
    node mode): a grid to measure from, where ``measure`` would refuse the rest."""
    node = ranks == "node"
    on_gpu = backend == "cuda" and (node or (device or "cuda") != "cpu")
    free = free_bytes(on_gpu, device)
    if free is None:
        return list(scenarios)
    return [s for s in scenarios if (1 if node else s.world_size) * rank_buffer_bytes(s) <= MEMORY_SHARE * free]


def describe(s: Scenario) -> str:
    """What a scenario is, as messages say it beside its id."""
    return f"{s.group} {s.op} m={s.m} n={s.n} k={s.k} P={s.world_size}"


def _host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (the check is skipped)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def node_options(scenarios: Sequence[Scenario], backend: str, device: str | None) -> NodeOptions:
    """The cuda backend's node mode: refused, before any work starts, where it cannot run."""
    if device is not None:
        raise ValueError(f"device {device!r}: in node mode rank r runs on GPU r; give no device")
    if under_torchrun():
        raise ValueError("ranks 'node' spawns its own ranks; run it without torchrun")
    need = max((s.world_size for s in scenarios), default=0)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        raise ValueError(f"ranks 'node': scenarios of world size {need} need {need} GPUs, {have} visible "
                         "here; use ranks 'loopback' (virtual ranks on one GPU)")
    return NodeOptions()


def loopback_device(scenarios: Sequence[Scenario], backend: str, device: str | None) -> str | None:
    """The device the loopback executor runs on, or None for the cpu backend's gloo ranks.

    Refuses, before any work starts, what cannot give honest rows: a cuda scenario whose
    hardware is ``cpu``, a backend/device mismatch, a cuda sweep without CUDA or under torchrun.
    """
    if backend == "cpu":
        if device not in (None, "cpu"):
            raise ValueError(f"device {device!r}: the cpu backend runs on device 'cpu' (loopback) or None "
                             "(gloo ranks); use backend 'cuda' for a GPU")
    elif backend == "cuda":
        device = device or "cuda"
        if torch.device(device).type != "cuda":
            raise ValueError(f"device {device!r}: the cuda backend measures on a CUDA device ('cuda' or "
                             "'cuda:<index>')")
    else:
        raise ValueError(f"backend {backend!r}: measure runs 'cpu' or 'cuda' (use `ficco simulate` for sim)")
    if device is None:
        return None
    if under_torchrun():
        raise ValueError(f"the loopback executor ({backend} backend) runs every scenario's ranks as "
                         "virtual ranks in one process; run it without torchrun")
    if backend == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--backend cuda: CUDA is not available here (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda or 'none'}, "
                         f"{torch.cuda.device_count()} device(s) visible); run it on a machine with an "
                         "NVIDIA GPU, or measure with --backend cpu")
    return device
