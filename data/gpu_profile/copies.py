"""Copy sections: latency and bandwidth of each copy engine, and contention (CIL) with a GEMM.

- ``copy_dma``: the cuda executor's ``dma`` copy (``copy_`` of contiguous device buffers, a
  ``cudaMemcpyAsync``) on a side stream, 4 KiB .. 1 GiB; fit ``t = latency + bytes / bw``.
- ``copy_sm``: the executor's ``sm`` copy (an elementwise kernel, on the SMs), likewise.
- ``copy_h2d``: pinned host -> device copies, which always use a copy engine (reference).
- ``cil``: a large GEMM alone vs while a dma / an SM copy stream runs beside it, and the
  copies' slowdown while GEMMs run: ``cil = t_contended / t_alone - 1``.

The copies are the executor's own (``ficco_select.executor.cuda.COPIES``), so the profile
measures exactly what the ``cuda`` backend's ``dma`` and ``sm`` do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ficco_select.data.gpu_profile.read import fit_latency_bw
from ficco_select.data.gpu_profile.runner import Run, Skip
from ficco_select.data.gpu_profile.timing import inner_for, is_cuda, median, new_stream, sig, sleep_s, time_gpu, us
from ficco_select.executor.cuda import COPIES

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
COPY_SIZES = tuple(4 * KiB * 4 ** i for i in range(11) if 4 * KiB * 4 ** i <= GiB)
"""4 KiB, 16 KiB, ..., 1 GiB."""
H2D_SIZES = tuple(s for s in COPY_SIZES if s <= 64 * MiB)
CIL_GEMM = (8192, 8192, 8192)
CIL_COPY_BYTES = 256 * MiB
TINY_COPY_SIZES, TINY_CIL_GEMM, TINY_CIL_COPY_BYTES = (4 * KiB, 16 * KiB, 64 * KiB), (64, 64, 64), 16 * KiB
"""The rehearsal's sizes (``Run.tiny``)."""
COPY_FUNCTIONS = "ficco_select.executor.cuda.COPIES"
"""Where the copies come from (``measurements.copy_functions``)."""


# -- latency and bandwidth ---------------------------------------------------------------------
def _copy_sweep(run: Run, until: float, *, name: str, fitted: str, sizes: Sequence[int],
                make: Callable[[int], Callable[[], None]]) -> None:
    """Time one copy of each size alone (GPU time) and back to back; fit latency + size / bw."""
    side = new_stream(run.device)
    points: list[dict[str, Any]] = []
    for size in sizes:
        if time.monotonic() > until:
            break
        copy = make(size)
        single = median(time_gpu(copy, reps=15 if size <= 64 * MiB else 7, warmup=3, stream=side,
                                 device=run.device))
        inner = inner_for(single, target_s=2e-3, most=100)
        b2b = median(time_gpu(copy, reps=5, warmup=1, inner=inner, stream=side, device=run.device))
        point = {"bytes": size, "t_us": us(single), "t_back_to_back_us": us(b2b),
                 "bw_gbps": sig(size / single / 1e9)}
        points.append(point)
        run.append("measurements", name, value=point)
        if len(points) >= 3:
            latency, bw = fit_latency_bw([p["bytes"] for p in points], [p["t_us"] * 1e-6 for p in points])
            run.put("fitted", f"{fitted}_latency_us", value=us(latency))
            run.put("fitted", f"{fitted}_bw_gbps", value=sig(bw / 1e9))


