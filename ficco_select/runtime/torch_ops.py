"""Torch helpers: collective + GEMM ops that pick their schedule and run it.

Drop-in for PyTorch's async tensor-parallel ops (``torch.distributed._symmetric_memory``):

    from ficco_select.runtime.torch_ops import all_gather_matmul, matmul_reduce_scatter
    A, (Y,) = all_gather_matmul(A_shard, [B], gather_dim=0, group_name=pg.group_name)
    Z = matmul_reduce_scatter(Y, B2, "sum", scatter_dim=0, group_name=pg.group_name)

have the signatures and results of ``fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter``. ``matmul_all_reduce`` is the row-parallel linear without
sequence parallelism (PyTorch has no fused op for it: its plain form is ``mm`` then
``dist.all_reduce``); ``all_to_all_matmul`` is the MoE dispatch + expert GEMM and
``matmul_all_to_all`` the expert GEMM + combine, its mirror.
Each call describes itself as a ``Scenario``, asks the selector (``configure``) for a
schedule and runs it with the executor on the caller's process group.

Choices a caller should know:
- Every rank must run the same schedule: the first decision for a new shape is taken on
  the group's rank 0 and broadcast (one small collective per new shape, then cached).
- The baseline decision (``none``) runs as it was measured, so that a decision means at
  run time what it meant in the labels: ``matmul_all_reduce``'s is PyTorch's ``mm`` then
  ``dist.all_reduce`` (the executor's ``gemm_ar`` baseline is the backend's all-reduce);
  the others' is the executor's (a ring of the group's point-to-point transfers for the
  all-gather and reduce-scatter, every peer at once for the MoE ops), level with PyTorch's
  own ops on gloo in ``benchmarks/e2e_tp.py``.
- What the executor cannot run falls back to PyTorch's own implementation, with the
  decision's reason saying why: a gather along the contraction (last) dim, a scatter dim
  whose size the world size does not divide, dtypes other than fp32/bf16/fp16, a
  ``reduce_op`` other than sum/avg.
- Engines: ``sm`` runs over the group's own backend (a step's transfers as one NCCL group
  on CUDA, gloo point-to-point on CPU); ``dma`` runs over ``executor.peer.PeerCopyComm``:
  copy engines through symmetric-memory staging slots on CUDA (built once per group, at
  the first dma call, on every rank), shared-memory slots on CPU (tests).
- Every rank must pass the same call: each call first all-gathers every rank's description
  of it (shapes, dtype, dims, reduce op; one tiny collective on the host: the group's CPU
  backend, or a gloo group of its ranks made at its first call, so the host never waits for
  the GPU; about 0.5 ms on this 2-core machine's gloo; ``configure(check_calls=False)`` or
  ``FICCO_CHECK_CALLS=0`` skips it for the job, PyTorch's own contract; ``run_check=False``
  for one call and its backward, where the caller vouches for its shapes: DTensor's styles,
  the compile pass), and a call the ranks disagree on raises ValueError on every rank,
  naming the op, the rank and both shapes (PyTorch's fallbacks check nothing: gloo aborts
  one rank and hands another garbage rows). Per call, not per shape: a rank repeating a
  shape it has seen while another passes a new one is refused too. The MoE ops check in the
  exchange of token counts they make anyway: the same k, n and dtype on every rank, and each
  rank's ``output_split_sizes`` what the others' ``input_split_sizes`` send it.
- ``matmul_all_reduce`` with a row count the world size does not divide runs PyTorch's
  plain form (the executor's all-reduce schedules split the rows into P blocks).
- Several ``Bs`` are concatenated into one weight (one gathered A, one GEMM per piece).
- The executor allocates its operator buffers per call; only the dma staging slots persist.
- Every op is differentiable, and each one's backward is its mirror op, chosen and run the
  same way: all-gather matmul <-> matmul reduce-scatter, dispatch <-> combine.
  ``matmul_all_reduce``'s backward has no collective (Megatron's row-parallel linear: the
  output is replicated, so every rank holds the whole gradient of it).

``last_decision.source``: the selector's ``model``, ``heuristic`` or ``fallback`` (also
when PyTorch's implementation ran), ``pinned`` (``configure(schedule=...)``) or
``explore`` (``configure(explore_every=n)``).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed._symmetric_memory as symm_mem

from ficco_select.executor.operators import AllGatherGemm, AllToAllGemm, GemmAllReduce, GemmAllToAll, GemmReduceScatter
from ficco_select.runtime import dispatch
from ficco_select.runtime.dispatch import (
    configure,
    decide,
    fall_back,
    hardware_name,
    reset,
    resolve_group,
    run_decided,
    run_native,
    runs_natively,
    scenario_for,
)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_to_all_matmul",
           "matmul_all_to_all", "configure", "reset", "hardware_name", "prepare_all_gather_matmul",
           "prepare_matmul_reduce_scatter", "prepare_matmul_all_reduce"]


def __getattr__(name: str):
    # ``torch_ops.last_decision``: the latest call's decision, read from the shared state.
    if name == "last_decision":
        return dispatch.last_decision()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the ops ----------------------------------------------------------------------------
def all_gather_matmul(A_shard: torch.Tensor, Bs: Sequence[torch.Tensor], gather_dim: int, group_name, *,
                      return_A: bool = True, run_check: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather A_shard along `gather_dim`, multiply the result by every B.

    Same signature and results as ``fused_all_gather_matmul``: returns (A or None, [A @ B]).
    Differentiable: the gradient of A_shard is itself a matmul + reduce-scatter.
    ``run_check=False``: the caller vouches that every rank passes the same call (see the
    module docstring), forward and backward.
    """
    if _needs_grad(A_shard, *Bs):
        A, *outs = _AllGatherMatmul.apply(A_shard, gather_dim, resolve_group(group_name), run_check, *Bs)
        return (A if return_A else None), outs
    return _all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=return_A, run_check=run_check)


