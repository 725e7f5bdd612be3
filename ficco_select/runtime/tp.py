"""Sequence-parallel tensor-parallel linear layers, and the hook that makes them use ficco.

The layers (Megatron-style sequence parallelism, the pattern PyTorch's async-TP fuses):

- ``ColumnParallelLinear``: input sharded along the sequence dim; all-gather it, then
  multiply by this rank's rows of the weight (output features split across ranks).
- ``RowParallelLinear``: input features split across ranks; multiply by this rank's
  columns of the weight, then reduce-scatter the partial sums along the sequence dim.

``parallelize(model, {"mlp.up": "colwise", "mlp.down": "rowwise"}, group)`` shards a
plain model's ``nn.Linear`` layers into them. Unhooked, they run PyTorch's plain
(differentiable) collectives. ``install(model)``
switches every such layer in a model to ``ficco_select.runtime.torch_ops`` (schedule chosen per
shape, executed by the executor); the returned handle's ``remove()`` restores them.
Backward of a hooked layer is the mirror op (``torch_ops``' gradients), itself chosen and
executed by ficco: d(AG(x) @ W^T)/dx = RS(dy @ W) and d(RS(x @ W^T))/dx = AG(dy) @ W.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ficco_select.runtime.torch_ops import (
    all_gather_matmul,
    matmul_reduce_scatter,
    prepare_all_gather_matmul,
    prepare_matmul_reduce_scatter,
)


class ColumnParallelLinear(nn.Module):
    """y = all_gather(x, seq_dim) @ W_r^T + b_r; W_r: this rank's rows of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                 seq_dim: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.seq_dim = group, seq_dim

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, seq_dim: int = 0) -> "ColumnParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (out_features divisible by the world size)."""
        r, P = dist.get_rank(group), dist.get_world_size(group)
        w = linear.weight.detach().chunk(P, dim=0)[r].clone()
        b = None if linear.bias is None else linear.bias.detach().chunk(P)[r].clone()
        return cls(w, b, group, seq_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = funcol.all_gather_single_autograd(x.contiguous(), self.seq_dim, self.group)
        return F.linear(full, self.weight, self.bias)

    def ficco_forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (y,) = all_gather_matmul(x, [self.weight.t()], self.seq_dim, self.group, return_A=False)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    """y = reduce_scatter(x @ W_r^T, seq_dim) + b; W_r: this rank's columns of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                 seq_dim: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None  # full: added after the sum
        self.group, self.seq_dim = group, seq_dim

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, seq_dim: int = 0) -> "RowParallelLinear":
        r, P = dist.get_rank(group), dist.get_world_size(group)
        w = linear.weight.detach().chunk(P, dim=1)[r].clone()
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, group, seq_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = funcol.reduce_scatter_single_autograd(F.linear(x, self.weight), "sum", self.seq_dim, self.group)
        return y if self.bias is None else y + self.bias

    def ficco_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul_reduce_scatter(x, self.weight.t(), "sum", self.seq_dim, self.group)
        return y if self.bias is None else y + self.bias


TP_LAYERS = (ColumnParallelLinear, RowParallelLinear)


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


def parallelize(model: nn.Module, plan: dict[str, str], group: dist.ProcessGroup, seq_dim: int = 0) -> nn.Module:
    """Replace the ``nn.Linear`` layers named in `plan` by this rank's shard, in place.

    `plan` maps a submodule's name (as ``model.named_modules()`` spells it) to
    ``"colwise"`` (ColumnParallelLinear: all-gather the sequence, split the outputs) or
    ``"rowwise"`` (RowParallelLinear: split the inputs, reduce-scatter the sequence). Every
    rank must start from the same full weights. Returns `model`.
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
        setattr(modules[parent_name] if parent_name else model, attr, kinds[kind].from_linear(linear, group, seq_dim))
    return model


def install(model: nn.Module, *, tables: bool = True) -> HookHandle:
    """Make every tensor-parallel linear layer of `model` run through ficco's ops.

    With `tables` (the default), the decision table of each layer's forward op and, for a
    trained weight, of its backward op is built now, for every token count (rank 0 builds,
    every rank receives): no step decides, or waits on a broadcast, the first one included.
    Every rank must call it, with the same model. Layers already switched are left alone
    (installing twice is harmless).
    """
    layers = []
    for module in model.modules():
        if isinstance(module, TP_LAYERS) and "forward" not in vars(module):
            module.forward = types.MethodType(type(module).ficco_forward, module)
            layers.append(module)
            if tables:
                _prepare(module)
    return HookHandle(layers)


def _prepare(layer: nn.Module) -> None:
    """Build the tables of `layer`'s ops: the forward's, and the backward's mirror op (the
    input's gradient) when the weight is trained."""
    w, group = layer.weight, layer.group
    out_features, in_features = w.shape  # this rank's shard of the weight
    if isinstance(layer, ColumnParallelLinear):  # AG(x) @ W^T; dx = RS(dy @ W)
        prepare_all_gather_matmul(in_features, out_features, w.dtype, w.device, group)
        if w.requires_grad:
            prepare_matmul_reduce_scatter(out_features, in_features, w.dtype, w.device, group)
    else:  # RS(x @ W^T); dx = AG(dy) @ W
        prepare_matmul_reduce_scatter(in_features, out_features, w.dtype, w.device, group)
        if w.requires_grad:
            prepare_all_gather_matmul(out_features, in_features, w.dtype, w.device, group)