def _device_pair(nbytes: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst): contiguous bf16 device buffers of `nbytes` each (the executor's usual dtype)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    return src, torch.empty_like(src)


def _copy_section(run: Run, until: float, engine: str, name: str, fitted: str) -> None:
    run.put("measurements", "copy_functions", value=COPY_FUNCTIONS)
    copy = COPIES[engine]
    sizes = TINY_COPY_SIZES if run.tiny else COPY_SIZES
    src, dst = _device_pair(max(sizes), run.device)

    def make(size):
        s, d = src[:size // 2], dst[:size // 2]
        return lambda: copy(d, s)

    _copy_sweep(run, until, name=name, fitted=fitted, sizes=sizes, make=make)


def section_copy_dma(run: Run, until: float) -> None:
    """Copy-engine copies: the executor's ``dma`` copy (``copy_`` of contiguous buffers, a
    device-to-device cudaMemcpyAsync) on a side stream."""
    _copy_section(run, until, "dma", "copy_dma", "dma")


def section_copy_sm(run: Run, until: float) -> None:
    """SM copies: the executor's ``sm`` copy (an elementwise kernel), the same bytes."""
    _copy_section(run, until, "sm", "copy_sm", "sm_copy")


def section_copy_h2d(run: Run, until: float) -> None:
    """Pinned host -> device copies: certainly a copy engine (reference for the D2D numbers)."""
    if not is_cuda(run.device):
        raise Skip("host-to-device copies need a GPU")
    host = torch.empty(max(H2D_SIZES), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(max(H2D_SIZES), dtype=torch.uint8, device="cuda")

    def make(size):
        h, d = host[:size], dev[:size]
        return lambda: d.copy_(h, non_blocking=True)

    _copy_sweep(run, until, name="copy_h2d", fitted="h2d", sizes=TINY_COPY_SIZES if run.tiny else H2D_SIZES,
                make=make)


# -- contention --------------------------------------------------------------------------------
def section_cil(run: Run, until: float) -> None:
    """GEMM slowdown beside a dma / SM copy stream, and the copies' slowdown beside GEMMs."""
    dev = torch.device(run.device)
    m, n, k = TINY_CIL_GEMM if run.tiny else CIL_GEMM
    copy_bytes = TINY_CIL_COPY_BYTES if run.tiny else CIL_COPY_BYTES
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    src, dst = _device_pair(copy_bytes, run.device)
    gemm = lambda: torch.mm(a, b, out=c)  # noqa: E731
    run.put("measurements", "copy_functions", value=COPY_FUNCTIONS)
    copies = {engine: (lambda f=f: f(dst, src)) for engine, f in COPIES.items()}
    g_stream, x_stream = new_stream(run.device), new_stream(run.device)
    t_gemm = median(time_gpu(gemm, reps=3, warmup=2, stream=g_stream, device=run.device))
    n_gemm = int(min(max(math.ceil(0.02 / t_gemm), 5), 400))  # a ~20 ms window
    gemm_alone = median(time_gpu(gemm, reps=5, warmup=0, inner=n_gemm, stream=g_stream,
                                 device=run.device))
    result: dict[str, Any] = {"gemm": {"m": m, "n": n, "k": k, "dtype": "bfloat16", "calls": n_gemm},
                              "copy_bytes": copy_bytes, "t_gemm_alone_us": us(gemm_alone)}
    run.put("measurements", "cil", value=dict(result))  # a copy: result changes on
    for engine, copy in copies.items():
        if time.monotonic() > until:
            break
        t_copy = median(time_gpu(copy, reps=3, warmup=2, stream=x_stream, device=run.device))
        n_copy = int(min(max(math.ceil(0.02 / t_copy), 5), 2000))
        copy_alone = median(time_gpu(copy, reps=5, warmup=0, inner=n_copy, stream=x_stream,
                                     device=run.device))
        # GEMM timed while copies run the whole time (3x its window, in case they slow down).
        cover = int(min(math.ceil(3 * (n_gemm * t_gemm + 1e-3) / t_copy) + 1, 20000))
        g_times, g_covered = _contended(timed=(g_stream, gemm, n_gemm), beside=(x_stream, copy, cover),
                                        device=run.device)
        cover = int(min(math.ceil(3 * (n_copy * t_copy + 1e-3) / t_gemm) + 1, 4000))
        x_times, x_covered = _contended(timed=(x_stream, copy, n_copy), beside=(g_stream, gemm, cover),
                                        device=run.device)
        cil_gemm = median(g_times) / gemm_alone - 1
        cil_copy = median(x_times) / copy_alone - 1
        result[engine] = {"copy_calls": n_copy, "t_copy_alone_us": us(copy_alone),
                          "t_gemm_contended_us": us(median(g_times)), "gemm_fully_overlapped": g_covered,
                          "t_copy_contended_us": us(median(x_times)), "copy_fully_overlapped": x_covered,
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
    if not is_cuda(device):  # dry run: no second stream to run beside, nothing overlapped
        return time_gpu(t_fn, reps=reps, warmup=0, inner=t_calls, device=device), False
    times, covered = [], True
    for _ in range(reps):
        torch.cuda.synchronize()
        # Raw events, not cuda.CudaTimer: the end of the work beside (ev[2], on the other
        # stream) is compared with the timed window's start, across streams.
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        with torch.cuda.stream(b_stream):
            sleep_s(0.004)
            for _ in range(b_calls):
                b_fn()
            ev[2].record(b_stream)
        with torch.cuda.stream(t_stream):
            sleep_s(0.005)
            ev[0].record(t_stream)
            for _ in range(t_calls):
                t_fn()
            ev[1].record(t_stream)
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) * 1e-3 / t_calls)
        covered &= ev[0].elapsed_time(ev[2]) >= ev[0].elapsed_time(ev[1])
    return times, bool(covered)