def _all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A, run_check=True):
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    gather_dim = gather_dim % A_shard.ndim
    _same_call_on_every_rank("all_gather_matmul", group, run_check,
                             f"A_shard {_tensor(A_shard)} gathered along dim {gather_dim} "
                             f"@ Bs {', '.join(map(_tensor, Bs))}")
    if gather_dim == A_shard.ndim - 1 or not Bs:
        fall_back("gather along the contraction dim: PyTorch's implementation")
        return symm_mem._fused_all_gather_matmul_fallback(A_shard, list(Bs), gather_dim, group.group_name,
                                                          return_A=return_A)
    # Gathered rows in rank order, as the executor's row all-gather produces them.
    A2 = A_shard.movedim(gather_dim, 0)
    lead = A2.shape[:-1]
    A2 = A2.reshape(-1, A2.shape[-1])
    widths = [B.shape[-1] for B in Bs]
    key = ("ag", tuple(A2.shape), sum(widths), A_shard.dtype, A_shard.device.type)
    scenario, decision = decide(key, group, lambda: scenario_for(
        "ag_gemm", P * A2.shape[0], P * sum(widths), A2.shape[1], A_shard.dtype, P, A_shard.device),
        layer=_ag_layer(sum(widths), A_shard.dtype, A_shard.device.type, A2.shape[1]), m=P * A2.shape[0])
    if scenario is None:
        return symm_mem._fused_all_gather_matmul_fallback(A_shard, list(Bs), gather_dim, group.group_name,
                                                          return_A=return_A)
    W = Bs[0] if len(Bs) == 1 else torch.cat(list(Bs), dim=1)

    def reference():
        return symm_mem._fused_all_gather_matmul_fallback(A2, [W], 0, group.group_name, return_A=False)[1][0]

    out, op = run_decided(AllGatherGemm, scenario, decision, group, reference, A_shard=A2, W=W)
    outs = [o.reshape(P * lead[0], *lead[1:], w).movedim(0, gather_dim)
            for o, w in zip(out.split(widths, dim=1), widths)]
    A = op.A_full.reshape(P * lead[0], *lead[1:], A2.shape[1]).movedim(0, gather_dim) if return_A else None
    return A, outs


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                          group_name, *, run_check: bool = True) -> torch.Tensor:
    """Reduce-scatter A @ B along `scatter_dim` (``sum`` or ``avg``).

    Same signature and result as ``fused_matmul_reduce_scatter``. Differentiable: the
    gradient of A is an all-gather + matmul. ``run_check``: as ``all_gather_matmul``'s.
    """
    if _needs_grad(A, B):
        return _MatmulReduceScatter.apply(A, B, reduce_op, scatter_dim, resolve_group(group_name), run_check)
    return _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=run_check)


