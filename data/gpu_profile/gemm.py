"""GEMM sections: peak throughput per dtype, the cost of one tiny call, and decomposition loss.

- ``gemm_peak``: large bf16 / fp16 / fp32 GEMMs; the best TFLOP/s per dtype (``fitted.gemm_*``),
  and one tiny 128^3 GEMM issued back to back from Python (``fitted.gemm_call_us``).
- ``dil``: one GEMM vs its d row pieces (and column pieces) back to back, d in 2, 4, 8, shapes
  from small to large: ``dil = t_pieces / t_whole - 1`` (``measurements.dil``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ficco_select.data.gpu_profile.runner import Run
from ficco_select.data.gpu_profile.timing import inner_for, median, sig, time_gpu, us
from ficco_select.executor.operators import TORCH_DTYPES, piece_bounds

GEMM_PEAK_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192))
"""(m, n, k) of the throughput GEMMs (bf16, fp16; fp32 runs the middle one only)."""
DIL_SHAPES = ((1024, 1024, 1024), (2048, 4096, 4096), (1024, 8192, 8192), (4096, 4096, 4096),
              (8192, 8192, 8192), (16384, 8192, 4096))
"""(m, n, k) of the DIL curve, small to large (1024 x 8192 x 8192: skinny, weight-heavy)."""
DIL_DEGREES = (2, 4, 8)
TINY_GEMM_PEAK_SHAPES = ((64, 64, 64), (96, 64, 32), (128, 64, 64))
TINY_DIL_SHAPES = ((64, 64, 64), (128, 96, 32))
"""The rehearsal's shapes (``Run.tiny``)."""


def section_gemm_peak(run: Run, until: float) -> None:
    """Best dense GEMM throughput per dtype, and the cost of one tiny GEMM call."""
    dev = torch.device(run.device)
    best: dict[str, dict[str, Any]] = {}
    shapes = TINY_GEMM_PEAK_SHAPES if run.tiny else GEMM_PEAK_SHAPES
    plan = [(d, s) for d in ("bfloat16", "float16") for s in shapes] + [("float32", shapes[1])]
    for dtype, (m, n, k) in plan:
        if time.monotonic() > until:
            break
        a = torch.randn(m, k, device=dev, dtype=TORCH_DTYPES[dtype])
        b = torch.randn(k, n, device=dev, dtype=TORCH_DTYPES[dtype])
        c = torch.empty(m, n, device=dev, dtype=TORCH_DTYPES[dtype])
        t = median(time_gpu(lambda: torch.mm(a, b, out=c), reps=7, warmup=2, inner=2, device=run.device))
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
        m, n, k = shapes[1]
        a, b = torch.randn(m, k, device=dev), torch.randn(k, n, device=dev)
        c = torch.empty(m, n, device=dev)
        torch.set_float32_matmul_precision("high")
        try:
            t = median(time_gpu(lambda: torch.mm(a, b, out=c), reps=5, warmup=2, inner=2, device=run.device))
        finally:
            torch.set_float32_matmul_precision("highest")
        run.append("measurements", "gemm_peak", value=_gemm_row(run, "float32", m, n, k, t, math_mode="tf32"))
    # One tiny GEMM: at the pace Python issues calls (the fixed cost per call), and GPU time.
    a = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    c = torch.empty(128, 128, device=dev, dtype=torch.bfloat16)
    tiny = lambda: torch.mm(a, a, out=c)  # noqa: E731
    paced = median(time_gpu(tiny, reps=7, warmup=20, inner=200, prefill_s=None, device=run.device))
    gpu = median(time_gpu(tiny, reps=7, warmup=2, inner=50, device=run.device))
    run.put("measurements", "gemm_tiny", value={"m": 128, "n": 128, "k": 128, "dtype": "bfloat16",
                                                "t_call_us": us(paced), "t_gpu_us": us(gpu)})
    run.put("fitted", "gemm_call_us", value=us(paced))


def _gemm_row(run: Run, dtype: str, m: int, n: int, k: int, t: float, *, math_mode: str) -> dict[str, Any]:
    tflops = 2.0 * m * n * k / t / 1e12
    row = {"dtype": dtype, "m": m, "n": n, "k": k, "math": math_mode, "time_us": us(t),
           "tflops": sig(tflops)}
    if run.preset is not None and dtype in run.preset.peak_tflops:
        row["efficiency_vs_preset_peak"] = sig(tflops / run.preset.peak_tflops[dtype], 4)
    return row


def _fit_gemm(run: Run, best: Mapping[str, Mapping[str, Any]]) -> None:
    run.put("fitted", "gemm_tflops", value={d: r["tflops"] for d, r in best.items()})
    run.put("fitted", "gemm_shape", value={d: [r["m"], r["n"], r["k"]] for d, r in best.items()})
    eff = {d: r["efficiency_vs_preset_peak"] for d, r in best.items() if "efficiency_vs_preset_peak" in r}
    if eff:
        run.put("fitted", "gemm_efficiency", value=eff)


def section_dil(run: Run, until: float) -> None:
    """DIL curve: the whole GEMM vs d row pieces and d column pieces, back to back (bf16).

    The pieces are cut as the executor cuts them (``piece_bounds``).
    """
    dev, dtype = torch.device(run.device), "bfloat16"
    for m, n, k in TINY_DIL_SHAPES if run.tiny else DIL_SHAPES:
        if time.monotonic() > until:
            break
        a = torch.randn(m, k, device=dev, dtype=TORCH_DTYPES[dtype])
        w = torch.randn(k, n, device=dev, dtype=TORCH_DTYPES[dtype])
        c = torch.empty(m, n, device=dev, dtype=TORCH_DTYPES[dtype])
        whole = lambda: torch.mm(a, w, out=c)  # noqa: E731
        inner = inner_for(median(time_gpu(whole, reps=2, warmup=2, device=run.device)))
        t_whole = median(time_gpu(whole, reps=7, warmup=1, inner=inner, device=run.device))
        for d in DIL_DEGREES:
            for split in ("m", "n"):
                if time.monotonic() > until:
                    break
                if split == "m":  # row pieces: views of A and C (contiguous)
                    calls = [(a[i:j], w, c[i:j]) for i, j in piece_bounds(m, d)]
                else:  # column pieces: W and C pieces held contiguous, as the executor holds them
                    calls = [(a, w[:, i:j].contiguous(), torch.empty(m, j - i, device=dev, dtype=c.dtype))
                             for i, j in piece_bounds(n, d)]

                def pieces(calls=calls) -> None:
                    for x, y, z in calls:
                        torch.mm(x, y, out=z)

                t = median(time_gpu(pieces, reps=7, warmup=1, inner=inner, device=run.device))
                run.append("measurements", "dil", value={
                    "dtype": dtype, "m": m, "n": n, "k": k, "split": split, "d": d,
                    "t_whole_us": us(t_whole), "t_pieces_us": us(t), "dil": round(t / t_whole - 1, 4)})
