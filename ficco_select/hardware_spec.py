"""A machine's spec: its fields (units in the names, see ``HardwareSpec``), their roles,
and the check that reads a mapping into a spec. A missing, unknown or impossible field is
an error naming the field and where it came from. Plain Python: the runtime may read specs.
Where a spec comes from (the shipped presets, a spec file, the machines a job names):
``ficco_select.hardware``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from ficco_select.scenario import DTYPES

TOPOLOGIES = ("fully_connected", "switch", "ring")
KINDS = ("gpu", "cpu")
"""``HardwareSpec.kind``: a GPU node, or the cpu backend's kind of machine."""


class HardwareError(ValueError):
    """A hardware spec is missing, malformed or impossible; names the field."""


def _field(unit: str, role: str, default: Any = dataclasses.MISSING, **bounds) -> Any:
    """A spec field with its unit and role (``ROLES``); `bounds` (low, high, low_open,
    high_open) narrow a number's validation, ``sample=(exponent, cap)`` how machine sampling
    draws a fraction (value x factor ** exponent, at most cap)."""
    return dataclasses.field(default=default, metadata={"unit": unit, "role": role, **bounds})


ROLES = ("label", "count", "peak", "topology", "rate", "latency", "fraction", "ceiling", "kind", "flag", "provenance")
"""What a spec field is. The lists that treat fields alike derive from the roles
(``fields_of``): validation, machine sampling (``ficco_select.data.machines``), recalibration
(``ficco_select.data.calibrate.RECALIBRATED``), perturbation (``ficco_select.train.adapt.PERTURBED``) and the
runtime's range check (``ficco_select.runtime.scope.SPEC_RANGE_FIELDS``).
- ``label``: a non-empty string. ``count``: a positive integer (``copy_engines`` may be 0).
- ``peak``: TFLOP/s per dtype. ``topology``: one of ``TOPOLOGIES``.
- ``rate``: a bandwidth, GB/s. ``latency``: a fixed cost, us. ``fraction``: a number in its bounds.
A rate or latency with a default of 0 is a model term a spec may leave out: 0 turns it off.
- ``ceiling``: a bandwidth that caps a rate where measurements show it, GB/s; 0 (off) on every
  trained machine. Machine sampling, perturbation and recalibration leave it as the spec
  says; the runtime's range check reads it, so a machine with one is not one the model saw.
- ``kind``: one of ``KINDS``. ``flag``: true or false, what the machine has; machine sampling,
  perturbation and recalibration leave it as the spec says.
- ``provenance``: where each other field's number came from (``PROVENANCES``); not a number of
  the machine: two specs that differ only in it are the same machine."""

