"""Runtime estimates for Inductor's overlap scheduler, from the calibrated cost model.

Inductor's overlap scheduler (``torch._inductor.config.aten_distributed_optimizations``,
``enable_overlap_scheduling``) moves collectives earlier and their waits later so that
compute hides them; how far depends on its estimate of each node's time. Its hook
``aten_distributed_optimizations.custom_runtime_estimation`` is called on the post-grad FX
graph as ``estimate(node: torch.fx.Node, override_size: int | None) -> float | None``, in
milliseconds; None means "use Inductor's own estimate" (its roofline or benchmark for
compute, its NCCL model for collectives). This module answers it with ``ficco_select.costs``
on the machine the process decides for (``dispatch.hardware_name``: ``configure(hardware=)``,
$FICCO_HARDWARE, the cpu preset, a GPU's preset by its name) or on the one given:

    from ficco_select.runtime.estimate import install_estimates
    with install_estimates() as estimates:   # or install_estimates(hardware="h100-nvswitch")
        out = torch.compile(model)(x)        # compiled while installed
    for estimate in estimates.made:          # what the scheduler was told
        print(estimate.line())

What it estimates, and what it leaves to Inductor (None):
- GEMMs: ``aten.mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``: ``costs.gemm_time`` of
  the (M x K) @ (K x N) shape at the inputs' dtype (its peak, ``HardwareSpec.peak_of``; its
  bytes); a batch of B as B GEMMs back to back with one launch.
- Functional collectives (``_c10d_functional``): ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_reduce`` (and ``all_reduce_``), ``all_to_all_single`` and
  the coalesced forms: ``costs.collective_time`` of the shard one rank sends one peer, over
  the group's size. ``override_size`` (Inductor's bytes of the collective's inputs plus
  outputs, as ``comm_analysis.estimate_fx_collective_size`` counts them) scales the shard;
  0 asks for the fixed cost alone.
- Everything else, a symbolic shape, a machine no spec describes, a node it cannot read:
  None. The hook never raises into Inductor.

The scheduler's other settings ``install_estimates`` changes, and why: it turns the
scheduler on (``enable_overlap_scheduling``: estimates alone change nothing), and it sets
``compute_estimator="analytical"``: with Inductor's default ``"benchmark"`` the scheduler
would time each GEMM on the device, look the time up in Inductor's on-disk cache before
asking the hook, and write the hook's answer into that cache as if it were measured. Both
are restored on exit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch

from ficco_select import costs
from ficco_select.executor.operators import dtype_name
from ficco_select.hardware import HardwareError, HardwareSpec, load_hardware
from ficco_select.runtime import dispatch

__all__ = ["install_estimates", "runtime_estimate", "RuntimeEstimates", "Estimate"]

log = logging.getLogger("ficco_select.runtime.estimate")

MS_PER_S = 1e3
"""The hook's unit is milliseconds; the cost model's is seconds."""

COMPUTE_ESTIMATORS = ("analytical", "benchmark")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One answer the hook gave the scheduler."""

    node: str
    """The FX node's name in its graph."""
    op: str
    """The node's target, e.g. ``aten.mm.default``."""
    kind: Literal["gemm", "collective"]
    shape: tuple[int, ...]
    """A GEMM's (B, M, N, K); a collective's (shard bytes, group size)."""
    hardware: str
    ms: float

    def line(self) -> str:
        return f"{self.node} {self.op} {self.kind} {self.shape} on {self.hardware}: {self.ms:.4g} ms"


# -- one node ---------------------------------------------------------------------------------
def runtime_estimate(node, override_size: int | None = None, *,
                     hardware: str | HardwareSpec | None = None) -> float | None:
    """Milliseconds the cost model gives `node` (a post-grad ``torch.fx.Node``) on `hardware`
    (default: the machine ``dispatch`` decides for, by the node's device), or None for
    Inductor's own estimate. Never raises."""
    estimate = _estimate(node, override_size, hardware)
    return None if estimate is None else estimate.ms


def _estimate(node, override_size, hardware) -> Estimate | None:
    try:
        if getattr(node, "op", None) != "call_function":
            return None
        target = node.target
        if target in GEMM_OPERANDS:
            return _gemm_estimate(node, hardware)
        if target in COLLECTIVES:
            return _collective_estimate(node, override_size, hardware)
        return None
    except Exception as e:  # noqa: BLE001 - Inductor's estimate instead of a failed compile
        log.debug("ficco-select estimates: no estimate for %s (%s: %s)", getattr(node, "name", node),
                  type(e).__name__, e)
        return None


