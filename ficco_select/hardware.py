"""Hardware specs: the public numbers the simulator and the features need.

A spec is a YAML file; presets ship in ``ficco_select/presets/``. Fields (units in the
names): see ``HardwareSpec``. A missing, unknown or impossible field is an error naming
the field and the file. Plain Python + PyYAML: the runtime may read specs.

Rows (scenario tables after reading, datasets, models) carry a machine's *name*. The
shipped machines (presets, data-sheet machines) are known everywhere; any other is known
where a job says so: ``with machines(specs, where):`` names them for the work inside the
block. Datasets carry the specs of their non-preset machines in their Parquet metadata
(``ficco_select.data.dataset.dataset_machines``) and models in ``selector.json``, so the
job that reads them can name them again. Reading a file never changes what a name means.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ficco_select.scenario import DTYPES

log = logging.getLogger("ficco_select.hardware")

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


ROLES = ("label", "count", "peak", "topology", "rate", "latency", "fraction", "ceiling", "kind")
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
- ``kind``: one of ``KINDS``."""


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
        return ("sm", "dma") if self.copy_engines > 0 else ("sm",)

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


LARGEST: dict[str, float] = {"devices": 4096, "compute_units": 10_000, "tile_m": 4096, "tile_n": 4096,
                             "copy_engines": 64, "peak": 1e5, "rate": 1e6, "ceiling": 1e6, "latency": 1e7}
"""The largest number a spec field may hold, by field (the counts) or by role (TFLOP/s, GB/s,
us): ten times and more past any machine (72 devices, 304 compute units, 15 PFLOP/s, 8 TB/s).
A larger one is a typo, and the simulator's arithmetic on it overflows."""


def spec_from_dict(spec: Any, where: str) -> HardwareSpec:
    """Check every field of a spec mapping; HardwareError naming `where` and the field."""
    if not isinstance(spec, dict):
        raise HardwareError(f"{where}: a hardware spec is a mapping of fields, got {type(spec).__name__}")
    spec = {**{f: v.default for f, v in _FIELDS.items() if v.default is not dataclasses.MISSING}, **spec}
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
    for f in fields_of("fraction"):
        meta = _FIELDS[f].metadata
        number(f, spec[f], low=meta.get("low", 0.0), high=meta.get("high", math.inf),
               low_open=meta.get("low_open", True), high_open=meta.get("high_open", True))
    return HardwareSpec(**{**spec, "name": spec["name"].strip(),
                           "peak_tflops": {k: float(v) for k, v in spec["peak_tflops"].items()}})


GPU_PRESETS = (("H200", "h200-nvswitch"), ("H100", "h100-nvswitch"), ("H800", "h800-nvswitch"),
               ("A100", "a100-nvswitch"), ("A800", "a800-nvswitch"), ("L40S", "l40s-pcie-8"),
               ("MI300", "mi300x-8"), ("MI250", "mi250x-8"),
               ("GB200", "gb200-nvl72"), ("B200", "b200-nvswitch"), ("B300", "b300-nvswitch"))
"""(device-name substring, preset), first match wins: the preset of a GPU by its name (a
data-sheet machine's too: ``datasheet_names``)."""


def preset_for_device(device_name: str) -> str | None:
    """The shipped preset of a GPU, by its device name (``NVIDIA H200`` -> h200-nvswitch)."""
    upper = device_name.upper()
    return next((preset for key, preset in GPU_PRESETS if key in upper), None)


def presets_dir() -> Path:
    return Path(str(resources.files("ficco_select") / "presets"))


def preset_names() -> list[str]:
    """The presets the training data simulates, and every hold-out scores."""
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def datasheet_names() -> list[str]:
    """Data-sheet machines (``presets/datasheet/``): GPUs with published rows (H800, A800,
    Blackwell), loaded by name like a preset but never trained on: the simulator's zero-shot
    check. Their terms are the data sheet's except where their own rows fit them (each
    field's comment says which)."""
    return sorted(p.stem for p in (presets_dir() / "datasheet").glob("*.yaml"))


def shipped_names() -> set[str]:
    """Every machine shipped with the package (presets and data-sheet machines): names that
    mean one spec everywhere."""
    return set(preset_names()) | set(datasheet_names())


def _preset_path(name: str) -> Path | None:
    for path in (presets_dir() / f"{name}.yaml", presets_dir() / "datasheet" / f"{name}.yaml"):
        if name and path.is_file():
            return path
    return None


def is_spec_path(value: str | Path) -> bool:
    """Whether a hardware value names a spec file (``./my-node.yaml``) rather than a machine."""
    text = str(value)
    return text.endswith(SPEC_SUFFIXES) or "/" in text or os.sep in text


