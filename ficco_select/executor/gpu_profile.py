"""Characterize one CUDA GPU for the simulator: GEMM, copy and contention microbenchmarks.

    python -m ficco_select.executor.gpu_profile --out DIR [--budget-s N] [--preset NAME]

(``scripts/gpu_check.sh`` runs it with a hard time limit.) Sections run in order, each
against its own share of the time budget and guarded: a section that fails records its
error and the next one runs. Everything goes into ``DIR/profile.json`` (the format of
``ficco_select.profile``, every field documented in ``data/profiles/README.md``), rewritten
atomically after every section and every few seconds during one, so a run killed by a
timeout still leaves what it had measured.

Sections (times are GPU time between CUDA events unless said otherwise):

1. ``gemm_peak``: large bf16 / fp16 / fp32 GEMMs; the best TFLOP/s per dtype, and the cost of
   one tiny GEMM call issued back to back from Python.
2. ``dil``: decomposition loss. One GEMM vs its d row pieces (and column pieces) back to
   back, d in 2, 4, 8, shapes from small to large: ``dil = t_pieces / t_whole - 1``.
3. ``copy_dma``: the cuda executor's ``dma`` copy (``copy_`` of contiguous device buffers,
   a ``cudaMemcpyAsync``) on a side stream, 4 KiB .. 1 GiB; fit ``t = latency + bytes / bw``.
4. ``copy_sm``: the executor's ``sm`` copy (an elementwise kernel, on the SMs), likewise.
5. ``copy_h2d``: pinned host -> device copies, which always use a copy engine (reference).
6. ``cil``: a large GEMM alone vs while a dma / an SM copy stream runs beside it, and the
   copies' slowdown while GEMMs run: ``cil = t_contended / t_alone - 1``.
7. ``loopback_correctness``: every legal schedule of small scenarios verified in loopback
   mode (``ficco_select.executor.loopback``, imported lazily; skipped if absent).
8. ``loopback_realized``: every legal schedule timed on >= 6 scenarios; realized fraction of
   the ideal overlap speedup per schedule.

Importing this module needs torch but no GPU; ``main`` exits with a message without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import logging
import math
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ficco_select.hardware import preset_for_device
from ficco_select.profile import SCHEMA, SCHEMA_VERSION, fit_latency_bw
from ficco_select.scenario import Scenario

log = logging.getLogger("ficco_select.gpu_profile")

DEFAULT_BUDGET_S = 390.0
"""Seconds for all sections together (scripts/gpu_check.sh kills the process 30 s later)."""
MIN_SECTION_S = 3.0
"""A section is skipped when less than this is left of the budget."""
GRACE_S = 20.0
"""How long past its share a section may run before it is declared hung and abandoned."""
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

GEMM_PEAK_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192))
"""(m, n, k) of the throughput GEMMs (bf16, fp16; fp32 runs the middle one only)."""
DIL_SHAPES = ((1024, 1024, 1024), (2048, 4096, 4096), (1024, 8192, 8192), (4096, 4096, 4096),
              (8192, 8192, 8192), (16384, 8192, 4096))
"""(m, n, k) of the DIL curve, small to large (1024 x 8192 x 8192: skinny, weight-heavy)."""
DIL_DEGREES = (2, 4, 8)
COPY_SIZES = tuple(4 * KiB * 4 ** i for i in range(11) if 4 * KiB * 4 ** i <= GiB)
"""4 KiB, 16 KiB, ..., 1 GiB."""
H2D_SIZES = tuple(s for s in COPY_SIZES if s <= 64 * MiB)
CIL_GEMM = (8192, 8192, 8192)
CIL_COPY_BYTES = 256 * MiB

CORRECTNESS_SCENARIOS = tuple(
    [dict(op=op, m=m, n=n, k=k, dtype="bfloat16", world_size=P)
     for P in (2, 4, 8)
     for op, m, n, k in (("ag_gemm", 129 * P, 24 * P, 72), ("gemm_rs", 66 * P, 100, 24 * P),
                         ("a2a_gemm", 96, 80, 64))]
    + [dict(op=op, m=m, n=n, k=k, dtype="float32", world_size=4)
       for op, m, n, k in (("ag_gemm", 516, 96, 72), ("gemm_rs", 264, 100, 96), ("a2a_gemm", 96, 80, 64))]
    + [dict(op="a2a_gemm", m=128, n=64, k=64, dtype="bfloat16", world_size=4, imbalance=2.5)]
)
"""Small scenarios, odd sizes on purpose (uneven pieces): every schedule verified."""

REALIZED_SCENARIOS = (
    dict(group="llama3-8b", op="ag_gemm", m=8192, n=14336, k=4096, dtype="bfloat16", world_size=4),
    dict(group="llama3-8b", op="gemm_rs", m=8192, n=4096, k=14336, dtype="bfloat16", world_size=4),
    dict(group="llama3-70b", op="ag_gemm", m=16384, n=28672, k=8192, dtype="bfloat16", world_size=8),
    dict(group="llama3-70b", op="gemm_rs", m=16384, n=8192, k=28672, dtype="bfloat16", world_size=8),
    dict(group="mixtral", op="a2a_gemm", m=4096, n=14336, k=4096, dtype="bfloat16", world_size=4),
    dict(group="mixtral", op="a2a_gemm", m=4096, n=14336, k=4096, dtype="bfloat16", world_size=8, imbalance=2.0),
    dict(group="small", op="ag_gemm", m=4096, n=4096, k=2048, dtype="bfloat16", world_size=8),
)
"""The >= 6 scenarios whose realized fraction of ideal speedup is measured, largest work first
per operator; as many as the budget allows run."""

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Skip(Exception):
    """A section cannot run here (its message says why); recorded as skipped, not failed."""


# -- the run: state, budget, writing ---------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class Run:
    """One profiling run: its output file, budget and the profile being filled in."""

    out: Path
    """Folder of profile.json."""
    deadline: float
    """time.monotonic() at which every section must be done."""
    state: dict[str, Any]
    """The profile (JSON-ready); mutate only through put/append (they take the lock)."""
    preset: Any = None
    """HardwareSpec whose peaks gemm_efficiency is relative to (None: not loaded)."""
    device: str = "cuda"
    """Device the loopback sections run on (``cpu`` only in tests: the glue, not the GPU)."""
    started: float = dataclasses.field(default_factory=time.monotonic)
    lock: Any = dataclasses.field(default_factory=threading.RLock)
    """Re-entrant: the SIGTERM handler takes it on the main thread, which may hold it."""
    dirty: bool = False

    @property
    def path(self) -> Path:
        return self.out / "profile.json"

    def put(self, *keys: str, value: Any) -> None:
        """state[k0][k1]...[kn] = value, creating objects on the way."""
        with self.lock:
            node = self.state
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value
            self.dirty = True

    def append(self, *keys: str, value: Any) -> None:
        """state[k0]...[kn].append(value), creating the list on the way."""
        with self.lock:
            node = self.state
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node.setdefault(keys[-1], []).append(value)
            self.dirty = True

    def write(self) -> None:
        """Rewrite profile.json atomically (a reader never sees half a file)."""
        with self.lock:
            self.state["elapsed_s"] = round(time.monotonic() - self.started, 1)
            text = json.dumps(_clean(self.state), indent=1, default=str, allow_nan=False)
            self.dirty = False
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.path)


def _clean(value: Any) -> Any:
    """A copy that is strict JSON: non-finite floats become null."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    max_s: float | None
    """Its share of the budget, seconds; None: whatever is left."""
    fn: Callable[[Run, float], None]
    """fn(run, until): measure until time.monotonic() reaches `until`, recording as it goes."""


