"""Drop-in DTensor parallel styles whose linears run ficco's schedules.

A torchtitan-style plan switches by class names only:

    parallelize_module(block, tp_mesh, {
        "attention_norm": SequenceParallel(),
        "attention": FiccoPrepareModuleInput(input_layouts=(Shard(1), None),
                                             desired_input_layouts=(Replicate(), None)),
        "attention.wq": FiccoColwiseParallel(), ..., "attention.wo": FiccoRowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": FiccoPrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": FiccoColwiseParallel(), "feed_forward.w2": FiccoRowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": FiccoColwiseParallel()})
    prepare_tables(block)  # optional: every decision table now, as ``tp.install`` builds them

The styles partition the weights as PyTorch's do (the same DTensor parameters: state_dict,
optimizers and checkpoints see no difference) and produce the same output layouts, so that
the rest of the plan (``SequenceParallel`` norms, attention) runs unchanged. Only the
linears' collectives change, in eager forward and backward:

- ``FiccoColwiseParallel``: a sequence-sharded input (``Shard(d)``, d not the last dim) is
  gathered while multiplying, ``torch_ops.all_gather_matmul`` (its backward: the mirror
  matmul reduce-scatter), instead of PyTorch's all-gather then matmul.
- ``FiccoRowwiseParallel``: the partial sums go to ``Shard(d)`` by
  ``torch_ops.matmul_reduce_scatter`` or to ``Replicate()`` by ``torch_ops.matmul_all_reduce``,
  instead of PyTorch's matmul then reduce-scatter or all-reduce.
- ``FiccoPrepareModuleInput``: where PyTorch's would all-gather a module's sequence-sharded
  input (``Shard(d)`` to ``Replicate()``), it leaves the input sharded, so that the module's
  Ficco colwise linears gather it while multiplying; those that take that very input
  (attention's wq, wk, wv; the feed-forward's w1, w3) share one ``all_gather_matmul`` with
  all their weights, the one gather PyTorch's plan makes.

Where ficco's ops have nothing to overlap or cannot run the layout (a replicated input, a
sequence length or weight the mesh does not divide evenly, ``Partial`` or feature-sharded
outputs, an ``nn.Embedding``), the styles run PyTorch's own path. Biases are added after the
collective as DTensor ops, with PyTorch's placements and gradients' placements. Only 1-D
meshes (the tensor-parallel mesh).

The ops run without their per-call check that every rank passes the same shapes
(``run_check=False``): a DTensor's global shape is the same on every rank by DTensor's
own contract, and the styles run ficco's ops only where the mesh divides it evenly, so
every rank's local shapes are equal; PyTorch's styles check nothing either
(``DTensor.from_local`` skips its own check by default, ``run_check=False``, for the
same reason: it is a collective per call).

Under ``torch.compile`` the styles call the registered ops (``torch.ops.ficco``,
``library.py``: one graph node each, no graph break; ``torch_ops``' autograd Functions and
the executor's Python would be traced into and fail), the shared gather included: the
compiled block runs the same ops as eager (``tests/test_dtensor_compile.py``).
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from ficco_select.runtime import library  # noqa: F401 - registers torch.ops.ficco (the compiled path)
from ficco_select.runtime.torch_ops import (
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
    prepare_all_gather_matmul,
    prepare_matmul_all_reduce,
    prepare_matmul_reduce_scatter,
)

__all__ = ["FiccoColwiseParallel", "FiccoRowwiseParallel", "FiccoPrepareModuleInput", "prepare_tables"]


class FiccoColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` (same arguments) whose ``nn.Linear`` gathers a sequence-sharded
    input while multiplying (``all_gather_matmul``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):  # an embedding has no collective to overlap
            return super()._apply(module, device_mesh)
        _one_dim(device_mesh, self)
        module = distribute_module(module, device_mesh, self._partition_linear_fn,
                                   partial(_annotate_input, self.input_layouts),
                                   partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
        module.forward = types.MethodType(partial(_colwise_forward, input_layouts=self.input_layouts), module)
        module._ficco_colwise_mesh = device_mesh
        module._ficco_group_name = device_mesh.get_group().group_name  # a constant for torch.compile
        return module


class FiccoRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` (same arguments) whose ``nn.Linear`` reduces its partial sums
    while multiplying: ``matmul_reduce_scatter`` to ``Shard(d)``, ``matmul_all_reduce`` to
    ``Replicate()``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        _one_dim(device_mesh, self)
        self.desired_input_layouts = (Shard(-1),)  # as PyTorch's rowwise linear
        module = distribute_module(module, device_mesh, self._partition_linear_fn,
                                   partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                   partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
        module.forward = types.MethodType(partial(_rowwise_forward, output_layout=self.output_layouts[0]), module)
        module._ficco_rowwise_layout = self.output_layouts[0]
        module._ficco_group_name = device_mesh.get_group().group_name
        return module


class FiccoPrepareModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` (same arguments) that leaves a sequence-sharded input sharded
    where PyTorch's would all-gather it (``Shard(d)`` to ``Replicate()``): the module's
    Ficco colwise linears gather it while multiplying, all those that take it in one call
    (a module without them: PyTorch's gather).

    The input stays a DTensor of the same global shape, so DTensor code in the module sees
    the same values (only ``to_local()`` sees a shard). With ``use_local_output`` the
    module wants local tensors: PyTorch's gather then."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(lambda mod, args, kwargs: self._prepare_for(
                mod, self._prepare_input_kwarg_fn, args, kwargs, device_mesh), with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, args: self._prepare_for(
                mod, self._prepare_input_fn, args, device_mesh))
        module.register_forward_pre_hook(_share_gathers)  # after the preparing hook: it sees DTensors
        module.register_forward_hook(_drop_shared_gathers, always_call=True)
        module._ficco_prepares = True
        return module

    def _prepare_for(self, module: nn.Module, prepare, *args):
        """PyTorch's preparation of `module`'s inputs, which leaves the gathers to the
        module's Ficco colwise linears where it has any (else PyTorch's gathers)."""
        self._deferring = any(_ficco_colwise(c) for c in module.children())
        try:
            return prepare(*args)
        finally:
            self._deferring = False

    def _prepare_input_arg(self, input, mesh: DeviceMesh, input_layout: Placement | None,
                           desired_layout: Placement | None):
        if (getattr(self, "_deferring", False) and not self.use_local_output and isinstance(input_layout, Shard)
                and isinstance(desired_layout, Replicate) and isinstance(input, torch.Tensor)):
            dt = input if isinstance(input, DTensor) else DTensor.from_local(input, mesh, (input_layout,),
                                                                             run_check=False)
            if _gather_dim(dt) is not None:
                return dt  # gathered by the colwise linears that multiply it
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)


# -- the forwards --------------------------------------------------------------------------
def _colwise_forward(linear: nn.Linear, x: DTensor, *, input_layouts: tuple[Placement]) -> DTensor:
    """x @ W^T (+ b), sharded on the last dim, as PyTorch's colwise linear returns it."""
    if _gather_dim(x) is None or not _even(linear.weight, 0):  # PyTorch's path, its input hook's redistribution
        if input_layouts != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        return F.linear(x, linear.weight, linear.bias)
    shared = next((s for s in getattr(linear, "_ficco_shared", ()) if s.x is x), None)
    y = shared.output(linear) if shared is not None else None
    return y if y is not None else _gather_matmul(x, [linear])[0]


