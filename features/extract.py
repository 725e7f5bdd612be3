"""The feature extractor: (scenario, schedule) pairs -> a feature matrix.

The formulas are written once, in ``_feature_rows``; three doors call it (module
docstring of ``features``). Plain records and NumPy arrays in, NumPy out: this module
imports the vocabulary (``ficco_select``'s scenario, schedule, hardware and costs) and
NumPy, nothing of ``data``, ``train`` or the runtime.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from ficco_select.costs import (
    GB,
    GRANULARITY_CODES,
    OP_CODES,
    US,
    collective_time,
    gemm_time,
    rank_work,
    schedule_times,
    switch_bytes,
    switch_time,
    transfer_time,
)
from ficco_select.hardware_spec import TOPOLOGIES, HardwareSpec
from ficco_select.heuristic import backend_for
from ficco_select.scenario import DTYPES, OPS, Scenario
from ficco_select.schedule import GRANULARITIES, Schedule, parse

FEATURE_SCHEMA_VERSION = 3

SCENARIO_FEATURES = (
    *[f"op_{op}" for op in OPS],
    "log2_m", "log2_n", "log2_k", "dtype_bytes", "world_size", "imbalance",
    "log2_rank_M", "log2_rank_N", "log2_rank_K", "log2_shard_rows",
    "log2_flops", "log2_bytes_moved", "log2_intensity",
    "log2_peak_flops", "log2_mem_bw", "compute_units", "log2_link_bw",
    "log2_sm_latency", "log2_dma_latency", "copy_engines",
    *[f"topo_{t}" for t in TOPOLOGIES],
    "log2_t_comp_est", "log2_t_comm_est", "log2_comp_comm_ratio", "ideal_est",
    "dil_d2_est", "dil_d4_est", "chunk_d2_est", "chunk_d4_est",
)
SCHEDULE_FEATURES = (
    *[f"gran_{g}" for g in GRANULARITIES],
    "degree", "pattern_a2a", "gemm_per_step", "split_n", "engine_dma", "engine_switch",
    "log2_pieces", "log2_piece_rows", "log2_piece_bytes", "log2_piece_gemm_est", "log2_piece_comm_est",
    "log2_over_baseline_est", "log2_over_bound_est",
)
FEATURE_NAMES = (*SCENARIO_FEATURES, *SCHEDULE_FEATURES)


def _log2(x) -> np.ndarray:
    return np.log2(np.maximum(np.asarray(x, dtype=float), 1e-30))


def schedule_axes(names: Sequence[str]) -> dict[str, np.ndarray]:
    """The schedule columns of the feature matrix, from schedule names."""
    parsed = [parse(n) for n in names]
    return {
        **{f"gran_{g}": np.array([s.granularity == g for s in parsed], dtype=float) for g in GRANULARITIES},
        "degree": np.array([s.degree for s in parsed], dtype=float),
        "pattern_a2a": np.array([s.pattern == "a2a" for s in parsed], dtype=float),
        "gemm_per_step": np.array([s.compute == "gemm_per_step" for s in parsed], dtype=float),
        "split_n": np.array([s.split == "n" for s in parsed], dtype=float),
        "engine_dma": np.array([s.engine == "dma" for s in parsed], dtype=float),
        "engine_switch": np.array([s.engine == "switch" for s in parsed], dtype=float),
    }


def pair_features(records: Sequence[Mapping], schedules: Sequence[str | Schedule],
                  hardware: Mapping[str, HardwareSpec]) -> np.ndarray:
    """Feature matrix (n, len(FEATURE_NAMES)) for n (scenario record, schedule) pairs.

    records[i] has the scenario-table columns; hardware maps each record's ``hardware``
    to its spec. A record whose hardware is missing from the mapping raises KeyError.
    The formulas are ``_feature_rows``'s, the runtime's: pairs are grouped by machine and
    world size, and each group's scenarios are computed against its schedules in blocks.
    """
    names = [s.name if isinstance(s, Schedule) else s for s in schedules]
    X = np.empty((len(records), len(FEATURE_NAMES)))
    # (hardware, P) -> ({scenario: its index}, {schedule: its index}, [(pair, scenario, schedule)])
    groups: dict[tuple, tuple[dict, dict, list]] = {}
    for i, (r, name) in enumerate(zip(records, names)):
        scenario = (r["op"], float(r["m"]), float(r["n"]), float(r["k"]), r["dtype"],
                    float(r.get("imbalance", 1.0) or 1.0))
        by_scenario, by_schedule, pairs = groups.setdefault((r["hardware"], int(r["world_size"])), ({}, {}, []))
        pairs.append((i, by_scenario.setdefault(scenario, len(by_scenario)),
                      by_schedule.setdefault(name, len(by_schedule))))
    for (hw_name, P), (by_scenario, by_schedule, pairs) in groups.items():
        hw = hardware[hw_name]
        layout = _layout(P, tuple(by_schedule))
        at, scenario_at, schedule_at = np.array(pairs).T
        ops, ms, ns, ks, dtypes, imbs = zip(*by_scenario)
        column = lambda values: np.array(values, dtype=float)[:, None]  # noqa: E731  (G, 1): one scenario a row
        block = dict(op_code=column([OP_CODES[o] for o in ops]), m=column(ms), n=column(ns), k=column(ks),
                     imbalance=column(imbs), dtype_bytes=column([DTYPES[d] for d in dtypes]),
                     peak=column([hw.peak_of(d) * 1e12 for d in dtypes]))
        for start in range(0, len(ops), _BLOCK):
            sel = (scenario_at >= start) & (scenario_at < start + _BLOCK)
            rows = _feature_rows(hw, float(P), layout, **{key: v[start:start + _BLOCK] for key, v in block.items()})
            X[at[sel]] = rows[scenario_at[sel] - start, schedule_at[sel]]
    return X


_BLOCK = 1024
"""Scenarios per block of ``pair_features`` (a block holds scenarios x schedules x features)."""


def _whole_schedule(spec: HardwareSpec, **arrays) -> tuple[np.ndarray, np.ndarray]:
    """log2 of each schedule's analytic time over the baseline's (the whole collective, then
    the GEMM) and over max(T_comp, T_comm); `arrays` are ``schedule_times``'s arguments."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = schedule_times(spec, **arrays)
        baseline = t["t_comp_s"] + t["t_comm_s"]
        bound = np.maximum(t["t_comp_s"], t["t_comm_s"])
        return _log2(t["time_s"] / baseline), _log2(t["time_s"] / bound)