# The machines a job knows by name beyond the shipped ones (spec files, datasets' specs,
# machines sampled around the presets, a fabric's profile), with where each came from.
# Rows carry a machine's name, never a path (a path differs between machines and would
# change the scenario id); this is where a name that is not a preset is found again. Known
# only while a ``machines`` block is open: reading a file changes nothing, and nothing a job
# names outlives it. A context finds its own innermost open block first (a context
# variable: each thread's or task's own job); a context in no open block of its own (a
# thread the job started) finds the machines of the blocks open in the process, where they
# agree on what the name means.
class _Job:
    """One open ``machines`` block: the machines it knows (its parent's, and its own)."""

    __slots__ = ("table", "parent", "open")

    def __init__(self, table: dict[str, tuple["HardwareSpec", str]], parent: "_Job | None"):
        self.table, self.parent, self.open = table, parent, True


_KNOWN: contextvars.ContextVar["_Job | None"] = contextvars.ContextVar("ficco_known_machines", default=None)
_OPEN: tuple[_Job, ...] = ()
"""Every block open in the process, in the order opened (replaced whole, under _OPEN_LOCK)."""
_OPEN_LOCK = threading.Lock()
_WHEN_A_JOB_ENDS: list[Callable[[frozenset[str]], None]] = []
"""Called with the names a block introduced, as it ends (``when_a_job_ends``)."""


def when_a_job_ends(forget: Callable[[frozenset[str]], None]) -> None:
    """Call `forget(names)` as each ``machines`` block ends, with the names it introduced:
    what a cache outside this module decided for those machines goes with the job (the
    runtime's plans and layer tables)."""
    _WHEN_A_JOB_ENDS.append(forget)


def _job() -> _Job | None:
    """The current context's innermost open block, None if none: a context copied inside a
    block that has since ended sees the block around it, not the ended one."""
    job = _KNOWN.get()
    while job is not None and not job.open:
        job = job.parent
    return job


def _known(name: str) -> tuple["HardwareSpec", str] | None:
    """What the current context knows `name` as (the spec and where it came from), None if
    nothing; HardwareError where the context is in no block that names it and the blocks open
    in the process mean different machines by it."""
    job = _job()
    if job is not None and (found := job.table.get(name)) is not None:
        return found
    found = []
    for other in _OPEN:
        entry = other.table.get(name)
        if entry is not None and all(entry[0] != seen[0] for seen in found):
            found.append(entry)
    if len(found) > 1:
        raise HardwareError(
            f"machine {name!r} means different machines in the jobs open in this process "
            f"({'; '.join(source for _, source in found)}), and this thread is in none of them: start its work "
            "in its job's context, threading.Thread(target=contextvars.copy_context().run, args=(work,)), or "
            "name the machine in it (with machines(...))")
    return found[0] if found else None


Known = Iterable["HardwareSpec | tuple[HardwareSpec, str]"]
"""Specs, each alone or with where it came from (``known_machines``' values)."""


class Scope:
    """The machines a ``machines`` block knows; its owner may refine the spec of one of the
    block's own names (``ficco adapt``, round by round) with ``refine``."""

    def __init__(self, table: dict[str, tuple[HardwareSpec, str]], own: set[str]):
        self._table, self._own = table, own

    def refine(self, spec: HardwareSpec) -> None:
        """From now on the block (not blocks already opened inside it) means `spec` by its name."""
        if spec.name not in self._own:
            raise HardwareError(f"machine {spec.name!r} is not one this block introduced; it cannot refine it")
        self._table[spec.name] = (spec, self._table[spec.name][1])


@contextlib.contextmanager
def machines(specs: Known, where: str = "", *, replace: bool = False) -> Iterator[Scope]:
    """Know `specs` by their names for the work inside the block (and the blocks it opens),
    while it is open: threads started inside it find them too (``known_machine``).

    A name means one machine: a preset's name is refused for a spec with other numbers, and
    so is a name the job already knows with other numbers, naming where each came from.
    `replace`: inside the block `specs` win over what the job knew by their names (the
    measurement of a machine by its own profile; a run that refines its belief of one).
    """
    global _OPEN
    parent = _job()
    table = dict(parent.table) if parent is not None else {}
    own = set()
    for item in specs:
        spec, source = item if isinstance(item, tuple) else (item, where or "a spec")
        if _known_as(spec, source, table, replace) is None:
            table[spec.name] = (spec, source)
            own.add(spec.name)
    job = _Job(table, parent)
    token = _KNOWN.set(job)
    with _OPEN_LOCK:
        _OPEN = (*_OPEN, job)
    try:
        yield Scope(table, own)
    finally:
        job.open = False  # before it leaves _OPEN: no context finds it from here on
        with _OPEN_LOCK:
            _OPEN = tuple(other for other in _OPEN if other is not job)
        _KNOWN.reset(token)
        if own:
            for forget in _WHEN_A_JOB_ENDS:
                forget(frozenset(own))


