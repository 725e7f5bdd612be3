"""Tensor-parallel linear layers, and the hook that makes them use ficco.

The layers, Megatron-style, with sequence parallelism (the pattern PyTorch's async-TP
fuses; training) or without (what inference engines run; ``sequence_parallel=False``):

- ``ColumnParallelLinear``: this rank's rows of the weight (output features split across
  ranks). With sequence parallelism the input is sharded along the sequence dim and
  all-gathered first; without, the input is replicated, the forward has no collective and
  the input's gradient is all-reduced.
- ``RowParallelLinear``: input features split across ranks; multiply by this rank's
  columns of the weight, then reduce-scatter the partial sums along the sequence dim
  (with sequence parallelism) or all-reduce them (without; the gradient then needs no
  collective).

``parallelize(model, {"mlp.up": "colwise", "mlp.down": "rowwise"}, group)`` shards a
plain model's ``nn.Linear`` layers into them. Unhooked, they run PyTorch's plain
(differentiable) collectives. ``install(model)`` switches every such layer in a model to
``ficco_select.runtime.torch_ops`` (schedule chosen per shape, executed by the executor);
the returned handle's ``remove()`` restores them. Where a hooked layer's backward has a
collective, it is the mirror op, itself chosen and executed by ficco:
d(AG(x) @ W^T)/dx = RS(dy @ W), d(RS(x @ W^T))/dx = AG(dy) @ W, and without sequence
parallelism the column-parallel layer's dx = AR(dy @ W) (``matmul_all_reduce``).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ficco_select.executor.supports import matmul_all_reduce_unsupported, matmul_reduce_scatter_unsupported
from ficco_select.runtime import dispatch
from ficco_select.runtime.ops import (
    all_gather_matmul_plan,
    matmul_all_reduce_plan,
    matmul_reduce_scatter_plan,
    prepare_all_gather_matmul,
    prepare_matmul_all_reduce,
    prepare_matmul_reduce_scatter,
)
from ficco_select.runtime.torch_ops import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter


# -- the collectives of tensor parallelism without sequence parallelism ------------------------
# PyTorch's functional all_reduce has no autograd, and torch.distributed.nn's sums the
# gradients (P times the replicated output's): these are Megatron's two conjugate ops.
class _AllReduceForward(torch.autograd.Function):
    """Forward all-reduce (sum), backward identity: the row-parallel layer's output."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _AllReduceBackward(torch.autograd.Function):
    """Forward identity, backward all-reduce (sum): the column-parallel layer's input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        dx = dx.clone()
        dist.all_reduce(dx, group=ctx.group)
        return dx, None


class _LinearAllReduceGrad(torch.autograd.Function):
    """x @ W^T, whose input gradient dy @ W is all-reduced by ``matmul_all_reduce``: the
    hooked column-parallel layer without sequence parallelism."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = matmul_all_reduce(dy.contiguous(), weight, "sum", ctx.group) if ctx.needs_input_grad[0] else None
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class ColumnParallelLinear(nn.Module):
    """y = all_gather(x, seq_dim) @ W_r^T + b_r (x @ W_r^T + b_r without sequence
    parallelism); W_r: this rank's rows of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                 seq_dim: int = 0, sequence_parallel: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.seq_dim, self.sequence_parallel = group, seq_dim, sequence_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, seq_dim: int = 0,
                    sequence_parallel: bool = True) -> "ColumnParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (out_features divisible by the world size)."""
        r, P = dist.get_rank(group), dist.get_world_size(group)
        w = linear.weight.detach().chunk(P, dim=0)[r].clone()
        b = None if linear.bias is None else linear.bias.detach().chunk(P)[r].clone()
        return cls(w, b, group, seq_dim, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return F.linear(_AllReduceBackward.apply(x, self.group), self.weight, self.bias)
        full = funcol.all_gather_single_autograd(x.contiguous(), self.seq_dim, self.group)
        return F.linear(full, self.weight, self.bias)

    def ficco_forward(self, x: torch.Tensor) -> torch.Tensor:
        if _runs_natively(self, x):
            return type(self).forward(self, x)
        if not self.sequence_parallel:
            y = _LinearAllReduceGrad.apply(x, self.weight, self.group)
        else:
            _, (y,) = all_gather_matmul(x, [self.weight.t()], self.seq_dim, self.group, return_A=False)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    """y = reduce_scatter(x @ W_r^T, seq_dim) + b (all_reduce(x @ W_r^T) + b without
    sequence parallelism); W_r: this rank's columns of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                 seq_dim: int = 0, sequence_parallel: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None  # full: added after the sum
        self.group, self.seq_dim, self.sequence_parallel = group, seq_dim, sequence_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, seq_dim: int = 0,
                    sequence_parallel: bool = True) -> "RowParallelLinear":
        r, P = dist.get_rank(group), dist.get_world_size(group)
        w = linear.weight.detach().chunk(P, dim=1)[r].clone()
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, group, seq_dim, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            y = _AllReduceForward.apply(F.linear(x, self.weight), self.group)
        else:
            y = funcol.reduce_scatter_single_autograd(F.linear(x, self.weight), "sum", self.seq_dim, self.group)
        return y if self.bias is None else y + self.bias

    def ficco_forward(self, x: torch.Tensor) -> torch.Tensor:
        if _runs_natively(self, x):
            return type(self).forward(self, x)
        if not self.sequence_parallel:
            y = matmul_all_reduce(x, self.weight.t(), "sum", self.group)
        else:
            y = matmul_reduce_scatter(x, self.weight.t(), "sum", self.seq_dim, self.group)
        return y if self.bias is None else y + self.bias


TP_LAYERS = (ColumnParallelLinear, RowParallelLinear)


def _runs_natively(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether every op a hooked layer's step would run for `x` is decided the baseline: its
    forward's, and its backward's where a gradient will flow. The layer then runs its own
    (unhooked) forward: PyTorch's collectives and kernels, nothing built. Per call: the
    plans' lookups (from the layer tables ``install`` built: no collective). With telemetry,
    exploration or learning on, the ops run instead, so that they are recorded and timed
    (a lookup here would count as a call of a shape that learns)."""
    w, group = layer.weight, layer.group
    ctx = dispatch.context(group)
    if ctx.settings.telemetry or ctx.settings.explore_every or ctx.settings.learn:
        return False
    out_features, in_features = w.shape  # this rank's shard of the weight
    P = group.size()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    # A row or sequence count the world size does not divide runs PyTorch's own op in every case.
    if not layer.sequence_parallel:  # row: AR(x @ W^T); column: x @ W^T, dx = AR(dy @ W)
        if isinstance(layer, RowParallelLinear):
            return bool(matmul_all_reduce_unsupported("sum", rows, P)) or matmul_all_reduce_plan(
                ctx, rows, in_features, out_features, x.dtype, x.device, group, P).native
        return (not (grad and x.requires_grad) or bool(matmul_all_reduce_unsupported("sum", rows, P))
                or matmul_all_reduce_plan(ctx, rows, out_features, in_features, x.dtype, x.device, group, P).native)
    if isinstance(layer, ColumnParallelLinear):  # AG(x) @ W^T; dx = RS(dy @ W)
        if not all_gather_matmul_plan(ctx, rows, in_features, out_features, x.dtype, x.device, group, P).native:
            return False
        return not grad or matmul_reduce_scatter_plan(ctx, P * rows, out_features, in_features, False, x.dtype,
                                                      x.device, group, P).native
    # RS(x @ W^T); dx = AG(dy) @ W
    if matmul_reduce_scatter_unsupported("sum", x.shape[layer.seq_dim], P):
        return True
    if not matmul_reduce_scatter_plan(ctx, rows, in_features, out_features, False, x.dtype, x.device, group,
                                      P).native:
        return False
    return not grad or all_gather_matmul_plan(ctx, rows // P, out_features, in_features, x.dtype, x.device,
                                              group, P).native


class HookHandle:
    """The layers ``install`` switched; ``remove()`` switches them back (idempotent)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward  # back to the class's forward
        self.layers = []

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def parallelize(model: nn.Module, plan: dict[str, str], group: dist.ProcessGroup, seq_dim: int = 0,
                sequence_parallel: bool = True) -> nn.Module:
    """Replace the ``nn.Linear`` layers named in `plan` by this rank's shard, in place.

    `plan` maps a submodule's name (as ``model.named_modules()`` spells it) to
    ``"colwise"`` (ColumnParallelLinear: split the outputs) or ``"rowwise"``
    (RowParallelLinear: split the inputs). With `sequence_parallel` the activations between
    a rowwise and the next colwise layer are sharded along `seq_dim` (all-gather in,
    reduce-scatter out); without, they are replicated (all-reduce out). Every rank must
    start from the same full weights. Returns `model`.
    """
    kinds = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}
    modules = dict(model.named_modules())
    for name, kind in plan.items():
        if kind not in kinds:
            raise ValueError(f"plan[{name!r}]: {kind!r} is not one of {', '.join(kinds)}")
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"plan[{name!r}]: no nn.Linear of that name in the model (found {type(linear).__name__})")
        parent_name, _, attr = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, attr,
                kinds[kind].from_linear(linear, group, seq_dim, sequence_parallel))
    return model


def install(model: nn.Module, *, tables: bool = True) -> HookHandle:
    """Make every tensor-parallel linear layer of `model` run through ficco's ops.

    With `tables` (the default), the decision table of each layer's forward op and, for a
    trained weight, of its backward op is built now, for every token count (rank 0 builds,
    every rank receives): no step decides, or waits on a broadcast, the first one included.
    Every rank must call it, with the same model. Layers already switched are left alone
    (installing twice is harmless). Each layer's process group gets its runtime context
    now (``context.py``), if it has none yet.
    """
    layers = []
    for module in model.modules():
        if isinstance(module, TP_LAYERS) and "forward" not in vars(module):
            module.forward = types.MethodType(type(module).ficco_forward, module)
            dispatch.context(module.group)
            layers.append(module)
            if tables:
                _prepare(module)
    return HookHandle(layers)


def _prepare(layer: nn.Module) -> None:
    """Build the tables of `layer`'s ops: the forward's, and the backward's mirror op (the
    input's gradient) when the weight is trained."""
    w, group = layer.weight, layer.group
    out_features, in_features = w.shape  # this rank's shard of the weight
    if not layer.sequence_parallel:  # row: AR(x @ W^T), dx = dy @ W; column: x @ W^T, dx = AR(dy @ W)
        if isinstance(layer, RowParallelLinear):
            prepare_matmul_all_reduce(in_features, out_features, w.dtype, w.device, group)
        elif w.requires_grad:
            prepare_matmul_all_reduce(out_features, in_features, w.dtype, w.device, group)
    elif isinstance(layer, ColumnParallelLinear):  # AG(x) @ W^T; dx = RS(dy @ W)
        prepare_all_gather_matmul(in_features, out_features, w.dtype, w.device, group)
        if w.requires_grad:
            prepare_matmul_reduce_scatter(out_features, in_features, w.dtype, w.device, group)
    else:  # RS(x @ W^T); dx = AG(dy) @ W
        prepare_matmul_reduce_scatter(in_features, out_features, w.dtype, w.device, group)
        if w.requires_grad:
            prepare_all_gather_matmul(out_features, in_features, w.dtype, w.device, group)
