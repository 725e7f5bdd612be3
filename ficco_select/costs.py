"""Analytic primitive costs on a hardware spec: a GEMM, a transfer, their contention.

Shared by the simulator (``data.simulate``), the features and the hand heuristic, so
they all estimate with the same formulas. NumPy only (vectorized; scalars work too).
"""

from __future__ import annotations

import numpy as np

from ficco_select.hardware import HardwareSpec

US = 1e-6
GB = 1e9


# -- primitives (vectorized: every argument may be an array) ------------------------------
TILE_CHOICES = ((1, 1.0), (2, 0.85), (4, 0.6))
"""(tile shrink factor, efficiency kept): as GEMM libraries do, a small problem picks a
smaller tile, filling more compute units at a lower per-unit efficiency."""


def gemm_time(hw: HardwareSpec, M, N, K, dtype_bytes, peak_flops, units_free=1.0, mem_slowdown=0.0):
    """Seconds for one (M x K) @ (K x N) GEMM on one device; 0 for empty GEMMs."""
    M, N, K = (np.asarray(x, dtype=float) for x in (M, N, K))
    with np.errstate(over="ignore"):  # absurd shapes give inf times, not warnings
        return _gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free, mem_slowdown)


def _gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free, mem_slowdown):
    units = hw.compute_units * np.asarray(units_free, dtype=float)
    flops = 2 * M * N * K
    compute = np.full(np.broadcast(M, N, K).shape, np.inf)
    for shrink, efficiency in TILE_CHOICES:
        tile_m, tile_n = max(hw.tile_m // shrink, 1), max(hw.tile_n // shrink, 1)
        tiles = np.ceil(M / tile_m) * np.ceil(N / tile_n)
        waves = np.ceil(tiles / np.maximum(units, 1))
        utilization = np.where(tiles > 0, tiles / np.maximum(waves * units, 1), 1.0)
        t = flops / (peak_flops * hw.gemm_efficiency * efficiency * utilization * units_free)
        compute = np.minimum(compute, t)
    memory = (M * K + K * N + M * N) * dtype_bytes / (hw.mem_bw_gbps * GB) * (1 + mem_slowdown)
    return np.where(flops > 0, np.maximum(compute, memory) + hw.gemm_launch_us * US, 0.0)


def transfer_time(hw: HardwareSpec, nbytes, concurrent, engine_dma, P):
    """Seconds for one step that sends `nbytes` to each of `concurrent` peers at once."""
    nbytes = np.asarray(nbytes, dtype=float)
    concurrent = np.maximum(np.asarray(concurrent, dtype=float), 1)
    P = np.asarray(P, dtype=float)
    link = hw.link_bw_gbps * GB
    if hw.topology == "fully_connected":
        per_transfer_bw = np.full_like(nbytes, link)
        hops = np.ones_like(nbytes)
    elif hw.topology == "switch":
        per_transfer_bw = link / concurrent  # one port into the switch, shared
        hops = np.ones_like(nbytes)
    else:  # ring: all-to-all traffic crosses P/4 links on average, in both directions
        per_transfer_bw = np.where(concurrent > 1, 2 * link / concurrent, link)
        hops = np.where(concurrent > 1, np.maximum(P / 4, 1), 1)
    if engine_dma is True or (not isinstance(engine_dma, bool) and np.any(engine_dma)):
        dma = np.asarray(engine_dma, dtype=bool)
        engines = max(hw.copy_engines, 1)
        dma_bw = np.minimum(per_transfer_bw, hw.dma_bw_gbps * GB)
        waves = np.ceil(concurrent / engines)  # more transfers than engines queue up
        t_dma = waves * (hw.dma_latency_us * US * hops + nbytes / dma_bw)
        t_sm = hw.sm_comm_latency_us * US * hops + nbytes / per_transfer_bw
        return np.where(nbytes > 0, np.where(dma, t_dma, t_sm), 0.0)
    return np.where(nbytes > 0, hw.sm_comm_latency_us * US * hops + nbytes / per_transfer_bw, 0.0)


def contended(hw: HardwareSpec, g, c, dma):
    """GEMM time while a transfer of time c runs beside it (only the overlapped part slows)."""
    overlap = np.minimum(1.0, np.where(g > 0, c / np.maximum(g, 1e-30), 0.0))
    slow_sm = 1 / (1 - hw.sm_comm_units) - 1
    factor = np.where(dma, hw.dma_mem_contention, slow_sm)
    return g * (1 + factor * overlap)


# -- per-row shapes ------------------------------------------------------------------------