def _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, *, run_check=True):
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    scatter_dim = scatter_dim % A.ndim
    _same_call_on_every_rank("matmul_reduce_scatter", group, run_check,
                             f"A {_tensor(A)} @ B {_tensor(B)}, {reduce_op} scattered along dim {scatter_dim}")
    extent = B.shape[-1] if scatter_dim == A.ndim - 1 else A.shape[scatter_dim]
    if reduce_op not in ("sum", "avg") or extent % P:
        fall_back(f"reduce_op {reduce_op!r} / scatter extent {extent} over {P} ranks: PyTorch's implementation")
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
    scenario, decision = decide(key, group, lambda: scenario_for(
        "gemm_rs", left.shape[0], right.shape[1], P * left.shape[1], A.dtype, P, A.device),
        layer=_rs_layer(right.shape[1], scatter_dim == A.ndim - 1, A.dtype, A.device.type, left.shape[1]),
        m=left.shape[0])
    if scenario is None:
        return symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, group.group_name)

    def reference():
        return symm_mem._fused_matmul_reduce_scatter_fallback(left, right, "sum", 0, group.group_name)

    out, _ = run_decided(GemmReduceScatter, scenario, decision, group, reference, A=left, W=right, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    if scatter_dim == A.ndim - 1:
        return out.t().reshape(*rows_lead, out.shape[0])
    return out.reshape(rows_lead[0] // P, *rows_lead[1:], out.shape[1]).movedim(0, scatter_dim)


def matmul_all_reduce(A: torch.Tensor, B: torch.Tensor, reduce_op: str = "sum", group_name=None, *,
                      run_check: bool = True) -> torch.Tensor:
    """All-reduce A @ B over the group (``sum`` or ``avg``): every rank gets the whole result.

    A (..., k_local) holds this rank's slice of the contraction, B (k_local, n) the matching
    rows of the weight; returns (..., n). The result equals ``A @ B`` then
    ``dist.all_reduce``. Differentiable as the row-parallel linear without sequence
    parallelism: dA = dY @ B^T and dB = A^T @ dY, with no collective (the output is
    replicated, so every rank's dY is the whole gradient). ``run_check``: as
    ``all_gather_matmul``'s.
    """
    if _needs_grad(A, B):
        return _MatmulAllReduce.apply(A, B, reduce_op, resolve_group(group_name), run_check)
    return _matmul_all_reduce(A, B, reduce_op, group_name, run_check=run_check)


def _matmul_all_reduce(A, B, reduce_op, group_name, *, run_check=True):
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    _same_call_on_every_rank("matmul_all_reduce", group, run_check,
                             f"A {_tensor(A)} @ B {_tensor(B)}, {reduce_op}")
    lead, A2 = A.shape[:-1], _rows(A)
    rows, n = A2.shape[0], B.shape[-1]

    def plain():  # PyTorch's form, in the caller's dtype
        Y = A2 @ B
        dist.all_reduce(Y, group=group)
        return Y

    if reduce_op not in ("sum", "avg") or rows % P or rows == 0:
        fall_back(f"reduce_op {reduce_op!r} / {rows} rows over {P} ranks: PyTorch's mm + all_reduce")
        out = plain()
    else:
        key = ("ar", tuple(A2.shape), n, A.dtype, A.device.type)
        scenario, decision = decide(key, group, lambda: scenario_for(
            "gemm_ar", rows, n, P * A2.shape[1], A.dtype, P, A.device),
            layer=_ar_layer(n, A.dtype, A.device.type, A2.shape[1]), m=rows)
        if scenario is None or runs_natively(decision):
            out = run_native(scenario, decision, A.device, plain)
        else:
            out, _ = run_decided(GemmAllReduce, scenario, decision, group, plain, A=A2, W=B, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    return out.reshape(*lead, n)


# -- every rank passes the same call --------------------------------------------------------
CALL_BYTES = 256
"""Room for one rank's description of its call in the per-call check (any real call fits)."""


def _tensor(t: torch.Tensor) -> str:
    """A tensor as a call's description names it: its shape and dtype, ``(4, 8) float32``."""
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _same_call_on_every_rank(op: str, group: dist.ProcessGroup, run_check: bool, call: str) -> None:
    """ValueError on every rank of `group` where a rank describes its call otherwise than
    rank 0 (the ranks' shapes must match for the collective to mean anything). Skipped
    where the caller vouches for the call (`run_check` False) and under
    ``configure(check_calls=False)``."""
    if not (run_check and dispatch.checks_calls()):
        return
    every = _gathered(group, call, CALL_BYTES)
    if every[0, 0] and bool((every == every[0]).all()):  # the common case: one comparison, nothing decoded
        return
    calls = _texts(every)
    odd = next(r for r, c in enumerate(calls) if c != calls[0] or c is None)
    raise ValueError(f"{op}: rank {odd} passed {calls[odd] or 'a call too long to compare'}, rank 0 passed "
                     f"{calls[0] or 'a call too long to compare'}; every rank of the group must pass the same "
                     "shapes, dtype and dims")


def _gathered(group: dist.ProcessGroup, mine: str, size: int) -> torch.Tensor:
    """Every rank's `mine` as a (ranks, 1 + size) uint8 CPU tensor in group rank order, from
    one all-gather: a row is a flag (0: the text did not fit, so that every rank sees the
    same and raises alike), then the text's bytes, zero-padded. On the host
    (``_host_group``): no CUDA stream waits for it."""
    data = mine.encode()
    row = b"\1" + data.ljust(size, b"\0") if len(data) <= size else bytes(1 + size)
    host = _host_group(group)
    every = torch.empty(dist.get_world_size(host) * (1 + size), dtype=torch.uint8)
    dist.all_gather_single(every, torch.frombuffer(bytearray(row), dtype=torch.uint8), group=host)
    return every.view(-1, 1 + size)


_HOST_GROUPS: dict[str, dist.ProcessGroup] = {}
_HOST_GROUPS_LOCK = threading.Lock()


def _host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Where the per-call check runs: `group` itself if it has a CPU backend, else a gloo
    group of the same ranks, made once, at the group's first call (every rank of it makes
    that call; ``use_local_synchronization``: no other rank takes part). A check on an
    NCCL-only group's device would make the host wait for the GPU at every call."""
    if torch.device("cpu") in group._device_types:
        return group
    with _HOST_GROUPS_LOCK:
        if group.group_name not in _HOST_GROUPS:
            _HOST_GROUPS[group.group_name] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                            use_local_synchronization=True)
        return _HOST_GROUPS[group.group_name]


def _texts(every: torch.Tensor) -> list[str | None]:
    """The texts of ``_gathered``'s rows (None where one did not fit)."""
    return [row[1:].rstrip(b"\0").decode() if row[0] else None
            for row in map(bytes, every.numpy())]


# -- layers: a call's shape without its token count -----------------------------------------
TABLE_ROWS = 64
"""Rows per rank of the scenario a prepared layer's table is built from (the table covers every m)."""


def _ag_layer(n_local: int, dtype: torch.dtype, device_type: str, k: int) -> tuple:
    """An all-gather matmul's layer: A_shard (rows, k) @ B (k, n_local), any rows."""
    return ("ag", n_local, dtype, device_type, k)


def _rs_layer(n: int, scatter_last: bool, dtype: torch.dtype, device_type: str, k_local: int) -> tuple:
    """A matmul reduce-scatter's layer: A (rows, k_local) @ B (k_local, n), any rows."""
    return ("rs", n, scatter_last, dtype, device_type, k_local)


def _ar_layer(n: int, dtype: torch.dtype, device_type: str, k_local: int) -> tuple:
    """A matmul all-reduce's layer: A (rows, k_local) @ B (k_local, n), any rows."""
    return ("ar", n, dtype, device_type, k_local)


def prepare_all_gather_matmul(k: int, n_local: int, dtype: torch.dtype, device: torch.device, group_name) -> bool:
    """Build now the decision table of ``all_gather_matmul`` calls of A_shard (rows, k) @ B
    (k, n_local) along dim 0, for every row count: such a call then decides by a lookup,
    with no collective and no model, from its first step on. Every rank of the group calls
    it, in the same order (rank 0 builds the table and shares it). Whether a table was built."""
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    return dispatch.prepare_layer(_ag_layer(n_local, dtype, device.type, k), group, lambda: scenario_for(
        "ag_gemm", P * TABLE_ROWS, P * n_local, k, dtype, P, device)) is not None


def prepare_matmul_reduce_scatter(k_local: int, n: int, dtype: torch.dtype, device: torch.device,
                                  group_name) -> bool:
    """``prepare_all_gather_matmul`` for ``matmul_reduce_scatter`` calls of A (rows, k_local)
    @ B (k_local, n) scattered along dim 0."""
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    return dispatch.prepare_layer(_rs_layer(n, False, dtype, device.type, k_local), group, lambda: scenario_for(
        "gemm_rs", P * TABLE_ROWS, n, P * k_local, dtype, P, device)) is not None


def prepare_matmul_all_reduce(k_local: int, n: int, dtype: torch.dtype, device: torch.device, group_name) -> bool:
    """``prepare_all_gather_matmul`` for ``matmul_all_reduce`` calls of A (rows, k_local) @ B (k_local, n)."""
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    return dispatch.prepare_layer(_ar_layer(n, dtype, device.type, k_local), group, lambda: scenario_for(
        "gemm_ar", P * TABLE_ROWS, n, P * k_local, dtype, P, device)) is not None


# -- gradients: each op's backward is its mirror op, chosen and run the same way -----------
def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    """(A, *[A @ B]) with A = all_gather(A_shard, gather_dim)."""

    @staticmethod
    def forward(ctx, A_shard, gather_dim, group, run_check, *Bs):
        A, outs = _all_gather_matmul(A_shard, Bs, gather_dim, group, return_A=True, run_check=run_check)
        ctx.set_materialize_grads(False)  # an unused A gets None, not zeros: the fused backward
        ctx.save_for_backward(A, *Bs)
        ctx.gather_dim, ctx.group, ctx.run_check = gather_dim, group, run_check
        return (A, *outs)

    @staticmethod
    def backward(ctx, dA, *dYs):
        A, *Bs = ctx.saved_tensors
        dYs = [A.new_zeros(*A.shape[:-1], B.shape[1]) if d is None else d for d, B in zip(dYs, Bs)]
        dY, W = torch.cat(dYs, dim=-1), torch.cat(Bs, dim=1)
        # d(A_shard) = reduce_scatter(dY @ W^T + dA): the ranks' contributions to my shard.
        if dA is None:
            dA_shard = _matmul_reduce_scatter(dY, W.t(), "sum", ctx.gather_dim, ctx.group, run_check=ctx.run_check)
        else:
            dA_shard = funcol.wait_tensor(funcol.reduce_scatter_single(
                dY @ W.t() + dA, "sum", ctx.gather_dim % A.ndim, ctx.group))
        dBs = [_rows(A).t() @ _rows(d) for d in dYs]
        return (dA_shard, None, None, None, *dBs)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, reduce_op, scatter_dim, group, run_check):
        ctx.save_for_backward(A, B)
        ctx.reduce_op, ctx.scatter_dim, ctx.group, ctx.run_check = reduce_op, scatter_dim, group, run_check
        return _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group, run_check=run_check)

    @staticmethod
    def backward(ctx, dY):
        A, B = ctx.saved_tensors
        if ctx.reduce_op == "avg":
            dY = dY / dist.get_world_size(ctx.group)
        # Every rank's A @ B fed my block: gather the blocks' gradients, then one GEMM.
        dY_full, (dA,) = _all_gather_matmul(dY.contiguous(), [B.t()], ctx.scatter_dim, ctx.group, return_A=True,
                                            run_check=ctx.run_check)
        dB = _rows(A).t() @ _rows(dY_full)
        return dA, dB, None, None, None, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, reduce_op, group, run_check):
        ctx.save_for_backward(A, B)
        ctx.reduce_op, ctx.group = reduce_op, group
        return _matmul_all_reduce(A, B, reduce_op, group, run_check=run_check)

    @staticmethod
    def backward(ctx, dY):
        A, B = ctx.saved_tensors
        if ctx.reduce_op == "avg":
            dY = dY / dist.get_world_size(ctx.group)
        return dY @ B.t(), _rows(A).t() @ _rows(dY), None, None, None


