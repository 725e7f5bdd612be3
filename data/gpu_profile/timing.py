"""GPU timing for the profile's sections, and how the times are rounded into it.

``time_gpu`` times a call on a stream with the cuda executor's timers
(``ficco_select.executor.cuda.make_timer``: CUDA events on CUDA, the host clock on CPU,
where only the tests run it). A GPU busy-wait (``sleep_s``) queued before each repetition
keeps the GPU busy while Python enqueues the timed work, so the events time the GPU, not
the launch rate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ficco_select.executor.cuda import CudaTimer, make_timer

_SLEEP_CYCLES_PER_S: float | None = None


def sleep_s(seconds: float) -> None:
    """Queue a GPU busy-wait of about `seconds` on the current stream (if torch has one)."""
    global _SLEEP_CYCLES_PER_S
    if not hasattr(torch.cuda, "_sleep"):
        return
    if _SLEEP_CYCLES_PER_S is None:
        timer = CudaTimer()
        torch.cuda.synchronize()
        timer.start()
        torch.cuda._sleep(1_000_000)
        timer.stop()
        _SLEEP_CYCLES_PER_S = 1_000_000 / max(timer.seconds(), 1e-6)
    torch.cuda._sleep(int(seconds * _SLEEP_CYCLES_PER_S))


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def new_stream(device: str) -> torch.cuda.Stream | None:
    """A side stream on CUDA; None elsewhere (``torch.cuda.stream(None)`` is a no-op)."""
    return torch.cuda.Stream() if is_cuda(device) else None


def time_gpu(fn: Callable[[], Any], *, reps: int, warmup: int = 1, inner: int = 1,
             stream: torch.cuda.Stream | None = None, prefill_s: float | None = 0.002,
             device: str = "cuda") -> list[float]:
    """Seconds per call of `fn` on `stream`, one value per rep: a timer around `inner` calls.

    prefill_s: a GPU busy-wait queued before each rep so that launch cost is hidden (GPU
    time); None measures at the pace Python issues the calls (launch-bound when tiny).
    device ``cpu`` (tests only: a dry run of the sections' logic) times with the host clock.
    """
    cuda = is_cuda(device)
    timers = []
    with torch.cuda.stream(stream):  # None: the current stream (or no stream on CPU)
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        for _ in range(reps):
            if cuda and prefill_s:
                sleep_s(prefill_s + 5e-6 * inner)
            timer = make_timer(device)
            timer.start()
            for _ in range(inner):
                fn()
            timer.stop()
            timers.append(timer)
    if cuda:
        torch.cuda.synchronize()
    return [t.seconds() / inner for t in timers]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def inner_for(t_s: float, target_s: float = 1e-3, most: int = 64) -> int:
    """Calls per timed rep so that one rep lasts about `target_s`."""
    return int(min(max(math.ceil(target_s / max(t_s, 1e-7)), 1), most))


def us(t_s: float) -> float:
    """Seconds -> microseconds, as the profile stores them (3 decimals)."""
    return round(t_s * 1e6, 3)


def sig(x: float, digits: int = 5) -> float:
    """`x` to `digits` significant digits (a slow device's ratios do not round to 0)."""
    return float(f"{x:.{digits}g}")
