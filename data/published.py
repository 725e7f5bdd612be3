"""Published real-GPU measurements, and the simulator held against them.

``data/published/gpu-calibration.csv`` (the fit set) and ``validation.csv`` (never fitted)
hold numbers measured on real GPUs by others, each row with its source URL and a grade
(``docs/published.md`` says what each column means). ``read_published`` turns such a table
into points; ``compare`` predicts every point on a spec; ``fit`` fits a preset's model
terms to them.

Kinds of point (``Point.kind``):
- ``overlap``: a collective + GEMM whose method is one of the project's schedules
  (``METHOD_SCHEDULES``): its serial baseline's time and the method's speedup over it.
- ``baseline``: a collective + GEMM whose method is not one of ours (a fused kernel): its
  baseline's time only (the serial baseline is what ``none.*`` runs).
- ``collective``: a plain collective of a stated message size: its time.
- ``sm_collective``: an all-reduce run by SM loads and stores on symmetric memory, not by the
  collective library (``SM_ALL_REDUCES``): its time, predicted with the ``sm`` transfers a
  schedule's steps use (``sm_all_reduce_time``), not the library's terms.
- ``switch_collective``: a collective the switch reduces or multicasts (NVLS, ``multimem``:
  ``published_kinds.SWITCH_COLLECTIVES``): its time, predicted with ``switch_collective_time``.
  A collective + GEMM whose baseline runs such a collective has ``none.switch`` for its serial
  baseline (``Point.baseline_schedule``).
- ``gemm``: one device's matmul: its time.
- ``bandwidth``: a reported bus or copy-engine bandwidth, no time: compared in GB/s. An
  all-to-all that SM loads and stores move (``SM_ALL_TO_ALLS``, a MoE dispatch or combine) is
  predicted with the ``sm`` transfers of one step to every peer, not the library's terms.
Errors name the file, the row (1-based, header excluded) and the column; a number past its
physical bounds (``LIMITS``, ``SMALLEST``) is one, and so is a collective of one rank; a table of
more than ``MAX_ROWS`` rows is refused whole. A row is compared on one node's spec: a world size
beyond its devices is refused where the row is predicted (``compare``, ``fit``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select.costs import (GB, OP_CODES, US, collective_time, gemm_time, sm_all_reduce_time,
                                switch_collective_time, transfer_time)
from ficco_select.data.published_kinds import LIBRARY_BASELINE, baseline_schedule, reduces_in_switch, switch_method
from ficco_select.hardware import HardwareSpec, load_hardware, preset_for_device, spec_field
from ficco_select.scenario import DTYPE_ALIASES, DTYPES, Scenario

COLUMNS = ("source", "hardware", "gpus", "interconnect", "op", "m", "n", "k", "dtype", "world_size", "baseline",
           "method", "baseline_time_us", "method_time_us", "speedup", "notes")
METHOD_SCHEDULES = {"torch.ops.symm_mem.fused_all_gather_matmul": "shard.ring.dma",
                    "torch.ops.symm_mem.fused_matmul_reduce_scatter": "shard.ring.dma"}
"""Published methods that are one of the project's schedules (named in the ``method`` cell):
PyTorch async-TP's fused all-gather matmul pulls one shard per step with copy engines and
multiplies it as it lands; its fused matmul reduce-scatter multiplies one shard's rows per
step and sends them with copy engines."""
BASELINE_SCHEDULE = "none.sm"
"""The serial baseline: the library's collective, then one GEMM."""
COLLECTIVES = {"all_gather": "ag_gemm", "reduce_scatter": "gemm_rs", "all_reduce": "gemm_ar", "all_to_all": "a2a_gemm"}
"""Plain collectives, with the operator whose collective they are (all-to-all: ``a2a_gemm``'s,
each rank sending one shard to each of its P - 1 peers)."""
SM_ALL_REDUCES = {"torch.ops.symm_mem.two_shot_all_reduce_": 2, "symm_mem_two_shot": 2, "ca_2stage": 2,
                  "torch.ops.symm_mem.one_shot_all_reduce": 1, "ca_1stage": 1}