def _gemm_estimate(node, hardware) -> Estimate | None:
    a_index, b_index = GEMM_OPERANDS[node.target]
    a, b = _val(node.args[a_index]), _val(node.args[b_index])
    if a is None or b is None or not (_concrete(a.shape) and _concrete(b.shape)):
        return None
    batch = a.shape[0] if a.ndim == 3 else 1
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    hw = _machine(a.device, hardware)
    if hw is None:
        return None
    dtype = dtype_name(a.dtype)
    # One dtype's bytes for all three operands, as the cost model has it (a scaled mm's
    # output is wider than its fp8 inputs: its memory term is a little low).
    seconds = float(costs.gemm_time(hw, M, N, K, a.element_size(), hw.peak_of(dtype) * 1e12))
    if batch != 1:  # B GEMMs back to back, one launch
        launch = hw.gemm_launch_us * costs.US if seconds > 0 else 0.0
        seconds = batch * (seconds - launch) + launch
    return _made(node, "gemm", (batch, M, N, K), hw, seconds)


def _collective_estimate(node, override_size, hardware) -> Estimate | None:
    op, shard_of = COLLECTIVES[node.target]
    kwargs = _normalized_kwargs(node)
    inputs = kwargs.get("inputs", [kwargs.get("input")])
    vals = [_val(x) for x in inputs]
    if not vals or any(v is None or not _concrete(v.shape) for v in vals):
        return None
    P = _group_size(kwargs)
    hw = _machine(vals[0].device, hardware)
    if hw is None or not isinstance(P, int) or P < 1:
        return None
    shard_bytes = sum(shard_of(v, P, kwargs) for v in vals)  # coalesced: one collective of all
    if override_size is not None:
        if override_size == 0:
            shard_bytes = 1  # one byte: the fixed cost alone
        else:
            from torch._inductor.comm_analysis import estimate_fx_collective_size

            whole = estimate_fx_collective_size(node)
            if not whole:
                return None
            shard_bytes = shard_bytes * override_size / whole
    seconds = float(costs.collective_time(hw, costs.OP_CODES[op], shard_bytes, P))
    return _made(node, "collective", (int(shard_bytes), P), hw, seconds)


def _made(node, kind: str, shape: tuple, hw: HardwareSpec, seconds: float) -> Estimate:
    estimate = Estimate(node=node.name, op=str(node.target), kind=kind, shape=tuple(int(s) for s in shape),
                        hardware=hw.name, ms=seconds * MS_PER_S)
    log.debug("ficco-select estimates: %s", estimate.line())
    return estimate


# -- what the nodes are -------------------------------------------------------------------------
aten, c10d = torch.ops.aten, torch.ops._c10d_functional

GEMM_OPERANDS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
                 aten.baddbmm.default: (1, 2), aten._scaled_mm.default: (0, 1)}
"""GEMM op -> the positions of its A (.., M, K) and B (.., K, N) arguments."""


def _gathered(t, P: int, kwargs: dict) -> float:
    return _bytes(t)  # the input is the shard


def _split(t, P: int, kwargs: dict) -> float:
    return _bytes(t) / P  # the input holds P shards


def _a2a_shard_bytes(t, P: int, kwargs: dict) -> float:
    """The largest piece this rank sends or receives from one peer (uneven splits: the
    busiest pair bounds the exchange); an even split without split sizes."""
    splits = [s for key in ("input_split_sizes", "output_split_sizes") for s in (kwargs.get(key) or [])]
    if not splits:
        return _bytes(t) / P
    if not all(isinstance(s, int) for s in splits):
        raise ValueError("symbolic split sizes")
    row_bytes = _bytes(t) / t.shape[0] if t.shape[0] else 0
    return max(splits) * row_bytes


COLLECTIVES = {
    c10d.all_gather_into_tensor.default: ("ag_gemm", _gathered),
    c10d.all_gather_into_tensor_coalesced.default: ("ag_gemm", _gathered),
    c10d.reduce_scatter_tensor.default: ("gemm_rs", _split),
    c10d.reduce_scatter_tensor_coalesced.default: ("gemm_rs", _split),
    c10d.all_reduce.default: ("gemm_ar", _split),
    c10d.all_reduce_.default: ("gemm_ar", _split),
    c10d.all_reduce_coalesced.default: ("gemm_ar", _split),
    c10d.all_to_all_single.default: ("a2a_gemm", _a2a_shard_bytes),
}
"""Functional collective -> (the cost model's operator, bytes of the shard one rank sends
one peer, from one input tensor, the group size and the call's arguments)."""


def _normalized_kwargs(node) -> dict:
    from torch.fx.operator_schemas import normalize_function

    normalized = normalize_function(node.target, args=node.args, kwargs=node.kwargs,
                                    normalize_to_only_use_kwargs=True)
    if normalized is None:
        raise ValueError(f"cannot read the arguments of {node.target}")
    return normalized[1]


