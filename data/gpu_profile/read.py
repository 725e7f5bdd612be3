"""Measured GPU profiles: read one, and turn it into a hardware spec the simulator uses.

A profile is the JSON file ``python -m ficco_select.data.gpu_profile.run`` (run by
``scripts/gpu_check.sh``) writes on one GPU; every field is documented in
``data/profiles/README.md``. This module defines the format (name, version, the fitted
fields and their checks), reads it with errors that name the field, and maps what one GPU
can measure onto ``HardwareSpec`` fields (``spec_overrides``). Plain Python + NumPy: the
runtime may read profiles, and no CUDA is needed to turn one into a spec.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ficco_select.hardware import (HardwareError, HardwareSpec, load_hardware, refuse_shipped_name, spec_as_dict,
                                   spec_from_dict)
from ficco_select.scenario import DTYPES

SCHEMA = "ficco-gpu-profile"
"""Value of the profile's ``schema`` field."""
SCHEMA_VERSION = 1
"""The one ``schema_version`` this code reads and writes."""

# Fitted fields: name -> (kind, meaning with units). Kinds: "dtype_map" (dtype -> positive
# number), "shape_map" (dtype -> [m, n, k]), "nonneg", "positive", "slowdown" (a fraction
# > -1: the time with contention / alone - 1; noise may make it slightly negative).
FITTED_FIELDS: dict[str, tuple[str, str]] = {
    "gemm_tflops": ("dtype_map", "best measured dense GEMM throughput per dtype, TFLOP/s"),
    "gemm_efficiency": ("dtype_map", "gemm_tflops / the preset's peak_tflops of that dtype (a ratio)"),
    "gemm_shape": ("shape_map", "[m, n, k] of the GEMM that reached gemm_tflops, per dtype"),
    "gemm_call_us": ("positive", "time per call of a tiny (128^3 bf16) GEMM issued back to back "
                                 "from Python: the fixed cost of one GEMM call, us"),
    "dma_latency_us": ("nonneg", "fixed cost per copy-engine copy (torch copy_ D2D, side stream), us"),
    "dma_bw_gbps": ("positive", "bandwidth of one copy-engine copy, GB/s (bytes copied / s / 1e9)"),
    "sm_copy_latency_us": ("nonneg", "fixed cost per copy by an SM kernel, us"),
    "sm_copy_bw_gbps": ("positive", "bandwidth of one SM-kernel copy, GB/s"),
    "h2d_latency_us": ("nonneg", "fixed cost per pinned host-to-device copy (copy engine), us"),
    "h2d_bw_gbps": ("positive", "bandwidth of a pinned host-to-device copy, GB/s"),
    "cil_gemm_dma": ("slowdown", "GEMM slowdown while a dma copy stream runs beside it (t / t_alone - 1)"),
    "cil_gemm_sm": ("slowdown", "GEMM slowdown while an SM copy kernel runs beside it"),
    "cil_copy_dma": ("slowdown", "dma copy slowdown while GEMMs run beside it"),
    "cil_copy_sm": ("slowdown", "SM copy slowdown while GEMMs run beside it"),
}
FITTED_CEILINGS: dict[str, float] = {
    "gemm_tflops": 1e5, "gemm_efficiency": 100.0, "gemm_call_us": 1e6, "dma_latency_us": 1e6,
    "dma_bw_gbps": 1e5, "sm_copy_latency_us": 1e6, "sm_copy_bw_gbps": 1e5, "h2d_latency_us": 1e6,
    "h2d_bw_gbps": 1e5, "cil_gemm_dma": 1e3, "cil_gemm_sm": 1e3, "cil_copy_dma": 1e3, "cil_copy_sm": 1e3,
}
"""The largest number each fitted field may hold: ten times and more past any GPU (100 PFLOP/s
dense, 100 TB/s, a second per call, a 1000x slowdown). Beyond it the number is not a
measurement, and turning it into a spec overflows (a GEMM of no time)."""
MAX_COMPUTE_UNITS = 10_000
"""``device.multiprocessor_count`` at most: today's GPUs have 80 to 304."""
MAX_DIM = 1 << 20
"""A GEMM dimension of a profile (``gemm_shape``, ``measurements.dil``) at most: the profiler's
shapes go to 16384."""
DIL_DEGREES_MAX = 64
"""A DIL row's ``d`` (pieces) at most: the profiler's are 2, 4 and 8."""


