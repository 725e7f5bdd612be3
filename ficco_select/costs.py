"""Analytic primitive costs on a hardware spec: a GEMM, a transfer, their contention.

Shared by the simulator (``data.simulate``), the features and the hand heuristic, so
they all estimate with the same formulas. NumPy only (vectorized; scalars work too).
"""

from __future__ import annotations

import functools

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
    M, N, K = np.asarray(M, dtype=float), np.asarray(N, dtype=float), np.asarray(K, dtype=float)
    with np.errstate(over="ignore"):  # absurd shapes give inf times, not warnings
        return _gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free, mem_slowdown)


def _gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free, mem_slowdown):
    scalar_units = type(units_free) is float or type(units_free) is int  # the usual case: plain numbers
    if scalar_units:  # the same values as the array path, with Python arithmetic
        units = hw.compute_units * float(units_free)
        units_ndim, units_at_least_1 = 0, max(units, 1)
    else:
        units = hw.compute_units * np.asarray(units_free, dtype=float)
        units_ndim, units_at_least_1 = units.ndim, np.maximum(units, 1)
    flops = 2 * M * N * K
    # Every tile choice at once, along a leading axis: (len(TILE_CHOICES), *shape). The
    # same operations, in the same order, as one tile at a time: the same bits.
    ndim = max(M.ndim, N.ndim, K.ndim, units_ndim, 0 if type(peak_flops) is float else np.ndim(peak_flops))
    tile_m, tile_n, efficiency = _tile_axis(hw.tile_m, hw.tile_n, ndim, TILE_CHOICES)
    tiles = np.ceil(M / tile_m) * np.ceil(N / tile_n)
    waves = np.ceil(tiles / units_at_least_1)
    utilization = np.where(tiles > 0, tiles / np.maximum(waves * units, 1), 1.0)
    rate = peak_flops * hw.gemm_efficiency * efficiency * utilization
    if not (scalar_units and units_free == 1):  # x * 1.0 is x, bit for bit
        rate = rate * units_free
    compute = np.minimum.reduce(flops / rate, axis=0)  # the fastest tile choice
    memory = (M * K + K * N + M * N) * dtype_bytes / (hw.mem_bw_gbps * GB)
    if not (type(mem_slowdown) in (float, int) and mem_slowdown == 0):  # x * (1 + 0) is x
        memory = memory * (1 + mem_slowdown)
    return np.where(flops > 0, np.maximum(compute, memory) + hw.gemm_launch_us * US, 0.0)


@functools.lru_cache(maxsize=64)
def _tile_axis(tile_m: int, tile_n: int, ndim: int, choices: tuple) -> tuple[np.ndarray, ...]:
    """Tile rows, tile columns and efficiency kept per tile choice, each (len(choices), 1 x ndim)."""
    shape = (len(choices),) + (1,) * ndim
    out = (np.array([max(tile_m // shrink, 1) for shrink, _ in choices], dtype=float).reshape(shape),
           np.array([max(tile_n // shrink, 1) for shrink, _ in choices], dtype=float).reshape(shape),
           np.array([efficiency for _, efficiency in choices], dtype=float).reshape(shape))
    for array in out:
        array.flags.writeable = False  # shared between calls
    return out


def transfer_time(hw: HardwareSpec, nbytes, concurrent, engine_dma, P):
    """Seconds for one step that sends `nbytes` to each of `concurrent` peers at once."""
    nbytes = np.asarray(nbytes, dtype=float)
    concurrent = np.maximum(np.asarray(concurrent, dtype=float), 1)
    link = hw.link_bw_gbps * GB
    sm_latency, dma_latency = hw.sm_comm_latency_us * US, hw.dma_latency_us * US
    if hw.topology == "ring":  # all-to-all traffic crosses P/4 links on average, in both directions
        P = np.asarray(P, dtype=float)
        per_transfer_bw = np.where(concurrent > 1, 2 * link / concurrent, link)
        hops = np.where(concurrent > 1, np.maximum(P / 4, 1), 1)
        sm_latency, dma_latency = sm_latency * hops, dma_latency * hops
    elif hw.topology == "switch":
        per_transfer_bw = link / concurrent  # one port into the switch, shared
    else:  # fully_connected: a link per peer. One hop (latency x 1 is the latency, bit for bit)
        per_transfer_bw = link
    dma = None if isinstance(engine_dma, bool) else np.asarray(engine_dma, dtype=bool)
    if engine_dma is True or (dma is not None and np.count_nonzero(dma)):  # any, for a bool array
        engines = max(hw.copy_engines, 1)
        dma_bw = np.minimum(per_transfer_bw, hw.dma_bw_gbps * GB)
        waves = np.ceil(concurrent / engines)  # more transfers than engines queue up
        t_dma = waves * (dma_latency + nbytes / dma_bw)
        t_sm = sm_latency + nbytes / per_transfer_bw
        return np.where(nbytes > 0, np.where(True if dma is None else dma, t_dma, t_sm), 0.0)
    return np.where(nbytes > 0, sm_latency + nbytes / per_transfer_bw, 0.0)


def contended(hw: HardwareSpec, g, c, dma):
    """GEMM time while a transfer of time c runs beside it (only the overlapped part slows)."""
    overlap = np.minimum(1.0, np.where(g > 0, c / np.maximum(g, 1e-30), 0.0))
    slow_sm = 1 / (1 - hw.sm_comm_units) - 1
    factor = np.where(dma, hw.dma_mem_contention, slow_sm)
    return g * (1 + factor * overlap)


# -- per-row shapes ------------------------------------------------------------------------