def all_to_all_matmul(X: torch.Tensor, W: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group_name) -> torch.Tensor:
    """MoE dispatch then the local expert: ``all_to_all_single(X) @ W``.

    X (sum(input_split_sizes), k) holds the tokens this rank routes, grouped by
    destination rank; returns (sum(output_split_sizes), n) grouped by source rank. The
    scenario comes from every rank's load (``_expert_load``). Differentiable: its backward
    is the combine (``matmul_all_to_all``: dX = all_to_all(dOut @ W^T), back to the ranks
    that routed the tokens), chosen and run the same way.
    """
    splits = (tuple(output_split_sizes), tuple(input_split_sizes))
    if _needs_grad(X, W):
        return _AllToAllMatmul.apply(X, W, splits, resolve_group(group_name))
    return _all_to_all_matmul(X, W, splits, group_name)[0]


def matmul_all_to_all(X: torch.Tensor, W: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group_name) -> torch.Tensor:
    """The local expert then the MoE combine: ``all_to_all_single(X @ W)``.

    X (sum(input_split_sizes), k) holds the tokens this expert received, grouped by source
    rank (``all_to_all_matmul``'s received layout); input_split_sizes[q] rows go back to
    rank q. Returns (sum(output_split_sizes), n): the answers for the tokens this rank
    routed, grouped by expert. Differentiable: its backward is the dispatch
    (``all_to_all_matmul`` of dOut by W^T, the splits swapped), chosen and run the same way.
    """
    splits = (tuple(output_split_sizes), tuple(input_split_sizes))
    if _needs_grad(X, W):
        return _MatmulAllToAll.apply(X, W, splits, resolve_group(group_name))
    return _matmul_all_to_all(X, W, splits, group_name)


