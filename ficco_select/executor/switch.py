"""The ``switch`` engine: the NVSwitch reduces and multicasts (NVLS), one operation for every peer.

A switch step is a collective of the whole group, not a set of point-to-point transfers, so
a switch comm speaks three steps (each posted by every rank in the same order, waited with
``wait``) instead of ``start``:

- ``start_all_gather(send, recvs, tag)``: `send` written once, by multicast, into every
  peer; each peer's piece lands in its buffer of `recvs` (the ``Comm`` step of that name).
- ``start_reduce_scatter(parts, out, tag)``: `parts[q]` is this rank's contribution to rank
  q's block; `out` gets the sum over ranks of every rank's `parts[r]` (may be `parts[r]`).
- ``start_all_reduce(segments, tag)``: every segment replaced by its sum over ranks.

Sources must not be written, nor destinations read, before the step is waited. Every rank
gets bit-identical sums: each element is reduced once, in one order, and that one result
reaches every rank.

Two comms:

- ``CudaSwitchComm``: PyTorch's symmetric-memory ``multimem`` ops, on a side stream, through
  one symmetric staging buffer with a multicast address: ``multimem_all_gather_out``
  (multicast stores) and ``multimem_all_reduce_`` (each rank ``multimem.ld_reduce``-s its
  1/P span in the switch and multicast-stores the sum). A reduce-scatter stages the P parts
  as P equal spans, so rank q's span is its own block: the switch reduces each block once, on
  its owner's request (the sums' multicast back is the op's, and unused). float16 is staged as
  float32 (the multimem ops reduce float32 and bfloat16 only).
- ``HostSwitchComm``: the cpu stand-in, on shared-memory files over a gloo group. A rank
  writes its contribution once into its own shared slot; once every rank has written, every
  rank reads all P slots: a multicast is read by every peer from that one write, a sum is
  taken over ranks 0..P-1 in float32 (the same order on every rank: bit-identical). One
  worker thread per comm plays the side stream. It checks results and the step protocol
  (slots, chunking, reuse) across real processes; its speed is a host's memcpy, not a switch's.

A step larger than the staging space goes as several chunks, in the same order on every rank.
Status: ``HostSwitchComm`` runs in the CPU tests; ``CudaSwitchComm`` has never run (it needs
>= 2 GPUs on an NVSwitch with multicast; its test skips without them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ficco_select.executor.comm import Comm, NullComm, Transfer
from ficco_select.executor.peer import EngineComm, PeerTimeout, byte_view, shared_files
from ficco_select.schedule import SWITCH_OPS, Schedule

ALIGN = 16
"""Bytes (and elements) every staged chunk is padded to: the multimem ops' vector width."""
HOST_SLOTS = 4
"""Chunks a host rank may run ahead of the slowest reader."""
HOST_SLOT_BYTES = 1 << 20
"""Bytes per host slot (its /dev/shm share)."""
CUDA_BUFFER_BYTES = 128 << 20
"""Bytes of the cuda staging buffer (symmetric memory, per rank)."""


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"engine 'switch' moves contiguous buffers only; {what} has shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.reshape(-1)


def _chunks(longest: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + per_chunk, longest)) for lo in range(0, longest, per_chunk)]


