"""ficco's collective + GEMM ops as registered PyTorch operators: ``torch.ops.ficco.*``.

Registered with ``torch.library.custom_op``, each op is one node in a compiled graph (a
Python function would be opaque to ``torch.compile``: Dynamo would trace into the
executor's Python and its point-to-point calls, and break the graph there), with a fake
implementation for its shapes and a registered autograd formula: the op's one backward,
which eager code (``torch_ops``, where a gradient is needed) and compiled code both run.
Inductor calls the op as an extern kernel at run time, where it decides its schedule per
call shape exactly as ``torch_ops`` does (``ops``: the same plans, the same layer tables,
the same debug-mode check that every rank passes the same call, which ``run_check=False``
skips where the caller vouches for it):

    torch.ops.ficco.all_gather_matmul(A_shard, [B], gather_dim, group_name, run_check=True) -> (A, [A @ B])
    torch.ops.ficco.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=True) -> Y
    torch.ops.ficco.matmul_all_reduce(A, B, reduce_op, group_name, run_check=True) -> Y
    torch.ops.ficco.all_to_all_matmul(X, W, output_split_sizes, input_split_sizes, group_name) -> (Y, X_recv)
    torch.ops.ficco.matmul_all_to_all(X, W, output_split_sizes, input_split_sizes, group_name) -> Y

Where they differ from ``torch_ops``' Python signatures, and why:
- The group is its name (``group.group_name``): an operator's schema cannot hold a
  ``ProcessGroup``.
- ``all_gather_matmul`` always returns the gathered A: an operator's outputs are fixed by
  its schema, and the backward needs A for the weights' gradients anyway (the executor
  gathers it in every schedule, so returning it costs nothing).
- ``all_to_all_matmul`` returns the received tokens ``X_recv`` as a second output, not
  differentiable: the weight's gradient needs them, and a registered autograd formula can
  save only inputs and outputs.
- Outputs never alias inputs or each other (the custom-op contract Inductor relies on):
  an output that would (the pieces of one GEMM split per B, a result that is a view of an
  input) is copied, and every output is contiguous, as the fake implementations say.

Backwards are the mirror ops, as in ``torch_ops``, called through ``torch.ops.ficco`` so
that AOTAutograd traces them as nodes too: all-gather matmul <-> matmul reduce-scatter,
dispatch <-> combine; ``matmul_all_reduce``'s input gradient has no collective.

Eager training does not go through the registered ops: ``eager`` runs the same forward and
the same backward formulas (``ctx.mirror`` says where the formula's mirror op runs) behind a
thin ``torch.autograd.Function`` each, whose dispatch costs the host less than a custom op's
(``benchmarks/hook_overhead.py``, its ``grad`` rows); the registered ops are for
``torch.compile`` and export.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ficco_select.runtime import ops
from ficco_select.runtime.dispatch import resolve_group

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_to_all_matmul",
           "matmul_all_to_all"]

NAMESPACE = "ficco"


def _world(group_name: str) -> int:
    return dist.get_world_size(resolve_group(group_name))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _owned(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`outputs`, contiguous from the start of their own memory (as the fake implementations
    make them), each copied where it shares memory with an input or with an output before it
    (the custom-op contract: no output aliases an input or another output)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    owned = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr in seen or t.storage_offset() or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        if ptr:
            seen.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return owned


def _as_passed(run_check: bool, *grads):
    """`grads` (one per schema argument, ``run_check`` last) as the call passed its arguments:
    the dispatcher drops a trailing argument equal to its default before autograd sees the
    call, so a call with ``run_check`` True gets no gradient slot for it."""
    return grads[:-1] if run_check else grads


# -- all-gather matmul <-> matmul reduce-scatter ---------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::all_gather_matmul", mutates_args=())
def all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int,
                      group_name: str, run_check: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(A, [A @ B for B in Bs]) with A = all_gather(A_shard, gather_dim): ``torch_ops.all_gather_matmul``."""
    A, outs = ops.all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=True, run_check=run_check)
    A, *outs = _owned([A, *outs], [A_shard, *Bs])
    return A, outs


@all_gather_matmul.register_fake
def _(A_shard, Bs, gather_dim, group_name, run_check=True):
    P = _world(group_name)
    dim = gather_dim % A_shard.ndim
    shape = list(A_shard.shape)
    shape[dim] *= P
    A = A_shard.new_empty(shape)
    return A, [A_shard.new_empty([*shape[:-1], B.shape[-1]]) for B in Bs]