def _routing(op: str, X: torch.Tensor, W: torch.Tensor, splits, group: dist.ProcessGroup) -> list[dict]:
    """Every rank's side of a MoE call (X's rows and shapes, its splits), from one small
    all-gather, in group rank order. ValueError on every rank where the ranks disagree:
    another k, n or dtype, a split list that is not one entry per rank, a rank whose
    ``input_split_sizes`` do not add up to X's rows, or a rank expecting rows
    (``output_split_sizes``) that another does not send it (its ``input_split_sizes``)."""
    output_split_sizes, input_split_sizes = splits
    P = dist.get_world_size(group)
    mine = {"call": f"X {_tensor(X)} @ W {_tensor(W)}", "same": [X.shape[-1], *W.shape, str(X.dtype), str(W.dtype)],
            "rows": X.shape[0], "recv": list(map(int, output_split_sizes)), "send": list(map(int, input_split_sizes))}
    texts = _texts(_gathered(group, json.dumps(mine), CALL_BYTES + 48 * P))
    if None in texts:
        raise ValueError(f"{op}: rank {texts.index(None)} passed a call too long to compare "
                         "(split lists of one entry per rank expected)")
    every = [json.loads(t) for t in texts]
    for r, side in enumerate(every):
        if side["same"] != every[0]["same"]:
            raise ValueError(f"{op}: rank {r} passed {side['call']}, rank 0 passed {every[0]['call']}; every rank "
                             "of the group must pass the same k, n and dtype (X's rows may differ)")
        if len(side["recv"]) != P or len(side["send"]) != P:
            raise ValueError(f"{op}: rank {r} passed {len(side['recv'])} output and {len(side['send'])} input split "
                             f"sizes; one per rank of the group ({P})")
        if sum(side["send"]) != side["rows"]:
            raise ValueError(f"{op}: rank {r}'s input_split_sizes {side['send']} add up to {sum(side['send'])}, "
                             f"its X has {side['rows']} rows")
    for r, q in itertools.product(range(P), range(P)):
        if every[r]["recv"][q] != every[q]["send"][r]:
            raise ValueError(f"{op}: rank {r} expects {every[r]['recv'][q]} rows from rank {q} (output_split_sizes), "
                             f"rank {q} sends it {every[q]['send'][r]} (input_split_sizes)")
    return every