def _gather_matmul(x: DTensor, linears: list[nn.Linear]) -> list[DTensor]:
    """Every linear's output for the sequence-sharded x, from one ``all_gather_matmul``."""
    mesh = x.device_mesh
    Bs = [linear.weight.to_local().t() for linear in linears]
    if torch.compiler.is_compiling():  # the registered op: one node in the graph (see the module)
        _, ys = torch.ops.ficco.all_gather_matmul(x.to_local(), Bs, _gather_dim(x), linears[0]._ficco_group_name,
                                                  False)
    else:
        _, ys = all_gather_matmul(x.to_local(), Bs, _gather_dim(x), mesh.get_group(), return_A=False,
                                  run_check=False)
    outs = [DTensor.from_local(y, mesh, (Shard(y.ndim - 1),), run_check=False) for y in ys]
    return [out if linear.bias is None else out + linear.bias for out, linear in zip(outs, linears)]


def _rowwise_forward(linear: nn.Linear, x: DTensor, *, output_layout: Placement) -> DTensor:
    """x @ W^T (+ b), reduced to `output_layout`, as PyTorch's rowwise linear returns it."""
    mesh = x.device_mesh
    if not _features_sharded(x) or not _even(linear.weight, 1):  # PyTorch's path
        return F.linear(x, linear.weight, linear.bias)
    local, W = x.to_local(), linear.weight.to_local().t()
    compiling, name = torch.compiler.is_compiling(), linear._ficco_group_name  # compiled: the registered ops
    if isinstance(output_layout, Replicate):
        y = (torch.ops.ficco.matmul_all_reduce(local, W, "sum", name, False) if compiling
             else matmul_all_reduce(local, W, "sum", mesh.get_group(), run_check=False))
    elif isinstance(output_layout, Shard) and _scatterable(output_layout.dim, x, mesh):
        output_layout = Shard(output_layout.dim % x.ndim)
        y = (torch.ops.ficco.matmul_reduce_scatter(local, W, "sum", output_layout.dim, name, False) if compiling
             else matmul_reduce_scatter(local, W, "sum", output_layout.dim, mesh.get_group(), run_check=False))
    else:  # Partial, a scatter of the features or of an extent the mesh does not divide: PyTorch's path
        return F.linear(x, linear.weight, linear.bias)
    out = DTensor.from_local(y, mesh, (output_layout,), run_check=False)
    return out if linear.bias is None else out + _ReducedGrad.apply(linear.bias)