# -- the formulas, and what depends on the schedules alone ------------------------------
_LOG2_SCENARIO = np.array([name.startswith("log2_") for name in SCENARIO_FEATURES])
"""Scenario columns that are log2 of a raw value (``_log2`` is applied to them at once)."""
_PIECE_COLUMNS = ["log2_piece_rows", "log2_piece_bytes", "log2_piece_gemm_est", "log2_piece_comm_est"]
"""Schedule columns that depend on the scenario too, in the order candidate_features fills them."""
_WHOLE_COLUMNS = ["log2_over_baseline_est", "log2_over_bound_est"]
"""The whole-schedule columns (``_whole_schedule``)."""
_AXIS_COLUMNS = [name for name in SCHEDULE_FEATURES if name not in _PIECE_COLUMNS + _WHOLE_COLUMNS]
"""Schedule columns that depend on the schedule and the world size alone."""


def _columns_at(names) -> slice | np.ndarray:
    """Where `names` sit in FEATURE_NAMES: a slice when they are adjacent and in order (a
    copy into a slice is cheaper than into an index array), else the index array."""
    at = np.array([FEATURE_NAMES.index(name) for name in names])
    return slice(int(at[0]), int(at[-1]) + 1) if (np.diff(at) == 1).all() else at


_SCENARIO_AT, _AXES_AT, _PIECES_AT, _WHOLE_AT = (_columns_at(names) for names in (
    SCENARIO_FEATURES, _AXIS_COLUMNS, _PIECE_COLUMNS, _WHOLE_COLUMNS))
_OP_COLUMNS = [(f"op_{o}", OP_CODES[o]) for o in OPS]
_TOPOLOGY_COLUMNS = [(f"topo_{t}", t) for t in TOPOLOGIES]
_LAYOUTS: dict[tuple, "_CandidateLayout"] = {}
_LAYOUTS_BY_ID: dict[int, tuple[int, tuple, "_CandidateLayout"]] = {}
"""The layouts of candidate tuples seen before, by the tuple's id: (world size, the tuple
itself, kept alive so that no other object takes its id, its layout)."""
_LAYOUTS_LIMIT = 4096