PROVENANCES = ("measured", "datasheet", "assumed")
"""Where a spec's number came from: ``measured`` (fitted on measurements of this machine or its
generation: published rows, a sweep, ``ficco adapt`` / ``ficco hardware bring-up``),
``datasheet`` (the vendor's figure) or ``assumed`` (a guess, or another machine's number).
The GPU do-no-harm rule trusts a decision only as far as the terms it rests on were measured
(``ficco_select.runtime.no_harm.TRUST_TERMS``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    name: str = _field("", "label")
    """Preset name, e.g. ``mi300x-8``."""
    description: str = _field("", "label")
    """What machine this is."""
    devices: int = _field("devices", "count")
    """Accelerators (ranks) in one node."""
    peak_tflops: dict[str, float] = _field("TFLOP/s", "peak")
    """Dense peak matrix throughput per dtype (float32, bfloat16, float16, float8_e4m3fn where
    the hardware has fp8), TFLOP/s."""
    mem_bw_gbps: float = _field("GB/s", "rate")
    """Memory bandwidth of one device, GB/s."""
    compute_units: int = _field("units", "count")
    """SMs (NVIDIA) or CUs (AMD): the unit of wave quantization."""
    tile_m: int = _field("rows", "count")
    """GEMM output tile rows per compute unit (wave quantization)."""
    tile_n: int = _field("columns", "count")
    """GEMM output tile columns per compute unit."""
    gemm_efficiency: float = _field("fraction", "fraction", low=0.0, high=1.0, high_open=False, sample=(0.5, 0.95))
    """Fraction of peak a large, well-shaped GEMM reaches, in (0, 1]."""
    gemm_launch_us: float = _field("us", "latency")
    """Fixed cost of one GEMM call (launch, prologue), microseconds."""
    topology: str = _field("", "topology")
    """How devices connect: fully_connected (a link per pair), switch (NVSwitch-like), ring."""
    link_bw_gbps: float = _field("GB/s", "rate")
    """One-direction bandwidth of one peer link (fully_connected, ring) or of a device's
    port into the switch (switch), GB/s."""
    sm_comm_latency_us: float = _field("us", "latency")
    """Fixed cost per transfer moved by kernels on compute units (``sm`` engine), us."""
    sm_comm_units: float = _field("fraction", "fraction", low=0.0, high=1.0, low_open=False, sample=(1.0, 0.5))
    """Fraction of compute units an ``sm`` transfer occupies while it runs, in [0, 1)."""
    sm_bw_gbps: float = _field("GB/s", "ceiling", 0.0)
    """Bandwidth a device's ``sm`` transfers reach together, GB/s; concurrent transfers share
    it. The few compute units a transfer occupies issue loads and stores, not bulk copies, and
    may not fill the link. 0 (the default): the link's rate."""
    copy_engines: int = _field("engines", "count")
    """DMA copy engines per device usable for peer transfers (0: no ``dma`` engine)."""
    dma_latency_us: float = _field("us", "latency")
    """Fixed cost per copy-engine transfer, us (larger than ``sm``'s)."""
    dma_bw_gbps: float = _field("GB/s", "rate")
    """Bandwidth one copy engine sustains, GB/s."""
    dma_mem_contention: float = _field("fraction", "fraction", low=0.0, high=1.0, low_open=False, high_open=False,
                                       sample=(1.0, 1.0))
    """GEMM slowdown fraction per unit of memory bandwidth a ``dma`` transfer takes, in [0, 1]."""
    gemm_mem_efficiency: float = _field("fraction", "fraction", 1.0, low=0.0, high=1.0, high_open=False,
                                        sample=(0.5, 1.0))
    """Fraction of ``mem_bw_gbps`` a GEMM's operand traffic reaches, in (0, 1]: what bounds a
    GEMM with few rows (a piece of a decomposed schedule), which streams its whole weight
    matrix for little compute. 1 (the default): the data-sheet bandwidth."""
    coll_latency_us: float = _field("us", "latency", 0.0)
    """Fixed cost of one whole collective of the collective library (NCCL, RCCL), us."""
    coll_bw_gbps: float = _field("GB/s", "rate", 0.0)
    """Bus bandwidth of the collective library's all-gather / reduce-scatter / all-to-all
    (nccl-tests' busbw: (P - 1) shards through each device), GB/s. 0 (the default): the
    serial baseline's collective is modelled by ``sm`` transfers (a ring, or a direct
    exchange with every peer, the faster)."""
    step_sync_us: float = _field("us", "latency", 0.0)
    """Fixed cost per step of a decomposed schedule beyond its transfer and its GEMM: waiting
    on the peer's signal, ordering the streams, us."""

    overlap_efficiency: float = _field("fraction", "fraction", 1.0, low=0.0, high=1.0, high_open=False,
                                       sample=(0.5, 1.0))
    """Realized fraction of the ideal overlap, in (0, 1]: a step of an overlapped schedule
    takes max(GEMM, transfer) + (1 - this) x min(GEMM, transfer). What interference between
    the overlapped GEMM and the transfer costs beyond ``sm_comm_units`` and
    ``dma_mem_contention`` (L2 and HBM traffic, the scheduler's own waits). 1 (the
    default): the ideal overlap."""
    overlap_call_us: float = _field("us", "latency", 0.0)
    """Fixed cost of one call of an overlapped schedule per peer, beyond its steps (the
    barrier and symmetric-memory handshake with each peer before the first transfer, extra
    launches), us: a call pays (P - 1) x this. What dominates at decode sizes."""
    fp8_gemm_efficiency: float = _field("fraction", "fraction", 1.0, low=0.0, high=2.0, high_open=False,
                                        sample=(0.5, 2.0))
    """An fp8 GEMM's efficiency relative to ``gemm_efficiency`` (of the fp8 peak), in (0, 2]:
    fp8 kernels reach another fraction of their peak than bf16's. 1 (the default): the same."""
    switch_reduce: bool = _field("", "flag", False)
    """Whether the fabric reduces and multicasts in the switch (NVLink SHARP: NCCL's NVLS
    algorithms, PyTorch's symmetric-memory ``multimem`` ops): the ``switch`` engine's schedules
    are legal only where it is true. True on the NVSwitch and NVL72 nodes of Hopper and
    Blackwell; false on A100 (its NVSwitch has no SHARP), PCIe, MI300X and the cpu."""
    switch_latency_us: float = _field("us", "latency", 0.0)
    """Fixed cost of one operation the switch reduces or multicasts (a whole collective, or one
    step of a decomposed schedule), us."""
    switch_bw_gbps: float = _field("GB/s", "rate", 0.0)
    """Bytes per second one device's port moves through the switch while it reduces or
    multicasts, GB/s: an all-reduce or reduce-scatter of S bytes per rank sends each rank's S
    once (the switch adds), an all-gather receives the P - 1 other shards (sent once,
    multicast). 0 on a machine without ``switch_reduce``."""
    provenance: dict[str, str] = dataclasses.field(default_factory=dict, compare=False,
                                                   metadata={"unit": "", "role": "provenance"})
    """Field name -> where its number came from (``PROVENANCES``); a field it leaves out is
    ``assumed``. The presets give every field's; a spec file may leave it out."""
    kind: str = _field("", "kind", "")
    """``gpu`` or ``cpu`` (``KINDS``): a GPU node, whose ranks are its devices, or the cpu
    backend's kind, whose ranks are processes time-sharing its cores (a shaped fabric's
    ``cpu-1gbit`` too). Candidate sets, feature scales, the abstention rules and the
    device-count rule follow it. A spec that leaves it out is a GPU if it has copy engines,
    else the cpu kind (what every spec written before the field meant); a GPU without copy
    engines for peer transfers says ``kind: gpu``."""

    def __post_init__(self) -> None:
        if not self.kind:  # left out: inferred once, so that equal machines compare equal
            object.__setattr__(self, "kind", "gpu" if self.copy_engines else "cpu")

    def peak_of(self, dtype: str) -> float:
        """Dense peak TFLOP/s of `dtype`, float32's where the spec gives none: the one rule the
        simulator, the features, the heuristic and the runtime's range check read it by."""
        return self.peak_tflops.get(dtype, self.peak_tflops["float32"])

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines this machine has: ``sm`` always, ``dma`` with copy engines, ``switch``
        where the fabric reduces in the switch."""
        return ("sm", *(("dma",) if self.copy_engines > 0 else ()), *(("switch",) if self.switch_reduce else ()))

    def source_of(self, field: str) -> str:
        """Where `field`'s number came from: ``measured``, ``datasheet`` or ``assumed``."""
        return self.provenance.get(field, "assumed")

    def beyond_devices(self, world_size: int) -> str | None:
        """The device-count rule: why `world_size` ranks are beyond this machine (a GPU spec
        describes one node: its costs say nothing about a larger job), or None. The cpu
        kind measures more ranks than cores, and the simulator stretches those times alike."""
        if self.kind == "gpu" and world_size > self.devices:
            return f"world_size {world_size} exceeds the {self.devices} devices of {self.name} (a spec describes one node)"
        return None