class _ReducedGrad(torch.autograd.Function):
    """Identity on a DTensor, whose gradient is redistributed to the DTensor's placements:
    a replicated bias added to sequence-sharded rows gets the sum over every rank's rows
    (``Replicate``, as PyTorch's rowwise linear gives it), not this rank's (``Partial``)."""

    @staticmethod
    def forward(ctx, t: DTensor) -> DTensor:
        ctx.placements = t.placements
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        return grad if grad.placements == ctx.placements else grad.redistribute(placements=ctx.placements)


# -- one gather for the linears that take the same input -----------------------------------
class _SharedGather:
    """A module's sequence-sharded input and the Ficco colwise linears that may multiply it:
    the first of them to do so runs one ``all_gather_matmul`` with every one's weight; the
    others take their output. A linear that multiplies another input runs its own (the
    share's output for it is then computed for nothing: correct, not free)."""

    def __init__(self, x: DTensor, linears: list[nn.Linear]) -> None:
        self.x, self.linears, self.outputs = x, linears, None

    def output(self, linear: nn.Linear) -> DTensor | None:
        if self.outputs is None:
            self.outputs = dict(zip(self.linears, _gather_matmul(self.x, self.linears)))
        return self.outputs.pop(linear, None)  # None: a second call on the same input runs its own


def _share_gathers(module: nn.Module, inputs: tuple) -> None:
    """Before `module` runs: one share per sequence-sharded input, with the Ficco colwise
    children that could multiply it (its features, dtype and mesh)."""
    children = [c for c in module.children() if _ficco_colwise(c)]
    for x in inputs:
        if not isinstance(x, DTensor) or _gather_dim(x) is None:
            continue
        takers = [c for c in children if c._ficco_colwise_mesh == x.device_mesh and c.weight.shape[1] == x.shape[-1]
                  and c.weight.dtype == x.dtype and _even(c.weight, 0)]
        if len(takers) > 1:
            share = _SharedGather(x, takers)
            for c in takers:
                c._ficco_shared = (*getattr(c, "_ficco_shared", ()), share)


def _ficco_colwise(module: nn.Module) -> bool:
    """Whether `module` is a linear that ``FiccoColwiseParallel`` parallelized."""
    return "_ficco_colwise_mesh" in vars(module)


def _drop_shared_gathers(module: nn.Module, inputs: tuple, output) -> None:
    """After `module` ran (or raised): its children hold no share (nor its outputs) any longer."""
    for c in module.children():
        c.__dict__.pop("_ficco_shared", None)