def _all_gather_matmul_setup(ctx, inputs, output):
    _, Bs, gather_dim, group_name, run_check = inputs
    A, _ = output
    ctx.save_for_backward(A, *Bs)
    ctx.gather_dim, ctx.group_name, ctx.run_check = gather_dim, group_name, run_check
    ctx.set_materialize_grads(False)  # an unused A gets None: the backward's fused path
    ctx.mirror = torch.ops.ficco


def _all_gather_matmul_backward(ctx, dA, dYs):
    A, *Bs = ctx.saved_tensors
    dYs = [A.new_zeros(*A.shape[:-1], B.shape[-1]) if d is None else d for d, B in zip(dYs, Bs)]
    dY = dYs[0] if len(dYs) == 1 else torch.cat(dYs, dim=-1)
    W = Bs[0] if len(Bs) == 1 else torch.cat(Bs, dim=1)
    # d(A_shard) = reduce_scatter(dY @ W^T + dA): every rank's contribution to my shard.
    if dA is None:
        dA_shard = ctx.mirror.matmul_reduce_scatter(dY, W.t(), "sum", ctx.gather_dim, ctx.group_name, ctx.run_check)
    else:
        dA_shard = funcol.wait_tensor(funcol.reduce_scatter_single(
            dY @ W.t() + dA, "sum", ctx.gather_dim % A.ndim, ctx.group_name))
    dBs = [_rows(A).t() @ _rows(d) for d in dYs]
    return _as_passed(ctx.run_check, dA_shard, dBs, None, None, None)


all_gather_matmul.register_autograd(_all_gather_matmul_backward, setup_context=_all_gather_matmul_setup)


@torch.library.custom_op(f"{NAMESPACE}::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                          group_name: str, run_check: bool = True) -> torch.Tensor:
    """reduce_scatter(A @ B, scatter_dim) with ``sum`` or ``avg``: ``torch_ops.matmul_reduce_scatter``."""
    out = ops.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=run_check)
    return _owned([out], [A, B])[0]


@matmul_reduce_scatter.register_fake
def _(A, B, reduce_op, scatter_dim, group_name, run_check=True):
    P = _world(group_name)
    shape = [*A.shape[:-1], B.shape[-1]]
    shape[scatter_dim % A.ndim] //= P
    return A.new_empty(shape)


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    A, B, reduce_op, scatter_dim, group_name, run_check = inputs
    ctx.save_for_backward(A, B)
    ctx.reduce_op, ctx.scatter_dim, ctx.group_name, ctx.run_check = reduce_op, scatter_dim, group_name, run_check
    ctx.mirror = torch.ops.ficco


def _matmul_reduce_scatter_backward(ctx, dY):
    A, B = ctx.saved_tensors
    if ctx.reduce_op == "avg":
        dY = dY / _world(ctx.group_name)
    # Every rank's A @ B fed my block: gather the blocks' gradients, then one GEMM.
    dY_full, (dA,) = ctx.mirror.all_gather_matmul(dY.contiguous(), [B.t()], ctx.scatter_dim, ctx.group_name,
                                                  ctx.run_check)
    dB = _rows(A).t() @ _rows(dY_full)
    return _as_passed(ctx.run_check, dA, dB, None, None, None, None)


matmul_reduce_scatter.register_autograd(_matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup)


# -- matmul all-reduce: the row-parallel linear without sequence parallelism -----------------
@torch.library.custom_op(f"{NAMESPACE}::matmul_all_reduce", mutates_args=())
def matmul_all_reduce(A: torch.Tensor, B: torch.Tensor, reduce_op: str, group_name: str,
                      run_check: bool = True) -> torch.Tensor:
    """all_reduce(A @ B) with ``sum`` or ``avg``: ``torch_ops.matmul_all_reduce``."""
    out = ops.matmul_all_reduce(A, B, reduce_op, group_name, run_check=run_check)
    return _owned([out], [A, B])[0]


@matmul_all_reduce.register_fake
def _(A, B, reduce_op, group_name, run_check=True):
    return A.new_empty([*A.shape[:-1], B.shape[-1]])