_FIELDS = {f.name: f for f in dataclasses.fields(HardwareSpec)}


def fields_of(*roles: str) -> tuple[str, ...]:
    """The spec's fields of these roles (``ROLES``), in declaration order."""
    return tuple(name for name, f in _FIELDS.items() if f.metadata["role"] in roles)


def spec_field(name: str) -> dataclasses.Field:
    """A spec field's declaration: its ``metadata`` holds its unit, role and bounds."""
    return _FIELDS[name]


SPEC_SUFFIXES = (".yaml", ".yml")
"""A hardware value ending so (or holding a path separator) is a spec file; else a name."""


def is_spec_path(value: str | Path) -> bool:
    """Whether a hardware value names a spec file (``./my-node.yaml``) rather than a machine."""
    text = str(value)
    return text.endswith(SPEC_SUFFIXES) or "/" in text or os.sep in text


LARGEST: dict[str, float] = {"devices": 4096, "compute_units": 10_000, "tile_m": 4096, "tile_n": 4096,
                             "copy_engines": 64, "peak": 1e5, "rate": 1e6, "ceiling": 1e6, "latency": 1e7}
"""The largest number a spec field may hold, by field (the counts) or by role (TFLOP/s, GB/s,
us): ten times and more past any machine (72 devices, 304 compute units, 15 PFLOP/s, 8 TB/s).
A larger one is a typo, and the simulator's arithmetic on it overflows."""