# -- decision tables before the first step -------------------------------------------------
def prepare_tables(model: nn.Module) -> None:
    """Build now the decision tables of the ops of every linear in `model` that ficco's styles
    parallelized, forward and (for a trained weight) backward, for every token count, as
    ``tp.install`` does: no step decides or waits on a broadcast, the first one included.
    Colwise linears of a ``FiccoPrepareModuleInput`` module that take the same features are
    prepared as their shared gather. Every rank calls it after ``parallelize_module``, with
    the same model. A call shape it did not foresee is decided at its first call, as without."""
    shared = set()
    for module in model.modules():
        if vars(module).get("_ficco_prepares"):
            for linears in _sharing(module):
                _prepare_colwise(linears)
                shared.update(map(id, linears))
    for module in model.modules():
        if _ficco_colwise(module) and id(module) not in shared and _even(module.weight, 0):
            _prepare_colwise([module])
        elif "_ficco_rowwise_layout" in vars(module) and _even(module.weight, 1):
            _prepare_rowwise(module)


def _sharing(module: nn.Module) -> list[list[nn.Linear]]:
    """`module`'s Ficco colwise children in the groups that share a gather (same in-features,
    dtype and mesh), as ``_share_gathers`` groups them for an input of those features."""
    groups: dict[tuple, list[nn.Linear]] = {}
    for c in module.children():
        if _ficco_colwise(c) and _even(c.weight, 0):
            groups.setdefault((c.weight.shape[1], c.weight.dtype, c._ficco_colwise_mesh), []).append(c)
    return list(groups.values())


def _prepare_colwise(linears: list[nn.Linear]) -> None:
    """AG(x) @ [W...]^T; the input's gradient RS(dy @ [W...])."""
    w = linears[0].weight  # DTensors: their global shapes
    n_local, k = sum(c.weight.shape[0] for c in linears) // w.device_mesh.size(), w.shape[1]
    group = w.device_mesh.get_group()
    prepare_all_gather_matmul(k, n_local, w.dtype, w.device, group)
    if w.requires_grad:
        prepare_matmul_reduce_scatter(n_local, k, w.dtype, w.device, group)


def _prepare_rowwise(linear: nn.Linear) -> None:
    """RS(x @ W^T), the input's gradient AG(dy) @ W; or AR(x @ W^T), whose gradient has no collective."""
    w, layout = linear.weight, linear._ficco_rowwise_layout
    n, k_local, group = w.shape[0], w.shape[1] // w.device_mesh.size(), w.device_mesh.get_group()
    if isinstance(layout, Replicate):
        prepare_matmul_all_reduce(k_local, n, w.dtype, w.device, group)
    elif isinstance(layout, Shard):
        prepare_matmul_reduce_scatter(k_local, n, w.dtype, w.device, group)
        if w.requires_grad:
            prepare_all_gather_matmul(n, k_local, w.dtype, w.device, group)


# -- layouts ficco's ops run ---------------------------------------------------------------
def _annotate_input(input_layouts: tuple[Placement], module: nn.Module, inputs: tuple, device_mesh: DeviceMesh):
    """The colwise linear's input as a DTensor (a local tensor has `input_layouts`), left
    sharded: ``_colwise_forward`` gathers it while multiplying, or as PyTorch would."""
    x = inputs[0]
    return x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, input_layouts, run_check=False)


def _gather_dim(x: DTensor) -> int | None:
    """The dim `x` is sharded along where ``all_gather_matmul`` can gather it (not the
    features, evenly over the mesh), else None."""
    (placement,) = x.placements
    if not isinstance(placement, Shard):
        return None
    dim = placement.dim % x.ndim
    return dim if dim != x.ndim - 1 and x.shape[dim] % x.device_mesh.size() == 0 else None


def _features_sharded(x: DTensor) -> bool:
    """Whether `x` is sharded along its last dim, the rowwise linear's input layout."""
    (placement,) = x.placements
    return isinstance(placement, Shard) and placement.dim % x.ndim == x.ndim - 1


def _scatterable(dim: int, x: DTensor, mesh: DeviceMesh) -> bool:
    """Whether ``matmul_reduce_scatter`` scatters the output's `dim` evenly (not the features)."""
    dim %= x.ndim
    return dim != x.ndim - 1 and x.shape[dim] % mesh.size() == 0


def _even(weight: DTensor, dim: int) -> bool:
    """Whether every rank holds as many of the weight's sharded `dim` (the ops' per-call check
    wants the same shapes on every rank)."""
    return weight.shape[dim] % weight.device_mesh.size() == 0


def _one_dim(device_mesh: DeviceMesh, style) -> None:
    if device_mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__}: a 1-D (tensor-parallel) mesh, not {device_mesh.ndim}-D")
