"""A quick profile of the loopback this process runs on: two gloo ranks send messages of a few
sizes back and forth, and a line through (bytes, one-way time) gives the link's bandwidth
(slope) and per-message latency (intercept). Inside a shaped fabric (``fabric.py``) it
measures what the token bucket lets through; a few seconds.

``fabric_spec`` turns a profile into the fabric's spec: the host's ``cpu`` spec (the same
cores, so the same GEMM numbers and gloo's per-transfer cost) with the shaped link's
profiled bandwidth. The profiled latencies are recorded, not used: a token bucket delays
bytes, not messages, and on a shared host the intercept of four sizes is mostly noise
(it moved by milliseconds between runs here, while the bandwidth held within 6%).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ficco_select.data.locks import write_json_atomic
from ficco_select.data.measure.fabric import Fabric, FabricError, inside, shaping
from ficco_select.executor import ranks
from ficco_select.hardware import HardwareSpec, load_hardware, spec_as_dict, spec_from_dict
from ficco_select.scenario import Scenario

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20)
"""Message sizes, bytes: from latency-bound to bandwidth-bound at 100 Mbit/s .. 10 Gbit/s."""
ROUND_TRIPS = 9


def _rank(rank: int, world_size: int) -> dict[int, float]:
    """One of two ranks timing a message's one-way trip at each size; the median per size."""
    peer = 1 - rank

    def one_way(size: int) -> float:
        buf = torch.zeros(size // 4)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        return (time.perf_counter() - t0) / 2

    for size in SIZES:  # warm up: connections, TCP windows, allocator
        one_way(size)
    return {size: statistics.median(one_way(size) for _ in range(ROUND_TRIPS)) for size in SIZES}


def profile_fabric(fabric: Fabric, timeout_s: float = 300.0) -> dict:
    """Inside `fabric`'s namespace (``fabric.inside()``): the loopback profiled unshaped, then
    shaped again to `fabric`, as {"link_bw_gbps", "latency_us", "unshaped": {...},
    "shaping": tc's line}, each profile {"link_bw_gbps", "latency_us", "points": [[bytes,
    one-way s], ...]}. The unshaped one tells what the shaping adds to gloo's own costs."""
    if inside() != fabric:
        raise FabricError(f"--fabric {fabric.rate}: profile_fabric runs inside that fabric's namespace only")
    _run(["tc", "qdisc", "del", "dev", "lo", "root"])  # our namespace: its loopback only
    unshaped = _profile(timeout_s)
    _run(fabric.tc_command())
    return {**_profile(timeout_s), "unshaped": unshaped, "shaping": shaping()}


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise FabricError(f"{' '.join(command)}: {done.stderr.strip()}")


def _profile(timeout_s: float) -> dict:
    one_way = ranks.run_ranks(_rank, 2, timeout_s=timeout_s, group_timeout_s=120)[0]
    return link_fit(one_way)


def link_fit(one_way: dict[int, float]) -> dict:
    """{"link_bw_gbps", "latency_us", "points"} of one-way times by message size: a line
    ``t = latency + bytes / bandwidth``."""
    sizes = np.array(sorted(one_way), dtype=float)
    seconds = np.array([one_way[s] for s in sorted(one_way)])
    # Absolute errors: the large messages set the rate (a token bucket lets small ones through
    # at its burst, faster than its rate).
    slope, intercept = np.polyfit(sizes, seconds, 1)
    if slope <= 0:  # noise swamped the sizes (an unshaped loopback, once): the largest message's rate
        slope, intercept = seconds[-1] / sizes[-1], 0.0
    return {"link_bw_gbps": float(1 / slope / 1e9), "latency_us": float(max(intercept, 0.0) * 1e6),
            "points": [[int(s), float(t)] for s, t in zip(sizes, seconds)]}


def fabric_spec(fabric: Fabric, profile: dict, base: HardwareSpec | None = None) -> HardwareSpec:
    """The fabric's spec from its profile (see the module docstring)."""
    base = base or load_hardware("cpu")
    return dataclasses.replace(
        base, name=fabric.name,
        description=(f"{fabric.describe()}; profiled link {profile['link_bw_gbps']:.4g} GB/s; "
                     f"the rest as {base.name}"),
        link_bw_gbps=profile["link_bw_gbps"])


def profile_path(out: str | Path) -> Path:
    """Where a sweep's fabric profile and spec are kept: beside `out`'s real path."""
    out = Path(out).resolve()
    return out.with_name(out.name + ".fabric.json")


def on_fabric(scenarios: Sequence[Scenario], fabric: Fabric, out: str | Path | None
              ) -> tuple[list[Scenario], HardwareSpec]:
    """`scenarios` (each on this host's ``cpu``) moved onto the fabric's machine, and its spec
    (what the job that measures them knows the machine by). A sweep with `out` profiles the fabric once and keeps the profile and spec in
    ``profile_path(out)`` before it measures anything: a resumed sweep, and every part of
    it, reads the same spec back instead of profiling again (a new profile would be a
    slightly different machine under the same name)."""
    elsewhere = next((s for s in scenarios if s.hardware != "cpu"), None)
    if elsewhere is not None:
        raise FabricError(f"--fabric {fabric.rate}: scenario {elsewhere.scenario_id}: column 'hardware' is "
                          f"{elsewhere.hardware!r}; a fabric shapes this host's network, so every row's "
                          "hardware must be cpu")
    kept = profile_path(out) if out is not None else None
    if kept is not None and kept.exists():
        spec = _kept_spec(kept, fabric)
    else:
        profile = profile_fabric(fabric)
        spec = fabric_spec(fabric, profile)
        if kept is not None:
            write_json_atomic(kept, {"fabric": fabric.rate, "made_by": " ".join(sys.argv), "profile": profile,
                                      "spec": spec_as_dict(spec)})
    return [dataclasses.replace(s, hardware=spec.name) for s in scenarios], spec


def _kept_spec(path: Path, fabric: Fabric) -> HardwareSpec:
    try:
        kept = json.loads(path.read_text())
        spec = spec_from_dict(kept["spec"], f"{path}: field 'spec'")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FabricError(f"{path}: not a fabric profile this sweep can resume from ({type(e).__name__}: {e}); "
                          "remove it (and the sweep's --out) to profile again") from None
    if kept.get("fabric") != fabric.rate or spec.name != fabric.name:
        raise FabricError(f"{path}: profiles fabric {kept.get('fabric')!r}, this run measures {fabric.rate!r}; "
                          "one --out holds one fabric: choose another --out")
    return spec