def _maximum(a, b):
    """``np.maximum`` of two scalars (NaN if either is), without a ufunc call's overhead."""
    return a if a >= b or a != a else b


def _minimum(a, b):
    """``np.minimum`` of two scalars (NaN if either is), without a ufunc call's overhead."""
    return a if a <= b or a != a else b


def candidate_features(scenario: Scenario, schedules: Sequence[str | Schedule], hw: HardwareSpec) -> np.ndarray:
    """The rows of ``pair_features`` for one scenario and each of its candidate schedules.

    Equal, bit for bit, to ``pair_features([scenario.as_record()] * n, schedules,
    {scenario.hardware: hw})`` (tests check it): (n_schedules, n_features) float64. The
    runtime selector calls this on every cache miss, so the same formulas run with the
    scenario's columns as scalars, what depends on the schedules alone cached per
    (world size, candidate list), and one batched ``gemm_time`` and ``transfer_time`` call
    for all the estimates of the decision.
    """
    if not len(schedules):
        return np.empty((0, len(FEATURE_NAMES)))
    given_tuple = type(schedules) is tuple  # immutable: its layout can be found by its id next time
    layout = _layout(scenario.world_size, schedules if given_tuple else tuple(schedules), remember=given_tuple)
    return _feature_rows(hw, float(scenario.world_size), layout, m=float(scenario.m),
                         **_scenario_scalars(scenario, hw))


def grid_features(scenario: Scenario, ms: Sequence[int], schedules: Sequence[str | Schedule],
                  hw: HardwareSpec) -> np.ndarray:
    """``candidate_features`` of `scenario` at every token count of `ms` at once, bit for bit:
    (len(ms), n_schedules, n_features), block i the rows of ``replace(scenario, m=ms[i])``.
    The layer tables' path (``ficco_select.runtime.layers``): one layer on a grid of m."""
    if not len(schedules) or not len(ms):
        return np.empty((len(ms), len(schedules), len(FEATURE_NAMES)))
    layout = _layout(scenario.world_size, tuple(schedules))
    return _feature_rows(hw, float(scenario.world_size), layout, m=np.asarray(ms, dtype=float)[:, None],
                         **_scenario_scalars(scenario, hw))


def _scenario_scalars(scenario: Scenario, hw: HardwareSpec) -> dict[str, float]:
    """``_feature_rows``'s scenario arguments but m, as Python floats."""
    return dict(op_code=OP_CODES[scenario.op], n=float(scenario.n), k=float(scenario.k),
                imbalance=float(scenario.imbalance or 1.0), dtype_bytes=float(DTYPES[scenario.dtype]),
                peak=hw.peak_of(scenario.dtype) * 1e12)


