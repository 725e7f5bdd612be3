"""Transfers between the processes of one node, one per GPU: the cuda backend's two engines.

Both comms speak the operators' ``start``/``wait`` interface (``comm.py``), so every
schedule runs unchanged; ``EngineComm`` switches between them by the schedule's engine.

- ``NcclComm`` (engine ``sm``): each step's sends and receives go out as one NCCL group
  (``batch_isend_irecv``); NCCL's kernels move the bytes, on SMs. The group matters: two
  ranks that each post a receive before a send to the other would deadlock if the ops
  went out one by one (NCCL matches point-to-point ops per pair in order, ignoring tags).
- ``PeerCopyComm`` (engine ``dma``): copy-engine copies between GPUs through symmetric
  memory (the mechanism of PyTorch's own copy-engine async-TP path). No kernel moves a
  payload byte; two tiny signal kernels per transfer order the copies across GPUs.

``PeerCopyComm``'s protocol. Every ordered pair (sender s, receiver d) owns K staging
slots of C bytes in s's symmetric buffer. Both ends count the pair's transfers in post
order (a buffer larger than C goes as several); transfer i uses slot k = i mod K and two
signal channels, FULL(k) = k and FREE(k) = K + k:

    sender s, on its stream to d           receiver d, on its stream from s
    wait s's compute marker (data written)  wait d's compute marker (slot not read)
    if i >= K: wait FREE(k) from d          wait FULL(k) from s
    copy src -> own slot k     (local)      copy s's slot k -> dst   (peer, NVLink)
    put FULL(k) to d                        put FREE(k) to s

An all-gather step (``start_all_gather``: one buffer to every peer) is staged once, in K
broadcast slots of the sender, on channels BFULL(k) = 2K + k and BFREE(k) = 3K + k; the
sender reuses a broadcast slot once every peer has freed it.

``wait`` makes the caller's compute stream wait on the copy's done event (the host does
not block). The sender's extra local copy (src into its staging slot) is the price of
transfers between arbitrary caller buffers; a pull straight from the operator's own
buffers would need those allocated in symmetric memory and their offsets exchanged.

What differs between devices is behind a ``PeerMemory``: ``CudaPeerMemory`` (torch's
symmetric memory, CUDA streams and events, ``put_signal``/``wait_signal``) and
``HostPeerMemory`` (shared-memory files, one worker thread per stream, signals as
shared int32 flags polled as the GPU kernels spin on theirs). The host one exists so
the protocol (slots, chunking, signal order, slot reuse) is tested across real processes
on a CPU; its copies are host memcpy, not a label of anything.

Status: ``NcclComm`` runs over gloo in the CPU tests (same grouping code, gloo issues the
ops one by one) and ``PeerCopyComm`` over ``HostPeerMemory``; neither has run on GPUs.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ficco_select.executor.comm import Comm, P2PComm, Transfer

DEFAULT_SLOT_BYTES = 32 << 20
"""C: bytes per staging slot (a larger transfer goes as several)."""
DEFAULT_SLOTS = 4
"""K: staging slots per ordered pair of ranks (transfers a sender may run ahead)."""


class PeerTimeout(TimeoutError):
    """A signal did not arrive in time (the message names rank, peer and channel)."""


# -- engine sm: NCCL groups -----------------------------------------------------------------
class NcclComm(P2PComm):
    """Engine ``sm`` across GPUs: a step's transfers as one group of NCCL point-to-point ops."""

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list[dist.Work]:
        # Global peer ranks (`peer=`): older torch (the GPU image's 2.11) may lack `group_peer`.
        ops = [dist.P2POp(dist.irecv, buf, self._global(peer), group=self.group, tag=tag)
               for buf, peer in recvs if buf.numel()]
        ops += [dist.P2POp(dist.isend, buf, self._global(peer), group=self.group, tag=tag)
                for buf, peer in sends if buf.numel()]
        return dist.batch_isend_irecv(ops) if ops else []


# -- engine dma: copy-engine pulls from symmetric memory ------------------------------------
def byte_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"engine 'dma' moves contiguous buffers only, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.reshape(-1).view(torch.uint8)