class ProfileError(ValueError):
    """A GPU profile is missing, malformed or of another schema; names the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuProfile:
    """A validated profile. ``data`` is the whole file (measurement tables included)."""

    source: str
    """Where it was read from (a path, or ``<dict>``)."""
    device_name: str
    """``device.name`` as CUDA reports it, e.g. ``NVIDIA H200``."""
    preset: str | None
    """Preset whose peak numbers ``gemm_efficiency`` is relative to (``preset``)."""
    fitted: dict[str, Any]
    """The fitted numbers (``FITTED_FIELDS``); absent ones were not measured."""
    data: dict[str, Any]
    """The whole profile as read."""


# -- reading --------------------------------------------------------------------------------
def read_profile(path: str | Path) -> GpuProfile:
    """Read and validate a profile file; ``ProfileError`` names the field at fault."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"{path}: no such profile file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return validate_profile(data, str(path))


def validate_profile(data: Any, where: str = "<dict>") -> GpuProfile:
    """Check a profile already parsed from JSON (what ``read_profile`` does after reading)."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile is a JSON object of fields")
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"{where}: field 'schema' must be {SCHEMA!r}, got {data.get('schema')!r} "
                           "(not a ficco GPU profile?)")
    version = data.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProfileError(f"{where}: field 'schema_version' must be an integer, got {version!r}")
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{where}: field 'schema_version' is {version}; this ficco-select reads "
                           f"version {SCHEMA_VERSION} (re-run scripts/gpu_check.sh with this version)")
    if not isinstance(data.get("created_utc"), str) or not data["created_utc"]:
        raise ProfileError(f"{where}: field 'created_utc' must be an ISO-8601 time string")
    device = data.get("device")
    if not isinstance(device, dict):
        raise ProfileError(f"{where}: field 'device' must be an object with the device's name")
    if not isinstance(device.get("name"), str) or not device["name"]:
        raise ProfileError(f"{where}: field 'device.name' must be a non-empty string")
    sms = device.get("multiprocessor_count")
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or not 0 < sms <= MAX_COMPUTE_UNITS):
        raise ProfileError(f"{where}: field 'device.multiprocessor_count' must be a positive integer of at most "
                           f"{MAX_COMPUTE_UNITS}, got {sms!r}")
    software = data.get("software")
    if not isinstance(software, dict) or not isinstance(software.get("torch"), str):
        raise ProfileError(f"{where}: field 'software.torch' must be the torch version string")
    preset = data.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ProfileError(f"{where}: field 'preset' must be a preset name, got {preset!r}")
    fitted = data.get("fitted")
    if not isinstance(fitted, dict):
        raise ProfileError(f"{where}: field 'fitted' must be an object (may be empty)")
    for name, value in fitted.items():
        _check_fitted(name, value, where)
    for name in ("measurements", "sections", "loopback"):
        if name in data and not isinstance(data[name], dict):
            raise ProfileError(f"{where}: field '{name}' must be an object")
    _check_dil((data.get("measurements") or {}).get("dil"), where)
    return GpuProfile(source=where, device_name=device["name"], preset=preset, fitted=dict(fitted), data=data)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _dimension(value: Any, high: int = MAX_DIM) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= high


def _check_dil(rows: Any, where: str) -> None:
    """``measurements.dil``, the one measurement table ``from-profile`` reads (``dil_vs_model``):
    each row a GEMM of positive sizes, its split and pieces, and its DIL (a number, or null)."""
    if rows is None:
        return
    if not isinstance(rows, list):
        raise ProfileError(f"{where}: field 'measurements.dil' must be a list of rows")
    for i, row in enumerate(rows):
        field = f"measurements.dil[{i}]"
        if not isinstance(row, dict):
            raise ProfileError(f"{where}: field '{field}' must be an object")
        if row.get("dtype") not in DTYPES:
            raise ProfileError(f"{where}: field '{field}.dtype' must be one of {', '.join(DTYPES)}, "
                               f"got {row.get('dtype')!r}")
        for key, high in (("m", MAX_DIM), ("n", MAX_DIM), ("k", MAX_DIM), ("d", DIL_DEGREES_MAX)):
            if not _dimension(row.get(key), high):
                raise ProfileError(f"{where}: field '{field}.{key}' must be a positive integer of at most {high}, "
                                   f"got {row.get(key)!r}")
        if row.get("split") not in ("m", "n"):
            raise ProfileError(f"{where}: field '{field}.split' must be 'm' or 'n', got {row.get('split')!r}")
        if row.get("dil") is not None and not _number(row["dil"]):
            raise ProfileError(f"{where}: field '{field}.dil' must be a finite number or null, got {row['dil']!r}")


def _check_fitted(name: str, value: Any, where: str) -> None:
    field = f"fitted.{name}"
    if name not in FITTED_FIELDS:
        raise ProfileError(f"{where}: unknown field '{field}' (known: {', '.join(FITTED_FIELDS)})")
    kind = FITTED_FIELDS[name][0]
    if kind in ("dtype_map", "shape_map"):
        if not isinstance(value, dict):
            raise ProfileError(f"{where}: field '{field}' must map dtypes ({', '.join(DTYPES)}) to values")
        for dtype, v in value.items():
            if dtype not in DTYPES:
                raise ProfileError(f"{where}: field '{field}.{dtype}': unknown dtype (known: {', '.join(DTYPES)})")
            if kind == "dtype_map" and not (_number(v) and 0 < v <= FITTED_CEILINGS[name]):
                raise ProfileError(f"{where}: field '{field}.{dtype}' must be a positive number of at most "
                                   f"{FITTED_CEILINGS[name]:g}, got {v!r}")
            if kind == "shape_map" and not (isinstance(v, list) and len(v) == 3 and all(map(_dimension, v))):
                raise ProfileError(f"{where}: field '{field}.{dtype}' must be [m, n, k] positive integers of at "
                                   f"most {MAX_DIM}, got {v!r}")
        return
    if not _number(value):
        raise ProfileError(f"{where}: field '{field}' must be a finite number, got {value!r}")
    if value > FITTED_CEILINGS[name]:
        raise ProfileError(f"{where}: field '{field}' must be at most {FITTED_CEILINGS[name]:g}, got {value!r}")
    if kind == "positive" and not value > 0:
        raise ProfileError(f"{where}: field '{field}' must be positive, got {value!r}")
    if kind == "nonneg" and not value >= 0:
        raise ProfileError(f"{where}: field '{field}' must be >= 0, got {value!r}")
    if kind == "slowdown" and not value > -1:
        raise ProfileError(f"{where}: field '{field}' must be a slowdown fraction > -1, got {value!r}")


# -- fitting helpers shared with the measuring side ------------------------------------------
def fit_latency_bw(nbytes, seconds) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of t = latency + nbytes / bw, least squares on relative error.

    nbytes, seconds: (n_sizes,). Relative errors weigh a 4 KiB copy as much as a 1 GiB one,
    so the intercept comes from the small sizes and the slope from the large ones. A
    negative intercept (noise) is clamped to 0 and the slope refitted through the origin.
    """
    x, y = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y) & (y > 0) & (x > 0)
    x, y = x[keep], y[keep]
    if len(x) < 2:
        raise ValueError(f"a latency + bandwidth fit needs at least 2 sizes, got {len(x)}")
    w = 1.0 / y
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if a < 0 or b <= 0:
        a = 0.0
        b = float(np.sum(x * y * w * w) / np.sum(x * x * w * w))
    return float(a), float(1.0 / b)