"""All-reduces that SM loads and stores run on symmetric memory (named in the ``baseline`` cell, as
the op or as vLLM's ``benchmark_device_communicators.py`` names its column), with their steps:
two shots (reduce-scatter, then all-gather: PyTorch's ``two_shot_all_reduce_``, vLLM's custom
all-reduce in 2 stages) or one (every rank reads every peer's buffer). Kernels that reduce in the
switch (``multimem``, NVLS) or pick their algorithm by size are not among them."""
SM_ALL_TO_ALLS = ("DeepEP", "HybridEP")
"""All-to-alls that SM loads and stores run (named in the ``baseline`` cell): one step that sends
each peer its shard at once, the transfers of an ``a2a`` schedule's step."""
PEAK_MESSAGE_BYTES = 1 << 30
"""Message size at which a bandwidth reported without one ("peak busbw") is predicted."""
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
MAX_ROWS = 10_000
"""The most rows a published table may hold. The record is hand-curated (tens of rows) and
every row is simulated (10,000 rows take about 20 s): a longer file is not such a record,
and is refused before its rows are read."""
LIMITS = {**dict.fromkeys(("m", "n", "k"), (2**31, "2**31")),
          **dict.fromkeys(("world_size", "gpus"), (2**16, "65536")),
          **dict.fromkeys(("baseline_time_us", "method_time_us"), (3.6e9, "3.6e9 us (an hour)")),
          "message": (float(1 << 40), "1 TiB"), "bandwidth": (1e5, "100000 GB/s"), "speedup": (100.0, "100")}
"""The largest value of each number a row holds (GEMM dimensions, GPUs, times, and a message
size and bandwidth in the notes), as an error says it. No GPU measurement comes near them
(the committed rows stay within 2**17, 8 GPUs, 8 ms, 4 GiB and 400 GB/s): a value beyond is
a typo or a unit slip, and would wreck a fit."""
SMALLEST = {**dict.fromkeys(("baseline_time_us", "method_time_us"), (0.1, "0.1 us")),
            "message": (1.0, "1 B"), "bandwidth": (0.01, "0.01 GB/s"), "speedup": (0.01, "0.01")}
"""The smallest value of a time, a message size, a bandwidth and a speedup: no GPU measures a
call in less than 0.1 us (a launch takes microseconds), and an error divided by a smaller
number is no error (1e-300 us printed a 180-digit APE). The committed rows stay above 4 us,
1 KiB, 0.3 GB/s and x0.2."""


SPEEDUP_AGREEMENT = 0.02
"""How far a row's ``speedup`` may stand from its times' ratio (baseline / method): the
rounding of published figures, not another measurement."""


class PublishedError(ValueError):
    """A published table is unreadable or a row cannot be used; names the row and column."""


@dataclasses.dataclass(frozen=True)
class Point:
    row: int
    """1-based row of the table, header excluded."""
    source: str
    kind: str
    """overlap, baseline, collective, sm_collective, switch_collective, gemm or bandwidth (the
    module's docstring)."""
    hardware: str
    """The preset of the published device (``preset_for_device``); "" where no preset is that
    device (an export variant with other links, say): such a point is read, not compared."""
    grade: str
    """A: a maintainer's benchmark whose script and hardware are stated; B: a credible author,
    the setup partly stated; C: a user report."""
    op: str = ""
    """ag_gemm / gemm_rs / a2a_gemm; for a collective or bandwidth, the collective's name."""
    m: int = 0
    n: int = 0
    k: int = 0
    dtype: str = "bfloat16"
    world_size: int = 1
    baseline_us: float = math.nan
    """The measured time: the serial baseline, the collective or the GEMM."""
    method_us: float = math.nan
    """The overlapped method's measured time: the schedule's (``overlap``), or the fused
    kernel's where a ``baseline`` row times one (its ``method_time_us``, else baseline /
    ``speedup``)."""
    schedule: str = ""
    """The project's schedule that the method is (``overlap``)."""
    message_bytes: float = math.nan
    """The collective's message (the gathered buffer, or the reduce-scatter's input)."""
    bandwidth_gbps: float = math.nan
    """A reported bandwidth (``bandwidth``): bus bandwidth, or one copy's."""
    shots: int = 0
    """The steps of a collective that SM loads and stores run (``SM_ALL_REDUCES``: 1 or 2;
    ``SM_ALL_TO_ALLS``: 1); 0 for the collective library's."""
    table: str = ""
    """The file the row was read from ("" for a point made in code): what an error names."""
    baseline_schedule: str = LIBRARY_BASELINE
    """The serial schedule the row's baseline runs (``overlap``, ``baseline``): ``none.sm`` (the
    library's collective, then the GEMM), or ``none.switch`` where the collective is the switch's."""

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.method_us

    def scenario(self, hardware: str) -> Scenario:
        return Scenario(group="published", op=self.op, m=self.m, n=self.n, k=self.k, dtype=self.dtype,
                        world_size=self.world_size, hardware=hardware, imbalance=1.0)


