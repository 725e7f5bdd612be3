"""Calibrate a hardware spec from measurements, and validate the simulator against them.

Calibration fits the primitive parameters the simulator composes, from what a measured
dataset records per scenario (the whole GEMM alone, the whole collective alone, the GEMM
slowdown while communicating):

- GEMM: t_comp = launch + FLOPs / F   (least squares; F = peak x efficiency per dtype)
- transfer: t_comm = steps x (latency + bytes_per_step / bandwidth)  (least squares over
  the ring collectives of ag_gemm and gemm_rs)
- contention: sm_comm_units = 1 - 1 / (1 + median cil_gemm_sm)
- then (``refine``) those primitives are rescaled so composed schedule times fit too.

``validate_simulator`` calibrates on part of the scenarios and predicts the rest:
median absolute percentage error of schedule times, per-scenario Kendall tau between the
simulated and measured orderings, and how often the simulated best is the measured best
(or within its measured noise).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares, minimize
from scipy.stats import kendalltau

from ficco_select.data.simulate import build_rows, predict_time, simulate_rows
from ficco_select.costs import OP_CODES, rank_work
from ficco_select.hardware import HardwareSpec, fields_of, load_hardware, spec_from_dict
from ficco_select.scenario import DTYPES, SCENARIO_COLUMNS, Scenario


POOLED_TIMES = ("time_s", "t_comp_s", "t_comm_s")
"""The times ``pool_sweeps`` averages over sweeps (geometric mean); other columns are the first sweep's."""


def pool_sweeps(sweeps: list[pd.DataFrame]) -> pd.DataFrame:
    """Independent sweeps of one machine as one dataset to calibrate on: the verified rows
    of every sweep; a (scenario, schedule) measured in several takes the geometric mean of
    their times (``POOLED_TIMES``), so that a label re-measured counts once, with less noise."""
    if len(sweeps) == 1:
        return sweeps[0]
    ok = pd.concat([d[(d["status"] == "ok") & d["verified"].astype(bool)] for d in sweeps], ignore_index=True)
    logs = np.log(ok[list(POOLED_TIMES)].astype(float).clip(lower=1e-12))
    keys = ["scenario_id", "schedule"]
    means = np.exp(logs.groupby([ok[k] for k in keys]).mean()).reset_index()
    rest = ok.drop(columns=list(POOLED_TIMES)).groupby(keys, sort=False).first().reset_index()
    return rest.merge(means, on=keys)