def run_sections(run: Run, sections: Sequence[Section], *, grace_s: float = GRACE_S,
                 write_every_s: float = 5.0) -> bool:
    """Run the sections in order, each guarded and time-boxed; False if one hung.

    A section runs in a daemon thread so the main thread can keep writing the profile and
    can give up on a section that does not return (a hung kernel or a deadlocked loopback):
    it is marked ``timeout`` and every later section ``skipped`` (the GPU is not idle any
    more, later timings would be wrong).
    """
    for i, section in enumerate(sections):
        now = time.monotonic()
        left = run.deadline - now
        if left < MIN_SECTION_S:
            _status(run, section.name, "skipped", "skipped: time budget exhausted")
            continue
        until = now + (left if section.max_s is None else min(section.max_s, left))
        _status(run, section.name, "running", f"until +{until - run.started:.0f} s")
        run.write()
        log.info("section %s: up to %.0f s", section.name, until - now)
        outcome: dict[str, Any] = {}
        thread = threading.Thread(target=_guarded, args=(section, run, until, outcome), daemon=True,
                                  name=f"section-{section.name}")
        thread.start()
        last_write = time.monotonic()
        while thread.is_alive() and time.monotonic() < until + grace_s:
            thread.join(timeout=0.5)
            if run.dirty and time.monotonic() - last_write > write_every_s:
                try:
                    run.write()
                except (OSError, ValueError) as e:  # keep measuring; the next write may work
                    log.warning("could not write %s: %s", run.path, e)
                last_write = time.monotonic()
        elapsed = round(time.monotonic() - now, 1)
        if thread.is_alive():
            _status(run, section.name, "timeout", f"did not return {grace_s:.0f} s after its share; abandoned",
                    elapsed)
            for later in sections[i + 1:]:
                _status(run, later.name, "skipped", f"skipped: section {section.name} did not return")
            run.write()
            return False
        _status(run, section.name, outcome["status"], outcome.get("message", ""), elapsed,
                outcome.get("traceback"))
        log.info("section %s: %s in %.1f s %s", section.name, outcome["status"], elapsed,
                 outcome.get("message", ""))
        run.write()
    return True


def _guarded(section: Section, run: Run, until: float, outcome: dict[str, Any]) -> None:
    try:
        section.fn(run, until)
        outcome["status"] = "ok"
        if time.monotonic() > until:
            outcome["message"] = "ran out of its time share; results may be partial"
    except Skip as e:
        outcome.update(status="skipped", message=f"skipped: {e}")
    except BaseException as e:  # noqa: BLE001 - recorded; the next section runs
        outcome.update(status="error", message=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc(limit=8)[-4000:])
    finally:
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a broken context shows in the next section
                pass


def _status(run: Run, name: str, status: str, message: str = "", elapsed: float | None = None,
            tb: str | None = None) -> None:
    entry: dict[str, Any] = {"status": status, "message": message}
    if elapsed is not None:
        entry["elapsed_s"] = elapsed
    if tb:
        entry["traceback"] = tb
    run.put("sections", name, value=entry)


# -- CUDA timing -----------------------------------------------------------------------------
_SLEEP_CYCLES_PER_S: float | None = None