# -- profile -> spec ------------------------------------------------------------------------
KEPT_FIELDS = ("devices", "topology", "link_bw_gbps", "copy_engines", "mem_bw_gbps", "tile_m", "tile_n")
"""HardwareSpec fields one GPU cannot measure: always the base spec's."""


def spec_overrides(profile: GpuProfile | Mapping[str, Any], base: HardwareSpec) -> dict[str, Any]:
    """HardwareSpec fields to replace in `base`, from what the profile measured.

    Only fields the profile has numbers for appear; the rest stay the base's. Mapping
    (what ``ficco_select.costs`` does with each field, and why the number fits it):

    - ``compute_units`` <- ``device.multiprocessor_count``: read from the device, exact.
    - ``gemm_launch_us`` <- ``fitted.gemm_call_us``: ``gemm_time`` adds it once per GEMM
      call; a tiny GEMM issued back to back from Python costs exactly that.
    - ``gemm_efficiency`` (and ``peak_tflops`` of the measured dtypes) <- ``fitted.gemm_shape``
      and ``gemm_tflops``: ``gemm_time`` divides FLOPs by peak x efficiency x wave
      utilization of the base's tiles, so the efficiency is solved so that ``gemm_time`` on the
      measured shape gives the measured time (not the raw TFLOP/s ratio, which would count
      wave quantization twice). The spec has one efficiency: that of bfloat16 (else
      float16, else float32), capped at 1; another measured dtype's ``peak_tflops`` is scaled
      so its measured time is reproduced too (e.g. float32 under torch's default "highest"
      matmul precision runs far below the TF32 data-sheet peak). Unmeasured dtypes keep the
      published peak.
    - ``dma_latency_us``, ``dma_bw_gbps`` <- ``fitted.dma_latency_us``, ``dma_bw_gbps``
      (fit of copy-engine copies, t = latency + bytes / bw): ``transfer_time`` charges a
      ``dma`` transfer ``latency + bytes / min(link share, dma_bw)``. Only if the base has
      copy engines (their count is not measurable here).
    - ``sm_comm_latency_us`` <- ``fitted.sm_copy_latency_us``: the fixed cost of a transfer
      moved by a kernel. Both latencies are measured on one device: a lower bound of a
      peer transfer, which also crosses a link.
    - ``sm_comm_units`` <- ``1 - 1 / (1 + cil_gemm_sm)`` (clipped to [0, 0.9]):
      ``contended`` slows a fully overlapped GEMM by ``1 / (1 - sm_comm_units) - 1``, so
      this inverts the measured GEMM slowdown beside an SM copy (as ``ficco_select.data.calibrate`` does).
    - ``dma_mem_contention`` <- ``cil_gemm_dma`` (clipped to [0, 1]): ``contended`` slows a
      fully overlapped GEMM by exactly ``dma_mem_contention`` beside a ``dma`` transfer.

    Never overridden (``KEPT_FIELDS``): bandwidth and topology of links between GPUs, device
    count and copy-engine count are not measurable on one GPU; ``mem_bw_gbps`` stays the data
    sheet's roofline bound; tile sizes stay the base's (``dil_vs_model`` shows how well they
    reproduce the measured DIL).
    """
    from ficco_select.costs import gemm_time

    if not isinstance(profile, GpuProfile):
        profile = validate_profile(dict(profile))
    fitted = profile.fitted
    out: dict[str, Any] = {}
    sms = profile.data["device"].get("multiprocessor_count")
    if sms:
        out["compute_units"] = int(sms)
    if "gemm_call_us" in fitted:
        out["gemm_launch_us"] = float(fitted["gemm_call_us"])
    work = dataclasses.replace(base, **out)

    shapes, tflops = fitted.get("gemm_shape", {}), fitted.get("gemm_tflops", {})
    measured = [d for d in DTYPES if d in shapes and d in tflops]
    if measured:
        raw = {}  # efficiency per dtype that makes gemm_time reproduce the measurement
        for dtype in measured:
            m, n, k = shapes[dtype]
            t_measured = 2.0 * m * n * k / (tflops[dtype] * 1e12)
            raw[dtype] = _solve_efficiency(gemm_time, work, m, n, k, DTYPES[dtype],
                                           work.peak_of(dtype) * 1e12,
                                           t_measured)
        primary = next(d for d in ("bfloat16", "float16", "float32") if d in raw)
        efficiency = min(raw[primary], 1.0)
        out["gemm_efficiency"] = round(efficiency, 6)
        peak = dict(base.peak_tflops)
        for dtype in measured:
            published = base.peak_of(dtype)
            peak[dtype] = float(f"{published * raw[dtype] / efficiency:.4g}")  # digits, not decimals: a slow cpu's peak is < 0.001
        if peak != base.peak_tflops:
            out["peak_tflops"] = peak

    if base.copy_engines > 0:
        if "dma_latency_us" in fitted:
            out["dma_latency_us"] = max(float(fitted["dma_latency_us"]), 0.01)
        if "dma_bw_gbps" in fitted:
            out["dma_bw_gbps"] = float(fitted["dma_bw_gbps"])
    if "sm_copy_latency_us" in fitted:
        out["sm_comm_latency_us"] = max(float(fitted["sm_copy_latency_us"]), 0.01)
    if "cil_gemm_sm" in fitted:
        cil = max(float(fitted["cil_gemm_sm"]), 0.0)
        out["sm_comm_units"] = round(float(np.clip(1 - 1 / (1 + cil), 0.0, 0.9)), 6)
    if "cil_gemm_dma" in fitted:
        out["dma_mem_contention"] = round(float(np.clip(fitted["cil_gemm_dma"], 0.0, 1.0)), 6)
    return out




