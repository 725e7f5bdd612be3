"""The cost model, in one place: primitive costs on a hardware spec (a GEMM, a transfer, a
collective, their contention), a scenario's estimates (T_comp, T_comm, DIL, chunking loss)
and whole schedules' times.

The simulator (``ficco_select.data.simulate``), the features and the hand heuristic all call these, so
they estimate with the same formulas. NumPy only (vectorized; scalars work too).
"""

from __future__ import annotations

import functools

import numpy as np

from ficco_select.hardware import HardwareSpec

US = 1e-6
GB = 1e9
OP_CODES = {"ag_gemm": 0, "gemm_rs": 1, "a2a_gemm": 2, "gemm_ar": 3, "gemm_a2a": 4}
GRANULARITY_CODES = {"none": 0, "shard": 1, "ficco": 2}


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
    if hw.fp8_gemm_efficiency != 1.0:  # 1-byte operands are fp8's (x * 1.0 would be x, bit for bit)
        rate = rate * np.where(np.asarray(dtype_bytes) == 1, hw.fp8_gemm_efficiency, 1.0)
    if not (scalar_units and units_free == 1):  # x * 1.0 is x, bit for bit
        rate = rate * units_free
    compute = np.minimum.reduce(flops / rate, axis=0)  # the fastest tile choice
    # Operand traffic at the bandwidth a GEMM reaches: a piece with few rows streams the whole
    # weight matrix for little compute, and that bounds it. An fp8 GEMM writes bf16 (2 bytes).
    moved = (M * K + K * N + M * N) * dtype_bytes
    if np.any(np.asarray(dtype_bytes) == 1):
        moved = np.where(np.asarray(dtype_bytes) == 1, (M * K + K * N) * dtype_bytes + M * N * 2, moved)
    memory = moved / (hw.mem_bw_gbps * hw.gemm_mem_efficiency * GB)
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
    sm_bw = per_transfer_bw  # what SM loads and stores reach of it
    if hw.sm_bw_gbps > 0:
        sm_bw = np.minimum(per_transfer_bw, hw.sm_bw_gbps * GB / concurrent)
    dma = None if isinstance(engine_dma, bool) else np.asarray(engine_dma, dtype=bool)
    if engine_dma is True or (dma is not None and np.count_nonzero(dma)):  # any, for a bool array
        engines = max(hw.copy_engines, 1)
        dma_bw = np.minimum(per_transfer_bw, hw.dma_bw_gbps * GB)
        waves = np.ceil(concurrent / engines)  # more transfers than engines queue up
        t_dma = waves * (dma_latency + nbytes / dma_bw)
        t_sm = sm_latency + nbytes / sm_bw
        return np.where(nbytes > 0, np.where(True if dma is None else dma, t_dma, t_sm), 0.0)
    return np.where(nbytes > 0, sm_latency + nbytes / sm_bw, 0.0)


def collective_time(hw: HardwareSpec, op, shard_bytes, P):
    """Seconds for the serial baseline's whole collective: each rank sends one shard of
    `shard_bytes` to each of its P - 1 peers (``op`` an ``OP_CODES`` code).

    With a collective library's numbers (``coll_bw_gbps`` > 0: NCCL's bus bandwidth and
    fixed cost, fitted to its measured times) that is latency + (P - 1) shards / bus
    bandwidth; a reduce-scatter's additions are in its bus bandwidth (the library adds as
    it moves). Without them, the better of a ring of ``sm`` transfers and a direct exchange
    with every peer at once (what a library picks: direct on a fully connected node), plus a
    reduce-scatter's additions (``reduction_time``). An all-reduce (``gemm_ar``) is a
    reduce-scatter then an all-gather: twice the transfers (and twice the fixed cost), as a
    library's ring all-reduce moves 2 (P - 1) shards at the same bus bandwidth."""
    shard_bytes = np.asarray(shard_bytes, dtype=float)
    phases = np.where(op == OP_CODES["gemm_ar"], 2.0, 1.0)
    if hw.coll_bw_gbps > 0:
        moved = phases * (hw.coll_latency_us * US + (P - 1) * shard_bytes / (hw.coll_bw_gbps * GB))
        return np.where(shard_bytes > 0, moved, 0.0)
    coll = np.minimum((P - 1) * transfer_time(hw, shard_bytes, 1, False, P),
                      transfer_time(hw, shard_bytes, P - 1, False, P))
    return phases * coll + reduction_time(hw, op, shard_bytes, P)