def _group_size(kwargs: dict) -> int:
    if "group_size" in kwargs:
        return kwargs["group_size"]
    from torch._inductor.fx_passes.bucketing import _resolve_group_name
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    return _get_group_size_by_name(_resolve_group_name(kwargs["group_name"]))


def _machine(device, hardware: str | HardwareSpec | None) -> HardwareSpec | None:
    """The spec to estimate on: the one given, else the one ``dispatch`` decides with on
    `device`; None where no spec describes it (Inductor's own estimate then)."""
    if isinstance(hardware, HardwareSpec):
        return hardware
    try:
        name = hardware or dispatch.hardware_name(device)
        return None if name is None else load_hardware(name)
    except (HardwareError, RuntimeError, AssertionError) as e:  # no GPU name, no such preset
        log.debug("ficco-select estimates: no machine for %s (%s)", device, e)
        return None


def _val(node_or_value) -> Any:
    val = getattr(node_or_value, "meta", {}).get("val")
    return val if hasattr(val, "shape") and hasattr(val, "dtype") else None


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def _concrete(shape) -> bool:
    """Whether every size is a plain int (a SymInt: Inductor's own estimate)."""
    return all(type(s) is int for s in shape)


# -- installing -----------------------------------------------------------------------------------
class RuntimeEstimates:
    """Inductor's ``custom_runtime_estimation``: the cost model's estimate of a node, else
    the estimator that was installed before (if any), else None (Inductor's own).
    ``made`` lists every estimate it gave."""

    def __init__(self, hardware: str | HardwareSpec | None = None) -> None:
        self.hardware = hardware
        self.made: list[Estimate] = []
        self._fallback = None
        self._previous: dict[str, Any] | None = None

    def __call__(self, node, override_size: int | None = None) -> float | None:
        estimate = _estimate(node, override_size, self.hardware)
        if estimate is not None:
            self.made.append(estimate)
            return estimate.ms
        return self._fallback(node, override_size) if self._fallback is not None else None

    def __reduce__(self):
        # Inductor pickles its config into its FX graph cache key: the machine decides the
        # estimates, the record of estimates made does not.
        return (RuntimeEstimates, (self.hardware,))

    def install(self, *, enable_overlap_scheduling: bool = True,
                compute_estimator: Literal["analytical", "benchmark"] | None = "analytical") -> RuntimeEstimates:
        """Set ``aten_distributed_optimizations.custom_runtime_estimation`` to this (and the
        two settings of ``install_estimates``); ``remove`` restores all three."""
        if compute_estimator is not None and compute_estimator not in COMPUTE_ESTIMATORS:
            raise ValueError(f"compute_estimator={compute_estimator!r}: use one of "
                             f"{', '.join(COMPUTE_ESTIMATORS)}, or None to leave Inductor's setting")
        if self._previous is not None:
            return self
        options = _options()
        wanted = {"custom_runtime_estimation": self}
        if enable_overlap_scheduling:
            wanted["enable_overlap_scheduling"] = True
        if compute_estimator is not None:
            wanted["compute_estimator"] = compute_estimator
        self._previous = {key: getattr(options, key) for key in wanted}
        previous = self._previous["custom_runtime_estimation"]
        self._fallback = previous if callable(previous) else None
        for key, value in wanted.items():
            setattr(options, key, value)
        return self

    def remove(self) -> None:
        """Restore the settings as they were before ``install``."""
        if self._previous is not None:
            options = _options()
            for key, value in self._previous.items():
                setattr(options, key, value)
            self._previous = self._fallback = None

    def __enter__(self) -> RuntimeEstimates:
        return self if self._previous is not None else self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


def install_estimates(hardware: str | HardwareSpec | None = None, *, enable_overlap_scheduling: bool = True,
                      compute_estimator: Literal["analytical", "benchmark"] | None = "analytical"
                      ) -> RuntimeEstimates:
    """Install the cost model's estimates for Inductor's overlap scheduler now; the returned
    estimator is also a context manager that restores Inductor's settings on exit.

    `hardware`: a preset name, a spec file or a ``HardwareSpec`` (checked here); None: the
    machine ``dispatch`` decides for, per node's device. `enable_overlap_scheduling`: also
    turn the scheduler on. `compute_estimator`: the scheduler's setting for compute nodes
    (``"analytical"``: see the module docstring; None leaves it). Install before the first
    call of the compiled function: Inductor reads the settings when it compiles.
    """
    if hardware is not None and not isinstance(hardware, HardwareSpec):
        hardware = load_hardware(hardware).name  # a typo fails here, naming the presets
    return RuntimeEstimates(hardware).install(enable_overlap_scheduling=enable_overlap_scheduling,
                                              compute_estimator=compute_estimator)


def _options():
    import torch._inductor.config as inductor_config

    return inductor_config.aten_distributed_optimizations