def _feature_rows(hw: HardwareSpec, P: float, layout: _CandidateLayout, *, op_code, m, n, k, imbalance,
                  dtype_bytes, peak) -> np.ndarray:
    """The features, the one definition: every scenario given against every schedule of
    `layout` (the schedules and the world size P), on machine `hw`.

    The scenario's numbers are Python floats (one scenario: ``candidate_features``, the
    runtime's decision, cheapest on floats) or columns (G, 1): G scenarios, or one scenario
    at G token counts with only m a column (``grid_features``), or G scenarios of one
    machine and world size (``pair_features``). Returns (n_schedules, n_features) for
    floats, else (G, n_schedules, n_features). The same operations in the same order
    either way, so the same bits.
    """
    grid = isinstance(m, np.ndarray)
    maximum, minimum = (np.maximum, np.minimum) if grid else (_maximum, _minimum)
    n_schedules = len(layout.degree)
    nn, b, imb = n, dtype_bytes, imbalance
    M, N, K, shard_rows, shard_cols = (x if grid else float(x) for x in rank_work(op_code, m, nn, k, P, imb))
    shard_bytes = shard_rows * shard_cols * b
    flops = 2 * M * N * K
    moved = (P - 1) * shard_bytes

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # One call per cost formula for every estimate: see _CandidateLayout for the entries.
        gemm_M = np.where(layout.is_piece_gemm, shard_rows, M) / layout.gemm_M_div
        gemm = gemm_time(hw, gemm_M, N / layout.gemm_N_div, K, b, peak)
        comm_bytes = shard_bytes / layout.comm_bytes_div
        comm = transfer_time(hw, comm_bytes, layout.concurrent, layout.dma, P)
        if layout.any_switch:  # a switch step moves the step's pieces in one operation
            comm = np.where(layout.switch, switch_time(hw, switch_bytes(op_code, comm_bytes, P)), comm)
        gemm, comm = gemm.T, comm.T  # the estimates first: gemm[i] is entry i, one value or one per m
        t_comp = gemm[0]
        ring = (P - 1) * comm[0]
        t_comm = collective_time(hw, op_code, shard_bytes, P)  # costs.scenario_estimates' T_comm
        t_comm = t_comm.ravel() if grid else float(t_comm)
        raw = {
            **{name: 1.0 * (op_code == code) for name, code in _OP_COLUMNS},
            "log2_m": m, "log2_n": nn, "log2_k": k, "dtype_bytes": b, "world_size": P, "imbalance": imb,
            "log2_rank_M": M, "log2_rank_N": N, "log2_rank_K": K, "log2_shard_rows": shard_rows,
            "log2_flops": flops, "log2_bytes_moved": moved, "log2_intensity": flops / maximum(moved, 1.0),
            "log2_peak_flops": peak, "log2_mem_bw": hw.mem_bw_gbps * GB, "compute_units": float(hw.compute_units),
            "log2_link_bw": hw.link_bw_gbps * GB, "log2_sm_latency": hw.sm_comm_latency_us * US,
            "log2_dma_latency": max(hw.dma_latency_us, 1e-3) * US, "copy_engines": float(hw.copy_engines),
            **{name: float(hw.topology == t) for name, t in _TOPOLOGY_COLUMNS},
            "log2_t_comp_est": t_comp, "log2_t_comm_est": t_comm, "log2_comp_comm_ratio": t_comp / t_comm,
            "ideal_est": (t_comp + t_comm) / maximum(t_comp, t_comm),
            "dil_d2_est": P * 2 * gemm[1] / t_comp - 1, "dil_d4_est": P * 4 * gemm[2] / t_comp - 1,
            "chunk_d2_est": (P - 1) * 2 * comm[1] / ring - 1, "chunk_d4_est": (P - 1) * 4 * comm[2] / ring - 1,
        }
        values = [raw[name] for name in SCENARIO_FEATURES]
        if grid:  # (G, n_scenario_features): each value, one or one per m, assigned down its column
            scenario_row = np.empty((len(m), len(values)))
            for j, v in enumerate(values):
                scenario_row[:, j] = v.ravel() if type(v) is np.ndarray else v
        else:
            scenario_row = np.array(values, dtype=float)
        scenario_row = np.where(_LOG2_SCENARIO, np.log2(np.maximum(scenario_row, 1e-30)), scenario_row)  # _log2
        X = np.empty((*np.shape(m)[:1], n_schedules, len(FEATURE_NAMES)))
        X[..., _SCENARIO_AT] = scenario_row[..., None, :]
        X[..., _AXES_AT] = layout.axes
        # (len(_PIECE_COLUMNS), n[, G]): the raw values of _PIECE_COLUMNS, then their log2 in place
        if grid:
            pieces = np.stack((gemm_M.T[3:], comm_bytes.T[3:], gemm[3:], comm[3:]))
        else:
            pieces = np.concatenate((gemm_M[3:], comm_bytes[3:], gemm[3:], comm[3:])).reshape(len(_PIECE_COLUMNS),
                                                                                                n_schedules)
        X[..., _PIECES_AT] = np.log2(np.maximum(pieces, 1e-30, out=pieces), out=pieces).T  # _log2
    per_row = lambda v: v if isinstance(v, np.ndarray) else np.full(n_schedules, v)  # noqa: E731
    over_base, over_bound = _whole_schedule(
        hw, op=per_row(op_code), m=per_row(m), n=per_row(nn), k=per_row(k), P=np.full(n_schedules, P),
        imbalance=per_row(imb), dtype_bytes=per_row(b), peak=per_row(peak), gran=layout.gran,
        degree=layout.degree, a2a=layout.a2a, per_step=layout.per_step, split_n=layout.split_n, dma=layout.dma[3:],
        switch=layout.switch[3:])
    X[..., _WHOLE_AT] = np.stack((over_base, over_bound), axis=-1)
    return X