class PeerCopyComm(Comm):
    """Engine ``dma`` across processes: the protocol above, on a ``PeerMemory``."""

    def __init__(self, memory: PeerMemory) -> None:
        self.memory = memory
        self.rank, self.world_size = memory.rank, memory.world_size
        self.K, self.C = memory.slots, memory.slot_bytes
        self._sent = [0] * self.world_size  # pair transfers to each peer so far
        self._received = [0] * self.world_size  # pair transfers from each peer so far
        self._broadcast = 0  # broadcasts (pieces) this rank staged so far
        self._received_broadcast = [0] * self.world_size  # broadcast pieces from each peer so far

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list[Any]:
        marker = self.memory.marker()
        # Receives first, then sends, as P2PComm: ops keep `works[:1]` of a one-peer step
        # as its receive.
        works = [self._recv(byte_view(buf), peer, marker) for buf, peer in recvs if buf.numel()]
        works += [self._send(byte_view(buf), peer, marker) for buf, peer in sends if buf.numel()]
        return works

    def start_all_gather(self, send: torch.Tensor, recvs: Sequence[Transfer], tag: int) -> list[Any]:
        """`send` is staged once, in this rank's broadcast slots, and every peer pulls it."""
        peers = sorted(peer for _, peer in recvs)
        if peers != [q for q in range(self.world_size) if q != self.rank]:
            raise ValueError(f"rank {self.rank}: an all-gather step receives from every peer once, "
                             f"got peers {peers} (tag {tag})")
        marker = self.memory.marker()
        works = [self._recv(byte_view(buf), peer, marker, broadcast=True) for buf, peer in recvs if buf.numel()]
        if send.numel():
            works.append(self._send_broadcast(byte_view(send), peers, marker))
        return works

    def wait(self, works: Sequence[Any]) -> None:
        for done in works:
            self.memory.join(done)

    def _pieces(self, nbytes: int) -> Iterator[tuple[int, int]]:
        for lo in range(0, nbytes, self.C):
            yield lo, min(lo + self.C, nbytes)

    def _send(self, src: torch.Tensor, peer: int, marker: Any) -> Any:
        with self.memory.lane("send", peer) as lane:
            lane.wait_marker(marker)
            for lo, hi in self._pieces(src.numel()):
                i, k = self._sent[peer], self._sent[peer] % self.K
                self._sent[peer] += 1
                if i >= self.K:
                    lane.wait_signal(peer, self.K + k)  # FREE(k)
                lane.copy(self.memory.slot(self.rank, peer, k)[:hi - lo], src[lo:hi], caller=src)
                lane.put_signal(peer, k)  # FULL(k)
            return lane.record()

    def _send_broadcast(self, src: torch.Tensor, peers: list[int], marker: Any) -> Any:
        # One staging copy for every peer; a slot is reused once every peer has freed it.
        with self.memory.lane("broadcast", self.rank) as lane:
            lane.wait_marker(marker)
            for lo, hi in self._pieces(src.numel()):
                i, k = self._broadcast, self._broadcast % self.K
                self._broadcast += 1
                if i >= self.K:
                    for peer in peers:
                        lane.wait_signal(peer, 3 * self.K + k)  # BFREE(k)
                lane.copy(self.memory.slot(self.rank, None, k)[:hi - lo], src[lo:hi], caller=src)
                for peer in peers:
                    lane.put_signal(peer, 2 * self.K + k)  # BFULL(k)
            return lane.record()

    def _recv(self, dst: torch.Tensor, peer: int, marker: Any, broadcast: bool = False) -> Any:
        counts = self._received_broadcast if broadcast else self._received
        first = 2 * self.K if broadcast else 0  # FULL or BFULL; its FREE is K channels on
        with self.memory.lane("recv", peer) as lane:
            lane.wait_marker(marker)
            for lo, hi in self._pieces(dst.numel()):
                k = counts[peer] % self.K
                counts[peer] += 1
                lane.wait_signal(peer, first + k)
                slot = self.memory.slot(peer, None if broadcast else self.rank, k)
                lane.copy(dst[lo:hi], slot[:hi - lo], caller=dst)
                lane.put_signal(peer, first + self.K + k)
            return lane.record()


