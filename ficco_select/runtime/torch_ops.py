"""Torch helpers: collective + GEMM ops that pick their schedule and run it.

Drop-in for PyTorch's async tensor-parallel ops (``torch.distributed._symmetric_memory``):

    from ficco_select.runtime.torch_ops import all_gather_matmul, matmul_reduce_scatter
    A, (Y,) = all_gather_matmul(A_shard, [B], gather_dim=0, group_name=pg.group_name)
    Z = matmul_reduce_scatter(Y, B2, "sum", scatter_dim=0, group_name=pg.group_name)

have the signatures and results of ``fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter``; ``all_to_all_matmul`` is the MoE dispatch + expert GEMM.
Each call describes itself as a ``Scenario``, asks the selector (``configure``) for a
schedule and runs it with the executor on the caller's process group.

Choices a caller should know:
- Every rank must run the same schedule: the first decision for a new shape is taken on
  the group's rank 0 and broadcast (one small collective per new shape, then cached).
- What the executor cannot run falls back to PyTorch's own implementation, with the
  decision's reason saying why: a gather along the contraction (last) dim, a scatter dim
  whose size the world size does not divide, dtypes other than fp32/bf16/fp16, a
  ``reduce_op`` other than sum/avg.
- Engines: ``sm`` runs over the group's own backend (a step's transfers as one NCCL group
  on CUDA, gloo point-to-point on CPU); ``dma`` runs over ``executor.peer.PeerCopyComm``:
  copy engines through symmetric-memory staging slots on CUDA (built once per group, at
  the first dma call, on every rank), shared-memory slots on CPU (tests).
- Several ``Bs`` are concatenated into one weight (one gathered A, one GEMM per piece).
- The executor allocates its operator buffers per call; only the dma staging slots persist.
- The two GEMM ops are differentiable (each one's backward is the other op, chosen
  and run the same way); ``all_to_all_matmul``'s backward uses PyTorch's all-to-all.

``last_decision.source``: the selector's ``model``, ``heuristic`` or ``fallback`` (also
when PyTorch's implementation ran), ``pinned`` (``configure(schedule=...)``) or
``explore`` (``configure(explore_every=n)``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed._symmetric_memory as symm_mem
from torch.distributed import distributed_c10d as c10d

from ficco_select.executor.comm import P2PComm
from ficco_select.executor.peer import CudaPeerMemory, HostPeerMemory, NcclComm, PeerCopyComm
from ficco_select.executor.operators import (TOLERANCE, AllGatherGemm, AllToAllGemm, GemmReduceScatter,
                                       relative_error)
from ficco_select.hardware import preset_for_device
from ficco_select.scenario import Scenario, ScenarioError
from ficco_select.schedule import BASELINE, Schedule, candidates, is_legal, parse
from ficco_select.runtime.selector import Decision, Selector
from ficco_select.runtime.telemetry import Telemetry
from ficco_select.runtime.telemetry import from_env as telemetry_from_env

log = logging.getLogger("ficco_select.runtime.torch_ops")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass
class _Config:
    selector: Selector | None = None
    hardware: str | None = None
    telemetry: str | None = None
    group_label: str = "runtime"
    schedule: Schedule | None = None
    """Pinned by the caller (benchmarks, debugging): runs wherever it is legal."""
    explore_every: int = 0
    """Every n-th call of a shape runs another candidate, in turn (0: never)."""


_config = _Config()
_decisions: dict[tuple, tuple[Scenario | None, Decision]] = {}
"""(call shape key, group name) -> the rank-agreed (scenario, decision)."""
_calls: dict[tuple, int] = {}
"""(call shape key, group name) -> calls so far (the same on every rank: they make the same calls)."""
_telemetry: dict[str, Telemetry] = {}
_verified: set[tuple[str, str]] = set()
_dma_comms: dict[tuple[str, str], PeerCopyComm | None] = {}
"""(group name, device) -> the dma comm; its staging slots persist, its transfer counts
match on every rank because every rank runs the same schedules on the group."""
last_decision: Decision | None = None
"""The decision of the latest call in this process (for logging and tests)."""


def configure(*, selector: Selector | str | os.PathLike | None = None, hardware: str | None = None,
              telemetry: str | os.PathLike | None = None, group_label: str | None = None,
              schedule: str | Schedule | None = None, explore_every: int | None = None) -> None:
    """Set the selector (object or exported folder), the hardware preset name, the
    telemetry file, the scenario ``group`` label, pin one schedule (``""`` unpins: the
    decision says ``source="pinned"`` where the schedule is legal, else the selector
    decides), or explore: every ``explore_every``-th call of a shape runs the next of its
    candidates, baseline first (``source="explore"``), so that telemetry times the
    alternatives ``ficco train`` needs on the job's own shapes. Clears the decision cache."""
    if selector is not None:
        _config.selector = selector if isinstance(selector, Selector) else Selector.load(selector)
    if hardware is not None:
        _config.hardware = hardware
    if telemetry is not None:
        _config.telemetry = str(telemetry)
    if group_label is not None:
        _config.group_label = group_label
    if schedule is not None:
        _config.schedule = parse(schedule) if isinstance(schedule, str) and schedule else schedule or None
    if explore_every is not None:
        _config.explore_every = max(0, int(explore_every))
    _decisions.clear()
    _calls.clear()