def sm_all_reduce_time(hw: HardwareSpec, message_bytes, P, shots):
    """Seconds for an all-reduce of `message_bytes` per rank run by SM loads and stores on
    symmetric memory, no collective library (PyTorch's ``symm_mem`` all-reduces, vLLM's custom
    one): ``shots`` 1 reads each peer's whole buffer at once and adds (one step of P - 1
    concurrent ``sm`` transfers); 2 reduce-scatters slices of 1/P, then all-gathers them, each a
    step of P - 1 concurrent transfers: the transfers of a ``gemm_ar`` a2a schedule's step. Its
    fixed cost is ``sm_comm_latency_us`` per step, where a library pays ``coll_latency_us``."""
    shots = np.asarray(shots, dtype=float)
    shard = np.where(shots == 2, message_bytes / P, message_bytes)
    return shots * transfer_time(hw, shard, P - 1, False, P) + reduction_time(hw, OP_CODES["gemm_ar"], shard, P)


def switch_bytes(op, shard_bytes, P):
    """Bytes through one device's port when the switch carries a collective of shards of
    `shard_bytes` (what one rank owes one peer): a reduce-scatter or all-reduce sends the
    rank's whole buffer, P shards, once (the switch adds them; multimem ``ld_reduce``); an
    all-gather receives the P - 1 other shards, each sent once and multicast (``st``)."""
    return np.where(op == OP_CODES["ag_gemm"], (P - 1) * shard_bytes, P * shard_bytes)


def switch_time(hw: HardwareSpec, port_bytes):
    """Seconds for one operation the switch reduces or multicasts, moving `port_bytes`
    through a device's port: ``switch_latency_us`` + bytes / ``switch_bw_gbps`` (no adds on
    the GPU: the switch adds). Infinite on a machine whose switch has no bandwidth."""
    port_bytes = np.asarray(port_bytes, dtype=float)
    rate = hw.switch_bw_gbps * GB
    if rate <= 0:
        return np.where(port_bytes > 0, np.inf, 0.0)
    return np.where(port_bytes > 0, hw.switch_latency_us * US + port_bytes / rate, 0.0)


def switch_collective_time(hw: HardwareSpec, op, shard_bytes, P):
    """Seconds for the baseline's whole collective in the switch (``none.switch``): one
    operation; an all-reduce's reduction and multicast are one pass through the port, both
    directions at once."""
    return switch_time(hw, switch_bytes(op, shard_bytes, P))


def reduction_time(hw: HardwareSpec, op, shard_bytes, P):
    """Seconds a reduce-scatter (``gemm_rs``, and the first half of ``gemm_ar``'s all-reduce)
    spends adding the P - 1 partial shards it receives (read two, write one, at memory
    bandwidth); 0 for the other operators."""
    reduces = (op == OP_CODES["gemm_rs"]) | (op == OP_CODES["gemm_ar"])
    return np.where(reduces, (P - 1) * 3 * shard_bytes / (hw.mem_bw_gbps * GB), 0.0)


def overlapped(hw: HardwareSpec, g, c):
    """Time of a GEMM of time g and a transfer of time c run beside each other: the longer,
    plus the part of the shorter that ``overlap_efficiency`` says is not hidden."""
    longer = np.maximum(g, c)
    if hw.overlap_efficiency == 1.0:  # the ideal: the longer alone, bit for bit
        return longer
    return longer + (1.0 - hw.overlap_efficiency) * np.minimum(g, c)


def contended(hw: HardwareSpec, g, c, dma):
    """GEMM time while a transfer of time c runs beside it (only the overlapped part slows)."""
    overlap = np.minimum(1.0, np.where(g > 0, c / np.maximum(g, 1e-30), 0.0))
    slow_sm = 1 / (1 - hw.sm_comm_units) - 1
    factor = np.where(dma, hw.dma_mem_contention, slow_sm)
    return g * (1 + factor * overlap)


# -- a scenario's estimates and whole schedules -------------------------------------------