class PeerMemory:
    """Symmetric staging slots, streams and signals of one rank (see the two subclasses).

    The staging buffer of every rank holds P * K slots of C bytes: slot (d, k) of owner s
    is where s stages its k-th-mod-K transfer to d, slot (None, k) its k-th-mod-K
    broadcast (an all-gather step's piece, pulled by every peer).
    """

    rank: int
    world_size: int
    slots: int
    slot_bytes: int

    def slot_offset(self, owner: int, dst: int | None, k: int) -> int:
        if dst is None:  # the broadcast slots come after the P - 1 peers' (owner has none)
            index = self.world_size - 1
        else:
            index = dst if dst < owner else dst - 1
        return (index * self.slots + k) * self.slot_bytes

    def buffer_bytes(self) -> int:
        return self.world_size * self.slots * self.slot_bytes

    def slot(self, owner: int, dst: int | None, k: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def marker(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def lane(self, direction: str, peer: int) -> contextlib.AbstractContextManager:  # pragma: no cover
        raise NotImplementedError

    def join(self, done: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass


SIGNAL_CHANNELS = 32
"""Channels used at most: torch's signal pads hold 32 per pair of ranks (and more for P < 72)."""


def _check_slots(slots: int, slot_bytes: int) -> None:
    if not 1 <= slots <= SIGNAL_CHANNELS // 4:  # FULL, FREE, BFULL, BFREE per slot
        raise ValueError(f"slots: 1..{SIGNAL_CHANNELS // 4} staging slots per pair, got {slots}")
    if slot_bytes < 1:
        raise ValueError(f"slot_bytes: must be >= 1, got {slot_bytes}")


# -- CUDA: torch symmetric memory -------------------------------------------------------------
class CudaPeerMemory(PeerMemory):
    """Staging slots in torch symmetric memory; a stream per (direction, peer).

    Collective: every rank of `group` builds one, with the same slots and slot_bytes.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, slots: int = DEFAULT_SLOTS,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 300.0) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        _check_slots(slots, slot_bytes)
        group = group or dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.slots, self.slot_bytes = slots, slot_bytes
        self.timeout_ms = int(timeout_s * 1e3)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = symm_mem.empty(max(1, self.buffer_bytes()), dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.streams = {(direction, q): torch.cuda.Stream(self.device)
                        for direction in ("send", "recv") for q in range(self.world_size) if q != self.rank}
        self.streams[("broadcast", self.rank)] = torch.cuda.Stream(self.device)

    def slot(self, owner: int, dst: int | None, k: int) -> torch.Tensor:
        return self.handle.get_buffer(owner, (self.slot_bytes,), torch.uint8,
                                      storage_offset=self.slot_offset(owner, dst, k))

    def marker(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def lane(self, direction: str, peer: int) -> Iterator[_CudaLane]:
        stream = self.streams[(direction, peer)]
        with torch.cuda.stream(stream):
            yield _CudaLane(self, stream)

    def join(self, done: torch.cuda.Event) -> None:
        torch.cuda.current_stream().wait_event(done)


class _CudaLane:
    """Ops issued to one stream, in order (the caller's current stream is that stream)."""

    def __init__(self, memory: CudaPeerMemory, stream: torch.cuda.Stream) -> None:
        self.memory, self.stream = memory, stream

    def wait_marker(self, marker: torch.cuda.Event) -> None:
        self.stream.wait_event(marker)

    def wait_signal(self, peer: int, channel: int) -> None:
        self.memory.handle.wait_signal(peer, channel=channel, timeout_ms=self.memory.timeout_ms)

    def put_signal(self, peer: int, channel: int) -> None:
        self.memory.handle.put_signal(peer, channel=channel, timeout_ms=self.memory.timeout_ms)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, caller: torch.Tensor) -> None:
        # Same dtype, contiguous, one device (a peer's slot is mapped into ours): a single
        # cudaMemcpyAsync, which the copy engines carry.
        dst.copy_(src, non_blocking=True)
        # The caller's buffer (from the caching allocator, unlike the slots) must not be
        # reused before this stream is done with it.
        caller.record_stream(self.stream)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


# -- host: shared-memory files and worker threads, to test the protocol on a CPU ---------------
def shared_files(group: dist.ProcessGroup | None, prefix: str, size: int) -> list[torch.Tensor]:
    """Every rank of `group`'s shared-memory file of `size` zeroed bytes, mapped here, in rank
    order (collective). A rank unlinks its file as soon as it has made it, before any
    collective, and its peers map it through the rank's open descriptor
    (``/proc/<pid>/fd/<fd>``): a job that dies at any point, its ranks killed, leaves nothing
    in /dev/shm."""
    path = f"/dev/shm/{prefix}-{uuid.uuid4().hex}"
    mine = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR)
    os.unlink(path)
    try:
        mine.zero_()
        where: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(where, f"/proc/{os.getpid()}/fd/{fd}", group=group)
        rank = dist.get_rank(group)
        maps = [mine if q == rank else torch.from_file(at, shared=True, size=size, dtype=torch.uint8)
                for q, at in enumerate(where)]
        dist.barrier(group=group)  # every peer has mapped this rank's file: its descriptor may close
    finally:
        os.close(fd)
    return maps


class HostPeerMemory(PeerMemory):
    """The same slots and signals in shared memory; a worker thread per (direction, peer)
    plays a stream: it runs its ops in order, spinning on signals as the GPU kernels do.

    Collective over a gloo `group` (every rank maps every rank's file: ``shared_files``).
    """

    POLL_S = 20e-6

    def __init__(self, group: dist.ProcessGroup | None = None, *, slots: int = DEFAULT_SLOTS,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 60.0) -> None:
        _check_slots(slots, slot_bytes)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.slots, self.slot_bytes, self.timeout_s = slots, slot_bytes, timeout_s
        pad_ints = 4 * slots * self.world_size  # channel * P + src, as torch's signal pads
        self._size = self.buffer_bytes() + 4 * pad_ints
        maps = shared_files(group, "ficco-peer", self._size)
        pad_bytes = 4 * pad_ints  # the pads first: an int32 view needs an aligned offset
        self._pads = [m[:pad_bytes].view(torch.int32) for m in maps]
        self._buffers = [m[pad_bytes:] for m in maps]
        self._lanes: dict[tuple[str, int], _HostLane] = {}
        self.error: BaseException | None = None

    def slot(self, owner: int, dst: int | None, k: int) -> torch.Tensor:
        at = self.slot_offset(owner, dst, k)
        return self._buffers[owner][at:at + self.slot_bytes]

    def marker(self) -> None:
        return None  # host compute is synchronous: everything before is written

    @contextlib.contextmanager
    def lane(self, direction: str, peer: int) -> Iterator[_HostLane]:
        key = (direction, peer)
        if key not in self._lanes:
            self._lanes[key] = _HostLane(self, f"rank {self.rank}'s {direction} lane "
                                               f"{'to' if direction == 'send' else 'from'} rank {peer}")
        yield self._lanes[key]

    def join(self, done: threading.Event) -> None:
        # A lane's own timeout names the lane and the channel it waited for and ends `done`
        # first; this one is the backstop for a lane that never reports, a moment later.
        deadline = time.monotonic() + self.timeout_s + 1.0
        while not done.wait(0.05):
            self.check()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"rank {self.rank}: a transfer did not finish in {self.timeout_s:g} s")
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _spin(self, owner: int, index: int, until: int, then: int, what: str) -> None:
        pad = self._pads[owner]
        deadline = time.monotonic() + self.timeout_s
        while int(pad[index]) != until:
            if time.monotonic() > deadline:
                raise PeerTimeout(f"rank {self.rank}: {what} timed out after {self.timeout_s:g} s")
            time.sleep(self.POLL_S)
        pad[index] = then

    def wait_signal(self, peer: int, channel: int) -> None:
        self._spin(self.rank, channel * self.world_size + peer, 1, 0,
                   f"waiting for signal channel {channel} from rank {peer}")

    def put_signal(self, peer: int, channel: int) -> None:
        self._spin(peer, channel * self.world_size + self.rank, 0, 1,
                   f"putting signal channel {channel} to rank {peer} (its previous one was never taken)")

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.stop()
        self._lanes.clear()


class _HostLane:
    """A worker thread that runs queued ops in order: the host's stand-in for a stream."""

    def __init__(self, memory: HostPeerMemory, label: str) -> None:
        self.memory, self.label = memory, label
        self._ops: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._main, name=label, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while (op := self._ops.get()) is not None:
            if self.memory.error is not None:
                continue  # a failed lane: drain without running
            try:
                op()
            except BaseException as e:  # reported by the next join on the rank's thread
                kind = PeerTimeout if isinstance(e, PeerTimeout) else RuntimeError
                self.memory.error = kind(f"{self.label}: {type(e).__name__}: {e}")

    def wait_marker(self, marker: None) -> None:
        pass  # the host already ran everything before the post

    def wait_signal(self, peer: int, channel: int) -> None:
        self._ops.put(lambda: self.memory.wait_signal(peer, channel))

    def put_signal(self, peer: int, channel: int) -> None:
        self._ops.put(lambda: self.memory.put_signal(peer, channel))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, caller: torch.Tensor) -> None:
        self._ops.put(lambda: dst.copy_(src))

    def record(self) -> threading.Event:
        done = threading.Event()
        self._ops.put(done.set)
        return done

    def stop(self) -> None:
        self._ops.put(None)
        self._thread.join(timeout=5)


# -- one comm per engine ------------------------------------------------------------------------
class EngineComm(Comm):
    """The comm of the schedule being run: ``select(engine)`` before each run."""

    def __init__(self, comms: dict[str, Any]) -> None:
        if not comms:
            raise ValueError("EngineComm needs at least one engine's comm")
        self.comms = comms
        first = next(iter(comms.values()))
        self.rank, self.world_size = first.rank, first.world_size
        self.engine = next(iter(comms))

    def select(self, engine: str) -> None:
        if engine not in self.comms:
            raise ValueError(f"engine {engine!r}: this comm has {sorted(self.comms)}")
        self.engine = engine

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list:
        return [(self.engine, w) for w in self.comms[self.engine].start(sends, recvs, tag)]

    def wait(self, works: Sequence) -> None:
        # Works remember their engine: a run never mixes them, but a wait must not guess.
        for engine, w in works:
            self.comms[engine].wait([w])

    def start_all_gather(self, send: torch.Tensor, recvs: Sequence[Transfer], tag: int) -> list:
        return [(self.engine, w) for w in self.comms[self.engine].start_all_gather(send, recvs, tag)]