def _matmul_all_reduce_setup(ctx, inputs, output):
    A, B, reduce_op, group_name, run_check = inputs
    ctx.save_for_backward(A, B)
    ctx.reduce_op, ctx.group_name, ctx.run_check = reduce_op, group_name, run_check


def _matmul_all_reduce_backward(ctx, dY):
    # The output is replicated: every rank's dY is the whole gradient, no collective.
    A, B = ctx.saved_tensors
    if ctx.reduce_op == "avg":
        dY = dY / _world(ctx.group_name)
    return _as_passed(ctx.run_check, dY @ B.t(), _rows(A).t() @ _rows(dY), None, None, None)


matmul_all_reduce.register_autograd(_matmul_all_reduce_backward, setup_context=_matmul_all_reduce_setup)


# -- MoE: dispatch + expert GEMM <-> expert GEMM + combine ----------------------------------
@torch.library.custom_op(f"{NAMESPACE}::all_to_all_matmul", mutates_args=())
def all_to_all_matmul(X: torch.Tensor, W: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_to_all_single(X) @ W, all_to_all_single(X)): ``torch_ops.all_to_all_matmul``
    and the tokens it received (for the weight's gradient)."""
    splits = (tuple(output_split_sizes), tuple(input_split_sizes))
    out, X_recv = ops.all_to_all_matmul(X, W, splits, group_name)
    out, X_recv = _owned([out, X_recv], [X, W])
    return out, X_recv


@all_to_all_matmul.register_fake
def _(X, W, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes)
    return X.new_empty([rows, W.shape[-1]]), X.new_empty([rows, X.shape[-1]])


def _all_to_all_matmul_setup(ctx, inputs, output):
    _, W, output_split_sizes, input_split_sizes, group_name = inputs
    _, X_recv = output
    ctx.mark_non_differentiable(X_recv)
    ctx.save_for_backward(X_recv, W)
    ctx.splits, ctx.group_name = (list(output_split_sizes), list(input_split_sizes)), group_name
    ctx.mirror = torch.ops.ficco


def _all_to_all_matmul_backward(ctx, dOut, _dX_recv):
    X_recv, W = ctx.saved_tensors
    output_split_sizes, input_split_sizes = ctx.splits
    # The combine: dOut @ W^T, each source's rows sent back to the rank that routed them.
    dX = ctx.mirror.matmul_all_to_all(dOut.contiguous(), W.t(), input_split_sizes, output_split_sizes,
                                      ctx.group_name)
    return dX, X_recv.t() @ dOut, None, None, None


all_to_all_matmul.register_autograd(_all_to_all_matmul_backward, setup_context=_all_to_all_matmul_setup)


@torch.library.custom_op(f"{NAMESPACE}::matmul_all_to_all", mutates_args=())
def matmul_all_to_all(X: torch.Tensor, W: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], group_name: str) -> torch.Tensor:
    """all_to_all_single(X @ W): ``torch_ops.matmul_all_to_all``."""
    splits = (tuple(output_split_sizes), tuple(input_split_sizes))
    return _owned([ops.matmul_all_to_all(X, W, splits, group_name)], [X, W])[0]


@matmul_all_to_all.register_fake
def _(X, W, output_split_sizes, input_split_sizes, group_name):
    return X.new_empty([sum(output_split_sizes), W.shape[-1]])


def _matmul_all_to_all_setup(ctx, inputs, output):
    X, W, output_split_sizes, input_split_sizes, group_name = inputs
    ctx.save_for_backward(X, W)
    ctx.splits, ctx.group_name = (list(output_split_sizes), list(input_split_sizes)), group_name
    ctx.mirror = torch.ops.ficco


def _matmul_all_to_all_backward(ctx, dOut):
    X, W = ctx.saved_tensors
    output_split_sizes, input_split_sizes = ctx.splits
    # The dispatch: every rank's dOut rows to the expert that computed them, then @ W^T.
    dX, dY = ctx.mirror.all_to_all_matmul(dOut.contiguous(), W.t(), input_split_sizes, output_split_sizes,
                                          ctx.group_name)
    return dX, X.t() @ dY, None, None, None


matmul_all_to_all.register_autograd(_matmul_all_to_all_backward, setup_context=_matmul_all_to_all_setup)