def _solve_efficiency(gemm_time, spec: HardwareSpec, m, n, k, dtype_bytes, peak_flops, t_measured) -> float:
    """Efficiency e with gemm_time(spec with e) == t_measured on (m, n, k).

    gemm_time = max(compute / e, memory) + launch, compute taken at e = 1; while the
    measured time is above the memory bound, e = compute / (t - launch). A measurement at or
    below the memory bound (not a compute-bound shape) falls back to the raw ratio.
    """
    ideal = dataclasses.replace(spec, gemm_efficiency=1.0, mem_bw_gbps=1e12)  # the compute part alone
    launch = spec.gemm_launch_us * 1e-6
    t_ideal = float(gemm_time(ideal, m, n, k, dtype_bytes, peak_flops)) - launch
    memory = (m * k + k * n + m * n) * dtype_bytes / (spec.mem_bw_gbps * 1e9)
    busy = t_measured - launch
    if busy > memory and busy > 0:
        return t_ideal / busy
    return 2.0 * m * n * k / t_measured / peak_flops


def profiled_spec(profile: GpuProfile, base: HardwareSpec, *, name: str | None = None,
                  description: str | None = None) -> tuple[HardwareSpec, dict[str, Any]]:
    """(the base spec with the profile's overrides, validated; the overrides applied)."""
    overrides = spec_overrides(profile, base)
    fields = {**spec_as_dict(base), **overrides,
              "provenance": {**base.provenance, **dict.fromkeys(overrides, "measured")},
              "name": name or f"{base.name}-profiled",
              "description": description or f"{base.description}; primitives measured on one "
                                            f"{profile.device_name} ({profile.source})"}
    try:
        spec = spec_from_dict(fields, f"spec from profile {profile.source}")
    except HardwareError as e:
        raise ProfileError(str(e)) from None
    return spec, overrides


