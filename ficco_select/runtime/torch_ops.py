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
- The baseline decision (``none.sm``) runs PyTorch's own collective and GEMM: what the
  unhooked job runs (``all_gather_into_tensor`` then ``mm``, ``mm`` then
  ``reduce_scatter_tensor`` or ``all_reduce``, ``all_to_all_single`` and ``mm``), nothing
  built, its cost one lookup of the call's plan.
- What the executor cannot run falls back to PyTorch's own implementation, with the
  decision's reason saying why: a gather along the contraction (last) dim, a scatter dim
  whose size the world size does not divide, dtypes other than fp32/bf16/fp16, a
  ``reduce_op`` other than sum/avg.
- Engines: ``sm`` runs over the group's own backend (a step's transfers as one NCCL group
  on CUDA, gloo point-to-point on CPU); ``dma`` runs over ``executor.peer.PeerCopyComm``:
  copy engines through symmetric-memory staging slots on CUDA (built once per group, at
  the first dma call, on every rank), shared-memory slots on CPU (tests).
- Every rank must pass the same call, as with PyTorch's own collectives, which check nothing
  per call. The check is a debug mode, off by default, turned on by PyTorch's own switch
  (``TORCH_DISTRIBUTED_DEBUG=DETAIL``), ``FICCO_CHECK_CALLS=1`` or
  ``configure(check_calls=True)``: each call first all-gathers every rank's description of
  it (shapes, dtype, dims, reduce op; one blocking collective on the host: the group's CPU
  backend, or a gloo group of its ranks made at its first call; about 0.5 ms on this 2-core
  machine's gloo), and a call the ranks disagree on raises ValueError on every rank, naming
  the op, the rank and both shapes; ``run_check=False`` skips the comparison for one call
  and its backward, where the caller vouches for its shapes (DTensor's styles, the compile
  pass); every rank still joins the exchange, so ranks passing ``run_check`` differently
  raise rather than wait on each other. A group's ranks agree on the debug mode itself
  once, at its first checked call: ranks that set it differently raise, naming the setting.
  With the check off, what a mismatch does is the backend's (docs/runtime.md, "Ranks that
  disagree"). The MoE ops check in the exchange of token counts their decision needs
  anyway: the same k, n and dtype on every rank, and each rank's ``output_split_sizes``
  what the others' ``input_split_sizes`` send it.
- ``matmul_all_reduce`` with a row count the world size does not divide runs PyTorch's
  plain form (the executor's all-reduce schedules split the rows into P blocks).
- Several ``Bs`` are concatenated into one weight (one gathered A, one GEMM per piece).
- An overlapped plan's comm and operator are bound at its first call, in its process group's
  context; each call binds the operator to its inputs and takes its buffers from the
  allocator, as PyTorch's ops do, and none outlives the call; only the dma staging slots persist.
- Every op is differentiable: where a gradient is needed the call goes through a thin
  autograd Function (``library.eager``; under ``torch.compile``, the registered op
  ``torch.ops.ficco.*``), whose backward is the op's one formula: its mirror op, chosen
  and run the same way (all-gather matmul <-> matmul reduce-scatter, dispatch <-> combine;
  ``matmul_all_reduce``'s backward has no collective, as Megatron's row-parallel linear).
  Without a gradient the call runs the op directly.

``last_decision`` (the latest call's decision) is kept only where calls are watched:
telemetry, the debug mode (``configure(check_calls=True)``) or exploration; otherwise it is
None (a planned call writes nothing outside its group's context; ``dispatch.decisions()``
lists every plan's decision). Its ``source``: the selector's ``model``, ``heuristic`` or
``fallback`` (also when PyTorch's implementation ran), ``pinned``
(``configure(schedule=...)``) or ``explore`` (``configure(explore_every=n)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ficco_select.runtime import dispatch, library, ops
from ficco_select.runtime.dispatch import configure, hardware_name, reset
from ficco_select.runtime.ops import prepare_all_gather_matmul, prepare_matmul_all_reduce, prepare_matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_to_all_matmul",
           "matmul_all_to_all", "configure", "reset", "hardware_name", "prepare_all_gather_matmul",
           "prepare_matmul_reduce_scatter", "prepare_matmul_all_reduce"]

assert library.NAMESPACE == "ficco"  # torch.ops.ficco.* are registered by importing library


def __getattr__(name: str):
    # ``torch_ops.last_decision``: the latest watched call's decision (None where none is watched).
    if name == "last_decision":
        return dispatch.last_decision()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _needs_grad(A: torch.Tensor, *Bs: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    if A.requires_grad:
        return True
    for B in Bs:  # a loop, not any(...): no generator made per call
        if B.requires_grad:
            return True
    return False


def _name(group) -> str:
    return group if type(group) is str else group.group_name


def _autograd():
    """Where a call that needs a gradient runs: eagerly, the ops' thin autograd Functions
    (``library.eager``: a custom op's dispatch costs the host more, ``hook_overhead.py``'s
    grad rows); being compiled, the registered ops (one graph node each). The same forward
    and backward formulas either way."""
    return torch.ops.ficco if torch.compiler.is_compiling() else library.eager


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
        A, outs = _autograd().all_gather_matmul(A_shard, list(Bs), gather_dim, _name(group_name), run_check)
        return (A if return_A else None), outs
    return ops.all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=return_A, run_check=run_check)


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                          group_name, *, run_check: bool = True) -> torch.Tensor:
    """Reduce-scatter A @ B along `scatter_dim` (``sum`` or ``avg``).

    Same signature and result as ``fused_matmul_reduce_scatter``. Differentiable: the
    gradient of A is an all-gather + matmul. ``run_check``: as ``all_gather_matmul``'s.
    """
    if _needs_grad(A, B):
        return _autograd().matmul_reduce_scatter(A, B, reduce_op, scatter_dim, _name(group_name), run_check)
    return ops.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=run_check)


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
        group = dist.group.WORLD if group_name is None else group_name
        return _autograd().matmul_all_reduce(A, B, reduce_op, _name(group), run_check)
    return ops.matmul_all_reduce(A, B, reduce_op, group_name, run_check=run_check)


def all_to_all_matmul(X: torch.Tensor, W: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group_name) -> torch.Tensor:
    """MoE dispatch then the local expert: ``all_to_all_single(X) @ W``.

    X (sum(input_split_sizes), k) holds the tokens this rank routes, grouped by
    destination rank; returns (sum(output_split_sizes), n) grouped by source rank. The
    scenario comes from every rank's load (``ops._expert_load``). Differentiable: its backward
    is the combine (``matmul_all_to_all``: dX = all_to_all(dOut @ W^T), back to the ranks
    that routed the tokens), chosen and run the same way.
    """
    if _needs_grad(X, W):
        return _autograd().all_to_all_matmul(X, W, list(output_split_sizes), list(input_split_sizes),
                                             _name(group_name))[0]
    return ops.all_to_all_matmul(X, W, (tuple(output_split_sizes), tuple(input_split_sizes)), group_name)[0]


def matmul_all_to_all(X: torch.Tensor, W: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group_name) -> torch.Tensor:
    """The local expert then the MoE combine: ``all_to_all_single(X @ W)``.

    X (sum(input_split_sizes), k) holds the tokens this expert received, grouped by source
    rank (``all_to_all_matmul``'s received layout); input_split_sizes[q] rows go back to
    rank q. Returns (sum(output_split_sizes), n): the answers for the tokens this rank
    routed, grouped by expert. Differentiable: its backward is the dispatch
    (``all_to_all_matmul`` of dOut by W^T, the splits swapped), chosen and run the same way.
    """
    if _needs_grad(X, W):
        return _autograd().matmul_all_to_all(X, W, list(output_split_sizes), list(input_split_sizes),
                                             _name(group_name))
    return ops.matmul_all_to_all(X, W, (tuple(output_split_sizes), tuple(input_split_sizes)), group_name)
