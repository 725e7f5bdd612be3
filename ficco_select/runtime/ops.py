"""ficco's collective + GEMM ops as they run, without autograd: each call describes itself,
looks up its plan (``dispatch.decide``) and runs it: PyTorch's own collective and GEMM where
the decision is the baseline, the executor's schedule otherwise.

``torch_ops`` (eager, the public functions) and ``library`` (the registered
``torch.ops.ficco.*``, whose autograd formulas are the ops' one backward) both call these.

Per call, where the plan is cached: the call's key (its shapes), one lookup in its group's
context, and the run. Nothing collective, nothing built (no closure: what a run needs besides
its inputs is a module function): the per-call check that every rank passes the same call
is a debug mode (``dispatch.Settings.check_calls``, ``checks.py``), which a group's ranks
agree on once, at its first call (``agree_on_the_check``), and an overlapped plan binds its
comm and one operator at its first run (``running.Runner``). The MoE ops are the exception:
their decision depends on every rank's load, so each call exchanges the ranks' token counts
(one small host all-gather, ``checks.routing``), and that exchange checks them too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ficco_select.executor.operators import (AllGatherGemm, AllToAllGemm, GemmAllReduce, GemmAllToAll,
                                             GemmReduceScatter)
from ficco_select.executor.supports import (all_gather_matmul_unsupported, matmul_all_reduce_unsupported,
                                            matmul_reduce_scatter_unsupported)
from ficco_select.runtime import dispatch
from ficco_select.runtime.checks import agree_on_the_check, described, routing, same_call_on_every_rank
from ficco_select.runtime.dispatch import (GroupContext, context, decide, fall_back, resolve_group, run_decided,
                                           run_native, scenario_for)


# -- the ops ----------------------------------------------------------------------------
def all_gather_matmul(A_shard: torch.Tensor, Bs: Sequence[torch.Tensor], gather_dim: int, group_name, *,
                      return_A: bool = True, run_check: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(A or None, [A @ B for B in Bs]) with A = all_gather(A_shard, gather_dim)."""
    group = resolve_group(group_name)
    ctx = context(group)
    P = group.size()
    gather_dim = gather_dim % A_shard.ndim
    if not ctx.check_agreed:
        agree_on_the_check(group)
    if ctx.settings.check_calls:
        same_call_on_every_rank("all_gather_matmul", group, run_check,
                                 f"A_shard {described(A_shard)} gathered along dim {gather_dim} @ Bs "
                                 f"{', '.join(map(described, Bs))}")
    if unsupported := all_gather_matmul_unsupported(gather_dim, A_shard.ndim, len(Bs)):
        fall_back(ctx, f"{unsupported}: PyTorch's implementation")
        return symm_mem._fused_all_gather_matmul_fallback(A_shard, list(Bs), gather_dim, group.group_name,
                                                          return_A=return_A)
    k = A_shard.shape[-1]
    single = len(Bs) == 1
    n_local = Bs[0].shape[-1] if single else sum(B.shape[-1] for B in Bs)
    device = A_shard.device
    plan = all_gather_matmul_plan(ctx, A_shard.numel() // k if k else 0, k, n_local, A_shard.dtype, device, group, P)
    if plan.native:
        return run_native(plan, ctx, device, _native_all_gather_matmul, A_shard, Bs, gather_dim, group, P, return_A)
    # Gathered rows in rank order, as the executor's row all-gather produces them.
    rows_in = A_shard.ndim == 2 and gather_dim == 0
    A2 = A_shard if rows_in else A_shard.movedim(gather_dim, 0)
    lead = A2.shape[:-1]
    A2 = A2 if rows_in else A2.reshape(-1, k)
    W = Bs[0] if single else torch.cat(list(Bs), dim=1)
    A_full, out = run_decided(AllGatherGemm, plan, ctx, group, device, _gathered_reference, _gathered_outputs,
                              A_shard=A2, W=W)
    if rows_in and single:  # rows in, rows out: nothing to reshape
        return (A_full if return_A else None), [out]
    widths = [B.shape[-1] for B in Bs]
    outs = [o.reshape(P * lead[0], *lead[1:], w).movedim(0, gather_dim)
            for o, w in zip(out.split(widths, dim=1), widths)]
    A = A_full.reshape(P * lead[0], *lead[1:], A2.shape[1]).movedim(0, gather_dim) if return_A else None
    return A, outs


def _gathered_outputs(op: AllGatherGemm, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return op.A_full, out


def _gathered_reference(op: AllGatherGemm, group: dist.ProcessGroup) -> torch.Tensor:
    return symm_mem._fused_all_gather_matmul_fallback(op.shard(op.r), [op.W], 0, group.group_name,
                                                      return_A=False)[1][0]


def _output(op, out: torch.Tensor) -> torch.Tensor:
    return out


_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
"""torch.distributed's all-gather and reduce-scatter into one tensor (older torch: the *_tensor names)."""


def _native_all_gather_matmul(A_shard, Bs, gather_dim: int, group: dist.ProcessGroup, P: int, return_A: bool):
    """PyTorch's own form: the group's all-gather along `gather_dim`, then each GEMM."""
    shard = (A_shard if gather_dim == 0 else A_shard.movedim(gather_dim, 0)).contiguous()
    A = shard.new_empty((P * shard.shape[0], *shard.shape[1:]))
    _all_gather_single(A, shard, group=group)
    if gather_dim:
        A = A.movedim(0, gather_dim)
    return (A if return_A else None), ([A @ Bs[0]] if len(Bs) == 1 else [A @ B for B in Bs])


def _native_matmul_reduce_scatter(A, B, reduce_op: str, scatter_dim: int, group: dist.ProcessGroup, P: int):
    """PyTorch's own form: the GEMM, then the group's reduce-scatter along `scatter_dim`."""
    Y = A @ B
    rows = (Y if scatter_dim == 0 else Y.movedim(scatter_dim, 0)).contiguous()
    out = rows.new_empty((rows.shape[0] // P, *rows.shape[1:]))
    _reduce_scatter_single(out, rows, group=group)
    if reduce_op == "avg":
        out /= P
    return out if scatter_dim == 0 else out.movedim(0, scatter_dim)


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int, group_name, *,
                          run_check: bool = True) -> torch.Tensor:
    """reduce_scatter(A @ B, scatter_dim) with ``sum`` or ``avg``."""
    group = resolve_group(group_name)
    ctx = context(group)
    P = group.size()
    scatter_dim = scatter_dim % A.ndim
    if not ctx.check_agreed:
        agree_on_the_check(group)
    if ctx.settings.check_calls:
        same_call_on_every_rank("matmul_reduce_scatter", group, run_check,
                                 f"A {described(A)} @ B {described(B)}, {reduce_op} scattered along dim {scatter_dim}")
    extent = B.shape[-1] if scatter_dim == A.ndim - 1 else A.shape[scatter_dim]
    if unsupported := matmul_reduce_scatter_unsupported(reduce_op, extent, P):
        fall_back(ctx, f"{unsupported}: PyTorch's implementation")
        return symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, group.group_name)
    k_local, scatter_last = A.shape[-1], scatter_dim == A.ndim - 1
    rows = A.numel() // k_local if k_local else 0
    device = A.device
    plan = matmul_reduce_scatter_plan(ctx, B.shape[-1] if scatter_last else rows, k_local,
                                      rows if scatter_last else B.shape[-1], scatter_last, A.dtype, device, group, P)
    if plan.native:
        return run_native(plan, ctx, device, _native_matmul_reduce_scatter, A, B, reduce_op, scatter_dim, group, P)
    if scatter_last:
        # Scatter the output's columns: (A @ B)^T = B^T @ A^T has them as rows.
        rows_lead, A2 = A.shape[:-1], A.reshape(-1, k_local)
        left, right = B.t(), A2.t()
    else:
        At = A if scatter_dim == 0 else A.movedim(scatter_dim, 0)
        rows_lead = At.shape[:-1]
        left, right = (At if At.ndim == 2 else At.reshape(-1, k_local)), B
    out = run_decided(GemmReduceScatter, plan, ctx, group, device, _scattered_reference, _output,
                      A=left, W=right, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    if scatter_last:
        return out.t().reshape(*rows_lead, out.shape[0])
    if len(rows_lead) == 1 and scatter_dim == 0:  # rows in, rows out: nothing to reshape
        return out
    return out.reshape(rows_lead[0] // P, *rows_lead[1:], out.shape[1]).movedim(0, scatter_dim)


def _scattered_reference(op: GemmReduceScatter, group: dist.ProcessGroup) -> torch.Tensor:
    return symm_mem._fused_matmul_reduce_scatter_fallback(op.A, op.W, "sum", 0, group.group_name)


def matmul_all_reduce(A: torch.Tensor, B: torch.Tensor, reduce_op: str = "sum", group_name=None, *,
                      run_check: bool = True) -> torch.Tensor:
    """all_reduce(A @ B) with ``sum`` or ``avg``: every rank gets the whole result."""
    group = resolve_group(group_name)
    ctx = context(group)
    P = group.size()
    if not ctx.check_agreed:
        agree_on_the_check(group)
    if ctx.settings.check_calls:
        same_call_on_every_rank("matmul_all_reduce", group, run_check,
                                 f"A {described(A)} @ B {described(B)}, {reduce_op}")
    A2 = A if A.ndim == 2 else _rows(A)
    rows, n = A2.shape[0], B.shape[-1]
    if unsupported := matmul_all_reduce_unsupported(reduce_op, rows, P):
        fall_back(ctx, f"{unsupported}: PyTorch's mm + all_reduce")
        out = _plain_all_reduce(A2, B, group)
    else:
        device = A.device
        plan = matmul_all_reduce_plan(ctx, rows, A2.shape[1], n, A.dtype, device, group, P)
        if plan.native:
            out = run_native(plan, ctx, device, _plain_all_reduce, A2, B, group)
        else:
            out = run_decided(GemmAllReduce, plan, ctx, group, device, _all_reduced_reference, _output,
                              A=A2, W=B, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    return out if A.ndim == 2 else out.reshape(*A.shape[:-1], n)


def _plain_all_reduce(A: torch.Tensor, B: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """PyTorch's form, in the caller's dtype: the GEMM, then the group's all-reduce."""
    Y = A @ B
    dist.all_reduce(Y, group=group)
    return Y


def _all_reduced_reference(op: GemmAllReduce, group: dist.ProcessGroup) -> torch.Tensor:
    return _plain_all_reduce(op.A, op.W, group)


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


def all_gather_matmul_plan(ctx: GroupContext, rows: int, k: int, n_local: int, dtype: torch.dtype,
                           device: torch.device, group: dist.ProcessGroup, P: int) -> dispatch.Plan:
    """The plan of an all-gather matmul of A_shard (rows, k) along its rows @ B (k, n_local)."""
    key = ("ag", (rows, k), n_local, dtype, device.type)
    return ctx.plan(key) or decide(
        ctx, key, group, lambda: scenario_for("ag_gemm", P * rows, P * n_local, k, dtype, P, device),
        layer=_ag_layer(n_local, dtype, device.type, k), m=P * rows)


def matmul_reduce_scatter_plan(ctx: GroupContext, rows: int, k_local: int, n: int, scatter_last: bool,
                               dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup,
                               P: int) -> dispatch.Plan:
    """The plan of a matmul reduce-scatter of A (rows, k_local) @ B (k_local, n) (its rows
    scattered; with `scatter_last`, the transposed product's)."""
    key = ("rs", (rows, k_local), n, scatter_last, dtype, device.type)
    return ctx.plan(key) or decide(
        ctx, key, group, lambda: scenario_for("gemm_rs", rows, n, P * k_local, dtype, P, device),
        layer=_rs_layer(n, scatter_last, dtype, device.type, k_local), m=rows)


def matmul_all_reduce_plan(ctx: GroupContext, rows: int, k_local: int, n: int, dtype: torch.dtype,
                           device: torch.device, group: dist.ProcessGroup, P: int) -> dispatch.Plan:
    """The plan of a matmul all-reduce of A (rows, k_local) @ B (k_local, n)."""
    key = ("ar", (rows, k_local), n, dtype, device.type)
    return ctx.plan(key) or decide(
        ctx, key, group, lambda: scenario_for("gemm_ar", rows, n, P * k_local, dtype, P, device),
        layer=_ar_layer(n, dtype, device.type, k_local), m=rows)


def prepare_all_gather_matmul(k: int, n_local: int, dtype: torch.dtype, device: torch.device, group_name) -> bool:
    """Build now the decision table of ``all_gather_matmul`` calls of A_shard (rows, k) @ B
    (k, n_local) along dim 0, for every row count: such a call then decides by a lookup,
    with no collective and no model, from its first step on. Every rank of the group calls
    it, in the same order (rank 0 builds the table and shares it). Whether a table was built."""
    group = resolve_group(group_name)
    agree_on_the_check(group)  # now, so that no step does
    P = group.size()
    return dispatch.prepare_layer(_ag_layer(n_local, dtype, device.type, k), group, lambda: scenario_for(
        "ag_gemm", P * TABLE_ROWS, P * n_local, k, dtype, P, device)) is not None


def prepare_matmul_reduce_scatter(k_local: int, n: int, dtype: torch.dtype, device: torch.device,
                                  group_name) -> bool:
    """``prepare_all_gather_matmul`` for ``matmul_reduce_scatter`` calls of A (rows, k_local)
    @ B (k_local, n) scattered along dim 0."""
    group = resolve_group(group_name)
    agree_on_the_check(group)  # now, so that no step does
    P = group.size()
    return dispatch.prepare_layer(_rs_layer(n, False, dtype, device.type, k_local), group, lambda: scenario_for(
        "gemm_rs", P * TABLE_ROWS, n, P * k_local, dtype, P, device)) is not None


def prepare_matmul_all_reduce(k_local: int, n: int, dtype: torch.dtype, device: torch.device, group_name) -> bool:
    """``prepare_all_gather_matmul`` for ``matmul_all_reduce`` calls of A (rows, k_local) @ B (k_local, n)."""
    group = resolve_group(group_name)
    agree_on_the_check(group)  # now, so that no step does
    P = group.size()
    return dispatch.prepare_layer(_ar_layer(n, dtype, device.type, k_local), group, lambda: scenario_for(
        "gemm_ar", P * TABLE_ROWS, n, P * k_local, dtype, P, device)) is not None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])



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


def all_to_all_matmul(X: torch.Tensor, W: torch.Tensor, splits, group_name) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_to_all_single(X) @ W, all_to_all_single(X)); splits: (output_split_sizes, input_split_sizes)."""
    output_split_sizes, input_split_sizes = splits
    group = resolve_group(group_name)
    ctx = context(group)
    P = group.size()
    every = routing("all_to_all_matmul", X, W, splits, group)
    m, imbalance = _expert_load([sum(side["recv"]) for side in every])
    device = X.device
    key = ("a2a", m, imbalance, X.shape[1], W.shape[1], X.dtype, device.type)
    plan = ctx.plan(key) or decide(ctx, key, group, lambda: scenario_for(
        "a2a_gemm", m, W.shape[1], X.shape[1], X.dtype, P, device, imbalance=imbalance),
        layer=key[:1] + key[2:], m=m)
    if plan.native:  # PyTorch's own: all_to_all_single, then the GEMM
        recv = run_native(plan, ctx, device, _received, X, list(output_split_sizes), list(input_split_sizes), group)
        return recv @ W, recv
    return run_decided(AllToAllGemm, plan, ctx, group, device, _dispatched_reference, _dispatched_outputs, X=X, W=W,
                       send_sizes=list(input_split_sizes), recv_sizes=list(output_split_sizes))


def _received(X: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """PyTorch's MoE dispatch: all_to_all_single of X's rows."""
    recv = X.new_empty(sum(output_split_sizes), X.shape[1])
    dist.all_to_all_single(recv, X.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return recv


def _dispatched_outputs(op: AllToAllGemm, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Overlapped schedules read the local chunk from X in place: complete X_recv.
    op.X_recv[op.recv_rows(op.r)] = op.send_chunk(op.r)
    return out, op.X_recv


def _dispatched_reference(op: AllToAllGemm, group: dist.ProcessGroup) -> torch.Tensor:
    return _received(op.X, op.recv_sizes, op.send_sizes, group) @ op.W


def matmul_all_to_all(X: torch.Tensor, W: torch.Tensor, splits, group_name) -> torch.Tensor:
    """all_to_all_single(X @ W); splits: (output_split_sizes, input_split_sizes)."""
    output_split_sizes, input_split_sizes = splits
    group = resolve_group(group_name)
    ctx = context(group)
    P = group.size()
    every = routing("matmul_all_to_all", X, W, splits, group)
    m, imbalance = _expert_load([side["rows"] for side in every])
    device = X.device
    key = ("combine", m, imbalance, X.shape[1], W.shape[1], X.dtype, device.type)
    plan = ctx.plan(key) or decide(ctx, key, group, lambda: scenario_for(
        "gemm_a2a", m, W.shape[1], X.shape[1], X.dtype, P, device, imbalance=imbalance),
        layer=key[:1] + key[2:], m=m)
    if plan.native:
        return run_native(plan, ctx, device, _combined, X, W, list(output_split_sizes), list(input_split_sizes), group)
    # The executor's names: recv_sizes are the tokens this expert received (they go back),
    # send_sizes those this rank routed (their answers come back).
    return run_decided(GemmAllToAll, plan, ctx, group, device, _combined_reference, _output, X_recv=X, W=W,
                       send_sizes=list(output_split_sizes), recv_sizes=list(input_split_sizes))


def _combined(X: torch.Tensor, W: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """PyTorch's form of the combine: the expert's GEMM, then all_to_all_single."""
    out = X.new_empty(sum(output_split_sizes), W.shape[1])
    dist.all_to_all_single(out, (X @ W).contiguous(), output_split_sizes, input_split_sizes, group=group)
    return out


def _combined_reference(op: GemmAllToAll, group: dist.ProcessGroup) -> torch.Tensor:
    return _combined(op.X_recv, op.W, op.send_sizes, op.recv_sizes, group)