def _part(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    n = t.numel()
    return t[min(lo, n):min(hi, n)]


class SwitchComm(Comm):
    """What both switch comms share: the three steps, cut into chunks a subclass runs."""

    rank: int
    world_size: int

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list:
        raise ValueError(f"rank {self.rank}: engine 'switch' has no point-to-point transfers (tag {tag}); "
                         "its steps are start_all_gather, start_reduce_scatter and start_all_reduce")

    def start_all_gather(self, send: torch.Tensor, recvs: Sequence[Transfer], tag: int) -> list:
        peers = sorted(peer for _, peer in recvs)
        if peers != [q for q in range(self.world_size) if q != self.rank]:
            raise ValueError(f"rank {self.rank}: a switch all-gather receives from every peer once, "
                             f"got peers {peers} (tag {tag})")
        src = byte_view(send)
        dsts = {peer: byte_view(buf) for buf, peer in recvs}
        longest = max([src.numel(), *(d.numel() for d in dsts.values())])
        return self._post_gather(src, dsts, longest)

    def start_reduce_scatter(self, parts: Sequence[torch.Tensor], out: torch.Tensor, tag: int) -> list:
        if len(parts) != self.world_size or parts[self.rank].shape != out.shape:
            raise ValueError(f"rank {self.rank}: a switch reduce-scatter takes one part per rank ({self.world_size}) "
                             f"and an output of its own part's shape; got {len(parts)} parts, output "
                             f"{tuple(out.shape)} (tag {tag})")
        segments = [_flat(p, f"part {q}") for q, p in enumerate(parts)]
        if len({s.numel() for s in segments}) > 1:
            raise ValueError(f"rank {self.rank}: a switch reduce-scatter's parts differ in size "
                             f"{[s.numel() for s in segments]} (tag {tag})")
        return self._post_reduce(segments, {self.rank: _flat(out, "the output")}, out.dtype)

    def start_all_reduce(self, segments: Sequence[torch.Tensor], tag: int) -> list:
        flat = [_flat(s, f"segment {i}") for i, s in enumerate(segments)]
        dtypes = {s.dtype for s in flat}
        if len(dtypes) != 1:
            raise ValueError(f"rank {self.rank}: a switch all-reduce's segments mix dtypes {dtypes} (tag {tag})")
        return self._post_reduce(flat, dict(enumerate(flat)), flat[0].dtype)

    def _post_gather(self, src: torch.Tensor, dsts: dict[int, torch.Tensor], longest: int) -> list:
        raise NotImplementedError  # pragma: no cover - abstract

    def _post_reduce(self, segments: list[torch.Tensor], outs: dict[int, torch.Tensor], dtype: torch.dtype) -> list:
        raise NotImplementedError  # pragma: no cover - abstract

    def close(self) -> None:
        pass


# -- what an operator runs a switch schedule with ----------------------------------------------
class _NullSwitch:
    """A compute skeleton's switch steps (``Operator.skeleton(comm=False)``): nothing moves."""

    def start_all_gather(self, send, recvs, tag):
        return []

    def start_reduce_scatter(self, parts, out, tag):
        return []

    def start_all_reduce(self, segments, tag):
        return []

    def wait(self, works):
        pass


class _EngineSwitch:
    """An ``EngineComm`` whose selected engine is the switch: its works carry the engine, as
    every ``EngineComm`` work does."""

    def __init__(self, comm: EngineComm) -> None:
        self.comm, self.switch = comm, comm.comms["switch"]

    def start_all_gather(self, send, recvs, tag):
        return [("switch", w) for w in self.switch.start_all_gather(send, recvs, tag)]

    def start_reduce_scatter(self, parts, out, tag):
        return [("switch", w) for w in self.switch.start_reduce_scatter(parts, out, tag)]

    def start_all_reduce(self, segments, tag):
        return [("switch", w) for w in self.switch.start_all_reduce(segments, tag)]

    def wait(self, works):
        self.comm.wait(works)


def switch_steps(comm: Comm, op: str, schedule: Schedule) -> Any:
    """What runs `schedule`'s switch steps on `comm`, or ValueError naming what is wrong: an
    op whose collective the switch does not carry, or a comm without a switch."""
    if op not in SWITCH_OPS:
        raise ValueError(f"schedule {schedule.name}: engine 'switch' runs {', '.join(SWITCH_OPS)}, not {op}")
    if isinstance(comm, SwitchComm):
        return comm
    if isinstance(comm, NullComm):
        return _NullSwitch()
    if isinstance(comm, EngineComm) and isinstance(comm.comms.get("switch"), SwitchComm):
        if comm.engine != "switch":
            raise ValueError(f"schedule {schedule.name}: the engine comm has engine {comm.engine!r} selected")
        return _EngineSwitch(comm)
    raise ValueError(f"schedule {schedule.name}: engine 'switch' needs a switch comm (executor/switch.py), "
                     f"this operator has a {type(comm).__name__}")


# -- cuda: PyTorch's multimem ops ------------------------------------------------------------------
def _agree(group: dist.ProcessGroup, ok: bool, device: torch.device) -> bool:
    """Whether every rank of `group` is ok: a rank alone without multicast must not leave the
    others waiting in a rendezvous."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class CudaSwitchComm(SwitchComm):
    """The switch engine on GPUs: multimem ops on one symmetric buffer with a multicast address.

    Collective: every rank of `group` builds one, with the same `buffer_bytes`. RuntimeError,
    on every rank alike, where a rank's GPU has no multicast support.
    """

    REDUCED = (torch.float32, torch.bfloat16)
    """The dtypes ``multimem_all_reduce_`` reduces (others are staged as float32)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, buffer_bytes: int = CUDA_BUFFER_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        group = group or dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if buffer_bytes < (self.world_size + 1) * 4 * ALIGN:  # a chunk of 16 elements of every part, float32
            raise ValueError(f"buffer_bytes: {buffer_bytes} is below {(self.world_size + 1) * 4 * ALIGN} "
                             f"for {self.world_size} ranks")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group_name = group.group_name
        if not _agree(group, _SymmetricMemory.has_multicast_support(DeviceType.CUDA, self.device.index), self.device):
            raise RuntimeError(f"group {self.group_name}: a rank's GPU has no multicast support (NVLS)")
        self.buffer_bytes = _round_up(buffer_bytes, ALIGN)
        self.buffer = symm_mem.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        if not _agree(group, bool(self.handle.multicast_ptr), self.device):
            raise RuntimeError(f"group {self.group_name}: the staging buffer got no multicast address on some rank")
        self.stream = torch.cuda.Stream(self.device)
        self._symm = torch.ops.symm_mem

    def wait(self, works: Sequence[torch.cuda.Event]) -> None:
        for done in works:
            torch.cuda.current_stream().wait_event(done)

    def _post(self, body: Callable[[], None], tensors: list[torch.Tensor]) -> list[torch.cuda.Event]:
        # After the caller's stream's work so far (the sources are written), on the side
        # stream: the next GEMM runs on the caller's stream meanwhile.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            body()
        for t in tensors:  # allocator buffers must outlive the side stream's use
            t.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return [done]

    def _post_gather(self, src, dsts, longest):
        P = self.world_size
        per_chunk = (self.buffer_bytes // (P + 1)) // ALIGN * ALIGN
        chunks = _chunks(longest, per_chunk)

        def body():
            for lo, hi in chunks:
                width = _round_up(hi - lo, ALIGN)  # every rank's piece of the chunk, padded alike
                staged, out = self.buffer[:width], self.buffer[per_chunk:per_chunk + P * width]
                mine = _part(src, lo, hi)
                staged[:mine.numel()].copy_(mine)
                self._symm.multimem_all_gather_out(staged, self.group_name, out)
                for q, dst in dsts.items():
                    part = _part(dst, lo, hi)
                    part.copy_(out[q * width:q * width + part.numel()])

        return self._post(body, [src, *dsts.values()]) if chunks else []

    def _post_reduce(self, segments, outs, dtype):
        staged_dtype = dtype if dtype in self.REDUCED else torch.float32
        size = staged_dtype.itemsize
        per_chunk = (self.buffer_bytes // (len(segments) * size)) // ALIGN * ALIGN
        if per_chunk < 1:
            raise ValueError(f"buffer_bytes: {self.buffer_bytes} cannot hold {ALIGN} elements of each of "
                             f"{len(segments)} segments of {staged_dtype}")
        chunks = _chunks(max(s.numel() for s in segments), per_chunk)

        def body():
            for lo, hi in chunks:
                # Equal spans of ALIGN-padded elements: multimem_all_reduce_ gives rank q the
                # q-th 1/P of the region, so for P parts rank q reduces exactly its block.
                width = _round_up(hi - lo, ALIGN)
                region = self.buffer[:len(segments) * width * size].view(staged_dtype)
                for i, seg in enumerate(segments):
                    mine = _part(seg, lo, hi)
                    region[i * width:i * width + mine.numel()].copy_(mine)
                    region[i * width + mine.numel():(i + 1) * width].zero_()
                self._symm.multimem_all_reduce_(region, "sum", self.group_name)
                for i, dst in outs.items():
                    part = _part(dst, lo, hi)
                    part.copy_(region[i * width:i * width + part.numel()])

        return self._post(body, [*segments, *outs.values()]) if chunks else []


# -- host: the cpu stand-in on shared memory -------------------------------------------------------
WRITTEN, READ = 0, 1
"""A rank's two counters in its shared pad: chunks it has written into its slots, and chunks
of every rank it has finished reading."""


class HostSwitchComm(SwitchComm):
    """The switch engine on a CPU: each rank's slots in a shared-memory file every rank maps.

    Chunk i (counted alike on every rank) uses slot i mod K of every rank. A rank's worker
    thread, for each chunk: waits until every rank has read chunk i - K (its slot is free),
    writes its contribution, raises WRITTEN, waits until every rank has written chunk i,
    reads all P slots (a multicast's pieces, or the rank-ordered sum), raises READ.

    Collective over a gloo `group` (every rank maps every rank's file: ``peer.shared_files``).
    """

    POLL_S = 20e-6

    def __init__(self, group: dist.ProcessGroup | None = None, *, slots: int = HOST_SLOTS,
                 slot_bytes: int = HOST_SLOT_BYTES, timeout_s: float = 60.0) -> None:
        if slots < 1:
            raise ValueError(f"slots: must be >= 1, got {slots}")
        if slot_bytes < ALIGN:
            raise ValueError(f"slot_bytes: must be >= {ALIGN}, got {slot_bytes}")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.slots, self.slot_bytes, self.timeout_s = slots, _round_up(slot_bytes, ALIGN), timeout_s
        pad_bytes = 64  # the counters, then slots at an offset any dtype may view
        maps = shared_files(group, "ficco-switch", pad_bytes + self.slots * self.slot_bytes)
        self._pads = [m[:16].view(torch.int64) for m in maps]
        self._slots = [[m[pad_bytes + k * self.slot_bytes:pad_bytes + (k + 1) * self.slot_bytes]
                        for k in range(self.slots)] for m in maps]
        self._chunk = 0  # chunks posted so far (the same count on every rank)
        self.error: BaseException | None = None
        self.closed = False
        self._lane: queue.Queue[tuple[Callable[[], None] | None, threading.Event | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._main, name=f"rank {self.rank}'s switch lane", daemon=True)
        self._thread.start()

    # The caller's side: post, wait.
    def wait(self, works: Sequence[threading.Event]) -> None:
        deadline = time.monotonic() + self.timeout_s + 1.0  # the lane's own timeout names its wait first
        for done in works:
            while not done.wait(0.05):
                self._check()
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"rank {self.rank}: a switch step did not finish in {self.timeout_s:g} s")
        self._check()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._lane.put(None)
        self._thread.join(timeout=5)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _post_chunks(self, steps: list[tuple[Callable, Callable]]) -> list[threading.Event]:
        if self.closed:  # its lane has ended: a step posted now would wait out the timeout
            raise RuntimeError(f"rank {self.rank}: this switch comm is closed; make a new one")
        if not steps:
            return []
        for write, read in steps:
            i = self._chunk
            self._chunk += 1
            self._lane.put((lambda i=i, write=write, read=read: self._run_chunk(i, write, read), None))
        done = threading.Event()
        self._lane.put((None, done))
        return [done]

    def _post_gather(self, src, dsts, longest):
        def step(lo: int, hi: int):
            def write(slot):
                mine = _part(src, lo, hi)
                slot[:mine.numel()].copy_(mine)

            def read(slots):
                for q, dst in dsts.items():
                    part = _part(dst, lo, hi)
                    part.copy_(slots[q][:part.numel()])
            return write, read

        return self._post_chunks([step(lo, hi) for lo, hi in _chunks(longest, self.slot_bytes)])

    def _post_reduce(self, segments, outs, dtype):
        size = dtype.itemsize
        per_chunk = self.slot_bytes // (len(segments) * size)
        if per_chunk < 1:
            raise ValueError(f"slot_bytes: {self.slot_bytes} cannot hold one element of each of "
                             f"{len(segments)} segments of {dtype}")

        def step(lo: int, hi: int):
            width = hi - lo

            def view(slot):
                return slot[:len(segments) * width * size].view(dtype)

            def write(slot):
                mine = view(slot)
                for i, seg in enumerate(segments):
                    part = _part(seg, lo, hi)
                    mine[i * width:i * width + part.numel()].copy_(part)

            def read(slots):
                views = [view(s) for s in slots]
                for i, dst in outs.items():
                    part = _part(dst, lo, hi)
                    n = part.numel()
                    total = torch.zeros(n, dtype=torch.float32)
                    for v in views:  # ranks 0..P-1 on every rank: the same bits everywhere
                        total += v[i * width:i * width + n]
                    part.copy_(total)
            return write, read

        longest = max(s.numel() for s in segments)
        return self._post_chunks([step(lo, hi) for lo, hi in _chunks(longest, per_chunk)])

    # The lane's side: one chunk after another.
    def _main(self) -> None:
        while (item := self._lane.get()) is not None:
            chunk, done = item
            if done is not None:
                done.set()  # a failed lane still ends every wait: the waiter raises its error
                continue
            if self.error is not None:
                continue  # a failed lane: drain without running
            try:
                chunk()
            except BaseException as e:  # reported by the next wait on the rank's thread
                kind = PeerTimeout if isinstance(e, PeerTimeout) else RuntimeError
                self.error = kind(f"rank {self.rank}'s switch lane: {type(e).__name__}: {e}")

    def _run_chunk(self, i: int, write: Callable, read: Callable) -> None:
        k = i % self.slots
        self._until(READ, i - self.slots + 1, f"every rank to free slot {k} (chunk {i - self.slots})")
        write(self._slots[self.rank][k])
        self._pads[self.rank][WRITTEN] = i + 1
        self._until(WRITTEN, i + 1, f"every rank to write chunk {i}")
        read([self._slots[q][k] for q in range(self.world_size)])
        self._pads[self.rank][READ] = i + 1

    def _until(self, counter: int, at_least: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while min(int(pad[counter]) for pad in self._pads) < at_least:
            if time.monotonic() > deadline:
                late = [q for q, pad in enumerate(self._pads) if int(pad[counter]) < at_least]
                raise PeerTimeout(f"rank {self.rank}: waited {self.timeout_s:g} s for {what}; "
                                  f"rank(s) {late} never got there")
            time.sleep(self.POLL_S)
