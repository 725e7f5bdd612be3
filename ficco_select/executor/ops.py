"""The three operators and every schedule of each, on one rank.

An operator object holds one rank's inputs, output and every work buffer, allocated
once before anything is timed (as a framework holds them). ``run(schedule)`` executes
one schedule and returns the output tensor; ``reference()`` computes the plain
"whole collective, then whole GEMM" result with torch's own collectives in float32,
independently of the schedule code, for verification.

Notation (rank r, world size P): shards and blocks are indexed by rank; a shard is cut
into d pieces along the schedule's split dimension (pieces differ in size by at most one
row or column). Transfers of one step carry the same tag on both ends.

Overlap structure shared by every schedule: post the transfers of step t+1 before
running the GEMMs that only need data of steps <= t, so the bytes move (on gloo's
threads, or a copy engine) while the GEMM runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import functools
import zlib

import torch
import torch.distributed as dist

from ficco_select.executor.comm import NullComm, P2PComm
from ficco_select.executor.cuda import make_timer
from ficco_select.scenario import Scenario
from ficco_select.schedule import Schedule, degrees

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def piece_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` nearly equal pieces of range(total) (sizes differ by <= 1)."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class Operator:
    """One rank's share of an operator: buffers, schedules, reference."""

    def __init__(self, scenario: Scenario, comm: P2PComm, *, seed: int = 0, device: str = "cpu") -> None:
        self.scenario = scenario
        self.comm = comm
        self.r, self.P = comm.rank, comm.world_size
        if self.P != scenario.world_size:
            raise ValueError(f"process group has {self.P} ranks but scenario world_size={scenario.world_size}")
        self.dtype = TORCH_DTYPES[scenario.dtype]
        self.device = device
        # Inputs depend on (scenario, rank, seed) only: every run of every schedule sees the same.
        self.gen = torch.Generator().manual_seed(zlib.crc32(f"{scenario.scenario_id}/{self.r}/{seed}".encode()))

    def _rand(self, *shape: int) -> torch.Tensor:
        # Scaled so that GEMM outputs are O(1) whatever k is: bf16 keeps its relative precision.
        x = torch.rand(*shape, generator=self.gen) * 2 - 1
        return x.to(device=self.device, dtype=self.dtype)

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, device=self.device, dtype=self.dtype)

    # Every GEMM and reduction add of every schedule goes through these three, so a
    # schedule can also run as its communication skeleton (compute off) to measure
    # chunking loss, or as its compute skeleton (comm off) to measure DIL.
    compute_on = True

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        if self.compute_on:
            torch.mm(a, b, out=out)

    def bmm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        if self.compute_on:
            torch.bmm(a, b, out=out)

    def add_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.compute_on:
            dst += src

    @contextlib.contextmanager
    def skeleton(self, *, compute: bool = True, comm: bool = True):
        """Run schedules with their compute or their communication switched off."""
        saved = self.comm
        self.compute_on = compute
        if not comm:
            self.comm = NullComm(saved.rank, saved.world_size)
        try:
            yield self
        finally:
            self.compute_on = True
            self.comm = saved

    def contended(self) -> float:
        """The whole GEMM while the whole collective's transfers are in flight.

        Returns the GEMM's own time (the caller times the whole): GEMM slowdown versus
        compute alone is the contention loss (CIL) of this backend's engine.
        """
        works = self._start_whole_collective()
        # On CUDA, events on the compute stream: the comm streams are still busy, so a
        # device-wide synchronize would time the transfers too.
        timer = make_timer(self.device)
        timer.start()
        self.compute_alone()
        timer.stop()
        self.comm.wait(works)
        return timer.seconds()

    def _start_whole_collective(self) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    # Subclasses implement these.
    def run(self, schedule: Schedule) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def reference(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def comm_alone(self) -> None:
        """The baseline's collective only (to time communication alone)."""
        raise NotImplementedError

    def compute_alone(self) -> None:
        """The baseline's whole GEMM only (to time compute alone)."""
        raise NotImplementedError

    def poison(self) -> None:
        """Fill receive and output buffers with NaN so stale data cannot pass verification."""
        for buf in self._scratch():
            buf.fill_(float("nan"))

    def _scratch(self) -> list[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError


# ---------------------------------------------------------------------------------------
class AllGatherGemm(Operator):
    """ag_gemm: out (m, n/P) = AG(A) @ W_r, A_r (m/P, k), W_r (k, n/P).

    A_r lives in its slot of the all-gather buffer A_full (m, k), as with symmetric
    memory; so no schedule, baseline included, copies the local shard.
    """

    def __init__(self, scenario: Scenario, comm: P2PComm, *, A_shard: torch.Tensor | None = None,
                 W: torch.Tensor | None = None, **kw) -> None:
        super().__init__(scenario, comm, **kw)
        s, P, r = scenario, self.P, self.r
        self.ms = s.m // P  # rows per shard
        self.A_full = self._empty(s.m, s.k)
        self.A_full[r * self.ms:(r + 1) * self.ms] = self._rand(self.ms, s.k) if A_shard is None else A_shard
        self.W = self._rand(s.k, s.n // P) if W is None else W
        self.out = self._empty(s.m, s.n // P)

    def shard(self, q: int) -> torch.Tensor:
        return self.A_full[q * self.ms:(q + 1) * self.ms]

    def _scratch(self):
        return [self.shard(q) for q in range(self.P) if q != self.r] + [self.out]

    def _ring_allgather(self) -> None:
        # Blocking ring all-gather: P-1 hops, each forwards the shard received last.
        r, P = self.r, self.P
        for h in range(P - 1):
            self.comm.exchange([(self.shard((r - h) % P), (r + 1) % P)],
                               [(self.shard((r - h - 1) % P), (r - 1) % P)], tag=h)

    def comm_alone(self):
        self._ring_allgather()

    def _start_whole_collective(self):
        peers = [q for q in range(self.P) if q != self.r]
        return self.comm.start_all_gather(self.shard(self.r), [(self.shard(q), q) for q in peers], tag=0)

    def compute_alone(self):
        self.mm(self.A_full, self.W, out=self.out)

    def reference(self) -> torch.Tensor:
        A32 = torch.empty(self.scenario.m, self.scenario.k, device=self.device)
        dist.all_gather_single(A32, self.shard(self.r).float().contiguous())
        return A32 @ self.W.float()

    def run(self, sch: Schedule) -> torch.Tensor:
        if sch.granularity == "none":  # the whole collective, then the whole GEMM
            self.comm_alone()
            self.compute_alone()
        elif sch.pattern == "ring":
            self._run_ring(sch.degree, per_step=sch.compute != "gemm_per_piece")
        else:
            self._run_a2a(sch.degree, per_step=sch.compute == "gemm_per_step")
        return self.out

    def _gemm_rows(self, q: int, lo: int, hi: int) -> None:
        rows = slice(q * self.ms + lo, q * self.ms + hi)
        self.mm(self.A_full[rows], self.W, out=self.out[rows])

    def _run_ring(self, d: int, per_step: bool) -> None:
        # Transfer steps (hop h, piece j): forward piece j of shard (r-h) to r+1 while
        # receiving piece j of shard (r-h-1) from r-1. One step in flight at a time.
        r, P = self.r, self.P
        pieces = piece_bounds(self.ms, d)
        steps = [(h, j) for h in range(P - 1) for j in range(d)]

        def start(t: int):
            h, j = steps[t]
            lo, hi = pieces[j]
            return self.comm.start([(self.shard((r - h) % P)[lo:hi], (r + 1) % P)],
                                   [(self.shard((r - h - 1) % P)[lo:hi], (r - 1) % P)], tag=t)

        works = start(0)
        for lo, hi in [(0, self.ms)] if per_step else pieces:
            self._gemm_rows(r, lo, hi)
        for t, (h, j) in enumerate(steps):
            self.comm.wait(works)
            if t + 1 < len(steps):
                works = start(t + 1)
            q = (r - h - 1) % P
            if not per_step:
                self._gemm_rows(q, *pieces[j])
            elif j == d - 1:  # the whole shard has arrived
                self._gemm_rows(q, 0, self.ms)

    def _run_a2a(self, d: int, per_step: bool) -> None:
        # Step j pulls piece j of every peer's shard at once (every link busy).
        r, P = self.r, self.P
        pieces = piece_bounds(self.ms, d)
        peers = [q for q in range(P) if q != r]

        def start(j: int):
            lo, hi = pieces[j]
            return self.comm.start_all_gather(self.shard(r)[lo:hi], [(self.shard(q)[lo:hi], q) for q in peers],
                                              tag=j)

        works = start(0)
        if not per_step:
            self._gemm_rows(r, *pieces[0])
        A3 = self.A_full.view(P, self.ms, -1)
        out3 = self.out.view(P, self.ms, -1)
        for j in range(d):
            self.comm.wait(works)
            if j + 1 < d:
                works = start(j + 1)
            lo, hi = pieces[j]
            if per_step:
                # One batched GEMM over piece j of all P shards (a strided view, no copy).
                self.bmm(A3[:, lo:hi], self.W.expand(P, *self.W.shape), out=out3[:, lo:hi])
            else:
                for q in peers:
                    self._gemm_rows(q, lo, hi)
                if j + 1 < d:
                    self._gemm_rows(r, *pieces[j + 1])


# ---------------------------------------------------------------------------------------
class GemmReduceScatter(Operator):
    """gemm_rs: out (m/P, n) = block r of sum_q A_q @ W_q, A_r (m, k/P), W_r (k/P, n).

    Partials go to C (m, n); block b of C is rows [b*m/P, (b+1)*m/P). For row pieces
    (split m) the output is block r of C; for column pieces (split n) partials live in
    column-piece buffers so every transfer is contiguous.
    """

    def __init__(self, scenario: Scenario, comm: P2PComm, *, A: torch.Tensor | None = None,
                 W: torch.Tensor | None = None, eager_buffers: bool = True, **kw) -> None:
        super().__init__(scenario, comm, **kw)
        s, P = scenario, self.P
        self.mb = s.m // P  # rows per output block
        self.A = self._rand(s.m, s.k // P) if A is None else A
        self.W = self._rand(s.k // P, s.n) if W is None else W
        self.C = self._empty(s.m, s.n)
        self._n_bufs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        if eager_buffers:  # measurement: allocate before anything is timed
            _ = self.recv, self.recv_peers, self.out_n
            for d in degrees(P):
                self._alloc_n(d)

    # Work buffers, allocated on first use when a runtime call needs only one schedule's.
    @functools.cached_property
    def recv(self) -> torch.Tensor:  # ring: double buffer by hop parity
        return self._empty(2, self.mb, self.scenario.n)

    @functools.cached_property
    def recv_peers(self) -> torch.Tensor:  # a2a pattern: one slot per peer
        return self._empty(self.P, self.mb, self.scenario.n)

    @functools.cached_property
    def out_n(self) -> torch.Tensor:  # output of column-piece schedules
        return self._empty(self.mb, self.scenario.n)

    def _alloc_n(self, d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Column pieces: partials (m, n_j) and receive slots (P, m/P, n_j) per piece j.
        # Allocated lazily (poisoned) when a runtime call needs them.
        if d not in self._n_bufs and d <= self.scenario.n:
            widths = [hi - lo for lo, hi in piece_bounds(self.scenario.n, d)]
            bufs = ([self._empty(self.scenario.m, w) for w in widths],
                    [self._empty(self.P, self.mb, w) for w in widths])
            for b in bufs[0] + bufs[1]:
                b.fill_(float("nan"))
            self._n_bufs[d] = bufs
        return self._n_bufs[d]

    def _scratch(self):
        bufs = [self.C, self.recv, self.recv_peers, self.out_n]
        for parts, recvs in self._n_bufs.values():
            bufs += parts + recvs
        return bufs

    def block(self, b: int, lo: int = 0, hi: int | None = None) -> slice:
        hi = self.mb if hi is None else hi
        return slice(b * self.mb + lo, b * self.mb + hi)

    def _ring_reduce_scatter(self) -> None:
        # Blocking ring reduce-scatter of C: at hop h send block (r-h-1), add block (r-h-2).
        r, P = self.r, self.P
        for h in range(P - 1):
            b_in = (r - h - 2) % P
            self.comm.exchange([(self.C[self.block((r - h - 1) % P)], (r + 1) % P)],
                               [(self.recv[0], (r - 1) % P)], tag=h)
            self.add_(self.C[self.block(b_in)], self.recv[0])

    def comm_alone(self):
        self._ring_reduce_scatter()

    def _start_whole_collective(self):
        # Partials go out of recv_peers' slots: compute_alone writes C meanwhile.
        peers = [q for q in range(self.P) if q != self.r]
        return self.comm.start([(self.recv_peers[self.r], q) for q in peers],
                               [(self.recv_peers[q], q) for q in peers], tag=0)

    def compute_alone(self):
        self.mm(self.A, self.W, out=self.C)

    def reference(self) -> torch.Tensor:
        partial = self.A.float() @ self.W.float()
        out = torch.empty(self.mb, self.scenario.n, device=self.device)
        dist.reduce_scatter_single(out, partial)
        return out

    def run(self, sch: Schedule) -> torch.Tensor:
        if sch.granularity == "none":  # the whole GEMM, then the whole collective
            self.compute_alone()
            self.comm_alone()
            return self.C[self.block(self.r)]
        d = sch.degree
        if sch.split == "n":
            return self._run_ring_n(d) if sch.pattern == "ring" else self._run_a2a_n(d)
        per_step = sch.compute != "gemm_per_piece"
        if sch.pattern == "ring":
            self._run_ring_m(d, per_step)
        else:
            self._run_a2a_m(d, per_step)
        return self.C[self.block(self.r)]

    def _gemm(self, rows: slice) -> None:
        self.mm(self.A[rows], self.W, out=self.C[rows])

    def _run_ring_m(self, d: int, per_step: bool) -> None:
        # Hop h computes the partial of block (r-h-1) (block r at the last hop), adds what
        # r-1 accumulated for it, and forwards it to r+1. The GEMM of hop h runs while
        # hop h-1's pieces are in flight.
        r, P = self.r, self.P
        pieces = piece_bounds(self.mb, d)
        inflight: list[list] = [[] for _ in range(d)]
        sends: list = []
        for h in range(P):
            b = (r - h - 1) % P
            if per_step:
                self._gemm(self.block(b))
            for j, (lo, hi) in enumerate(pieces):
                rows = self.block(b, lo, hi)
                if not per_step:
                    self._gemm(rows)
                if h > 0:
                    self.comm.wait(inflight[j])
                    self.add_(self.C[rows], self.recv[(h - 1) % 2, lo:hi])
                if h < P - 1:
                    works = self.comm.start([(self.C[rows], (r + 1) % P)],
                                            [(self.recv[h % 2, lo:hi], (r - 1) % P)], tag=h * d + j)
                    inflight[j] = works[:1]  # the receive; sends are waited at the end
                    sends += works[1:]
        self.comm.wait(sends)

    def _run_a2a_m(self, d: int, per_step: bool) -> None:
        # Step j computes row piece j of every block and sends each to its owner; the
        # owner sums the P partials of its piece j. Step j+1's GEMMs overlap step j's transfers.
        r, P = self.r, self.P
        pieces = piece_bounds(self.mb, d)
        peers = [q for q in range(P) if q != r]
        A3, C3 = self.A.view(P, self.mb, -1), self.C.view(P, self.mb, -1)
        pending: list = []

        def compute_and_send(j: int) -> list:
            lo, hi = pieces[j]
            if per_step:
                self.bmm(A3[:, lo:hi], self.W.expand(P, *self.W.shape), out=C3[:, lo:hi])
            else:
                for q in peers + [r]:  # remote pieces first: their transfers start sooner
                    self._gemm(self.block(q, lo, hi))
            return self.comm.start([(C3[q, lo:hi], q) for q in peers],
                                   [(self.recv_peers[q, lo:hi], q) for q in peers], tag=j)

        pending = compute_and_send(0)
        for j in range(d):
            nxt = compute_and_send(j + 1) if j + 1 < d else []
            self.comm.wait(pending)
            lo, hi = pieces[j]
            for q in peers:
                self.add_(C3[r, lo:hi], self.recv_peers[q, lo:hi])
            pending = nxt

    def _run_ring_n(self, d: int) -> torch.Tensor:
        # As _run_ring_m with column pieces: piece j of block b is parts[j][block b].
        r, P = self.r, self.P
        parts, recvs = self._alloc_n(d)
        cols = piece_bounds(self.scenario.n, d)
        inflight: list[list] = [[] for _ in range(d)]
        sends: list = []
        for h in range(P):
            b = (r - h - 1) % P
            for j, (lo, hi) in enumerate(cols):
                dst = parts[j][self.block(b)]
                self.mm(self.A[self.block(b)], self.W[:, lo:hi], out=dst)
                if h > 0:
                    self.comm.wait(inflight[j])
                    self.add_(dst, recvs[j][(h - 1) % 2])
                if h < P - 1:
                    works = self.comm.start([(dst, (r + 1) % P)], [(recvs[j][h % 2], (r - 1) % P)],
                                            tag=h * d + j)
                    inflight[j] = works[:1]
                    sends += works[1:]
                else:
                    self.out_n[:, lo:hi] = dst
        self.comm.wait(sends)
        return self.out_n

    def _run_a2a_n(self, d: int) -> torch.Tensor:
        r, P = self.r, self.P
        parts, recvs = self._alloc_n(d)
        cols = piece_bounds(self.scenario.n, d)
        peers = [q for q in range(P) if q != r]

        def compute_and_send(j: int) -> list:
            lo, hi = cols[j]
            for q in peers + [r]:
                self.mm(self.A[self.block(q)], self.W[:, lo:hi], out=parts[j][self.block(q)])
            return self.comm.start([(parts[j][self.block(q)], q) for q in peers],
                                   [(recvs[j][q], q) for q in peers], tag=j)

        pending = compute_and_send(0)
        for j in range(d):
            nxt = compute_and_send(j + 1) if j + 1 < d else []
            self.comm.wait(pending)
            acc = parts[j][self.block(r)]
            for q in peers:
                self.add_(acc, recvs[j][q])
            lo, hi = cols[j]
            self.out_n[:, lo:hi] = acc
            pending = nxt
        return self.out_n


# ---------------------------------------------------------------------------------------
class AllToAllGemm(Operator):
    """a2a_gemm: MoE dispatch then the local expert's GEMM, with uneven token counts.

    X (sum_q c[r][q], k): tokens rank r routes, grouped by destination expert.
    X_recv (sum_q c[q][r], k): tokens for expert r, grouped by source rank.
    out (sum_q c[q][r], n) = X_recv @ W_r. The local chunk is read from X in place.
    """

    def __init__(self, scenario: Scenario, comm: P2PComm, *, X: torch.Tensor | None = None,
                 W: torch.Tensor | None = None, send_sizes: list[int] | None = None,
                 recv_sizes: list[int] | None = None, **kw) -> None:
        super().__init__(scenario, comm, **kw)
        s, r, P = scenario, self.r, self.P
        if send_sizes is None:  # the scenario's synthetic routing (measurement)
            counts = s.token_counts()
            send_sizes, recv_sizes = counts[r], [counts[q][r] for q in range(P)]
        self.send_sizes = list(send_sizes)  # to each destination
        self.recv_sizes = list(recv_sizes)  # from each source
        self.send_off, self.recv_off = offsets(self.send_sizes), offsets(self.recv_sizes)
        self.X = self._rand(sum(self.send_sizes), s.k) if X is None else X
        self.W = self._rand(s.k, s.n) if W is None else W
        self.X_recv = self._empty(sum(self.recv_sizes), s.k)
        self.out = self._empty(sum(self.recv_sizes), s.n)

    def _scratch(self):
        # The local chunk of X_recv is never read by the overlapped schedules but is
        # copied by the baseline's collective: poison all of it.
        return [self.X_recv, self.out]

    def send_chunk(self, q: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        hi = self.send_sizes[q] if hi is None else hi
        return self.X[self.send_off[q] + lo:self.send_off[q] + hi]

    def recv_rows(self, q: int, lo: int = 0, hi: int | None = None) -> slice:
        hi = self.recv_sizes[q] if hi is None else hi
        return slice(self.recv_off[q] + lo, self.recv_off[q] + hi)

    def _all_to_all(self) -> None:
        # Non-overlapped all-to-all over the same point-to-point transport the overlapped
        # schedules use (every peer at once), so a speedup never comes from a better
        # transport: gloo's own all_to_all_single was slower than this here.
        r, P = self.r, self.P
        peers = [q for q in range(P) if q != r]
        self.X_recv[self.recv_rows(r)] = self.send_chunk(r)
        self.comm.exchange([(self.send_chunk(q), q) for q in peers],
                           [(self.X_recv[self.recv_rows(q)], q) for q in peers], tag=0)

    def comm_alone(self):
        self._all_to_all()

    def _start_whole_collective(self):
        peers = [q for q in range(self.P) if q != self.r]
        return self.comm.start([(self.send_chunk(q), q) for q in peers],
                               [(self.X_recv[self.recv_rows(q)], q) for q in peers], tag=0)

    def compute_alone(self):
        self.mm(self.X_recv, self.W, out=self.out)

    def reference(self) -> torch.Tensor:
        X32 = torch.empty(sum(self.recv_sizes), self.scenario.k, device=self.device)
        dist.all_to_all_single(X32, self.X.float(), self.recv_sizes, self.send_sizes)
        return X32 @ self.W.float()

    def run(self, sch: Schedule) -> torch.Tensor:
        if sch.granularity == "none":  # the whole collective, then the whole GEMM
            self.comm_alone()
            self.compute_alone()
        elif sch.pattern == "ring":
            self._run_pairwise(sch.degree, per_step=sch.compute != "gemm_per_piece")
        else:
            self._run_a2a(sch.degree)
        return self.out

    def _gemm_local(self, lo: int = 0, hi: int | None = None) -> None:
        rows = self.recv_rows(self.r, lo, hi)
        if rows.stop > rows.start:
            self.mm(self.send_chunk(self.r, lo, hi), self.W, out=self.out[rows])

    def _gemm_recv(self, q: int, lo: int = 0, hi: int | None = None) -> None:
        rows = self.recv_rows(q, lo, hi)
        if rows.stop > rows.start:
            self.mm(self.X_recv[rows], self.W, out=self.out[rows])

    def _run_pairwise(self, d: int, per_step: bool) -> None:
        # Hop h exchanges with one peer each way: send to r+h, receive from r-h; each
        # chunk goes as d pieces. One step in flight at a time.
        r, P = self.r, self.P
        steps = [(h, j) for h in range(1, P) for j in range(d)]

        def start(t: int):
            h, j = steps[t]
            dst, src = (r + h) % P, (r - h) % P
            slo, shi = piece_bounds(self.send_sizes[dst], d)[j]
            rlo, rhi = piece_bounds(self.recv_sizes[src], d)[j]
            return self.comm.start([(self.send_chunk(dst, slo, shi), dst)],
                                   [(self.X_recv[self.recv_rows(src, rlo, rhi)], src)], tag=t)

        works = start(0)
        if per_step:
            self._gemm_local()
        else:
            for lo, hi in piece_bounds(self.recv_sizes[r], d):
                self._gemm_local(lo, hi)
        for t, (h, j) in enumerate(steps):
            self.comm.wait(works)
            if t + 1 < len(steps):
                works = start(t + 1)
            src = (r - h) % P
            if not per_step:
                self._gemm_recv(src, *piece_bounds(self.recv_sizes[src], d)[j])
            elif j == d - 1:
                self._gemm_recv(src)

    def _run_a2a(self, d: int) -> None:
        # Step j pulls piece j of every peer's chunk at once; a GEMM per arriving piece.
        r, P = self.r, self.P
        peers = [q for q in range(P) if q != r]
        send_pieces = {q: piece_bounds(self.send_sizes[q], d) for q in peers}
        recv_pieces = {q: piece_bounds(self.recv_sizes[q], d) for q in range(P)}

        def start(j: int):
            return self.comm.start(
                [(self.send_chunk(q, *send_pieces[q][j]), q) for q in peers],
                [(self.X_recv[self.recv_rows(q, *recv_pieces[q][j])], q) for q in peers], tag=j)

        works = start(0)
        self._gemm_local(*recv_pieces[r][0])
        for j in range(d):
            self.comm.wait(works)
            if j + 1 < d:
                works = start(j + 1)
            for q in peers:
                self._gemm_recv(q, *recv_pieces[q][j])
            if j + 1 < d:
                self._gemm_local(*recv_pieces[r][j + 1])


OPERATORS: dict[str, type[Operator]] = {
    "ag_gemm": AllGatherGemm,
    "gemm_rs": GemmReduceScatter,
    "a2a_gemm": AllToAllGemm,
}


def build_operator(scenario: Scenario, comm: P2PComm, **kw) -> Operator:
    return OPERATORS[scenario.op](scenario, comm, **kw)


def rank_buffer_bytes(scenario: Scenario) -> int:
    """An upper bound on what one rank of a measurement allocates for `scenario`: the
    operator's buffers (every schedule's, as measurement builds them eagerly), its float32
    reference and the float32 copies verification makes. For the busiest rank (the hot
    expert's, for a2a_gemm), so P times this bounds a node's P ranks. Checked before any
    rank starts (``data.measure``): a shape that cannot fit is refused, not allocated.
    """
    s, P, b = scenario, scenario.world_size, scenario.dtype_bytes
    f32 = 4
    if s.op == "ag_gemm":
        # A_full (m, k), W_r (k, n/P), out (m, n/P); reference: the same in float32 + out copy.
        elems = s.m * s.k + s.k * (s.n // P) + s.m * (s.n // P)
        return elems * b + (elems + s.m * (s.n // P)) * f32
    if s.op == "gemm_rs":
        # A (m, k/P), W (k/P, n); C, recv_peers: (m, n) each; recv (2, m/P, n), out_n (m/P, n);
        # column pieces: partials (m, n) + receive slots (m, n) per degree. Reference: the
        # float32 partial (m, n), inputs, output block.
        inputs = s.m * (s.k // P) + (s.k // P) * s.n
        work = (2 + 2 * len(degrees(P))) * s.m * s.n + 3 * (s.m // P) * s.n
        return (inputs + work) * b + (inputs + s.m * s.n + 2 * (s.m // P) * s.n) * f32
    # a2a_gemm: X (tokens sent, k), W (k, n), X_recv (tokens received, k), out (received, n).
    counts = s.token_counts()
    sent = max(sum(row) for row in counts)
    received = max(sum(counts[q][r] for q in range(P)) for r in range(P))
    elems = sent * s.k + s.k * s.n + received * (s.k + s.n)
    return elems * b + (elems + received * s.n) * f32


TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
"""Max |out - ref| / max(|ref|, 1) accepted per dtype (reference is float32)."""


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return float("inf")
    if ref.numel() == 0:
        return 0.0
    err = (out.float() - ref).abs().max().item()
    if err != err:  # NaN: a buffer was not written
        return float("inf")
    return err / max(ref.abs().max().item(), 1.0)