def packaged() -> Path:
    """The committed table of published measurements."""
    return Path(str(resources.files("ficco_select.data") / "published" / "gpu-calibration.csv"))


def read_published(path: str | Path | None = None) -> list[Point]:
    """The points of a published table (default: the committed one). PublishedError names
    the file, the row and the column of the first unusable cell."""
    path = Path(path) if path is not None else packaged()
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False, nrows=MAX_ROWS + 1)
    except FileNotFoundError:
        raise PublishedError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise PublishedError(f"{path}: not a readable CSV table ({type(e).__name__})") from None
    if len(table) > MAX_ROWS:
        raise PublishedError(f"{path}: more than {MAX_ROWS} rows, the most a table of published "
                             "measurements holds (a hand-curated record: tens of rows)")
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise PublishedError(f"{path}: column '{missing[0]}' is missing (columns: {', '.join(COLUMNS)})")
    points = []
    for i, record in enumerate(table.to_dict("records"), start=1):
        try:
            point = _point(i, {k: str(v).strip() for k, v in record.items()})
        except PublishedError as e:
            raise PublishedError(f"{path}: row {i}, {e}") from None
        points.append(dataclasses.replace(point, table=str(path)))
    return points


def _point(row: int, r: dict[str, str]) -> Point:
    if not r["source"].startswith(("http://", "https://")):
        raise PublishedError(f"column 'source': every row names the URL it was read from, got {r['source']!r}")
    token = re.match(r"[A-Za-z]+\d+[A-Za-z]*", r["hardware"])
    if token is None:
        raise PublishedError(f"column 'hardware': not a device name: {r['hardware']!r}")
    preset = preset_for_device(token.group(0)) or ""
    grade = re.match(r"\[grade ([ABC])\]", r["notes"])
    if grade is None:
        raise PublishedError("column 'notes': a note begins with its grade, [grade A], [grade B] or [grade C]")
    common = {"row": row, "source": r["source"], "hardware": preset, "grade": grade.group(1)}
    if r["gpus"]:  # the machine's GPU count, first word ("8 (inferred)")
        _integer(r, "gpus", first_word=True)
    speedup = _number(r, "speedup") if r["speedup"] else None
    op = r["op"]
    if op in OP_CODES:
        method = r["method"]
        schedule = next((s for name, s in METHOD_SCHEDULES.items() if name in method), "") or switch_method(method)
        baseline_us = _number(r, "baseline_time_us")
        if schedule or r["method_time_us"]:
            method_us = _number(r, "method_time_us")
        else:  # a fused kernel's speedup without its time, or a serial time alone
            method_us = baseline_us / speedup if speedup is not None else math.nan
            if method_us < SMALLEST["method_time_us"][0]:
                raise PublishedError(f"column 'speedup': {r['speedup']!r} makes the method's time "
                                     f"{method_us:.3g} us, below {SMALLEST['method_time_us'][1]}")
        ratio = baseline_us / method_us
        if speedup is not None and r["method_time_us"] and abs(ratio / speedup - 1) > SPEEDUP_AGREEMENT:
            raise PublishedError(f"column 'speedup': {r['speedup']!r}, where the row's times make it "
                                 f"{ratio:.3g} (baseline_time_us / method_time_us)")
        return Point(**common, kind="overlap" if schedule else "baseline", op=op, schedule=schedule,
                     **_shape(r), baseline_us=baseline_us, method_us=method_us,
                     baseline_schedule=baseline_schedule(r["baseline"]))
    plain = re.match(r"plain (all_gather|reduce_scatter|all_reduce|all_to_all|GEMM|p2p copy)", op)
    if plain is None:
        raise PublishedError(f"column 'op': {op!r} is neither an operator ({', '.join(OP_CODES)}) nor a plain "
                             "collective, copy or GEMM")
    what = plain.group(1)
    if what == "GEMM":
        return Point(**common, kind="gemm", op="gemm", **_shape(r, gemm=True), baseline_us=_number(r, "baseline_time_us"))
    P = _integer(r, "world_size") if r["world_size"] else _integer(r, "gpus", first_word=True)
    if P < 2:
        column = "world_size" if r["world_size"] else "gpus"
        raise PublishedError(f"column '{column}': {r[column]!r}; a collective or copy runs on at least 2 GPUs")
    if r["baseline_time_us"] and what in COLLECTIVES:
        size = re.search(r"message = [^0-9]*(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|B)\b", r["notes"])
        if size is None:
            raise PublishedError("column 'notes': a timed collective states its message (message = ... MiB)")
        shots = next((n for name, n in SM_ALL_REDUCES.items() if name in r["baseline"]), 0)
        if shots and what != "all_reduce":
            raise PublishedError(f"column 'baseline': {r['baseline']!r} is an all-reduce, the op says {what}")
        if shots and reduces_in_switch(r["baseline"]):
            raise PublishedError(f"column 'baseline': {r['baseline']!r} names both an SM all-reduce and one "
                                 "the switch reduces; a row times one of them")
        kind = "sm_collective" if shots else "switch_collective" if reduces_in_switch(r["baseline"]) else "collective"
        return Point(**common, kind=kind, op=what, world_size=P,
                     dtype=_dtype(r), shots=shots,
                     message_bytes=_noted(float(size.group(1)) * _UNITS[size.group(2)], "message", size.group(0)),
                     baseline_us=_number(r, "baseline_time_us"))
    rate = (re.search(r"busbw[^\d]{0,12}(\d+(?:\.\d+)?)\s*GB/s", r["notes"])
            or re.search(r"(\d+(?:\.\d+)?)\s*GB/s busbw", r["notes"])
            or re.search(r"(\d+(?:\.\d+)?)\s*GB/s unidirectional", r["notes"]))
    if rate is None:
        raise PublishedError("column 'notes': a collective or copy without a time states its bandwidth (GB/s)")
    size = re.search(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB) payload", r["notes"])
    sm_driven = what == "all_to_all" and any(name in r["baseline"] for name in SM_ALL_TO_ALLS)
    return Point(**common, kind="bandwidth", op="copy" if what == "p2p copy" else what, world_size=P,
                 shots=int(sm_driven),
                 bandwidth_gbps=_noted(float(rate.group(1)), "bandwidth", rate.group(0)),
                 message_bytes=(_noted(float(size.group(1)) * _UNITS[size.group(2)], "message", size.group(0))
                                if size else float(PEAK_MESSAGE_BYTES)))


