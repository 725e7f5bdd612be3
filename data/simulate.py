"""The `sim` backend: predicted time of every legal schedule, for hardware we do not have.

A schedule is composed from per-primitive costs along its pipeline, vectorized over all
(scenario, schedule) rows with NumPy:

- GEMM: roofline with wave quantization: tiles = ceil(M/tile_m) * ceil(N/tile_n) spread
  over the compute units in waves; time = max(FLOPs / (peak * efficiency * wave
  utilization), bytes / memory bandwidth) + a fixed launch cost, with the best of three
  tile sizes (``TILE_CHOICES``).
- transfer: fixed cost per transfer + bytes / bandwidth, where the bandwidth depends on
  the engine (``sm``: the link; ``dma``: min(link, copy-engine bandwidth), with at most
  ``copy_engines`` transfers at once) and on how many links a step uses at once
  (fully connected: one link per peer; switch: the device's port is shared; ring: a
  transfer to a non-neighbour crosses several links).
- contention while overlapped: an ``sm`` transfer takes ``sm_comm_units`` of the compute
  units from the GEMM; a ``dma`` transfer only slows it by ``dma_mem_contention``.
- pipeline: S steps; step s moves c_s while the GEMMs of step s-1 run, so
  T = first + sum_s max(g_{s-1}', c_s) + last, where g' is the GEMM under contention
  (reduce-scatter runs the same pipeline the other way round: GEMM, then its transfer).

Same rows and columns as ``ficco measure`` (schema ``ficco_select.data.dataset``), ``backend=sim``;
optional log-normal noise imitates measurement noise, and the repetitions are labelled by
the rule measured rows are (``ficco_select.data.labels``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ficco_select.data.dataset import provenance
from ficco_select.data.labels import label_columns
from ficco_select.data.measure.config import TimingPolicy
from ficco_select.costs import GRANULARITY_CODES, OP_CODES, gemm_time, schedule_times, transfer_time
from ficco_select.costs import contended as _contended
from ficco_select.hardware import HardwareSpec, load_hardware, machines
from ficco_select.scenario import Scenario
from ficco_select.schedule import TIE, engine_candidates
from ficco_select.signatures import SIGNATURE_COLUMNS, SIGNATURE_GRANULARITIES, signature


@functools.lru_cache(maxsize=4096)
def _schedule_table(op: str, P: int, extent_m: int, extent_n: int, dtype: str, engines: tuple[str, ...],
                    m_below_P: int = 0) -> tuple:
    """Legal schedules of every scenario sharing (op, P, extents, dtype), as column arrays.

    Legality depends on the shape only through the shard extents compared with the
    degrees (at most max(4, P)), so extents are capped and the answer cached. An MoE
    scenario may route fewer rows than ranks to an expert (`m_below_P`: its m, else 0): its
    shard extent is 0, and its own m decides.
    """
    m = m_below_P or extent_m * P
    n = extent_n if op in ("gemm_rs", "gemm_ar") else extent_n * P
    probe = Scenario(group="probe", op=op, m=m, n=n, k=P, dtype=dtype, world_size=P, hardware="sim",
                     imbalance=1.0)
    schedules = engine_candidates(probe, "sim", engines)
    return (np.array([c.name for c in schedules], dtype=object),
            np.array([c.granularity for c in schedules], dtype=object),
            np.array([c.degree for c in schedules], dtype=float),
            np.array([c.pattern == "a2a" for c in schedules]),
            np.array([c.compute == "gemm_per_step" for c in schedules]),
            np.array([c.split == "n" for c in schedules]),
            np.array([c.engine == "dma" for c in schedules]),
            np.array([c.engine == "switch" for c in schedules]))


def build_rows(scenarios: Sequence[Scenario], hw: HardwareSpec) -> dict[str, np.ndarray]:
    """One row per (scenario, legal schedule): scenario columns and, as ``_*`` numeric
    columns, what the model needs."""
    cap = lambda x, P: min(x, max(4, P) + 1)  # noqa: E731 - extents beyond the largest degree are alike
    tables = [_schedule_table(s.op, s.world_size, cap(s.m // s.world_size, s.world_size),
                              cap(s.n // (1 if s.op in ("gemm_rs", "gemm_ar") else s.world_size), s.world_size),
                              s.dtype, hw.engines, s.m if s.m < s.world_size else 0) for s in scenarios]
    counts = np.array([len(t[0]) for t in tables])
    cols: dict[str, np.ndarray] = {}
    for col in ("group", "op", "m", "n", "k", "dtype", "world_size", "hardware", "imbalance"):
        cols[col] = np.repeat(np.array([getattr(s, col) for s in scenarios]), counts)
    cols["scenario_id"] = np.repeat(np.array([s.scenario_id for s in scenarios]), counts)
    for name, i in (("schedule", 0), ("_gran", 1), ("_d", 2), ("_a2a", 3), ("_per_step", 4),
                    ("_split_n", 5), ("_dma", 6), ("_switch", 7)):
        cols[name] = np.concatenate([t[i] for t in tables]) if tables else np.array([])
    cols["_bytes"] = np.repeat(np.array([s.dtype_bytes for s in scenarios], dtype=float), counts)
    cols["_op"] = np.repeat(np.array([OP_CODES[s.op] for s in scenarios]), counts)
    cols["_gran"] = np.array([GRANULARITY_CODES[g] for g in cols["_gran"]], dtype=int)
    peak = [hw.peak_of(s.dtype) * 1e12 for s in scenarios]
    cols["_peak"] = np.repeat(np.array(peak, dtype=float), counts)
    return cols


def simulate_rows(scenarios: Sequence[Scenario], hw: HardwareSpec) -> pd.DataFrame:
    """Predicted time of every legal schedule of every scenario, plus signatures."""
    cols = build_rows(scenarios, hw)
    pred = predict(cols, hw)
    public = {c: v for c, v in cols.items() if not c.startswith("_")}
    return pd.DataFrame({**public, **pred})


def predict(cols: dict[str, np.ndarray], hw: HardwareSpec) -> dict[str, np.ndarray]:
    """The model on column arrays (one entry per (scenario, schedule)): time and signatures."""
    t, share = _times(cols, hw)
    g_whole, t_comm_whole = t["t_comp_s"], t["t_comm_s"]
    sig = _signatures(hw, t["M"], t["N"], t["K"], t["shard_rows"], t["shard_cols"], cols["_bytes"], cols["_peak"],
                      cols["world_size"].astype(float), g_whole, t_comm_whole)  # ratios: before the time-sharing
    time, g_whole, t_comm_whole = t["time_s"] * share, g_whole * share, t_comm_whole * share
    # The ratios stand (both times stretch alike); the times and their ideal speedup are shared ones.
    return {"time_s": time, **sig, "t_comp_s": g_whole, "t_comm_s": t_comm_whole,
            "ideal_speedup": (g_whole + t_comm_whole) / np.maximum(g_whole, t_comm_whole)}


def predict_time(cols: dict[str, np.ndarray], hw: HardwareSpec) -> np.ndarray:
    """``predict``'s ``time_s`` alone: what a calibration's loss reads, hundreds of times, without
    the signatures (half of ``predict``'s work)."""
    t, share = _times(cols, hw)
    return t["time_s"] * share


def _times(cols: dict[str, np.ndarray], hw: HardwareSpec) -> tuple[dict[str, np.ndarray], np.ndarray]:
    P = cols["world_size"].astype(float)
    t = schedule_times(hw, op=cols["_op"], m=cols["m"].astype(float), n=cols["n"].astype(float),
                       k=cols["k"].astype(float), P=P, imbalance=cols["imbalance"].astype(float),
                       dtype_bytes=cols["_bytes"], peak=cols["_peak"], gran=cols["_gran"], degree=cols["_d"], a2a=cols["_a2a"],
                       per_step=cols["_per_step"], split_n=cols["_split_n"], dma=cols["_dma"],
                       switch=cols.get("_switch", False))
    # More ranks than devices (the cpu backend's 4 ranks on 2 cores) time-share them.
    return t, np.maximum(1.0, P / hw.devices)


def _signatures(hw, M, N, K, shard_rows, shard_cols, b, peak, P, g_whole, t_comm):
    """The signature columns on one device per rank: the ring schedule's GEMM pieces and
    transfers alone at each granularity (NaN where its pieces would be empty), the GEMM
    beside a transfer (the ``sm`` transfer's share of the compute units)."""
    ring_comp, ring_comm = {}, {}
    for g in SIGNATURE_GRANULARITIES:
        d = P if g == "dP" else (1.0 if g == "shard" else float(g[1:]))
        pieces = P * d
        legal = shard_rows >= d
        ring_comp[g] = np.where(legal, pieces * gemm_time(hw, M / pieces, N, K, b, peak), np.nan)
        ring_comm[g] = np.where(legal, (P - 1) * d * transfer_time(hw, shard_rows / d * shard_cols * b, 1, False, P),
                                np.nan)
    return signature(t_comp=g_whole, t_comm=t_comm, t_pair=np.maximum(_contended(hw, g_whole, t_comm, False), t_comm),
                     gemm_slowdown=np.full(len(M), 1 / (1 - hw.sm_comm_units)), ring_comp=ring_comp,
                     ring_comm=ring_comm)


def simulate(scenarios: Sequence[Scenario], hw: HardwareSpec, *, noise: float = 0.0, reps: int = 5,
             seed: int = 0) -> pd.DataFrame:
    """A dataset in the schema of ``ficco measure`` with backend=sim.

    noise > 0 draws `reps` log-normal repetitions (sigma = noise) around each prediction.
    """
    if not (np.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise (--noise {noise}): the log-normal sigma must be a finite number >= 0")
    out = simulate_rows(scenarios, hw)
    rng = np.random.default_rng(seed)
    base = out["time_s"].to_numpy()
    reps_t = base[:, None] * (rng.lognormal(0.0, noise, size=(len(out), reps)) if noise > 0 else 1.0)
    reps_t = np.broadcast_to(reps_t, (len(out), reps)) if noise == 0 else reps_t
    labels = label_columns(reps_t, verified=np.ones(len(out), bool), rel_error=np.zeros(len(out)),
                           attempts=np.ones(len(out), int), noisy_spread=TimingPolicy().noisy_spread, tie_floor=TIE,
                           groups=out["scenario_id"].to_numpy())
    out["time_model_s"] = base  # the truth metrics score against; time_s is what a noisy sweep would see
    for column in ("time_s", "time_spread", "times_s"):
        out[column] = labels.pop(column)
    out["status"], out["error"] = "ok", ""  # the model has no wrong outputs; measured backends check theirs
    for column, values in labels.items():
        out[column] = values
    out["threads_per_rank"] = 0
    out["runs_per_rep"] = 0
    prov = provenance("sim")
    prov["hardware_fingerprint"] = f"sim:{hw.name}"
    out = out.assign(**prov)
    order = [c for c in out.columns if c not in SIGNATURE_COLUMNS] + list(SIGNATURE_COLUMNS)
    return out[order].reset_index(drop=True)


def simulate_table(path, *, hardware: str | None, noise: float, seed: int) -> tuple[pd.DataFrame, list[HardwareSpec]]:
    """``ficco simulate``: every legal schedule of the table `path` simulated on its machines
    (or `hardware`), one simulation per machine. Returns (rows, the machines' specs: what a
    job that writes or reads the rows knows them by, ``machines``).
    Raises ScenarioError, HardwareError, ValueError."""
    from ficco_select.data.scenarios import read_scenarios, table_machines

    scenarios = read_scenarios(path, backend="sim", hardware=hardware)
    with machines(table_machines(path, hardware)):
        specs = [load_hardware(name) for name in sorted({s.hardware for s in scenarios})]
    frames = [simulate([s for s in scenarios if s.hardware == spec.name], spec, noise=noise, seed=seed)
              for spec in specs]
    return pd.concat(frames, ignore_index=True), specs


M_BANDS = ((0, 2048), (2049, 8192), (8193, 32768), (32769, 1 << 62))
"""Global token-count bands of ``overlap_map``: decode and small prefill, prefill, long
prefill, whole-batch (MoE expert) GEMMs."""


def overlap_map(rows: pd.DataFrame, *, margin: float = TIE, no_harm: dict | None = None) -> pd.DataFrame:
    """Where overlap pays on simulated `rows` (noise-free): per (op, dtype, band of m), the
    scenarios, and the share whose best schedule beats the serial baseline by more than
    `margin` (the near-opt tolerance), split by that schedule's granularity (shard, ficco).
    With `no_harm` (selector.json's ``gpu_no_harm``), also ``beyond_error``: the share whose
    best gain exceeds that rule's margin, where a GPU selector may ship the overlap."""
    baseline = rows[rows["schedule"].str.startswith("none.")].groupby("scenario_id")["time_s"].min()
    best = rows.loc[rows.groupby("scenario_id")["time_s"].idxmin()].set_index("scenario_id")
    serial = baseline.reindex(best.index)
    best = best.assign(pays=best["time_s"] * (1 + margin) < serial,
                       granularity=best["schedule"].str.split(".").str[0])
    if no_harm is not None:
        needed = np.where(serial * 1e6 < no_harm["split_us"], no_harm["small_margin"], no_harm["large_margin"])
        best["beyond_error"] = best["pays"] & (np.log(serial / best["time_s"]) > needed)
    labels = [f"{lo}-{hi}" if hi < 1 << 62 else f">{lo - 1}" for lo, hi in M_BANDS]
    best["m_band"] = pd.cut(best["m"], [lo - 1 for lo, _ in M_BANDS] + [1 << 62], labels=labels)
    best = best.assign(shard=best["pays"] & (best["granularity"] == "shard"),
                       ficco=best["pays"] & (best["granularity"] == "ficco"))
    out = best.groupby(["op", "dtype", "m_band"], observed=True).agg(
        scenarios=("pays", "size"), overlap_pays=("pays", "mean"), shard=("shard", "mean"), ficco=("ficco", "mean"),
        **({"beyond_error": ("beyond_error", "mean")} if no_harm is not None else {}))
    return out.reset_index()