def _known_as(spec: HardwareSpec, where: str, table: Mapping[str, tuple[HardwareSpec, str]],
              replace: bool) -> HardwareSpec | None:
    """The machine `spec`'s name already means (a preset, or one in `table`, equal to
    `spec`); None if the name is free (or `replace`); HardwareError if it means another."""
    if _preset_path(spec.name) is not None:
        if _preset(spec.name) != spec:
            raise HardwareError(f"{where}: name {spec.name!r} is a preset's, with other numbers; "
                                "give this machine its own name (field 'name')")
        return spec
    known = table.get(spec.name)
    if known is None or replace:
        return None
    if known[0] != spec:
        differ = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != getattr(known[0], f.name)]
        raise HardwareError(f"{where}: machine {spec.name!r} is already known in this job from {known[1]}, "
                            f"with other numbers ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}); "
                            "a name means one machine: give this one its own name (field 'name')")
    return known[0]


def refuse_shipped_name(spec: HardwareSpec, where: str) -> None:
    """HardwareError if `spec` takes a shipped machine's name with other numbers."""
    _known_as(spec, where, {}, replace=False)


def known_machines() -> dict[str, tuple[HardwareSpec, str]]:
    """The machines the current job knows beyond the shipped ones, by name, with where each
    came from: what a worker process is handed to know them as this one does
    (``with machines(known.values()):``). In a thread of no block of its own: those of the
    blocks open in the process, but for a name they mean differently."""
    job, known = _job(), {}
    for other in _OPEN:
        for name in other.table:
            if name not in known:
                try:
                    if (found := _known(name)) is not None:
                        known[name] = found
                except HardwareError:
                    pass  # the open jobs disagree: no machine by that name for this context
    return {**known, **(job.table if job is not None else {})}


def known_machine(name: str) -> HardwareSpec | None:
    """The machine the current job knows by `name` (not a shipped one), None if none;
    HardwareError where the jobs open in the process mean different machines by it and this
    context is in none of them."""
    found = _known(name)
    return None if found is None else found[0]


def refuse_known_name(spec: HardwareSpec, where: str) -> None:
    """HardwareError naming `where` if `spec`'s name means another machine here: a shipped
    one's, or one the current job knows."""
    found = _known(spec.name)
    _known_as(spec, where, {spec.name: found} if found is not None else {}, replace=False)


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    """A machine by name (a shipped one, or one the job knows: ``machines``), or a spec file
    by path (read, never remembered: a job that names the machine later says so with
    ``machines``)."""
    if not is_spec_path(name_or_path):
        name = str(name_or_path)
        known = _known(name)
        if known is not None:
            return known[0]
        if _preset_path(name) is None:
            raise HardwareError(f"unknown hardware {name!r}; presets: {', '.join(preset_names())}; data-sheet "
                                f"machines: {', '.join(datasheet_names())} (or pass a spec file: ./my-node.yaml)")
        return _preset(name)
    path = Path(name_or_path)
    spec = _read_spec(path)
    refuse_known_name(spec, str(path))  # a preset's or a known machine's name: refused
    return spec


@functools.cache  # the package's files: read once per process, not once per table row
def _preset(name: str) -> HardwareSpec:
    return _read_spec(_preset_path(name))


def hardware_name(value: str) -> str:
    """The name rows carry for a hardware value: a spec file's ``name``, else the value."""
    return load_hardware(value).name if is_spec_path(value) else value


def _read_spec(path: Path) -> HardwareSpec:
    if not path.exists():
        raise HardwareError(f"{path}: no such hardware spec file")
    if not path.is_file():
        raise HardwareError(f"{path}: not a file (a hardware spec is a YAML file)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise HardwareError(f"{path}: not a text file (a hardware spec is a YAML file)") from None
    except OSError as e:
        raise HardwareError(f"{path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        # Position and problem only: the file's lines are not echoed (it may not be a spec at all).
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise HardwareError(f"{path}: not valid YAML{at} ({getattr(e, 'problem', None) or type(e).__name__})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: a hardware spec is a mapping of fields")
    return spec_from_dict(data, str(path))


def spec_as_dict(spec: HardwareSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)
