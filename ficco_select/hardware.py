"""Hardware specs: the public numbers the simulator and the features need.

A spec is a YAML file; presets ship in ``ficco_select/presets/``. Fields (units in the
names): see ``HardwareSpec``. A missing, unknown or impossible field is an error naming
the field and the file. Plain Python + PyYAML: the runtime may read specs.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

TOPOLOGIES = ("fully_connected", "switch", "ring")


class HardwareError(ValueError):
    """A hardware spec is missing, malformed or impossible; names the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    name: str
    """Preset name, e.g. ``mi300x-8``."""
    description: str
    """What machine this is."""
    devices: int
    """Accelerators (ranks) in one node."""
    peak_tflops: dict[str, float]
    """Dense peak matrix throughput per dtype (float32, bfloat16, float16), TFLOP/s."""
    mem_bw_gbps: float
    """Memory bandwidth of one device, GB/s."""
    compute_units: int
    """SMs (NVIDIA) or CUs (AMD): the unit of wave quantization."""
    tile_m: int
    """GEMM output tile rows per compute unit (wave quantization)."""
    tile_n: int
    """GEMM output tile columns per compute unit."""
    gemm_efficiency: float
    """Fraction of peak a large, well-shaped GEMM reaches, in (0, 1]."""
    gemm_launch_us: float
    """Fixed cost of one GEMM call (launch, prologue), microseconds."""
    topology: str
    """How devices connect: fully_connected (a link per pair), switch (NVSwitch-like), ring."""
    link_bw_gbps: float
    """One-direction bandwidth of one peer link (fully_connected, ring) or of a device's
    port into the switch (switch), GB/s."""
    sm_comm_latency_us: float
    """Fixed cost per transfer moved by kernels on compute units (``sm`` engine), us."""
    sm_comm_units: float
    """Fraction of compute units an ``sm`` transfer occupies while it runs, in [0, 1)."""
    copy_engines: int
    """DMA copy engines per device usable for peer transfers (0: no ``dma`` engine)."""
    dma_latency_us: float
    """Fixed cost per copy-engine transfer, us (larger than ``sm``'s)."""
    dma_bw_gbps: float
    """Bandwidth one copy engine sustains, GB/s."""
    dma_mem_contention: float
    """GEMM slowdown fraction per unit of memory bandwidth a ``dma`` transfer takes, in [0, 1]."""

    @property
    def engines(self) -> tuple[str, ...]:
        return ("sm", "dma") if self.copy_engines > 0 else ("sm",)


_FIELDS = {f.name: f for f in dataclasses.fields(HardwareSpec)}


def _check(spec: dict[str, Any], where: str) -> HardwareSpec:
    missing = [f for f in _FIELDS if f not in spec]
    if missing:
        raise HardwareError(f"{where}: field '{missing[0]}' is missing")
    unknown = [f for f in spec if f not in _FIELDS]
    if unknown:
        raise HardwareError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(_FIELDS)})")

    def positive(field: str, value: Any, integer: bool = False) -> None:
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or not value > 0:
            kind = "a positive integer" if integer else "a positive number"
            raise HardwareError(f"{where}: field '{field}' must be {kind}, got {value!r}")

    for f in ("devices", "compute_units", "tile_m", "tile_n"):
        positive(f, spec[f], integer=True)
    for f in ("mem_bw_gbps", "link_bw_gbps", "gemm_launch_us", "sm_comm_latency_us"):
        positive(f, spec[f])
    if not isinstance(spec["peak_tflops"], dict) or "float32" not in spec["peak_tflops"]:
        raise HardwareError(f"{where}: field 'peak_tflops' must map dtypes to TFLOP/s, including float32")
    for dtype, value in spec["peak_tflops"].items():
        if dtype not in ("float32", "bfloat16", "float16"):
            raise HardwareError(f"{where}: field 'peak_tflops.{dtype}': unknown dtype")
        positive(f"peak_tflops.{dtype}", value)
    if not 0 < spec["gemm_efficiency"] <= 1:
        raise HardwareError(f"{where}: field 'gemm_efficiency' must lie in (0, 1], got {spec['gemm_efficiency']}")
    if not 0 <= spec["sm_comm_units"] < 1:
        raise HardwareError(f"{where}: field 'sm_comm_units' must lie in [0, 1), got {spec['sm_comm_units']}")
    if spec["topology"] not in TOPOLOGIES:
        raise HardwareError(f"{where}: field 'topology' must be one of {', '.join(TOPOLOGIES)}, "
                            f"got {spec['topology']!r}")
    if isinstance(spec["copy_engines"], bool) or not isinstance(spec["copy_engines"], int) \
            or spec["copy_engines"] < 0:
        raise HardwareError(f"{where}: field 'copy_engines' must be an integer >= 0")
    if spec["copy_engines"]:
        positive("dma_latency_us", spec["dma_latency_us"])
        positive("dma_bw_gbps", spec["dma_bw_gbps"])
    if not 0 <= spec["dma_mem_contention"] <= 1:
        raise HardwareError(f"{where}: field 'dma_mem_contention' must lie in [0, 1]")
    return HardwareSpec(**{**spec, "peak_tflops": {k: float(v) for k, v in spec["peak_tflops"].items()}})


def presets_dir() -> Path:
    return Path(str(resources.files("ficco_select") / "presets"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    """A preset by name, or a spec file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = presets_dir() / f"{name_or_path}.yaml"
        if not path.exists():
            raise HardwareError(f"unknown hardware {str(name_or_path)!r}; presets: {', '.join(preset_names())}")
    if not path.exists():
        raise HardwareError(f"{path}: no such hardware spec file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise HardwareError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: a hardware spec is a mapping of fields")
    return _check(data, str(path))


def spec_as_dict(spec: HardwareSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)