@dataclasses.dataclass(frozen=True)
class _CandidateLayout:
    """What ``candidate_features`` needs of a candidate list at a world size P, made once.

    The batched cost calls evaluate, in this order:
    GEMMs (3 + n,): the whole per-rank GEMM, its pieces at d = 2 and d = 4 (for DIL), then
    each candidate's piece GEMM; transfers (3 + n,): one ring step, a ring step of a shard
    cut in 2 and in 4 (for chunking loss), then each candidate's piece transfer (T_comm is
    ``costs.collective_time``'s, one call of its own). d is the number of pieces per shard (the degree for ficco, else 1).
    """

    axes: np.ndarray
    """(n, len(_AXIS_COLUMNS)): the schedule-axis columns, log2_pieces included."""
    is_piece_gemm: np.ndarray
    """(3 + n,) bool: the GEMM's rows are a shard's (a candidate's piece), else the whole M."""
    gemm_M_div: np.ndarray
    """(3 + n,): rows divisor: 1, 2P, 4P, then d (1 for an n-split: rows stay whole)."""
    gemm_N_div: np.ndarray
    """(3 + n,): columns divisor: 1, 1, 1, then d for an n-split, else 1."""
    comm_bytes_div: np.ndarray
    """(3 + n,): shard bytes divisor: 1, 2, 4, then d."""
    concurrent: np.ndarray
    """(3 + n,): peers sent to at once: 1, 1, 1, then P - 1 for a2a, else 1."""
    dma: np.ndarray
    """(3 + n,) bool: the transfer runs on copy engines."""
    switch: np.ndarray
    """(3 + n,) bool: the switch carries the step (``costs.switch_time``)."""
    any_switch: bool
    """Whether any candidate uses the switch (the common case, none, skips its cost call)."""
    gran: np.ndarray
    """(n,): each candidate's ``GRANULARITY_CODES`` (for ``_whole_schedule``)."""
    degree: np.ndarray
    """(n,): each candidate's degree."""
    a2a: np.ndarray
    """(n,) bool: the a2a pattern."""
    per_step: np.ndarray
    """(n,) bool: one GEMM per step."""
    split_n: np.ndarray
    """(n,) bool: pieces split n."""


def _layout(world_size: int, schedules: tuple, remember: bool = False) -> _CandidateLayout:
    """The cached layout of a candidate list; a framework asks for the same few again and again.

    Found by the tuple's id when it is the same tuple object as one `remember`ed before
    (the caller's own tuple, e.g. the runtime selector's shared candidate tuples), else by
    value (hashing every schedule).
    """
    seen = _LAYOUTS_BY_ID.get(id(schedules))
    if seen is not None and seen[1] is schedules and seen[0] == world_size:
        return seen[2]
    key = (world_size, schedules)
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= _LAYOUTS_LIMIT:
            _LAYOUTS.clear()
        cols = schedule_axes([s.name if isinstance(s, Schedule) else s for s in schedules])
        P = float(world_size)
        d = np.where(cols["gran_ficco"] > 0, cols["degree"], 1.0)
        split_n, a2a = cols["split_n"] > 0, cols["pattern_a2a"] > 0
        cols["log2_pieces"] = _log2(P * d)
        layout = _CandidateLayout(
            axes=np.column_stack([cols[name] for name in _AXIS_COLUMNS]),
            is_piece_gemm=np.concatenate([[False] * 3, np.ones(len(d), bool)]),
            gemm_M_div=np.concatenate([[1.0, P * 2, P * 4], np.where(split_n, 1.0, d)]),
            gemm_N_div=np.concatenate([[1.0, 1.0, 1.0], np.where(split_n, d, 1.0)]),
            comm_bytes_div=np.concatenate([[1.0, 2.0, 4.0], d]),
            concurrent=np.concatenate([[1.0, 1.0, 1.0], np.where(a2a, P - 1, 1.0)]),
            dma=np.concatenate([[False] * 3, cols["engine_dma"] > 0]),
            switch=np.concatenate([[False] * 3, cols["engine_switch"] > 0]),
            any_switch=bool((cols["engine_switch"] > 0).any()),
            gran=np.select([cols[f"gran_{g}"] > 0 for g in GRANULARITY_CODES], list(GRANULARITY_CODES.values())),
            degree=cols["degree"], a2a=a2a, per_step=cols["gemm_per_step"] > 0, split_n=split_n)
        for array in dataclasses.astuple(layout):
            if isinstance(array, np.ndarray):
                array.flags.writeable = False  # shared between calls
        _LAYOUTS[key] = layout
    if remember:
        if len(_LAYOUTS_BY_ID) >= _LAYOUTS_LIMIT:
            _LAYOUTS_BY_ID.clear()
        _LAYOUTS_BY_ID[id(schedules)] = (world_size, schedules, layout)
    return layout