def rank_work(op, m, n, k, P, imbalance):
    """The busiest rank's whole GEMM and its shard of the collective, as the cost model sees them.

    `op` an ``OP_CODES`` code; every argument a number or an array (element-wise).
    Returns (M, N, K, shard_rows, shard_cols): the GEMM is (M, N, K); one shard (what one
    rank sends one peer in the collective) is shard_rows rows of shard_cols elements.
    - ``ag_gemm``:  GEMM (m, n/P, k); a shard is m/P rows of A (k wide).
    - ``gemm_rs``:  GEMM (m, n, k/P); a shard is m/P rows of the partial output (n wide).
    - ``a2a_gemm``: the hot expert's GEMM (imbalance * m, n, k); a shard is one source's
      share of its tokens, imbalance * m / P rows (k wide).
    - ``gemm_ar``: as ``gemm_rs`` (its all-reduce moves each shard twice).
    - ``gemm_a2a``: the hot expert's GEMM, as ``a2a_gemm``; a shard is one source's share
      of its outputs, imbalance * m / P rows (n wide).
    Real numbers, no rounding (smooth costs for the heuristic, features, simulator and
    calibration); the integer shapes the executor runs are ``Scenario.rank_gemms()``.
    """
    is_ag = op == OP_CODES["ag_gemm"]
    is_rs = (op == OP_CODES["gemm_rs"]) | (op == OP_CODES["gemm_ar"])
    M = np.where(is_ag | is_rs, m, imbalance * m)
    N = np.where(is_ag, n / P, n)
    K = np.where(is_rs, k / P, k)
    return M, N, K, M / P, np.where(is_rs | (op == OP_CODES["gemm_a2a"]), n, k)


def scenario_estimates(hw: HardwareSpec, *, op, m, n, k, P, imbalance, dtype_bytes, peak,
                       degrees=(2, 4)) -> dict[str, np.ndarray]:
    """A scenario's analytic estimates on `hw` (every argument a number or an array):

    - ``t_comp``: the busiest rank's whole GEMM; ``t_comm``: the whole collective
      (``collective_time``), each alone, in seconds;
    - ``ring``: the collective as a ring of P - 1 ``sm`` transfers of one shard;
    - per degree d of `degrees`: ``dil_<d>``, the decomposition loss of P x d row pieces
      (their GEMMs over the whole GEMM, minus 1); ``chunk_<d>``, the chunking loss of a ring
      moving d pieces per shard (over the ring, minus 1); ``piece_comm_<d>``, one piece's
      ``sm`` transfer;
    - the per-rank work of ``rank_work`` (``M``, ``N``, ``K``, ``shard_rows``,
      ``shard_cols``) and ``shard_bytes``.
    The heuristic, the features and the simulator's baseline read these.
    """
    # Absurd shapes (a hostile record at the runtime's door) give inf and NaN estimates that
    # the callers handle, not warnings in the job's log.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        M, N, K, shard_rows, shard_cols = rank_work(op, m, n, k, P, imbalance)
        shard_bytes = shard_rows * shard_cols * dtype_bytes
        t_comp = gemm_time(hw, M, N, K, dtype_bytes, peak)
        ring = (P - 1) * transfer_time(hw, shard_bytes, 1, False, P)
        out = {"M": M, "N": N, "K": K, "shard_rows": shard_rows, "shard_cols": shard_cols,
               "shard_bytes": shard_bytes, "t_comp": t_comp, "t_comm": collective_time(hw, op, shard_bytes, P),
               "ring": ring}
        for d in degrees:
            pieces = P * d
            piece_comm = transfer_time(hw, shard_bytes / d, 1, False, P)
            out[f"dil_{d}"] = pieces * gemm_time(hw, M / pieces, N, K, dtype_bytes, peak) / t_comp - 1
            out[f"chunk_{d}"] = (P - 1) * d * piece_comm / ring - 1
            out[f"piece_comm_{d}"] = piece_comm
    return out