def _expert_load(loads: Sequence[int]) -> tuple[int, float]:
    """(m, imbalance) of a MoE call from every expert's token count.

    Token counts differ per rank and per step: m = mean tokens per expert, rounded up to a
    quarter-octave so that a drifting load reuses its decision, and imbalance = max load /
    mean load, in steps of 1/8.
    """
    P = len(loads)
    mean = sum(loads) / P
    m = math.ceil(2 ** (math.ceil(4 * math.log2(mean)) / 4)) if mean >= 1 else 0
    imbalance = min(float(P), math.ceil(8 * max(loads) / mean) / 8) if mean > 0 else 1.0
    return m, imbalance


def _all_to_all_matmul(X, W, splits, group_name) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_recv @ W, X_recv)."""
    output_split_sizes, input_split_sizes = splits
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    every = _routing("all_to_all_matmul", X, W, splits, group)
    m, imbalance = _expert_load([sum(side["recv"]) for side in every])
    key = ("a2a", m, imbalance, X.shape[1], W.shape[1], X.dtype, X.device.type)
    scenario, decision = decide(key, group, lambda: scenario_for(
        "a2a_gemm", m, W.shape[1], X.shape[1], X.dtype, P, X.device, imbalance=imbalance),
        layer=key[:1] + key[2:], m=m)

    def received():
        recv = X.new_empty(sum(output_split_sizes), X.shape[1])
        dist.all_to_all_single(recv, X.contiguous(), list(output_split_sizes), list(input_split_sizes), group=group)
        return recv

    if scenario is None:
        recv = received()
        return recv @ W, recv
    out, op = run_decided(AllToAllGemm, scenario, decision, group, lambda: received() @ W, X=X, W=W,
                          send_sizes=list(input_split_sizes), recv_sizes=list(output_split_sizes))
    # Overlapped schedules read the local chunk from X in place: complete X_recv.
    op.X_recv[op.recv_rows(op.r)] = op.send_chunk(op.r)
    return out, op.X_recv


def _matmul_all_to_all(X, W, splits, group_name) -> torch.Tensor:
    output_split_sizes, input_split_sizes = splits
    group = resolve_group(group_name)
    P = dist.get_world_size(group)
    every = _routing("matmul_all_to_all", X, W, splits, group)
    m, imbalance = _expert_load([side["rows"] for side in every])
    key = ("combine", m, imbalance, X.shape[1], W.shape[1], X.dtype, X.device.type)
    scenario, decision = decide(key, group, lambda: scenario_for(
        "gemm_a2a", m, W.shape[1], X.shape[1], X.dtype, P, X.device, imbalance=imbalance),
        layer=key[:1] + key[2:], m=m)

    def plain():  # PyTorch's form: the expert's GEMM, then all_to_all_single
        out = X.new_empty(sum(output_split_sizes), W.shape[1])
        dist.all_to_all_single(out, (X @ W).contiguous(), list(output_split_sizes), list(input_split_sizes),
                               group=group)
        return out

    if scenario is None:
        return plain()
    # The executor's names: recv_sizes are the tokens this expert received (they go back),
    # send_sizes those this rank routed (their answers come back).
    out, _ = run_decided(GemmAllToAll, scenario, decision, group, plain, X_recv=X, W=W,
                         send_sizes=list(output_split_sizes), recv_sizes=list(input_split_sizes))
    return out


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
        # The combine: dOut @ W^T, each source's rows sent back to the rank that routed them.
        dX = _matmul_all_to_all(dOut.contiguous(), W.t(), (input_split_sizes, output_split_sizes), ctx.group)
        return dX, X_recv.t() @ dOut, None, None


class _MatmulAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, splits, group):
        ctx.save_for_backward(X, W)
        ctx.splits, ctx.group = splits, group
        return _matmul_all_to_all(X, W, splits, group)

    @staticmethod
    def backward(ctx, dOut):
        X, W = ctx.saved_tensors
        output_split_sizes, input_split_sizes = ctx.splits
        # The dispatch: every rank's dOut rows to the expert that computed them, then @ W^T.
        dX, dY = _all_to_all_matmul(dOut.contiguous(), W.t(), (input_split_sizes, output_split_sizes), ctx.group)
        return dX, X.t() @ dY, None, None