def _sleep_s(seconds: float) -> None:
    """Queue a GPU busy-wait of about `seconds` on the current stream (if torch has one).

    Queued before the timed work, it keeps the GPU busy while Python enqueues that work, so
    the events time the GPU, not the launch rate.
    """
    global _SLEEP_CYCLES_PER_S
    if not hasattr(torch.cuda, "_sleep"):
        return
    if _SLEEP_CYCLES_PER_S is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S = 1_000_000 / max(start.elapsed_time(end) * 1e-3, 1e-6)
    torch.cuda._sleep(int(seconds * _SLEEP_CYCLES_PER_S))


def _is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def new_stream(device: str) -> torch.cuda.Stream | None:
    """A side stream on CUDA; None elsewhere (``torch.cuda.stream(None)`` is a no-op)."""
    return torch.cuda.Stream() if _is_cuda(device) else None


def time_gpu(fn: Callable[[], Any], *, reps: int, warmup: int = 1, inner: int = 1,
             stream: torch.cuda.Stream | None = None, prefill_s: float | None = 0.002,
             device: str = "cuda") -> list[float]:
    """Seconds per call of `fn` on `stream`, one value per rep: CUDA events around `inner` calls.

    prefill_s: a GPU busy-wait queued before each rep so that launch cost is hidden (GPU
    time); None measures at the pace Python issues the calls (launch-bound when tiny).
    device ``cpu`` (tests only: a dry run of the sections' logic) times with the host clock.
    """
    if not _is_cuda(device):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
        return times
    stream = stream or torch.cuda.current_stream()
    pairs = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        for _ in range(reps):
            if prefill_s:
                _sleep_s(prefill_s + 5e-6 * inner)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(inner):
                fn()
            end.record(stream)
            pairs.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e-3 / inner for s, e in pairs]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _inner_for(t_s: float, target_s: float = 1e-3, most: int = 64) -> int:
    """Calls per timed rep so that one rep lasts about `target_s`."""
    return int(min(max(math.ceil(target_s / max(t_s, 1e-7)), 1), most))


def _us(t_s: float) -> float:
    return round(t_s * 1e6, 3)


def _sig(x: float, digits: int = 5) -> float:
    """`x` to `digits` significant digits (a slow device's ratios do not round to 0)."""
    return float(f"{x:.{digits}g}")


# -- sections: GEMM ---------------------------------------------------------------------------
def section_gemm_peak(run: Run, until: float) -> None:
    """Best dense GEMM throughput per dtype, and the cost of one tiny GEMM call."""
    dev = torch.device(run.device)
    best: dict[str, dict[str, Any]] = {}
    plan = [(d, s) for d in ("bfloat16", "float16") for s in GEMM_PEAK_SHAPES] + [("float32", GEMM_PEAK_SHAPES[1])]
    for dtype, (m, n, k) in plan:
        if time.monotonic() > until:
            break
        a = torch.randn(m, k, device=dev, dtype=TORCH_DTYPES[dtype])
        b = torch.randn(k, n, device=dev, dtype=TORCH_DTYPES[dtype])
        c = torch.empty(m, n, device=dev, dtype=TORCH_DTYPES[dtype])
        t = _median(time_gpu(lambda: torch.mm(a, b, out=c), reps=7, warmup=2, inner=2, device=run.device))
        row = _gemm_row(run, dtype, m, n, k, t, math_mode=torch.get_float32_matmul_precision()
                        if dtype == "float32" else "tensor_core")
        run.append("measurements", "gemm_peak", value=row)
        if dtype not in best or row["tflops"] > best[dtype]["tflops"]:
            best[dtype] = row
            _fit_gemm(run, best)
        del a, b, c
    if time.monotonic() < until and torch.get_float32_matmul_precision() == "highest":
        # Reference only: what fp32 would reach with TF32 allowed (not fitted: the executor
        # runs with torch's default precision, which is recorded in software).
        m, n, k = GEMM_PEAK_SHAPES[1]
        a, b = torch.randn(m, k, device=dev), torch.randn(k, n, device=dev)
        c = torch.empty(m, n, device=dev)
        torch.set_float32_matmul_precision("high")
        try:
            t = _median(time_gpu(lambda: torch.mm(a, b, out=c), reps=5, warmup=2, inner=2, device=run.device))
        finally:
            torch.set_float32_matmul_precision("highest")
        run.append("measurements", "gemm_peak", value=_gemm_row(run, "float32", m, n, k, t, math_mode="tf32"))
    # One tiny GEMM: at the pace Python issues calls (the fixed cost per call), and GPU time.
    a = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    c = torch.empty(128, 128, device=dev, dtype=torch.bfloat16)
    tiny = lambda: torch.mm(a, a, out=c)  # noqa: E731
    paced = _median(time_gpu(tiny, reps=7, warmup=20, inner=200, prefill_s=None, device=run.device))
    gpu = _median(time_gpu(tiny, reps=7, warmup=2, inner=50, device=run.device))
    run.put("measurements", "gemm_tiny", value={"m": 128, "n": 128, "k": 128, "dtype": "bfloat16",
                                                "t_call_us": _us(paced), "t_gpu_us": _us(gpu)})
    run.put("fitted", "gemm_call_us", value=_us(paced))