def dil_vs_model(profile: GpuProfile, spec: HardwareSpec) -> list[dict[str, Any]]:
    """Measured DIL next to what ``costs.gemm_time`` predicts on `spec`, per DIL row.

    One dict per ``measurements.dil`` row: its dtype, m, n, k, split, d, ``dil`` (measured)
    and ``dil_model``. Empty if the profile has no DIL table.
    """
    from ficco_select.costs import gemm_time

    rows = (profile.data.get("measurements") or {}).get("dil") or []
    out = []
    for r in rows:
        try:
            m, n, k, d, dtype = int(r["m"]), int(r["n"]), int(r["k"]), int(r["d"]), str(r["dtype"])
            if min(m, n, k, d) < 1:
                continue  # a row of nothing, or a degree of no pieces: nothing to compare
            b, peak = DTYPES[dtype], spec.peak_of(dtype) * 1e12
            whole = float(gemm_time(spec, m, n, k, b, peak))
            # Pieces differ by at most one row/column; the model takes the mean piece.
            pm, pn = (m / d, n) if r["split"] == "m" else (m, n / d)
            pieces = d * float(gemm_time(spec, pm, pn, k, b, peak))
        except (KeyError, TypeError, ValueError):
            continue
        out.append({"dtype": dtype, "m": m, "n": n, "k": k, "split": r["split"], "d": d,
                    "dil": r.get("dil"), "dil_model": round(pieces / whole - 1, 4)})
    return out


def write_profiled_spec(profile_path, *, base: str | None, out, name: str | None) -> tuple[dict, str | None, str]:
    """``ficco hardware from-profile``: a measured GPU profile over a base spec, written to
    `out` and loaded back once.

    Returns (report, the profile's preset, the base spec's name); the report lists each
    overridden field (base and profiled value), the fields kept, and how far the DIL
    measured lies from the simulated one. Raises ProfileError, HardwareError.
    """
    from ficco_select.data.calibrate import write_spec

    profile = read_profile(profile_path)
    base = base or profile.preset
    if not base:
        raise ProfileError("--base is required: the profile names no preset")
    base_spec = load_hardware(base)
    spec, overrides = profiled_spec(profile, base_spec, name=name)
    refuse_shipped_name(spec, f"{profile.source}: --name {spec.name}")  # before writing: nothing left behind
    write_spec(spec, out, f"ficco hardware from-profile {profile_path} --base {base}")
    try:
        load_hardware(out)  # what the simulator will do with it
    except HardwareError:
        Path(out).unlink(missing_ok=True)
        raise
    before = spec_as_dict(base_spec)
    dil = [r for r in dil_vs_model(profile, spec) if isinstance(r["dil"], (int, float))]
    dil_err = sorted(abs(r["dil"] - r["dil_model"]) for r in dil)
    report = {"out": str(out), "name": spec.name, "base": base, "device": profile.device_name,
              "overrides": {f: {"base": before[f], "profiled": v} for f, v in overrides.items()},
              "kept": [f for f in before if f not in overrides and f not in ("name", "description")],
              "dil_rows": len(dil), "dil_median_abs_error": dil_err[len(dil_err) // 2] if dil_err else None}
    return report, profile.preset, base_spec.name
