"""The cost formulas give, bit for bit, what the original loop-over-tiles code gave.

``gemm_time`` and ``transfer_time`` feed the simulator, the calibrated presets and the
training features, so a faster rewrite must not move a single bit. The reference below is
the code as it was before the rewrite (kept verbatim); every output is compared on a
large grid: every preset plus edited specs, both dtypes, shapes from 0 to overflowing,
scalars, 0-d and n-d arrays, units_free and mem_slowdown values, every engine_dma form.
"""

import dataclasses
import itertools

import numpy as np
import pytest

from ficco_select.costs import GB, US, gemm_time, transfer_time
from ficco_select.hardware import load_hardware, preset_names

# -- the reference: costs.py before the rewrite, verbatim ----------------------------------
REF_TILE_CHOICES = ((1, 1.0), (2, 0.85), (4, 0.6))


def ref_gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free=1.0, mem_slowdown=0.0):
    M, N, K = (np.asarray(x, dtype=float) for x in (M, N, K))
    with np.errstate(over="ignore"):
        return _ref_gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free, mem_slowdown)


def _ref_gemm_time(hw, M, N, K, dtype_bytes, peak_flops, units_free, mem_slowdown):
    units = hw.compute_units * np.asarray(units_free, dtype=float)
    flops = 2 * M * N * K
    compute = np.full(np.broadcast(M, N, K).shape, np.inf)
    for shrink, efficiency in REF_TILE_CHOICES:
        tile_m, tile_n = max(hw.tile_m // shrink, 1), max(hw.tile_n // shrink, 1)
        tiles = np.ceil(M / tile_m) * np.ceil(N / tile_n)
        waves = np.ceil(tiles / np.maximum(units, 1))
        utilization = np.where(tiles > 0, tiles / np.maximum(waves * units, 1), 1.0)
        t = flops / (peak_flops * hw.gemm_efficiency * efficiency * utilization * units_free)
        compute = np.minimum(compute, t)
    # The one change since: operands move at the GEMM's share of the bandwidth (gemm_mem_efficiency).
    memory = (M * K + K * N + M * N) * dtype_bytes / (hw.mem_bw_gbps * hw.gemm_mem_efficiency * GB) * (1 + mem_slowdown)
    return np.where(flops > 0, np.maximum(compute, memory) + hw.gemm_launch_us * US, 0.0)


def ref_transfer_time(hw, nbytes, concurrent, engine_dma, P):
    nbytes = np.asarray(nbytes, dtype=float)
    concurrent = np.maximum(np.asarray(concurrent, dtype=float), 1)
    P = np.asarray(P, dtype=float)
    link = hw.link_bw_gbps * GB
    if hw.topology == "fully_connected":
        per_transfer_bw = np.full_like(nbytes, link)
        hops = np.ones_like(nbytes)
    elif hw.topology == "switch":
        per_transfer_bw = link / concurrent
        hops = np.ones_like(nbytes)
    else:
        per_transfer_bw = np.where(concurrent > 1, 2 * link / concurrent, link)
        hops = np.where(concurrent > 1, np.maximum(P / 4, 1), 1)
    if engine_dma is True or (not isinstance(engine_dma, bool) and np.any(engine_dma)):
        dma = np.asarray(engine_dma, dtype=bool)
        engines = max(hw.copy_engines, 1)
        dma_bw = np.minimum(per_transfer_bw, hw.dma_bw_gbps * GB)
        waves = np.ceil(concurrent / engines)
        t_dma = waves * (hw.dma_latency_us * US * hops + nbytes / dma_bw)
        t_sm = hw.sm_comm_latency_us * US * hops + nbytes / per_transfer_bw
        return np.where(nbytes > 0, np.where(dma, t_dma, t_sm), 0.0)
    return np.where(nbytes > 0, hw.sm_comm_latency_us * US * hops + nbytes / per_transfer_bw, 0.0)


# -- the grid --------------------------------------------------------------------------------
def specs():
    """Every preset, and edited copies that reach the corner cases of the formulas."""
    out = [load_hardware(name) for name in preset_names()]
    base = load_hardware("h100-nvswitch")
    for topology in ("fully_connected", "switch", "ring"):
        out.append(dataclasses.replace(base, topology=topology, tile_m=3, tile_n=1, compute_units=1,
                                       copy_engines=0, dma_bw_gbps=1e4))
        out.append(dataclasses.replace(base, topology=topology, tile_m=96, tile_n=200, compute_units=7,
                                       copy_engines=1, gemm_efficiency=0.33))
    return out


SPECS = specs()
IDS = [f"{i}-{hw.name}-{hw.topology}" for i, hw in enumerate(SPECS)]
EXTENTS = np.array([0.0, 0.25, 1.0, 2.0, 3.0, 7.0, 63.0, 64.0, 65.0, 127.5, 128.0, 129.0, 255.0, 256.0, 257.0,
                    1000.0, 1024.0, 4095.0, 8192.0, 12288.0, 57344.0, 1e6, 3.3e7, 2.0 ** 40, 1e100, 2.0 ** 600,
                    1e300, np.inf])
"""Shape extents: empty, fractional (pieces of pieces), around tile edges, large, overflowing."""
BYTES = np.array([0.0, 1.0, 2.0, 1000.0, 4096.0, 65536.0, 1e6, 3.7e7, 1e9, 2.0 ** 40, 1e300, np.inf])


def bits(x):
    """Value, shape and type, with NaN payloads and signed zeros compared exactly."""
    a = np.asarray(x)
    return type(x), a.dtype, a.shape, a.tobytes()


def assert_same(got, want, what):
    assert bits(got) == bits(want), f"{what}: got {got!r}, want {want!r}"


# -- gemm_time ---------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", SPECS, ids=IDS)
def test_gemm_time_bit_equal_on_a_grid_of_arrays(hw):
    # Every (M, N, K) triple of the extents, as (n,) arrays, per dtype and peak.
    M, N, K = (a.ravel() for a in np.meshgrid(EXTENTS, EXTENTS, EXTENTS, indexing="ij"))
    for dtype, b in (("float32", 4), ("bfloat16", 2)):
        peak = hw.peak_tflops.get(dtype, hw.peak_tflops["float32"]) * 1e12
        for units_free, mem_slowdown in ((1.0, 0.0), (0.88, 0.0), (0.5, 0.25), (1e-3, 3.0), (0.0, 0.0), (1, 0)):
            with np.errstate(divide="ignore", invalid="ignore"):
                got = gemm_time(hw, M, N, K, b, peak, units_free, mem_slowdown)
                want = ref_gemm_time(hw, M, N, K, b, peak, units_free, mem_slowdown)
            assert_same(got, want, f"{dtype} units_free={units_free} mem_slowdown={mem_slowdown}")


@pytest.mark.parametrize("hw", SPECS, ids=IDS)
def test_gemm_time_bit_equal_on_random_shapes(hw):
    # Log-uniform, non-round extents (pieces of shards are fractional): rounding shows in
    # every step, memory-bound and compute-bound GEMMs both occur.
    rng = np.random.default_rng(0)
    M, N, K = (np.exp(rng.uniform(np.log(0.5), np.log(1e7), 4000)) for _ in range(3))
    K[::3] = rng.integers(1, 64, len(K[::3]))  # skinny reductions: memory-bound
    b = rng.choice([2.0, 4.0], len(M))
    peak = hw.peak_tflops["float32"] * 1e12 * rng.uniform(0.5, 8, len(M))
    # A few tiny pieces at a high peak: memory-bound on every spec, the cpu's included.
    M[:50], N[:50], K[:50], b[:50], peak[:50] = 0.5, 0.5, 0.5, 4.0, hw.peak_tflops["float32"] * 8e12
    for units_free, mem_slowdown in ((1.0, 0.0), (rng.uniform(0.5, 1, len(M)), rng.uniform(0, 1, len(M))),
                                     (0.9, 0.3)):
        got = gemm_time(hw, M, N, K, b, peak, units_free, mem_slowdown)
        want = ref_gemm_time(hw, M, N, K, b, peak, units_free, mem_slowdown)
        assert_same(got, want, f"random shapes, units_free={units_free!r}")
        assert_same(gemm_time(hw, M[7], N[7], K[7], b[7], peak[7]), ref_gemm_time(hw, M[7], N[7], K[7], b[7], peak[7]),
                    "one random shape, scalars")
    compute = ref_gemm_time(hw, M, N, K, b, peak)
    memory = (M * K + K * N + M * N) * b / (hw.mem_bw_gbps * hw.gemm_mem_efficiency * GB) + hw.gemm_launch_us * US
    assert (compute == memory).any() and (compute > memory).any(), "both regimes are exercised"


@pytest.mark.parametrize("hw", SPECS, ids=IDS)
def test_gemm_time_bit_equal_on_scalars_and_broadcast_shapes(hw):
    peak = hw.peak_tflops.get("bfloat16", hw.peak_tflops["float32"]) * 1e12
    peaks = np.array([hw.peak_tflops["float32"], peak / 1e12]) * 1e12
    cases = []
    for M, N, K in itertools.product((0, 1, 48, 257, 8192, 2 ** 70), (0, 3, 1024, 28672), (1, 96, 8192)):
        cases += [((M, N, K, 2, peak), {}),                              # Python ints
                  ((float(M), float(N), float(K), 4.0, peak), {}),     # Python floats
                  ((np.float64(M), N, np.int64(K), 2, np.float64(peak)), {"units_free": 0.75}),
                  ((np.array(M), N, K, 2, peak), {"mem_slowdown": 0.5}),  # 0-d array
                  ((M, N, K, 2, peak), {"units_free": np.float64(0.9), "mem_slowdown": np.float64(0.1)})]
    col = EXTENTS[:, None]
    cases += [
        ((col, EXTENTS, 4096.0, 2, peak), {}),                                       # (n, 1) x (n,) -> (n, n)
        ((EXTENTS, 1024, 512, np.where(EXTENTS > 100, 2, 4), peak), {}),             # per-row dtype bytes
        ((col, EXTENTS[:5], 64.0, 2, peaks[:, None, None]), {}),                     # peak adds a dimension
        ((EXTENTS, 512, 512, 2, peak), {"units_free": np.linspace(0.1, 1, len(EXTENTS))}),
        ((EXTENTS, 512, 512, 2, peak), {"units_free": np.array([[0.5], [1.0]])}),   # units_free adds one
        ((EXTENTS, 512, 512, 2, peak), {"mem_slowdown": np.linspace(0, 2, len(EXTENTS))}),
        ((np.zeros((0,)), 512, 512, 2, peak), {}),                                   # empty
        ((np.zeros((2, 0)), 512, 512, 2, peak), {}),
        ((np.arange(12.0).reshape(3, 4) * 100, np.arange(4.0) * 300, 8, 4, peak), {}),
        (([1, 256, 300], [256, 1, 7], [9, 9, 9], 2, peak), {}),                      # lists
    ]
    for args, kw in cases:
        with np.errstate(divide="ignore", invalid="ignore"):
            assert_same(gemm_time(hw, *args, **kw), ref_gemm_time(hw, *args, **kw), f"{args} {kw}")


# -- transfer_time -----------------------------------------------------------------------------
def assert_transfer_same(hw, nbytes, concurrent, engine_dma, P, what):
    with np.errstate(divide="ignore", invalid="ignore"):
        got = transfer_time(hw, nbytes, concurrent, engine_dma, P)
        want = ref_transfer_time(hw, nbytes, concurrent, engine_dma, P)
    assert_same(got, want, what)


@pytest.mark.parametrize("hw", SPECS, ids=IDS)
def test_transfer_time_bit_equal_on_a_grid(hw):
    nbytes = np.repeat(BYTES, 9)
    concurrent = np.tile(np.array([0, 1, 1, 2, 3, 7, 15, 63, 1023], dtype=float), len(BYTES))
    dma_rows = np.arange(len(nbytes)) % 2 == 0
    for P in (2, 3, 4, 8, 16, 64, 1024, 2.0 ** 40):
        for engine_dma in (False, True, dma_rows, np.zeros(len(nbytes), bool), np.ones(len(nbytes), bool),
                           dma_rows.astype(float), np.bool_(True), np.bool_(False), 1, 0):
            assert_transfer_same(hw, nbytes, concurrent, engine_dma, P, f"P={P} engine_dma={engine_dma!r}")
        # P per row too (the simulator's tables mix world sizes)
        Ps = np.tile(np.array([2.0, 3.0, 8.0]), len(nbytes) // 3 + 1)[: len(nbytes)]
        for engine_dma in (False, dma_rows):
            assert_transfer_same(hw, nbytes, concurrent, engine_dma, Ps, f"per-row P, {engine_dma!r}")


@pytest.mark.parametrize("hw", SPECS, ids=IDS)
def test_transfer_time_bit_equal_on_random_sizes(hw):
    rng = np.random.default_rng(1)
    nbytes = np.exp(rng.uniform(0, np.log(1e10), 4000))
    concurrent = rng.integers(0, 16, len(nbytes)).astype(float)
    P = rng.integers(2, 65, len(nbytes)).astype(float)
    dma = rng.uniform(size=len(nbytes)) < 0.5
    for engine_dma in (False, True, dma):
        assert_transfer_same(hw, nbytes, concurrent, engine_dma, P, f"random sizes, engine_dma={engine_dma!r}")


@pytest.mark.parametrize("hw", SPECS, ids=IDS)
def test_transfer_time_bit_equal_on_scalars_and_broadcast_shapes(hw):
    cases = []
    for nbytes, concurrent, P in itertools.product((0, 1, 4096, 1e6, 2 ** 70), (1, 2, 7), (2, 8)):
        for engine_dma in (False, True):
            cases += [(nbytes, concurrent, engine_dma, P), (float(nbytes), np.float64(concurrent), engine_dma,
                                                            np.int64(P)),
                      (np.array(nbytes), concurrent, np.bool_(engine_dma), P)]
    conc = np.array([1.0, 3.0, 7.0])
    cases += [
        (4096.0, conc, False, 8),                 # scalar bytes, array concurrent
        (4096.0, conc, True, 8),
        (4096.0, conc, np.array([True, False, True]), 8),
        (4096.0, 1, np.array([True, False]), 8),  # the engine array alone sets the shape
        (BYTES[:, None], conc, np.array([True, False, True]), 8),
        (BYTES, 1, False, np.array([[2.0], [8.0]])),
        (BYTES, 3, False, np.array([[2.0], [8.0]])),
        (np.zeros((0,)), 1, True, 8), (np.zeros((0,)), 1, np.zeros((0,), bool), 8),
        ([0, 10, 1e9], [1, 2, 3], [True, False, True], 8),  # lists
        (BYTES, 2, [True] * len(BYTES), [4] * len(BYTES)),
    ]
    for args in cases:
        with np.errstate(divide="ignore", invalid="ignore"):
            assert_same(transfer_time(hw, *args), ref_transfer_time(hw, *args), f"{args}")


def test_the_grid_reaches_the_corner_cases():
    # The grid is only worth something if it hits zeros, infs and NaNs in the outputs.
    hw = load_hardware("mi300x-8")
    M, N, K = (a.ravel() for a in np.meshgrid(EXTENTS, EXTENTS, EXTENTS, indexing="ij"))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = ref_gemm_time(hw, M, N, K, 2, 1e15)
    assert (t == 0).any() and np.isinf(t).any() and np.isnan(t).any() and np.isfinite(t[t > 0]).any()