def _gemm_row(run: Run, dtype: str, m: int, n: int, k: int, t: float, *, math_mode: str) -> dict[str, Any]:
    tflops = 2.0 * m * n * k / t / 1e12
    row = {"dtype": dtype, "m": m, "n": n, "k": k, "math": math_mode, "time_us": _us(t),
           "tflops": _sig(tflops)}
    if run.preset is not None and dtype in run.preset.peak_tflops:
        row["efficiency_vs_preset_peak"] = _sig(tflops / run.preset.peak_tflops[dtype], 4)
    return row


def _fit_gemm(run: Run, best: Mapping[str, Mapping[str, Any]]) -> None:
    run.put("fitted", "gemm_tflops", value={d: r["tflops"] for d, r in best.items()})
    run.put("fitted", "gemm_shape", value={d: [r["m"], r["n"], r["k"]] for d, r in best.items()})
    eff = {d: r["efficiency_vs_preset_peak"] for d, r in best.items() if "efficiency_vs_preset_peak" in r}
    if eff:
        run.put("fitted", "gemm_efficiency", value=eff)


def bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` nearly equal pieces of range(total) (as the executor cuts)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def section_dil(run: Run, until: float) -> None:
    """DIL curve: the whole GEMM vs d row pieces and d column pieces, back to back (bf16)."""
    dev, dtype = torch.device(run.device), "bfloat16"
    for m, n, k in DIL_SHAPES:
        if time.monotonic() > until:
            break
        a = torch.randn(m, k, device=dev, dtype=TORCH_DTYPES[dtype])
        w = torch.randn(k, n, device=dev, dtype=TORCH_DTYPES[dtype])
        c = torch.empty(m, n, device=dev, dtype=TORCH_DTYPES[dtype])
        whole = lambda: torch.mm(a, w, out=c)  # noqa: E731
        inner = _inner_for(_median(time_gpu(whole, reps=2, warmup=2, device=run.device)))
        t_whole = _median(time_gpu(whole, reps=7, warmup=1, inner=inner, device=run.device))
        for d in DIL_DEGREES:
            for split in ("m", "n"):
                if time.monotonic() > until:
                    break
                if split == "m":  # row pieces: views of A and C (contiguous)
                    calls = [(a[i:j], w, c[i:j]) for i, j in bounds(m, d)]
                else:  # column pieces: W and C pieces held contiguous, as the executor holds them
                    calls = [(a, w[:, i:j].contiguous(), torch.empty(m, j - i, device=dev, dtype=c.dtype))
                             for i, j in bounds(n, d)]

                def pieces(calls=calls) -> None:
                    for x, y, z in calls:
                        torch.mm(x, y, out=z)

                t = _median(time_gpu(pieces, reps=7, warmup=1, inner=inner, device=run.device))
                run.append("measurements", "dil", value={
                    "dtype": dtype, "m": m, "n": n, "k": k, "split": split, "d": d,
                    "t_whole_us": _us(t_whole), "t_pieces_us": _us(t), "dil": round(t / t_whole - 1, 4)})


# -- sections: copies --------------------------------------------------------------------------
def sm_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Fallback SM copy (an elementwise kernel, never cudaMemcpy) if the cuda executor is absent."""
    torch.mul(src, 1, out=dst)


def dma_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Fallback copy-engine copy: ``copy_`` of contiguous buffers, a D2D cudaMemcpyAsync."""
    dst.copy_(src, non_blocking=True)


def copy_functions() -> tuple[dict[str, Callable[[torch.Tensor, torch.Tensor], None]], str]:
    """({engine: copy(dst, src)}, where they come from): the executor's own copies if present,
    so the profile measures exactly what the ``cuda`` backend's ``dma`` and ``sm`` do."""
    try:
        from ficco_select.executor.cuda import COPIES  # noqa: PLC0415 - optional, built separately

        return {"dma": COPIES["dma"], "sm": COPIES["sm"]}, "ficco_select.executor.cuda.COPIES"
    except Exception:  # noqa: BLE001 - fall back on the same calls, defined here
        return {"dma": dma_copy, "sm": sm_copy}, "ficco_select.executor.gpu_profile (fallback)"


def _copy_sweep(run: Run, until: float, *, name: str, fitted: str, sizes: Sequence[int],
                make: Callable[[int], tuple[Callable[[], None], Callable[[], None]]]) -> None:
    """Time one copy of each size alone (GPU time) and back to back; fit latency + size / bw."""
    side = new_stream(run.device)
    points: list[dict[str, Any]] = []
    for size in sizes:
        if time.monotonic() > until:
            break
        copy, free = make(size)
        single = _median(time_gpu(copy, reps=15 if size <= 64 * MiB else 7, warmup=3, stream=side,
                                 device=run.device))
        inner = _inner_for(single, target_s=2e-3, most=100)
        b2b = _median(time_gpu(copy, reps=5, warmup=1, inner=inner, stream=side, device=run.device))
        point = {"bytes": size, "t_us": _us(single), "t_back_to_back_us": _us(b2b),
                 "bw_gbps": _sig(size / single / 1e9)}
        points.append(point)
        run.append("measurements", name, value=point)
        free()
        if len(points) >= 3:
            latency, bw = fit_latency_bw([p["bytes"] for p in points], [p["t_us"] * 1e-6 for p in points])
            run.put("fitted", f"{fitted}_latency_us", value=_us(latency))
            run.put("fitted", f"{fitted}_bw_gbps", value=_sig(bw / 1e9))


def _device_pair(nbytes: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst): contiguous bf16 device buffers of `nbytes` each (the executor's usual dtype)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    return src, torch.empty_like(src)


def _copy_section(run: Run, until: float, engine: str, name: str, fitted: str) -> None:
    copies, where = copy_functions()
    run.put("measurements", "copy_functions", value=where)
    copy = copies[engine]
    src, dst = _device_pair(max(COPY_SIZES), run.device)

    def make(size):
        s, d = src[:size // 2], dst[:size // 2]
        return (lambda: copy(d, s)), (lambda: None)

    _copy_sweep(run, until, name=name, fitted=fitted, sizes=COPY_SIZES, make=make)


def section_copy_dma(run: Run, until: float) -> None:
    """Copy-engine copies: the executor's ``dma`` copy (``copy_`` of contiguous buffers, a
    device-to-device cudaMemcpyAsync) on a side stream."""
    _copy_section(run, until, "dma", "copy_dma", "dma")


def section_copy_sm(run: Run, until: float) -> None:
    """SM copies: the executor's ``sm`` copy (an elementwise kernel), the same bytes."""
    _copy_section(run, until, "sm", "copy_sm", "sm_copy")


def section_copy_h2d(run: Run, until: float) -> None:
    """Pinned host -> device copies: certainly a copy engine (reference for the D2D numbers)."""
    if not _is_cuda(run.device):
        raise Skip("host-to-device copies need a GPU")
    host = torch.empty(max(H2D_SIZES), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(max(H2D_SIZES), dtype=torch.uint8, device="cuda")

    def make(size):
        h, d = host[:size], dev[:size]
        return (lambda: d.copy_(h, non_blocking=True)), (lambda: None)

    _copy_sweep(run, until, name="copy_h2d", fitted="h2d", sizes=H2D_SIZES, make=make)


# -- section: contention -----------------------------------------------------------------------
def section_cil(run: Run, until: float) -> None:
    """GEMM slowdown beside a dma / SM copy stream, and the copies' slowdown beside GEMMs."""
    dev = torch.device(run.device)
    m, n, k = CIL_GEMM
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    src, dst = _device_pair(CIL_COPY_BYTES, run.device)
    gemm = lambda: torch.mm(a, b, out=c)  # noqa: E731
    fns, where = copy_functions()
    run.put("measurements", "copy_functions", value=where)
    copies = {engine: (lambda f=f: f(dst, src)) for engine, f in fns.items()}
    g_stream, x_stream = new_stream(run.device), new_stream(run.device)
    t_gemm = _median(time_gpu(gemm, reps=3, warmup=2, stream=g_stream, device=run.device))
    n_gemm = int(min(max(math.ceil(0.02 / t_gemm), 5), 400))  # a ~20 ms window
    gemm_alone = _median(time_gpu(gemm, reps=5, warmup=0, inner=n_gemm, stream=g_stream,
                                   device=run.device))
    result: dict[str, Any] = {"gemm": {"m": m, "n": n, "k": k, "dtype": "bfloat16", "calls": n_gemm},
                              "copy_bytes": CIL_COPY_BYTES, "t_gemm_alone_us": _us(gemm_alone)}
    run.put("measurements", "cil", value=dict(result))  # a copy: result changes on
    for engine, copy in copies.items():
        if time.monotonic() > until:
            break
        t_copy = _median(time_gpu(copy, reps=3, warmup=2, stream=x_stream, device=run.device))
        n_copy = int(min(max(math.ceil(0.02 / t_copy), 5), 2000))
        copy_alone = _median(time_gpu(copy, reps=5, warmup=0, inner=n_copy, stream=x_stream,
                                        device=run.device))
        # GEMM timed while copies run the whole time (3x its window, in case they slow down).
        cover = int(min(math.ceil(3 * (n_gemm * t_gemm + 1e-3) / t_copy) + 1, 20000))
        g_times, g_covered = _contended(timed=(g_stream, gemm, n_gemm), beside=(x_stream, copy, cover),
                                        device=run.device)
        cover = int(min(math.ceil(3 * (n_copy * t_copy + 1e-3) / t_gemm) + 1, 4000))
        x_times, x_covered = _contended(timed=(x_stream, copy, n_copy), beside=(g_stream, gemm, cover),
                                        device=run.device)
        cil_gemm = _median(g_times) / gemm_alone - 1
        cil_copy = _median(x_times) / copy_alone - 1
        result[engine] = {"copy_calls": n_copy, "t_copy_alone_us": _us(copy_alone),
                          "t_gemm_contended_us": _us(_median(g_times)), "gemm_fully_overlapped": g_covered,
                          "t_copy_contended_us": _us(_median(x_times)), "copy_fully_overlapped": x_covered,
                          "cil_gemm": round(cil_gemm, 4), "cil_copy": round(cil_copy, 4)}
        run.put("measurements", "cil", value=dict(result))  # a copy: result changes on
        run.put("fitted", f"cil_gemm_{engine}", value=round(cil_gemm, 4))
        run.put("fitted", f"cil_copy_{engine}", value=round(cil_copy, 4))


def _contended(*, timed: tuple, beside: tuple, reps: int = 5, device: str = "cuda") -> tuple[list[float], bool]:
    """Time timed = (stream, fn, calls) while beside = (stream, fn, calls) runs on another stream.

    Both streams start behind a GPU busy-wait, the one beside 1 ms earlier, so it is running
    when the timed window opens. Returns (window seconds per rep, whether the work beside
    outlasted the timed window in every rep).
    """
    (t_stream, t_fn, t_calls), (b_stream, b_fn, b_calls) = timed, beside
    if not _is_cuda(device):  # dry run: no second stream to run beside, nothing overlapped
        return time_gpu(t_fn, reps=reps, warmup=0, inner=t_calls, device=device), False
    times, covered = [], True
    for _ in range(reps):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        with torch.cuda.stream(b_stream):
            _sleep_s(0.004)
            for _ in range(b_calls):
                b_fn()
            ev[2].record(b_stream)
        with torch.cuda.stream(t_stream):
            _sleep_s(0.005)
            ev[0].record(t_stream)
            for _ in range(t_calls):
                t_fn()
            ev[1].record(t_stream)
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) * 1e-3 / t_calls)
        covered &= ev[0].elapsed_time(ev[2]) >= ev[0].elapsed_time(ev[1])
    return times, bool(covered)


# -- sections: loopback ------------------------------------------------------------------------
def _loopback_fn() -> Callable[..., Any]:
    try:
        from ficco_select.executor import loopback  # noqa: PLC0415 - optional, built separately
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        raise Skip(f"loopback not available ({type(e).__name__}: {e})") from None
    fn = getattr(loopback, "run_loopback", None)
    if fn is None:
        raise Skip("loopback not available (ficco_select.executor.loopback has no run_loopback)")
    return fn


def call_loopback(fn: Callable[..., Any], scenario: Scenario, schedules: Sequence[Any], *,
                  reps: int, warmup: int, device: str = "cuda") -> dict[str, dict[str, Any]]:
    """run_loopback on `schedules`; normalized results keyed by schedule name.

    Passes only the keywords it takes. If it requires ``engine`` (no default), one call per
    engine with that engine's schedules; otherwise one call, each schedule on its own engine.
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    engine_required = "engine" in params and params["engine"].default is inspect.Parameter.empty
    groups: dict[str | None, list[Any]] = {}
    for s in schedules:
        groups.setdefault(s.engine if engine_required else None, []).append(s)
    out: dict[str, dict[str, Any]] = {}
    for engine, group in groups.items():
        kwargs = {"device": device, "engine": engine, "reps": reps, "warmup": warmup}
        kwargs = {key: v for key, v in kwargs.items() if (key in params or takes_any) and v is not None}
        out.update(normalize_loopback(fn(scenario, group, **kwargs), group))
    return out


def _field(entry: Any, *names: str) -> Any:
    for name in names:
        if isinstance(entry, Mapping) and name in entry:
            return entry[name]
        if not isinstance(entry, Mapping) and hasattr(entry, name):
            return getattr(entry, name)
    return None


def normalize_loopback(result: Any, schedules: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """{schedule name: {verified, rel_error, times_s, extra}} from what run_loopback returned.

    Accepts a mapping keyed by schedule (object or name), a sequence aligned with
    `schedules`, or a sequence of entries that name their schedule; an entry is a mapping
    or an object with ``verified``, ``rel_error`` and ``times_s`` (or ``times`` /
    ``time_s``, seconds). Numbers it also carries (e.g. ``t_comp_s``) go to ``extra``.
    """
    names = [getattr(s, "name", str(s)) for s in schedules]
    if isinstance(result, Mapping):
        if isinstance(result.get("results"), (Mapping, list, tuple)):
            return normalize_loopback(result["results"], schedules)
        items = [(getattr(key, "name", str(key)), entry) for key, entry in result.items()]
    elif isinstance(result, (list, tuple)):
        named = [_field(e, "schedule") for e in result]
        if all(x is not None for x in named):
            items = [(getattr(x, "name", str(x)), e) for x, e in zip(named, result)]
        elif len(result) == len(names):
            items = list(zip(names, result))
        else:
            raise ValueError(f"run_loopback returned {len(result)} results for {len(names)} schedules")
    else:
        raise ValueError(f"run_loopback returned a {type(result).__name__}; expected a mapping or a list")
    out = {}
    for name, entry in items:
        times = _field(entry, "times_s", "times", "time_s")
        if times is None:
            times = []
        elif isinstance(times, (int, float)):
            times = [float(times)]
        else:
            times = [float(t) for t in times]
        verified = _field(entry, "verified", "ok")
        rel = _field(entry, "rel_error", "error")
        extra = {}
        if isinstance(entry, Mapping):
            extra = {k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and k not in ("rel_error", "error", "time_s")}
        out[name] = {"verified": None if verified is None else bool(verified),
                     "rel_error": None if rel is None else float(rel), "times_s": times, "extra": extra}
    return out


def _scenario(spec: Mapping[str, Any], hardware: str) -> Scenario:
    return Scenario(**{"group": "gpu-check", "hardware": hardware, **spec})


def _call_tolerant(fn, scenario, schedules, reps, warmup, device):
    """call_loopback; if it refuses so few reps (ValueError naming reps/warmup), retry with 5/1."""
    try:
        return call_loopback(fn, scenario, schedules, reps=reps, warmup=warmup, device=device)
    except ValueError as e:
        if "rep" not in str(e) and "warmup" not in str(e):
            raise
        return call_loopback(fn, scenario, schedules, reps=5, warmup=1, device=device)


def _loopback_scenarios(run: Run, specs, until: float):
    """(scenario, its legal cuda schedules, its result row) for each spec, until time is up."""
    from ficco_select.schedule import candidates

    hardware = run.state.get("preset") or "h200-nvswitch"
    for spec in specs:
        if time.monotonic() > until:
            break
        scenario = _scenario(spec, hardware)
        row: dict[str, Any] = {"scenario": scenario.as_record(), "scenario_id": scenario.scenario_id}
        yield scenario, candidates(scenario, "cuda"), row


def section_loopback_correctness(run: Run, until: float) -> None:
    """Every legal cuda schedule of small scenarios, verified against the reference."""
    fn = _loopback_fn()
    for scenario, schedules, row in _loopback_scenarios(run, CORRECTNESS_SCENARIOS, until):
        row["schedules"] = len(schedules)
        try:
            res = _call_tolerant(fn, scenario, schedules, reps=1, warmup=0, device=run.device)
        except Exception as e:  # noqa: BLE001 - one scenario's failure is recorded, the rest run
            row["error"] = f"{type(e).__name__}: {e}"
            run.append("loopback", "correctness", value=row)
            continue
        failed = [name for name, r in res.items() if r["verified"] is not True]
        missing = [s.name for s in schedules if s.name not in res]
        errs = [r["rel_error"] for r in res.values() if r["rel_error"] is not None]
        row.update(verified=len(res) - len(failed), failed=failed, missing=missing,
                   max_rel_error=max(errs) if errs else None,
                   per_schedule={name: [r["verified"], r["rel_error"]] for name, r in res.items()})
        run.append("loopback", "correctness", value=row)
    done = run.state.get("loopback", {}).get("correctness", [])
    run.put("loopback", "correctness_summary", value={
        "scenarios": len(done), "schedules": sum(r["schedules"] for r in done),
        "all_verified": bool(done) and all(not r.get("error") and not r.get("failed") and not r.get("missing")
                                           for r in done)})


def rank_gemm_shapes(scenario: Scenario) -> list[tuple[int, int, int]]:
    """(m, n, k) of every rank's whole GEMM: loopback runs all P of them on one device."""
    P = scenario.world_size
    if scenario.op == "ag_gemm":
        return [(scenario.m, scenario.n // P, scenario.k)] * P
    if scenario.op == "gemm_rs":
        return [(scenario.m, scenario.n, scenario.k // P)] * P
    counts = scenario.token_counts()  # a2a_gemm: rank r's expert gets column r
    return [(sum(counts[src][r] for src in range(P)), scenario.n, scenario.k) for r in range(P)]


def realized_fractions(results: Mapping[str, Mapping[str, Any]], t_comp_s: float | None
                       ) -> list[dict[str, Any]]:
    """Per verified schedule: realized speedup over its engine's baseline and its fraction of ideal.

    realized = t(none.<engine>) / t(schedule); ideal = (T_comp + T_comm) / max(T_comp, T_comm);
    fraction = (realized - 1) / (ideal - 1). T_comp, T_comm come from the loopback result's
    ``t_comp_s`` / ``t_comm_s`` when it reports them (``ideal_from: loopback``); otherwise
    T_comp is `t_comp_s` (every rank's GEMM timed alone on the device) and T_comm the
    baseline's time minus it (the baseline runs them one after the other;
    ``ideal_from: estimate``). None where the ideal speedup is ~1 (nothing to overlap).
    """
    rows = []
    for name, r in results.items():
        if not r["times_s"] or r["verified"] is False:
            continue
        engine = name.rsplit(".", 1)[-1]
        base = results.get(f"none.{engine}")
        if not base or not base["times_s"]:
            continue
        t_none, t = _median(base["times_s"]), _median(r["times_s"])
        extra = base.get("extra", {})
        if "t_comp_s" in extra and "t_comm_s" in extra:
            comp, comm, source = float(extra["t_comp_s"]), float(extra["t_comm_s"]), "loopback"
        elif t_comp_s is not None:
            comp, comm, source = t_comp_s, max(t_none - t_comp_s, 0.0), "estimate"
        else:
            comp = comm = None
            source = None
        ideal = (comp + comm) / max(comp, comm) if comp is not None and max(comp, comm) > 0 else None
        realized = t_none / t
        fraction = (realized - 1) / (ideal - 1) if ideal is not None and ideal > 1.01 else None
        rows.append({"schedule": name, "time_s": t, "realized_speedup": round(realized, 4),
                     "ideal_speedup": None if ideal is None else round(ideal, 4),
                     "realized_fraction": None if fraction is None else round(fraction, 4),
                     "ideal_from": source})
    return rows


def best_by_engine(per: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fastest verified schedule of each engine with its realized fraction: the issue's
    question (does dma realize more of the ideal than sm?) per scenario."""
    best: dict[str, dict[str, Any]] = {}
    for p in per:
        engine = p["schedule"].rsplit(".", 1)[-1]
        if engine not in best or p["time_s"] < best[engine]["time_s"]:
            best[engine] = {k: p[k] for k in ("schedule", "time_s", "realized_speedup", "realized_fraction")}
    return best


def section_loopback_realized(run: Run, until: float) -> None:
    """Every legal schedule timed on >= 6 scenarios: realized fraction of ideal speedup."""
    fn = _loopback_fn()
    for scenario, schedules, row in _loopback_scenarios(run, REALIZED_SCENARIOS, until):
        try:
            t_comp = _ranks_gemm_time(scenario, run.device)
            row["t_comp_alone_s"] = t_comp
            res = call_loopback(fn, scenario, schedules, reps=5, warmup=2, device=run.device)
        except Exception as e:  # noqa: BLE001 - recorded; the next scenario runs
            row["error"] = f"{type(e).__name__}: {e}"
            run.append("loopback", "realized", value=row)
            continue
        per = realized_fractions(res, t_comp)
        fractions = [p for p in per if p["realized_fraction"] is not None]
        best = min(per, key=lambda p: p["time_s"]) if per else None
        row.update(schedules=per, unverified=[n for n, r in res.items() if r["verified"] is False],
                   best=best and best["schedule"], best_realized_speedup=best and best["realized_speedup"],
                   best_realized_fraction=best and best["realized_fraction"],
                   best_by_engine=best_by_engine(per),
                   median_realized_fraction=round(_median([p["realized_fraction"] for p in fractions]), 4)
                   if fractions else None)
        run.append("loopback", "realized", value=row)


def _ranks_gemm_time(scenario: Scenario, device: str = "cuda") -> float:
    """Seconds of every rank's whole GEMM back to back on this device (T_comp of loopback)."""
    dev, dtype = torch.device(device), TORCH_DTYPES[scenario.dtype]
    bufs = [(torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype),
             torch.empty(m, n, device=dev, dtype=dtype)) for m, n, k in rank_gemm_shapes(scenario) if m and n and k]

    def all_ranks() -> None:
        for x, y, z in bufs:
            torch.mm(x, y, out=z)

    return _median(time_gpu(all_ranks, reps=5, warmup=2, device=device))


SECTIONS = (
    Section("gemm_peak", 30, section_gemm_peak),
    Section("dil", 50, section_dil),
    Section("copy_dma", 25, section_copy_dma),
    Section("copy_sm", 20, section_copy_sm),
    Section("copy_h2d", 10, section_copy_h2d),
    Section("cil", 25, section_cil),
    Section("loopback_correctness", 90, section_loopback_correctness),
    Section("loopback_realized", None, section_loopback_realized),
)


# -- entry point -------------------------------------------------------------------------------
def _environment(preset: str | None) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    from importlib import metadata

    try:
        version = metadata.version("ficco-select")
    except metadata.PackageNotFoundError:
        version = None
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
        "device": {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                   "multiprocessor_count": int(props.multi_processor_count),
                   "total_memory_gib": round(props.total_memory / GiB, 2), "count_visible": torch.cuda.device_count()},
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "hip": getattr(torch.version, "hip", None),
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     "float32_matmul_precision": torch.get_float32_matmul_precision(),
                     "python": platform.python_version(), "ficco_select": version, "host": platform.node()},
        "preset": preset,
        "fitted": {},
        "measurements": {},
        "sections": {s.name: {"status": "pending", "message": ""} for s in SECTIONS},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ficco_select.executor.gpu_profile",
        description="Characterize one CUDA GPU for ficco-select: GEMM throughput and DIL, copy-engine "
                    "and SM copy latency/bandwidth, contention (CIL), loopback correctness and realized "
                    "overlap. Writes OUT/profile.json as it goes (see data/profiles/README.md).")
    p.add_argument("--out", required=True, type=Path, help="Folder for profile.json (created).")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"Seconds for all sections together (default {DEFAULT_BUDGET_S:.0f}).")
    p.add_argument("--preset", default="auto",
                   help="Preset whose peak TFLOP/s gemm_efficiency is relative to; 'auto': by device name.")
    p.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                   help="Comma-separated subset of sections, in the default order.")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    unknown = set(args.sections.split(",")) - {s.name for s in SECTIONS}
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in SECTIONS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        print(f"gpu_profile: no CUDA device visible to torch {torch.__version__} "
              f"(torch.version.cuda={torch.version.cuda}); this profiler needs a GPU and a CUDA build of torch. "
              "Nothing was measured.", file=sys.stderr)
        return 2
    from ficco_select.hardware import HardwareError, load_hardware

    name = torch.cuda.get_device_name(0)
    preset_name = preset_for_device(name) if args.preset == "auto" else args.preset
    preset = None
    if preset_name:
        try:
            preset = load_hardware(preset_name)
        except HardwareError as e:
            print(f"gpu_profile: --preset: {e}", file=sys.stderr)
            return 2
    else:
        log.warning("no preset matches %r: gemm_efficiency is not computed (pass --preset)", name)
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(out=args.out, deadline=time.monotonic() + args.budget_s, state=_environment(preset_name), preset=preset)
    run.state["budget_s"] = args.budget_s
    wanted = set(args.sections.split(","))
    for s in SECTIONS:
        if s.name not in wanted:
            run.state["sections"][s.name] = {"status": "skipped", "message": "skipped: not in --sections"}

    def on_term(signum, frame) -> None:  # a timeout's TERM: keep what was measured
        with run.lock:
            for entry in run.state["sections"].values():
                if entry["status"] in ("running", "pending"):
                    entry.update(status="interrupted", message=f"signal {signum}")
        run.write()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    log.info("profiling %s (preset %s), budget %.0f s -> %s", name, preset_name, args.budget_s, run.path)
    returned = run_sections(run, [s for s in SECTIONS if s.name in wanted])
    run.state["complete"] = all(run.state["sections"][s]["status"] == "ok" for s in wanted)
    run.write()
    log.info("wrote %s (complete: %s)", run.path, run.state["complete"])
    if not returned:  # a section thread is still running: do not wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