def reset() -> None:
    """Back to defaults: the exported champion (or the heuristic), detected hardware, no telemetry."""
    global _config, last_decision
    _config = _Config()
    _decisions.clear()
    _calls.clear()
    _telemetry.clear()
    _verified.clear()
    for comm in _dma_comms.values():
        if comm is not None:
            comm.memory.close()
    _dma_comms.clear()
    last_decision = None


def _selector() -> Selector:
    if _config.selector is None:
        _config.selector = Selector.load()
    return _config.selector


def hardware_name(device: torch.device) -> str | None:
    """The hardware preset for tensors on `device`: $FICCO_HARDWARE, cpu, or by GPU name."""
    if _config.hardware or os.environ.get("FICCO_HARDWARE"):
        return _config.hardware or os.environ["FICCO_HARDWARE"]
    if device.type == "cpu":
        return "cpu"
    return preset_for_device(torch.cuda.get_device_name(device))


def _group(group_name) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


# -- deciding ---------------------------------------------------------------------------
def _decide(key: tuple, group: dist.ProcessGroup, make_scenario) -> tuple[Scenario | None, Decision]:
    """The cached, rank-agreed decision for a call shape; `make_scenario` -> Scenario or a reason."""
    global last_decision
    # Keyed by the group's name: holding ProcessGroup objects in a module global would keep
    # gloo's threads alive until interpreter teardown, where they can abort the process.
    key = (key, group.group_name)
    hit = _decisions.get(key)
    if hit is None:
        scenario = decision = None
        if dist.get_rank(group) == 0:
            try:
                scenario = make_scenario()
            except Exception as e:  # noqa: BLE001 - the other ranks wait for this rank's answer
                decision = Decision(BASELINE, "fallback", 0.0, f"not a scenario the executor runs: {e}")
            pinned = _config.schedule
            if decision is None and pinned is not None and is_legal(pinned, scenario, _backend(scenario)):
                decision = Decision(pinned, "pinned", 1.0, "configure(schedule=...)")
            if decision is None:
                decision = _selector().select(scenario)
        # One rank decides so that every rank runs the same schedule.
        box = [(scenario, decision)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        hit = _decisions[key] = box[0]
    if _config.explore_every and hit[0] is not None:
        hit = _explore(key, *hit)
    last_decision = hit[1]
    return hit


def _explore(key: tuple, scenario: Scenario, decision: Decision) -> tuple[Scenario, Decision]:
    # Deterministic in the call count, so every rank explores the same schedule.
    n = _calls[key] = _calls.get(key, 0) + 1
    every = _config.explore_every
    if n % every:
        return scenario, decision
    runnable = candidates(scenario, _backend(scenario))
    pick = runnable[(n // every - 1) % len(runnable)]
    return scenario, Decision(pick, "explore", 0.0, f"exploration: call {n} of this shape")


def _backend(scenario: Scenario) -> str:
    return "cpu" if scenario.hardware == "cpu" else "cuda"


HOST_SLOT_BYTES = 1 << 20
"""Staging slot size of the CPU stand-in of the dma transport (it lives in /dev/shm)."""


def _comm(engine: str, group: dist.ProcessGroup, device: torch.device):
    """The comm that moves `engine`'s bytes on `group`, or None where dma has no transport.

    A dma comm is built once per group, collectively (every rank runs the same decision).
    Building it can fail where symmetric memory is not supported; the group then runs
    dma schedules as their sm twins, with a warning, rather than fail the job.
    """
    if engine == "sm":
        return NcclComm(group) if device.type == "cuda" else P2PComm(group)
    key = (group.group_name, str(device))  # not the group object: see _decisions
    if key not in _dma_comms:
        try:
            if device.type == "cuda":
                memory = CudaPeerMemory(group)
            else:
                memory = HostPeerMemory(group, slot_bytes=HOST_SLOT_BYTES)
            _dma_comms[key] = PeerCopyComm(memory)
        except Exception as e:  # noqa: BLE001 - any failure means: no copy-engine transport
            log.warning("ficco-select: no dma transport on group %s (%s: %s); dma schedules run as "
                        "their sm twins", group.group_name, type(e).__name__, e)
            _dma_comms[key] = None
    return _dma_comms[key]


def _run(op_cls, scenario: Scenario, decision: Decision, group: dist.ProcessGroup, reference, **inputs):
    """Run the decided schedule with the executor; telemetry (and a first-call check) if on."""
    global last_decision
    schedule = decision.schedule
    device = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device
    comm = _comm(schedule.engine, group, device)
    if comm is None:  # the decision as it really runs (telemetry records this schedule)
        schedule = dataclasses.replace(schedule, engine="sm")
        comm = _comm("sm", group, device)
        last_decision = dataclasses.replace(decision, schedule=schedule,
                                            reason=f"{decision.schedule.name} as its sm twin: no dma transport")
    op = op_cls(scenario, comm, device=device, **inputs)
    rec = _recorder()
    if rec is None:
        return op.run(schedule), op
    call = rec.next_call(scenario.scenario_id, schedule.name)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = op.run(schedule)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    verified = err = None
    if (scenario.scenario_id, schedule.name) not in _verified:
        _verified.add((scenario.scenario_id, schedule.name))
        err = relative_error(out, reference().float())
        verified = err <= TOLERANCE[scenario.dtype]
        if not verified:
            log.warning("ficco-select: schedule %s gave a wrong result on %s (rel. error %.2e)",
                        schedule.name, scenario.scenario_id, err)
    rec.record({**scenario.as_record(), "scenario_id": scenario.scenario_id}, schedule=schedule.name,
               source=decision.source, call=call, time_s=elapsed, verified=verified,
               rel_error=None if err is None or math.isinf(err) else err, backend=device.type)
    return out, op


def _recorder() -> Telemetry | None:
    path = _config.telemetry or os.environ.get("FICCO_TELEMETRY")
    if not path:
        return None
    rank = dist.get_rank()
    key = f"{path}@{rank}"
    if key not in _telemetry:
        _telemetry[key] = Telemetry(path, rank) if _config.telemetry else telemetry_from_env(rank)
    return _telemetry[key]


def _scenario(op: str, m: int, n: int, k: int, dtype: torch.dtype, P: int, device: torch.device,
              imbalance: float = 1.0) -> Scenario:
    if dtype not in DTYPE_NAMES:
        raise ScenarioError(f"column 'dtype': {dtype} is not one of {', '.join(DTYPE_NAMES.values())}")
    hw = hardware_name(device)
    if hw is None:
        raise ScenarioError(f"column 'hardware': no preset for {torch.cuda.get_device_name(device)}; "
                            "set $FICCO_HARDWARE")
    return Scenario(group=_config.group_label, op=op, m=m, n=n, k=k, dtype=DTYPE_NAMES[dtype],
                    world_size=P, hardware=hw, imbalance=imbalance)


def _fallback(reason: str) -> None:
    global last_decision
    last_decision = Decision(BASELINE, "fallback", 0.0, reason)


# -- the ops ----------------------------------------------------------------------------
def all_gather_matmul(A_shard: torch.Tensor, Bs: Sequence[torch.Tensor], gather_dim: int, group_name, *,
                      return_A: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather A_shard along `gather_dim`, multiply the result by every B.

    Same signature and results as ``fused_all_gather_matmul``: returns (A or None, [A @ B]).
    Differentiable: the gradient of A_shard is itself a matmul + reduce-scatter.
    """
    if _needs_grad(A_shard, *Bs):
        A, *outs = _AllGatherMatmul.apply(A_shard, gather_dim, _group(group_name), *Bs)
        return (A if return_A else None), outs
    return _all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=return_A)


def _all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A):
    group = _group(group_name)
    P = dist.get_world_size(group)
    gather_dim = gather_dim % A_shard.ndim
    if gather_dim == A_shard.ndim - 1 or not Bs:
        _fallback("gather along the contraction dim: PyTorch's implementation")
        return symm_mem._fused_all_gather_matmul_fallback(A_shard, list(Bs), gather_dim, group.group_name,
                                                          return_A=return_A)
    # Gathered rows in rank order, as the executor's row all-gather produces them.
    A2 = A_shard.movedim(gather_dim, 0)
    lead = A2.shape[:-1]
    A2 = A2.reshape(-1, A2.shape[-1])
    widths = [B.shape[-1] for B in Bs]
    key = ("ag", tuple(A2.shape), sum(widths), A_shard.dtype, A_shard.device.type)
    scenario, decision = _decide(key, group, lambda: _scenario(
        "ag_gemm", P * A2.shape[0], P * sum(widths), A2.shape[1], A_shard.dtype, P, A_shard.device))
    if scenario is None:
        return symm_mem._fused_all_gather_matmul_fallback(A_shard, list(Bs), gather_dim, group.group_name,
                                                          return_A=return_A)
    W = Bs[0] if len(Bs) == 1 else torch.cat(list(Bs), dim=1)

    def reference():
        return symm_mem._fused_all_gather_matmul_fallback(A2, [W], 0, group.group_name, return_A=False)[1][0]

    out, op = _run(AllGatherGemm, scenario, decision, group, reference, A_shard=A2, W=W)
    outs = [o.reshape(P * lead[0], *lead[1:], w).movedim(0, gather_dim)
            for o, w in zip(out.split(widths, dim=1), widths)]
    A = op.A_full.reshape(P * lead[0], *lead[1:], A2.shape[1]).movedim(0, gather_dim) if return_A else None
    return A, outs


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                          group_name) -> torch.Tensor:
    """Reduce-scatter A @ B along `scatter_dim` (``sum`` or ``avg``).

    Same signature and result as ``fused_matmul_reduce_scatter``. Differentiable: the
    gradient of A is an all-gather + matmul.
    """
    if _needs_grad(A, B):
        return _MatmulReduceScatter.apply(A, B, reduce_op, scatter_dim, _group(group_name))
    return _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)


def _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    group = _group(group_name)
    P = dist.get_world_size(group)
    scatter_dim = scatter_dim % A.ndim
    extent = B.shape[-1] if scatter_dim == A.ndim - 1 else A.shape[scatter_dim]
    if reduce_op not in ("sum", "avg") or extent % P:
        _fallback(f"reduce_op {reduce_op!r} / scatter extent {extent} over {P} ranks: PyTorch's implementation")
        return symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, group.group_name)
    if scatter_dim == A.ndim - 1:
        # Scatter the output's columns: (A @ B)^T = B^T @ A^T has them as rows.
        rows_lead, A2 = A.shape[:-1], A.reshape(-1, A.shape[-1])
        left, right = B.t(), A2.t()
    else:
        At = A.movedim(scatter_dim, 0)
        rows_lead = At.shape[:-1]
        left, right = At.reshape(-1, At.shape[-1]), B
    key = ("rs", tuple(left.shape), right.shape[1], scatter_dim == A.ndim - 1, A.dtype, A.device.type)
    scenario, decision = _decide(key, group, lambda: _scenario(
        "gemm_rs", left.shape[0], right.shape[1], P * left.shape[1], A.dtype, P, A.device))
    if scenario is None:
        return symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, group.group_name)

    def reference():
        return symm_mem._fused_matmul_reduce_scatter_fallback(left, right, "sum", 0, group.group_name)

    out, _ = _run(GemmReduceScatter, scenario, decision, group, reference, A=left, W=right, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    if scatter_dim == A.ndim - 1:
        return out.t().reshape(*rows_lead, out.shape[0])
    return out.reshape(rows_lead[0] // P, *rows_lead[1:], out.shape[1]).movedim(0, scatter_dim)


# -- gradients: each op's backward is the other op, chosen and run the same way -----------
def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    """(A, *[A @ B]) with A = all_gather(A_shard, gather_dim)."""

    @staticmethod
    def forward(ctx, A_shard, gather_dim, group, *Bs):
        A, outs = _all_gather_matmul(A_shard, Bs, gather_dim, group, return_A=True)
        ctx.set_materialize_grads(False)  # an unused A gets None, not zeros: the fused backward
        ctx.save_for_backward(A, *Bs)
        ctx.gather_dim, ctx.group = gather_dim, group
        return (A, *outs)

    @staticmethod
    def backward(ctx, dA, *dYs):
        A, *Bs = ctx.saved_tensors
        dYs = [A.new_zeros(*A.shape[:-1], B.shape[1]) if d is None else d for d, B in zip(dYs, Bs)]
        dY, W = torch.cat(dYs, dim=-1), torch.cat(Bs, dim=1)
        # d(A_shard) = reduce_scatter(dY @ W^T + dA): the ranks' contributions to my shard.
        if dA is None:
            dA_shard = _matmul_reduce_scatter(dY, W.t(), "sum", ctx.gather_dim, ctx.group)
        else:
            dA_shard = funcol.wait_tensor(funcol.reduce_scatter_single(
                dY @ W.t() + dA, "sum", ctx.gather_dim % A.ndim, ctx.group))
        dBs = [_rows(A).t() @ _rows(d) for d in dYs]
        return (dA_shard, None, None, *dBs)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, reduce_op, scatter_dim, group):
        ctx.save_for_backward(A, B)
        ctx.reduce_op, ctx.scatter_dim, ctx.group = reduce_op, scatter_dim, group
        return _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group)

    @staticmethod
    def backward(ctx, dY):
        A, B = ctx.saved_tensors
        if ctx.reduce_op == "avg":
            dY = dY / dist.get_world_size(ctx.group)
        # Every rank's A @ B fed my block: gather the blocks' gradients, then one GEMM.
        dY_full, (dA,) = _all_gather_matmul(dY.contiguous(), [B.t()], ctx.scatter_dim, ctx.group, return_A=True)
        dB = _rows(A).t() @ _rows(dY_full)
        return dA, dB, None, None, None


def all_to_all_matmul(X: torch.Tensor, W: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group_name) -> torch.Tensor:
    """MoE dispatch then the local expert: ``all_to_all_single(X) @ W``.

    X (sum(input_split_sizes), k) holds the tokens this rank routes, grouped by
    destination rank; returns (sum(output_split_sizes), n) grouped by source rank.
    Token counts differ per rank and per step, so the scenario is built from every
    rank's load (one small all-gather per call): m = mean tokens per expert, rounded
    up to a quarter-octave so that a drifting load reuses its decision, and imbalance =
    max load / mean load, in steps of 1/8. Differentiable: dX is the expert's input
    gradient sent back with the reverse all-to-all (PyTorch's; not overlapped).
    """
    splits = (tuple(output_split_sizes), tuple(input_split_sizes))
    if _needs_grad(X, W):
        return _AllToAllMatmul.apply(X, W, splits, _group(group_name))
    return _all_to_all_matmul(X, W, splits, group_name)[0]


def _all_to_all_matmul(X, W, splits, group_name) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_recv @ W, X_recv)."""
    output_split_sizes, input_split_sizes = splits
    group = _group(group_name)
    P = dist.get_world_size(group)
    loads = torch.zeros(P, dtype=torch.int64, device=X.device)
    dist.all_gather_single(loads, torch.tensor([sum(output_split_sizes)], dtype=torch.int64, device=X.device),
                           group=group)
    mean = loads.double().mean().item()
    m = math.ceil(2 ** (math.ceil(4 * math.log2(mean)) / 4)) if mean >= 1 else 0
    imbalance = min(float(P), math.ceil(8 * loads.max().item() / mean) / 8) if mean > 0 else 1.0
    key = ("a2a", m, imbalance, X.shape[1], W.shape[1], X.dtype, X.device.type)
    scenario, decision = _decide(key, group, lambda: _scenario(
        "a2a_gemm", m, W.shape[1], X.shape[1], X.dtype, P, X.device, imbalance=imbalance))

    def received():
        recv = X.new_empty(sum(output_split_sizes), X.shape[1])
        dist.all_to_all_single(recv, X.contiguous(), list(output_split_sizes), list(input_split_sizes), group=group)
        return recv

    if scenario is None:
        recv = received()
        return recv @ W, recv
    out, op = _run(AllToAllGemm, scenario, decision, group, lambda: received() @ W, X=X, W=W,
                   send_sizes=list(input_split_sizes), recv_sizes=list(output_split_sizes))
    # Overlapped schedules read the local chunk from X in place: complete X_recv.
    op.X_recv[op.recv_rows(op.r)] = op.send_chunk(op.r)
    return out, op.X_recv


class _AllToAllMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, splits, group):
        out, X_recv = _all_to_all_matmul(X, W, splits, group)
        ctx.save_for_backward(X_recv, W)
        ctx.splits, ctx.group = splits, group
        return out

    @staticmethod
    def backward(ctx, dOut):
        X_recv, W = ctx.saved_tensors
        output_split_sizes, input_split_sizes = ctx.splits
        dX_recv = dOut @ W.t()
        dX = funcol.wait_tensor(funcol.all_to_all_single(  # back to the ranks that routed the tokens
            dX_recv.contiguous(), list(input_split_sizes), list(output_split_sizes), ctx.group))
        return dX, X_recv.t() @ dOut, None, None