def _per_scenario(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"]
    return ok.groupby("scenario_id", sort=False).first().reset_index()


def calibrate(df: pd.DataFrame, *, name: str, devices: int, description: str = "",
              refine: bool = True) -> HardwareSpec:
    """A spec whose primitive costs fit the measured dataset `df` (one backend, one machine)."""
    _check_devices(devices)
    s = _per_scenario(df)
    if len(s) < 4:
        raise ValueError(f"calibration needs at least 4 measured scenarios, got {len(s)}")
    P = s["world_size"].to_numpy(float)
    # Ranks beyond the machine's devices share them: undo that before fitting one device.
    share = np.maximum(1.0, P / devices)
    m, n, k = (s[c].to_numpy(float) for c in ("m", "n", "k"))
    op = s["op"].to_numpy()
    M, N, K, shard_rows, shard_cols = rank_work(s["op"].map(OP_CODES).to_numpy(), m, n, k, P,
                                                s["imbalance"].to_numpy(float))
    flops = 2 * M * N * K
    t_comp = s["t_comp_s"].to_numpy(float) / share

    peak: dict[str, float] = {}
    launches = []
    for dtype in sorted(set(s["dtype"])):
        sel = (s["dtype"] == dtype).to_numpy()
        launch, per_flop = _fit_line(flops[sel], t_comp[sel])
        peak[dtype] = 1.0 / per_flop / 1e12
        launches.append(launch)
    peak.setdefault("float32", max(peak.values()))

    ring = np.isin(op, ["ag_gemm", "gemm_rs"])
    if ring.sum() < 2:  # the link's latency and bandwidth come from these rows alone
        raise ValueError(f"calibration needs at least 2 measured ag_gemm or gemm_rs scenarios to fit the link, "
                         f"got {int(ring.sum())} (ops measured: {', '.join(sorted(set(op)))})")
    shard_bytes = shard_rows * (shard_cols * s["dtype"].map(DTYPES).to_numpy())
    steps = P - 1
    t_comm = s["t_comm_s"].to_numpy(float) / share
    lat, per_byte = _fit_line(shard_bytes[ring], t_comm[ring] / steps[ring])
    cil = float(np.nanmedian(s["cil_gemm_sm"])) if "cil_gemm_sm" in s else 0.0
    spec = HardwareSpec(
        name=name, description=description or f"calibrated from {len(s)} measured scenarios",
        devices=devices, peak_tflops=peak, mem_bw_gbps=1e4,  # GEMMs here are compute-bound
        compute_units=1, tile_m=1, tile_n=1, gemm_efficiency=1.0,
        gemm_launch_us=max(float(np.median(launches)) * 1e6, 0.1),
        topology="switch", link_bw_gbps=1.0 / per_byte / 1e9,
        sm_comm_latency_us=max(lat * 1e6, 0.1),
        sm_comm_units=float(np.clip(1 - 1 / (1 + max(cil, 0.0)), 0.0, 0.9)),
        copy_engines=0, dma_latency_us=0.0, dma_bw_gbps=0.0, dma_mem_contention=0.0,
    )
    return _refine(spec, df) if refine else spec


def _refine(spec: HardwareSpec, df: pd.DataFrame) -> HardwareSpec:
    """Second stage: adjust the fitted primitives so composed schedule times match.

    Primitives timed alone miss what composing them costs here (rank skew, thread
    wake-ups, gloo threads taking a core from the GEMM), so the scale of link bandwidth,
    per-transfer latency and GEMM launch cost, and the share of compute an ``sm``
    transfer takes, are fitted by Nelder-Mead to the median absolute log error of every
    measured schedule time. The compute rate stays as fitted on whole GEMMs: letting it
    float absorbed composition overheads and broke large compute-bound shapes.
    """
    ok = df[(df["status"] == "ok") & df["verified"]]
    scenarios = [Scenario.from_record(r) for r in ok.groupby("scenario_id", sort=False).first()
                 .reset_index()[list(SCENARIO_COLUMNS)].to_dict("records")]
    cols = build_rows(scenarios, spec)
    keys = pd.DataFrame({"scenario_id": cols["scenario_id"], "schedule": cols["schedule"]})
    measured = keys.merge(ok[["scenario_id", "schedule", "time_s"]], how="left")["time_s"].to_numpy()
    have = np.isfinite(measured)

    def adjusted(y: np.ndarray) -> HardwareSpec:
        x = np.concatenate([[0.0], y])  # the compute rate stays as fitted on GEMMs alone
        scale = [float(np.exp(v)) for v in x[:4]]
        return dataclasses.replace(
            spec, peak_tflops={d: v * scale[0] for d, v in spec.peak_tflops.items()},
            link_bw_gbps=spec.link_bw_gbps * scale[1], sm_comm_latency_us=spec.sm_comm_latency_us * scale[2],
            gemm_launch_us=spec.gemm_launch_us * scale[3], sm_comm_units=float(np.clip(x[4], 0.0, 0.9)))

    def loss(y: np.ndarray) -> float:
        t = predict_time(cols, adjusted(y))
        return float(np.median(np.abs(np.log(t[have] / measured[have]))))

    start = np.array([0.0, 0.0, 0.0, spec.sm_comm_units])
    simplex = np.vstack([start] + [start + step for step in np.diag([0.3, 0.3, 0.3, 0.2])])
    best = minimize(loss, start, method="Nelder-Mead",
                    options={"maxiter": 600, "xatol": 1e-3, "fatol": 1e-4, "initial_simplex": simplex})
    return adjusted(best.x) if best.fun < loss(start) else spec


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares (intercept, slope) with both kept positive, weighted to relative error."""
    w = 1.0 / np.maximum(y, 1e-12)  # relative errors: small and large shapes count alike
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if b <= 0:  # degenerate data: force through the origin
        a, b = 0.0, float(np.sum(x * y * w * w) / np.sum(x * x * w * w))
    return max(float(a), 0.0), float(b)


def split_scenarios(ids: pd.Series, test_fraction: float = 0.5, seed: int = 0) -> np.ndarray:
    """Deterministic split by scenario id hash: True = held out."""
    h = ids.map(lambda s: zlib.crc32(f"{seed}/{s}".encode()) / 2**32)
    return (h < test_fraction).to_numpy()


def measured_rows(df: pd.DataFrame) -> pd.DataFrame:
    """`df` if it holds measured rows only; ValueError naming the first simulated row (checked
    against the simulator's own predictions, the simulator would only agree with itself)."""
    simulated = df.index[df["backend"] == "sim"]
    if len(simulated):
        raise ValueError(f"row {simulated[0]}, column 'backend': 'sim'; validate the simulator on measured rows "
                         "(cpu or cuda backend), not on its own predictions")
    return df


def validate_simulator(df: pd.DataFrame, *, devices: int | None = None, seed: int = 0) -> dict:
    """Calibrate on half the scenarios, predict the other half; the agreement figures.

    `devices`: the measured machine's devices; None: its spec's (the dataset's one machine).
    Refuses a machine count below 1, naming it. (``ficco sim validate`` also refuses
    simulated rows, ``measured_rows``; the method itself is checked on its own model's.)"""
    if devices is None:
        machines = sorted(set(df["hardware"]))
        if len(machines) != 1:
            raise ValueError(f"the dataset holds {len(machines)} machines ({', '.join(machines[:3])}); give "
                             "--devices, or validate one machine's rows at a time")
        devices = load_hardware(machines[0]).devices
    _check_devices(devices)
    ok = df[(df["status"] == "ok") & df["verified"]].copy()
    test = split_scenarios(ok["scenario_id"], seed=seed)
    spec = calibrate(ok[~test], name="calibrated", devices=devices)
    held = ok[test]
    scenarios = [Scenario.from_record(r) for r in held.groupby("scenario_id", sort=False).first()
                 .reset_index()[list(SCENARIO_COLUMNS)].to_dict("records")]
    # Predict with the measured scenarios' own hardware label so ids line up.
    sim = simulate_rows(scenarios, _with_devices(spec, devices))
    merged = held.merge(sim[["scenario_id", "schedule", "time_s"]], on=["scenario_id", "schedule"],
                        suffixes=("", "_sim"))
    ape = (merged["time_s_sim"] - merged["time_s"]).abs() / merged["time_s"]
    taus, best_hit, best_tie = [], [], []
    for _, g in merged.groupby("scenario_id"):
        if len(g) >= 3:
            tau = kendalltau(g["time_s"], g["time_s_sim"]).statistic
            if tau == tau:
                taus.append(tau)
        sim_best = g.loc[g["time_s_sim"].idxmin()]
        best_hit.append(bool(sim_best["is_best"]))
        best_tie.append(bool(sim_best["near_best"]))
    worst = merged.assign(ape=ape).sort_values("ape", ascending=False).head(5)
    self_tau, self_ape = measurement_self_agreement(held)
    return {
        "calibrated_on_scenarios": int((~test).sum() and ok[~test]["scenario_id"].nunique()),
        "held_out_scenarios": int(held["scenario_id"].nunique()),
        "mape": round(float(np.median(ape)), 3),
        "mean_ape": round(float(np.mean(ape)), 3),
        "kendall_tau_median": round(float(np.median(taus)), 3) if taus else None,
        "kendall_tau_mean": round(float(np.mean(taus)), 3) if taus else None,
        # The ceiling set by measurement noise: odd vs even repetitions of the same data.
        "measurement_self_tau_median": self_tau,
        "measurement_self_ape_median": self_ape,
        "sim_best_is_measured_best": round(float(np.mean(best_hit)), 3),
        "sim_best_within_measured_noise": round(float(np.mean(best_tie)), 3),
        "spec": dataclasses.asdict(spec),
        "largest_errors": worst[["op", "m", "n", "k", "world_size", "schedule", "time_s", "time_s_sim", "ape"]]
        .round(5).to_dict("records"),
    }


def measurement_self_agreement(df: pd.DataFrame) -> tuple[float | None, float]:
    """Median Kendall tau and APE between the medians of odd and even repetitions."""
    odd = df["times_s"].map(lambda t: float(np.median(t[0::2])))
    even = df["times_s"].map(lambda t: float(np.median(t[1::2])))
    pairs = pd.DataFrame({"sid": df["scenario_id"], "a": odd, "b": even})
    taus = [kendalltau(g["a"], g["b"]).statistic for _, g in pairs.groupby("sid") if len(g) >= 3]
    taus = [t for t in taus if t == t]
    ape = ((pairs["a"] - pairs["b"]).abs() / pairs["b"]).median()
    return (round(float(np.median(taus)), 3) if taus else None), round(float(ape), 3)


def spec_yaml(spec: HardwareSpec, source: str) -> str:
    """A preset file for a calibrated spec, saying where its numbers came from."""
    import yaml

    head = f"# Calibrated, not published: {source}\n"
    return head + yaml.safe_dump(dataclasses.asdict(spec), sort_keys=False)


def _check_devices(devices) -> None:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"--devices must be a positive integer (the measured machine's devices), got {devices!r}")


def _with_devices(spec: HardwareSpec, devices: int) -> HardwareSpec:
    return dataclasses.replace(spec, devices=devices)


def write_spec(spec: HardwareSpec, out, made_by: str) -> None:
    """Write `spec` as the YAML file `out`, headed by the command that made it: through a file
    beside it, renamed into place, so that a failed write leaves no half a spec. A spec the
    loader would refuse (2 devices at least, every number in its range) is refused before."""
    spec_from_dict(dataclasses.asdict(spec), str(out))
    out = Path(out)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        partial.write_text(spec_yaml(spec, made_by))
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


# -- adapting a spec to a machine from a few measured scenarios (``ficco adapt``) ----------
RECALIBRATED = ("peak_tflops", *fields_of("rate", "latency"), "sm_comm_units", "dma_mem_contention")
"""The spec's numbers ``recalibrate`` rescales (all dtypes' peaks together; a term a spec
leaves at 0 stays off); of the counts it searches the compute units (``COMPUTE_UNIT_STEPS``);
devices, tiles, copy engines, the topology and the GEMM efficiencies stay as the spec says."""
RECALIBRATE_PRIOR = 0.05
"""Weight of a pull of each log factor towards 1 (the spec as given): with a handful of
scenarios, numbers the measurements say little about stay where the data sheet put them."""


COMPUTE_UNIT_STEPS = tuple(2 ** (j / 8) for j in range(-4, 5))
"""The compute-unit counts ``recalibrate`` tries first, as factors of the spec's (up to x1.41
either way): a count is not a rate to rescale smoothly (it sets the wave quantization), so
each is fitted in turn; then the counts between the best one's neighbours (at most 25 of
them), and the best fit of all is kept."""
DMA_BW_RESTART = 0.8
"""A copy engine moves ``min(link share, dma_bw)``: once a fit puts the link below the DMA
bandwidth, the DMA bandwidth has no gradient and stays where it is, however slow the copies
measured (seen: l40s-pcie-8 with its DMA 18% slower than the data sheet, left at the sheet's
number while the link was pulled down instead). So the best count is refitted once from a
DMA bandwidth of this fraction of the link, and the better of the two fits is kept."""


def recalibrate(spec: HardwareSpec, df: pd.DataFrame) -> HardwareSpec:
    """`spec` fitted to the measured rows `df`: its primitive numbers (``RECALIBRATED``)
    rescaled (``_rescaled``) at each compute-unit count tried (``COMPUTE_UNIT_STEPS``); the
    count whose fit is best wins. Unchanged if `df` has no usable row."""
    ok = df[(df["status"] == "ok") & df["verified"].astype(bool)]
    ok = ok[np.isfinite(ok["time_s"].astype(float)) & (ok["time_s"].astype(float) > 0)]
    if ok.empty:
        return spec
    fits: dict[int, tuple[HardwareSpec, float]] = {}

    def fit(count: int) -> float:
        if count not in fits:
            fits[count] = _rescaled(dataclasses.replace(spec, compute_units=count), ok)
        return fits[count][1]

    coarse = sorted({max(1, round(spec.compute_units * f)) for f in COMPUTE_UNIT_STEPS})
    best = min(coarse, key=fit)
    # Then every count between the best coarse one's neighbours: the wave quantization of a
    # count a few units off already misplaces schedules.
    at = coarse.index(best)
    lo, hi = coarse[max(at - 1, 0)], coarse[min(at + 1, len(coarse) - 1)]
    for count in range(lo, hi + 1, max(1, (hi - lo) // 24)):
        fit(count)
    count = min(fits, key=lambda c: fits[c][1])
    fitted, cost = fits[count]
    if spec.copy_engines:  # the fit from below the link (DMA_BW_RESTART)
        restart = DMA_BW_RESTART * min(spec.link_bw_gbps, spec.dma_bw_gbps) / spec.dma_bw_gbps
        other, other_cost = _rescaled(dataclasses.replace(spec, compute_units=count), ok, {"dma_bw_gbps": restart})
        if other_cost < cost:
            fitted = other
    # What the rows fitted is measured now: the GPU do-no-harm rule trusts it (TRUST_TERMS).
    refit = [f for f in (*RECALIBRATED, "compute_units") if getattr(fitted, f) != getattr(spec, f)]
    return dataclasses.replace(fitted, provenance={**spec.provenance, **dict.fromkeys(refit, "measured")})


def _rescaled(spec: HardwareSpec, ok: pd.DataFrame, start: dict[str, float] | None = None
              ) -> tuple[HardwareSpec, float]:
    """`spec` with its primitive numbers (``RECALIBRATED``) rescaled to fit the usable measured
    rows `ok` (any backend; every schedule time counts): one log factor per number, fitted
    by robust least squares (soft L1: a few outlying times do not pull the fit) to the log
    ratios of simulated to measured schedule times, plus ``RECALIBRATE_PRIOR`` x the squared
    log factors. The copy-engine numbers are left alone on a spec without copy engines.
    `start`: factors to start the fit from (field -> factor; default 1 each).
    Returns the spec and the fit's cost."""
    scenarios = [Scenario.from_record(r) for r in ok.groupby("scenario_id", sort=False).first()
                 .reset_index()[list(SCENARIO_COLUMNS)].to_dict("records")]
    cols = build_rows(scenarios, spec)
    keys = pd.DataFrame({"scenario_id": cols["scenario_id"], "schedule": cols["schedule"]})
    measured = keys.merge(ok[["scenario_id", "schedule", "time_s"]].drop_duplicates(["scenario_id", "schedule"]),
                          how="left")["time_s"].to_numpy(float)
    have = np.isfinite(measured)
    fields = [f for f in RECALIBRATED if (spec.copy_engines or not f.startswith("dma_")) and getattr(spec, f)]

    def scaled(x: np.ndarray) -> HardwareSpec:
        changes = {}
        for field, v in zip(fields, np.exp(x)):
            value = getattr(spec, field)
            if field == "peak_tflops":
                changes[field] = {d: p * float(v) for d, p in value.items()}
            elif field == "sm_comm_units":
                changes[field] = float(min(value * v, 0.9))
            elif field == "dma_mem_contention":
                changes[field] = float(min(value * v, 1.0))
            else:
                changes[field] = float(value * v)
        return dataclasses.replace(spec, **changes)

    def residuals(x: np.ndarray) -> np.ndarray:
        s = scaled(x)  # the rows hold each scenario's peak: rescaled with the spec's
        t = predict_time({**cols, "_peak": cols["_peak"] * (s.peak_of("float32") / spec.peak_of("float32"))}, s)
        return np.concatenate([np.log(t[have] / measured[have]), np.sqrt(RECALIBRATE_PRIOR) * x])

    x0 = np.log([(start or {}).get(field, 1.0) for field in fields])
    fit = least_squares(residuals, x0, loss="soft_l1", f_scale=0.05, diff_step=1e-3)
    return scaled(fit.x), float(fit.cost)
