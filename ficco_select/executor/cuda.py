"""What the loopback backend needs from CUDA: streams per virtual rank, events, the two
copy engines, event timing.

Safe to import without CUDA: nothing here calls the CUDA runtime until a ``CudaLanes``
is built. ``data/measure/loopback.py`` drives these through the same small "lanes" interface as its
CPU lanes, so one rendezvous is correct both with synchronous copies (CPU) and with
asynchronous streams (CUDA).

Per virtual rank r (P of them on one device):
- ``compute[r]``: the stream r's operator runs on (its thread's current stream);
- ``comm[r][q]``: the stream r issues its copies to or from peer q on. One stream per
  peer, so the P - 1 copies of an ``a2a`` step run at once, as over P - 1 links.

A copy waits for markers (events) recorded on both ends' compute streams when they
posted the transfer (the sender's data is written; the receiver has stopped reading the
slot), and records a done event; a ``wait`` makes the waiting rank's compute stream wait
on that event instead of blocking the host.

Status: the copy functions run (synchronously) in the CPU tests; everything that needs a
GPU (streams, events, that ``dma`` issues no kernel, that ``sm`` does) is written for,
but has not been run on, a GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch


# -- the two engines ----------------------------------------------------------------------
def copy_dma(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy-engine transfer: no kernel, no SMs.

    For contiguous tensors of one dtype on one device, ``copy_`` is a single
    ``cudaMemcpyAsync`` (device to device) on the current stream. Anything else would
    silently become a copy kernel (SM work under the ``dma`` label), so it is refused.
    """
    if dst.dtype != src.dtype or not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError(
            f"engine 'dma' needs contiguous buffers of one dtype (got dst {dst.dtype} "
            f"contiguous={dst.is_contiguous()}, src {src.dtype} contiguous={src.is_contiguous()}); "
            "a strided copy would be a kernel, i.e. engine 'sm'")
    dst.copy_(src, non_blocking=True)


def copy_sm(dst: torch.Tensor, src: torch.Tensor) -> None:
    """SM transfer: an elementwise kernel reads src and writes dst, on the compute units.

    ``torch.mul(src, 1, out=dst)`` rather than ``copy_`` of a strided view: it is a kernel
    whatever the layout (``copy_`` of contiguous buffers is the memcpy ``dma`` stands for),
    it is the same vectorized elementwise kernel family as a copy kernel (read n, write n
    elements), and x * 1 == x exactly in every float dtype (NaN stays NaN), so it moves
    the bytes unchanged.
    """
    torch.mul(src, 1, out=dst)


COPIES = {"dma": copy_dma, "sm": copy_sm}
"""engine -> copy function; a schedule's ``engine`` picks one (never inferred)."""


# -- streams and events ---------------------------------------------------------------------
class CudaLanes:
    """Streams of P virtual ranks on one device; the CUDA side of the lanes interface."""

    def __init__(self, world_size: int, device: str | torch.device = "cuda") -> None:
        if not torch.cuda.is_available():
            raise ValueError("device='cuda': CUDA is not available here; use device='cpu'")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.device):
            self.compute = [torch.cuda.Stream() for _ in range(world_size)]
            self.comm = [[torch.cuda.Stream() if q != r else None for q in range(world_size)]
                         for r in range(world_size)]

    @contextlib.contextmanager
    def on_rank(self, rank: int) -> Iterator[None]:
        """Make rank's compute stream current in this thread (current streams are per thread)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.compute[rank]):
            yield

    def ready(self) -> torch.cuda.Event:
        """A marker of everything enqueued so far on the caller's compute stream."""
        event = torch.cuda.Event()
        event.record()
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, engine: str, *, issuer: int, peer: int,
             after: Sequence[torch.cuda.Event]) -> torch.cuda.Event:
        """Enqueue dst <- src on issuer's stream to peer, after `after`; return its done event."""
        stream = self.comm[issuer][peer]
        with torch.cuda.stream(stream):
            for event in after:
                stream.wait_event(event)
            COPIES[engine](dst, src)
            # The allocator must not reuse either buffer before this stream is done with it.
            dst.record_stream(stream)
            src.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def join(self, done: torch.cuda.Event | None) -> None:
        """Make the caller's compute stream wait for a copy (the host does not block)."""
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def timer(self) -> CudaTimer:
        return CudaTimer()


class CudaTimer:
    """Elapsed GPU time between start() and stop() on the caller's current stream."""

    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record()

    def stop(self) -> None:
        self._end.record()

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class HostTimer:
    """Wall time between start() and stop(): the host counterpart (work there is synchronous)."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self._t1 = time.perf_counter()

    def seconds(self) -> float:
        return self._t1 - self._t0


def make_timer(device: str | torch.device) -> CudaTimer | HostTimer:
    return CudaTimer() if torch.device(device).type == "cuda" else HostTimer()