def _number(r: dict[str, str], column: str) -> float:
    try:
        value = float(r[column])
    except ValueError:
        raise PublishedError(f"column '{column}': a number is needed, got {r[column]!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise PublishedError(f"column '{column}': must be positive, got {r[column]!r}")
    limit, words = LIMITS.get(column, (math.inf, ""))
    if value > limit:
        raise PublishedError(f"column '{column}': {r[column]!r} is beyond {words}; no measured value is that large")
    least, words = SMALLEST.get(column, (0.0, ""))
    if value < least:
        raise PublishedError(f"column '{column}': {r[column]!r} is below {words}; no measured value is that small")
    return value


def _noted(value: float, what: str, text: str) -> float:
    """A message size or bandwidth read from the notes, checked as a column's number is."""
    limit, words = LIMITS[what]
    least, least_words = SMALLEST[what]
    if not least <= value <= limit:
        raise PublishedError(f"column 'notes': {text!r}: a {what} must be at least {least_words} and at most {words}")
    return value


def _integer(r: dict[str, str], column: str, *, first_word: bool = False) -> int:
    text = r[column].split()[0] if first_word and r[column] else r[column]
    value = _number({column: text}, column)
    if value != int(value):
        raise PublishedError(f"column '{column}': an integer is needed, got {r[column]!r}")
    return int(value)


def _dtype(r: dict[str, str]) -> str:
    word = r["dtype"].split(" ")[0]  # "bf16 (inferred)": the dtype, then a remark
    dtype = DTYPE_ALIASES.get(word, {"float": "float32"}.get(word, word))
    if dtype not in DTYPES:
        raise PublishedError(f"column 'dtype': unknown dtype {r['dtype']!r} (known: {', '.join(DTYPES)})")
    return dtype


def _shape(r: dict[str, str], gemm: bool = False) -> dict:
    shape = {c: _integer(r, c) for c in ("m", "n", "k")}
    return {**shape, "dtype": _dtype(r), "world_size": 1 if gemm else _integer(r, "world_size")}


# -- the simulator against the points --------------------------------------------------------
def within_devices(point: Point, hw: HardwareSpec) -> None:
    """PublishedError naming the table, row and column if `point` ran on more GPUs than `hw`
    has (a spec describes one node, and its terms say nothing of a larger job), or reduced in
    the switch where `hw`'s switch does not (``switch_reduce``)."""
    where = f"{point.table or 'published points'}: row {point.row}"
    beyond = hw.beyond_devices(point.world_size)
    if beyond:
        timed = ("overlap", "baseline", "collective", "sm_collective", "switch_collective")
        column = "world_size" if point.kind in timed else "gpus"
        raise PublishedError(f"{where}, column '{column}': {beyond}")
    if (point.kind == "switch_collective" or point.baseline_schedule != LIBRARY_BASELINE) and not hw.switch_reduce:
        raise PublishedError(f"{where}, column 'baseline': a collective the switch reduces, where {hw.name}'s "
                             "switch does not (switch_reduce: false)")


def predict(point: Point, hw: HardwareSpec) -> dict[str, float]:
    """What the cost model says of `point` on `hw`: ``time_us`` (the baseline, collective or
    GEMM), ``method_us`` (an overlap point's schedule), ``best_us`` (a collective + GEMM's
    fastest overlapped schedule) or ``bandwidth_gbps``."""
    if point.kind in ("overlap", "baseline"):
        from ficco_select.data.simulate import simulate_rows

        times = simulate_rows([point.scenario(hw.name)], hw).set_index("schedule")["time_s"]
        overlapped = times[~times.index.str.startswith("none.")]
        out = {"time_us": float(times[point.baseline_schedule]) / US, "best_us": float(overlapped.min()) / US}
        if point.kind == "overlap":
            out["method_us"] = float(times[point.schedule]) / US if point.schedule in times.index else math.nan
        return out
    if point.kind == "gemm":
        peak = hw.peak_of(point.dtype) * 1e12
        return {"time_us": float(gemm_time(hw, point.m, point.n, point.k, DTYPES[point.dtype], peak)) / US}
    P = point.world_size
    shard = point.message_bytes / P
    if point.kind == "collective":
        return {"time_us": float(collective_time(hw, OP_CODES[COLLECTIVES[point.op]], shard, P)) / US}
    if point.kind == "sm_collective":
        return {"time_us": float(sm_all_reduce_time(hw, point.message_bytes, P, point.shots)) / US}
    if point.kind == "switch_collective":
        return {"time_us": float(switch_collective_time(hw, OP_CODES[COLLECTIVES[point.op]], shard, P)) / US}
    if point.op == "copy":  # one copy-engine copy between two devices
        return {"bandwidth_gbps": point.message_bytes / float(transfer_time(hw, point.message_bytes, 1, True, 2)) / GB}
    if point.op == "all_to_all" and point.shots:  # one step of P - 1 concurrent sm transfers
        return {"bandwidth_gbps": (P - 1) * shard / float(transfer_time(hw, shard, P - 1, False, P)) / GB}
    if point.op in ("all_gather", "all_to_all"):  # busbw: the (P - 1) shards a rank receives, over the time
        moved = float(collective_time(hw, OP_CODES[COLLECTIVES[point.op]], shard, P))
        return {"bandwidth_gbps": (P - 1) * shard / moved / GB}
    gather = float(collective_time(hw, OP_CODES["ag_gemm"], shard, P))
    scatter = float(collective_time(hw, OP_CODES["gemm_rs"], shard, P))
    if point.op == "reduce_scatter":
        return {"bandwidth_gbps": (P - 1) * shard / scatter / GB}
    # all-reduce: a reduce-scatter, then an all-gather; nccl-tests' busbw counts 2 (P - 1) shards
    return {"bandwidth_gbps": 2 * (P - 1) * shard / (scatter + gather) / GB}


def compare(points: list[Point], specs: dict[str, HardwareSpec] | None = None) -> dict:
    """Each point predicted on its preset (or ``specs[preset]``), and a summary per preset.

    Per point: the measured and predicted value, their absolute percentage error (APE) and,
    for an overlap point, the speedup's and whether overlap wins (speedup > 1) as measured.
    Per preset: median APEs of the serial baseline (each distinct baseline once), of the
    overlap speedup, of collectives and of GEMMs, and how many overlap points win or lose
    as measured."""
    specs = specs or {}
    rows = []
    for point in points:
        if not point.hardware:
            continue  # listed under "unmatched"
        hw = specs.get(point.hardware) or load_hardware(point.hardware)
        within_devices(point, hw)
        p = predict(point, hw)
        row = {"row": point.row, "kind": point.kind, "hardware": point.hardware, "grade": point.grade,
               "op": point.op, "m": point.m, "n": point.n, "k": point.k, "world_size": point.world_size}
        if "time_us" in p:
            row.update(measured_us=point.baseline_us, predicted_us=round(p["time_us"], 2),
                       ape=_ape(p["time_us"], point.baseline_us))
        if point.kind in ("collective", "sm_collective", "switch_collective"):
            row["message_mib"] = point.message_bytes / (1 << 20)
        if point.kind == "sm_collective":
            row["shots"] = point.shots
        if point.kind == "overlap":
            predicted = p["time_us"] / p["method_us"]
            row.update(schedule=point.schedule, speedup=round(point.speedup, 3), predicted_speedup=round(predicted, 3),
                       speedup_ape=_ape(predicted, point.speedup), wins=point.speedup > 1,
                       predicted_wins=bool(predicted > 1), agrees=(point.speedup > 1) == bool(predicted > 1))
        if point.kind == "bandwidth":
            row.update(measured_gbps=point.bandwidth_gbps, predicted_gbps=round(p["bandwidth_gbps"], 1),
                       ape=_ape(p["bandwidth_gbps"], point.bandwidth_gbps))
        rows.append(row)
    return {"points": rows, "presets": _summaries(rows), "unmatched": [p.row for p in points if not p.hardware]}


def _ape(predicted: float, measured: float) -> float:
    return round(abs(predicted - measured) / measured, 4)


def _summaries(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for preset in sorted({r["hardware"] for r in rows}):
        mine = [r for r in rows if r["hardware"] == preset]
        baselines = {(r["op"], r["m"], r["n"], r["k"], r["world_size"], r["measured_us"]): r["ape"]
                     for r in mine if r["kind"] in ("overlap", "baseline")}
        overlap = [r for r in mine if r["kind"] == "overlap"]
        median = lambda values: round(float(np.median(values)), 4) if len(values) else None  # noqa: E731
        out[preset] = {
            "baselines": len(baselines), "baseline_ape_median": median(list(baselines.values())),
            "overlap_points": len(overlap), "speedup_ape_median": median([r["speedup_ape"] for r in overlap]),
            "wins_as_measured": sum(r["agrees"] for r in overlap),
            "collectives": sum(r["kind"] == "collective" for r in mine),
            "collective_ape_median": median([r["ape"] for r in mine if r["kind"] == "collective"]),
            "sm_collectives": sum(r["kind"] == "sm_collective" for r in mine),
            "sm_collective_ape_median": median([r["ape"] for r in mine if r["kind"] == "sm_collective"]),
            "switch_collectives": sum(r["kind"] == "switch_collective" for r in mine),
            "switch_collective_ape_median": median([r["ape"] for r in mine if r["kind"] == "switch_collective"]),
            "gemms": sum(r["kind"] == "gemm" for r in mine),
            "gemm_ape_median": median([r["ape"] for r in mine if r["kind"] == "gemm"]),
            "bandwidths": sum(r["kind"] == "bandwidth" for r in mine),
            "bandwidth_ape_median": median([r["ape"] for r in mine if r["kind"] == "bandwidth"]),
        }
    return out


_FIT_NAMES = ("FITTED", "FIT_KINDS", "KINDS", "NEGLIGIBLE", "fit")


def __getattr__(name: str):
    """The fit's names (``published_fit``), where callers import them from here."""
    if name in _FIT_NAMES:
        from ficco_select.data import published_fit

        return getattr(published_fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