def spec_from_dict(spec: Any, where: str) -> HardwareSpec:
    """Check every field of a spec mapping; HardwareError naming `where` and the field."""
    if not isinstance(spec, dict):
        raise HardwareError(f"{where}: a hardware spec is a mapping of fields, got {type(spec).__name__}")
    spec = {**{f: v.default for f, v in _FIELDS.items() if v.default is not dataclasses.MISSING},
            "provenance": {}, **spec}
    missing = [f for f in _FIELDS if f not in spec]
    if missing:
        raise HardwareError(f"{where}: field '{missing[0]}' is missing")
    unknown = [f for f in spec if f not in _FIELDS]
    if unknown:
        raise HardwareError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(_FIELDS)})")

    def number(field: str, value: Any, *, integer: bool = False, low: float = 0.0, high: float = math.inf,
               low_open: bool = True, high_open: bool = True) -> None:
        kind = "an integer" if integer else "a number"
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or not math.isfinite(value):
            raise HardwareError(f"{where}: field '{field}' must be {kind}, got {value!r}")
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below):
            lo, hi = "(" if low_open else "[", ")" if high_open else "]"
            raise HardwareError(f"{where}: field '{field}' must lie in {lo}{low:g}, {high:g}{hi}, got {value!r}")

    for f in fields_of("label"):
        if not isinstance(spec[f], str) or not spec[f].strip():
            raise HardwareError(f"{where}: field '{f}' must be a non-empty string, got {spec[f]!r}")
    if is_spec_path(spec["name"]):
        raise HardwareError(f"{where}: field 'name' is {spec['name']!r}, which reads as a file path; "
                            "give the machine a plain name such as my-node")
    for f in fields_of("count"):
        number(f, spec[f], integer=True, low_open=f != "copy_engines", high=LARGEST[f], high_open=False)
    if spec["devices"] < 2:  # every scenario has P >= 2 ranks on one node
        raise HardwareError(f"{where}: field 'devices' must be at least 2 (a spec describes a node whose devices "
                            f"are the ranks; one GPU is measured in loopback under its node's spec), got {spec['devices']}")
    if not isinstance(spec["peak_tflops"], dict) or "float32" not in spec["peak_tflops"]:
        raise HardwareError(f"{where}: field 'peak_tflops' must map dtypes to TFLOP/s, including float32")
    for dtype, value in spec["peak_tflops"].items():
        if dtype not in DTYPES:
            raise HardwareError(f"{where}: field 'peak_tflops.{dtype}': unknown dtype (known: {', '.join(DTYPES)})")
        number(f"peak_tflops.{dtype}", value, high=LARGEST["peak"], high_open=False)
    if spec["kind"] not in ("", *KINDS):  # "": left out, inferred (HardwareSpec.kind)
        raise HardwareError(f"{where}: field 'kind' must be one of {', '.join(KINDS)}, got {spec['kind']!r}")
    if spec["topology"] not in TOPOLOGIES:
        raise HardwareError(f"{where}: field 'topology' must be one of {', '.join(TOPOLOGIES)}, "
                            f"got {spec['topology']!r}")
    for f in fields_of("rate", "latency", "ceiling"):
        # Zero is allowed where the term may be off: a model term left out, or a copy-engine
        # number of a machine without copy engines (a dataset stores them all the same).
        may_be_off = _FIELDS[f].default == 0 or (f.startswith("dma_") and not spec["copy_engines"])
        number(f, spec[f], low_open=not may_be_off, high=LARGEST[_FIELDS[f].metadata["role"]], high_open=False)
    provenance = spec["provenance"]
    if not isinstance(provenance, dict):
        raise HardwareError(f"{where}: field 'provenance' must map fields to one of {', '.join(PROVENANCES)}, "
                            f"got {type(provenance).__name__}")
    for f, source in provenance.items():
        if f not in _FIELDS or f in ("name", "description", "provenance"):
            raise HardwareError(f"{where}: field 'provenance.{f}': not a number of the spec")
        if source not in PROVENANCES:
            raise HardwareError(f"{where}: field 'provenance.{f}' must be one of {', '.join(PROVENANCES)}, got {source!r}")
    for f in fields_of("flag"):
        if not isinstance(spec[f], bool):
            raise HardwareError(f"{where}: field '{f}' must be true or false, got {spec[f]!r}")
    if spec["switch_reduce"] and not spec["switch_bw_gbps"]:
        raise HardwareError(f"{where}: field 'switch_bw_gbps' must be above 0 where switch_reduce is true "
                            "(the switch engine's bandwidth)")
    for f in fields_of("fraction"):
        meta = _FIELDS[f].metadata
        number(f, spec[f], low=meta.get("low", 0.0), high=meta.get("high", math.inf),
               low_open=meta.get("low_open", True), high_open=meta.get("high_open", True))
    return HardwareSpec(**{**spec, "name": spec["name"].strip(), "provenance": dict(provenance),
                           "peak_tflops": {k: float(v) for k, v in spec["peak_tflops"].items()}})





def spec_as_dict(spec: HardwareSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)