def schedule_times(hw: HardwareSpec, *, op, m, n, k, P, imbalance, dtype_bytes, peak, gran, degree, a2a, per_step,
                   split_n, dma, switch=False) -> dict[str, np.ndarray]:
    """The analytic time of whole schedules along their pipelines, one entry per
    (scenario, schedule); every argument an array (or a scalar) of that length.

    `op`, `gran`: ``OP_CODES``, ``GRANULARITY_CODES``; `imbalance`: max / mean expert load
    (a2a_gemm); `a2a`, `per_step`, `split_n`, `dma`, `switch`: the schedule's axes as
    booleans (`dma` copy engines, `switch` the switch engine, neither ``sm``).
    Returns ``time_s`` (the schedule), ``t_comp_s`` and ``t_comm_s`` (the whole GEMM and
    the whole collective, each alone), and the per-rank GEMM (``M``, ``N``, ``K``) and
    shard (``shard_rows``, ``shard_cols``). One device per rank: the simulator scales for
    ranks sharing devices. The model is ``ficco_select.data.simulate``'s (its docstring has the pipeline);
    the features use it too, so that a model sees each candidate's whole physics.

    ``gemm_ar``: its ring schedules are ``gemm_rs``'s followed by the whole all-gather of
    the reduced blocks; its a2a schedules move each step's pieces twice (the reduce-scatter
    to the owners, then their all-gather) while the next step's GEMMs run.
    """
    b = dtype_bytes
    d = degree
    M_whole, N_whole, K_whole, shard_rows, shard_cols = rank_work(op, m, n, k, P, imbalance)
    g_whole = gemm_time(hw, M_whole, N_whole, K_whole, b, peak)

    # Baseline: the whole collective (``collective_time``), then the GEMM.
    shard_bytes = shard_rows * shard_cols * b
    t_comm_whole = collective_time(hw, op, shard_bytes, P)
    rs_adds = reduction_time(hw, op, shard_bytes, P)

    # Overlapped schedules: pieces of shard_rows / d rows (or n / d columns for gemm_rs split n).
    dd = np.where(gran == GRANULARITY_CODES["ficco"], d, 1.0)
    piece_rows = np.where(split_n, shard_rows, shard_rows / dd)
    piece_N = np.where(split_n, N_whole / dd, N_whole)
    piece_bytes = np.where(split_n, shard_bytes / dd, piece_rows * shard_cols * b)
    concurrent = np.where(a2a, P - 1, 1)
    c_piece = transfer_time(hw, piece_bytes, concurrent, dma, P)
    is_ar = op == OP_CODES["gemm_ar"]
    g_piece = gemm_time(hw, piece_rows, piece_N, K_whole, b, peak)
    g_shard = gemm_time(hw, shard_rows, N_whole, K_whole, b, peak)
    # a2a pattern, per step: one batched GEMM over the P pieces of the step.
    g_step_batched = gemm_time(hw, piece_rows * P, piece_N, K_whole, b, peak)

    # Steps of the pipeline: ring: (P-1) hops x d pieces; a2a: d steps of P-1 peers at once.
    steps = np.where(a2a, dd, (P - 1) * dd)
    # GEMM work per step and transfer time per step.
    g_step = np.where(a2a, np.where(per_step, g_step_batched, P * g_piece),
                      np.where(per_step, g_shard / dd, g_piece))
    c_step = np.where(is_ar & a2a, 2 * c_piece, c_piece)
    switch = np.asarray(switch, dtype=bool)
    if switch.any():
        step_switch = switch_time(hw, switch_bytes(op, piece_bytes, P))
        c_step = np.where(switch, step_switch, c_step)
        rs_adds = np.where(switch, 0.0, rs_adds)
    g_step_c = contended(hw, g_step, c_step, dma)
    # Local work that overlaps the first transfer: the local shard (ring), or the first
    # local piece (a2a pattern, GEMM per piece); a per-step a2a GEMM waits for its step.
    g_local = np.where(a2a, np.where(per_step, 0.0, g_piece), np.where(per_step, g_shard, dd * g_piece))
    first = overlapped(hw, contended(hw, g_local, c_step, dma), c_step)
    middle = (steps - 1) * overlapped(hw, g_step_c, c_step)
    # Each step also waits on its peer's signal and orders the streams (``step_sync_us``);
    # each call sets up once with each peer (``overlap_call_us``).
    t_over = (first + middle + g_step + rs_adds / np.maximum(steps, 1) + steps * (hw.step_sync_us * US)
              + (P - 1) * hw.overlap_call_us * US)
    # gemm_ar's reduce-scatter + all-gather form: the reduced blocks' all-gather comes last.
    all_gather = collective_time(hw, OP_CODES["ag_gemm"], shard_bytes, P)
    t_over = np.where(is_ar & ~np.asarray(a2a, dtype=bool), t_over + all_gather, t_over)
    whole_comm = t_comm_whole
    if switch.any():
        whole_comm = np.where(switch, switch_collective_time(hw, op, shard_bytes, P), t_comm_whole)
    time = np.where(gran == GRANULARITY_CODES["none"], whole_comm + g_whole, t_over)

    return {"time_s": time, "t_comp_s": g_whole, "t_comm_s": t_comm_whole, "M": M_whole, "N": N_whole, "K": K_whole,
            "shard_rows": shard_rows, "shard_cols": shard_cols}