# -- eager training: the same formulas behind thin autograd Functions ------------------------
def _grad(*tensors: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.requires_grad:
            return True
    return False


# Forward(ctx, ...) style: a Function with a separate setup_context binds its arguments by
# inspect.signature at every apply, tens of microseconds.
class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A_shard, gather_dim, group_name, run_check, *Bs):
        A, outs = ops.all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=True, run_check=run_check)
        _all_gather_matmul_setup(ctx, (A_shard, Bs, gather_dim, group_name, run_check), (A, outs))
        ctx.mirror = eager
        return (A, *outs)

    @staticmethod
    def backward(ctx, dA, *dYs):
        dA_shard, dBs = _all_gather_matmul_backward(ctx, dA, list(dYs))[:2]
        return (dA_shard, None, None, None, *dBs)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, reduce_op, scatter_dim, group_name, run_check):
        out = ops.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=run_check)
        _matmul_reduce_scatter_setup(ctx, (A, B, reduce_op, scatter_dim, group_name, run_check), out)
        ctx.mirror = eager
        return out

    @staticmethod
    def backward(ctx, dY):
        return (*_matmul_reduce_scatter_backward(ctx, dY)[:2], None, None, None, None)


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, reduce_op, group_name, run_check):
        out = ops.matmul_all_reduce(A, B, reduce_op, group_name, run_check=run_check)
        _matmul_all_reduce_setup(ctx, (A, B, reduce_op, group_name, run_check), out)
        return out

    @staticmethod
    def backward(ctx, dY):
        return (*_matmul_all_reduce_backward(ctx, dY)[:2], None, None, None)


class _AllToAllMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, output_split_sizes, input_split_sizes, group_name):
        out = ops.all_to_all_matmul(X, W, (tuple(output_split_sizes), tuple(input_split_sizes)), group_name)
        _all_to_all_matmul_setup(ctx, (X, W, output_split_sizes, input_split_sizes, group_name), out)
        ctx.mirror = eager
        return out

    @staticmethod
    def backward(ctx, dOut, dX_recv):
        return _all_to_all_matmul_backward(ctx, dOut, dX_recv)


class _MatmulAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, output_split_sizes, input_split_sizes, group_name):
        out = ops.matmul_all_to_all(X, W, (tuple(output_split_sizes), tuple(input_split_sizes)), group_name)
        _matmul_all_to_all_setup(ctx, (X, W, output_split_sizes, input_split_sizes, group_name), out)
        ctx.mirror = eager
        return out

    @staticmethod
    def backward(ctx, dOut):
        return _matmul_all_to_all_backward(ctx, dOut)


class eager:  # noqa: N801 - a namespace with ``torch.ops.ficco``'s names, as ``ctx.mirror`` calls them
    """The registered ops' signatures and results, run eagerly: where a gradient is needed,
    through their thin autograd Function (the same forward and backward formulas), else the
    op itself (``ops``)."""

    @staticmethod
    def all_gather_matmul(A_shard, Bs, gather_dim, group_name, run_check=True):
        if _grad(A_shard, *Bs):
            A, *outs = _AllGatherMatmul.apply(A_shard, gather_dim, group_name, run_check, *Bs)
            return A, outs
        return ops.all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=True, run_check=run_check)

    @staticmethod
    def matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=True):
        if _grad(A, B):
            return _MatmulReduceScatter.apply(A, B, reduce_op, scatter_dim, group_name, run_check)
        return ops.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, run_check=run_check)

    @staticmethod
    def matmul_all_reduce(A, B, reduce_op, group_name, run_check=True):
        if _grad(A, B):
            return _MatmulAllReduce.apply(A, B, reduce_op, group_name, run_check)
        return ops.matmul_all_reduce(A, B, reduce_op, group_name, run_check=run_check)

    @staticmethod
    def all_to_all_matmul(X, W, output_split_sizes, input_split_sizes, group_name):
        if _grad(X, W):
            return _AllToAllMatmul.apply(X, W, output_split_sizes, input_split_sizes, group_name)
        return ops.all_to_all_matmul(X, W, (tuple(output_split_sizes), tuple(input_split_sizes)), group_name)

    @staticmethod
    def matmul_all_to_all(X, W, output_split_sizes, input_split_sizes, group_name):
        if _grad(X, W):
            return _MatmulAllToAll.apply(X, W, output_split_sizes, input_split_sizes, group_name)
        return ops.matmul_all_to_all(X, W, (tuple(output_split_sizes), tuple(input_split_sizes)), group_name)