# -- the schema's fingerprint: names and formulas ----------------------------------------
def _probe() -> tuple[list[dict], list[str], dict[str, HardwareSpec]]:
    """Fixed (scenario, schedule) pairs on fixed made-up machines, one per topology, one
    without copy engines: every formula of the features runs on them. Not the presets,
    whose numbers may be corrected without changing a formula."""
    from ficco_select.schedule import candidates

    base = dict(description="feature-schema probe", devices=8, peak_tflops={"float32": 400.0, "bfloat16": 800.0},
                mem_bw_gbps=3000.0, compute_units=120, tile_m=128, tile_n=256, gemm_efficiency=0.75,
                gemm_launch_us=4.0, link_bw_gbps=300.0, sm_comm_latency_us=6.0, sm_comm_units=0.12,
                copy_engines=3, dma_latency_us=12.0, dma_bw_gbps=150.0, dma_mem_contention=0.05)
    specs = {f"probe-{t}": HardwareSpec(name=f"probe-{t}", **{**base, "topology": t}) for t in TOPOLOGIES}
    specs["probe-no-dma"] = HardwareSpec(name="probe-no-dma", **{**base, "topology": "switch", "copy_engines": 0})
    specs["probe-library"] = HardwareSpec(name="probe-library", **{  # every fitted term on
        **base, "topology": "switch", "gemm_mem_efficiency": 0.5, "coll_latency_us": 14.0, "coll_bw_gbps": 280.0,
        "step_sync_us": 1.0, "overlap_efficiency": 0.8, "overlap_call_us": 20.0, "fp8_gemm_efficiency": 1.2,
        "switch_reduce": True, "switch_latency_us": 9.0, "switch_bw_gbps": 250.0})
    records, names = [], []
    for name, spec in specs.items():
        for op in OPS:
            for P, (m, n, k) in ((2, (64, 4096, 4096)), (8, (8192, 14336, 4096)), (4, (512, 1024, 8192))):
                rec = dict(group="probe", op=op, m=m * P, n=n * P, k=k, dtype="bfloat16", world_size=P,
                           hardware=name, imbalance=1.5 if op == "a2a_gemm" else 1.0)
                backend = backend_for(spec)
                for c in candidates(Scenario(**rec), backend, spec):
                    records.append(rec)
                    names.append(c.name)
    return records, names, specs


def formula_digest() -> str:
    """A digest of the features' values on ``_probe``'s pairs (6 significant digits: the
    same on any machine): changes when a formula does, not when a comment does."""
    records, names, specs = _probe()
    X = pair_features(records, names, specs)
    return hashlib.sha1(" ".join(f"{v:.6g}" for v in X.ravel()).encode()).hexdigest()[:12]


@functools.cache
def feature_schema_hash() -> str:
    """``FEATURE_SCHEMA_HASH``: stored with every model; a model whose hash differs is
    refused at load. It covers the names and the formulas (``formula_digest``): a changed
    formula refuses an old model. Computed on first use (tens of ms), not at import: the
    runtime's first decision imports this module and needs no hash."""
    return hashlib.sha1(
        f"{FEATURE_SCHEMA_VERSION}:{','.join(FEATURE_NAMES)}:{formula_digest()}".encode()).hexdigest()[:12]

