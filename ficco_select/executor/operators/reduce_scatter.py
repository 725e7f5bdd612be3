"""gemm_rs: GEMM then reduce-scatter (row-parallel linear), every schedule."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators.base import Operator, piece_bounds
from ficco_select.executor.switch import switch_steps
from ficco_select.scenario import Scenario
from ficco_select.schedule import Schedule, degrees


class GemmReduceScatter(Operator):
    """gemm_rs: out (m/P, n) = block r of sum_q A_q @ W_q, A_r (m, k/P), W_r (k/P, n).

    Partials go to C (m, n); block b of C is rows [b*m/P, (b+1)*m/P). For row pieces
    (split m) the output is block r of C; for column pieces (split n) partials live in
    column-piece buffers so every transfer is contiguous.
    """

    def _set_up(self, scenario: Scenario, comm: P2PComm, seed: int, device: str) -> None:
        super()._set_up(scenario, comm, seed, device)
        self.mb = scenario.m // self.P  # rows per output block

    def _bind(self, A: torch.Tensor | None = None, W: torch.Tensor | None = None, eager_buffers: bool = True) -> None:
        s, P = self.scenario, self.P
        self.A = self._rand(s.m, s.k // P) if A is None else A
        self.W = self._rand(s.k // P, s.n) if W is None else W
        self.C = self._empty(s.m, s.n)
        self._n_bufs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        if eager_buffers:  # measurement: allocate before anything is timed
            _ = self.recv, self.recv_peers, self.out_n
            for d in degrees(P):
                if d <= s.n:  # a degree above n has no column pieces (no schedule splits n so)
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
        if sch.engine == "switch":
            return self._run_switch(sch, switch_steps(self.comm, self.scenario.op, sch))
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

    def _run_a2a_m(self, d: int, per_step: bool, after_step=None) -> None:
        # Step j computes row piece j of every block and sends each to its owner; the
        # owner sums the P partials of its piece j. Step j+1's GEMMs overlap step j's transfers.
        # `after_step(j, lo, hi)`, if given, starts more transfers once piece j is summed
        # (gemm_ar's all-gather of it); they are waited at the end.
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
        later: list = []
        for j in range(d):
            nxt = compute_and_send(j + 1) if j + 1 < d else []
            self.comm.wait(pending)
            lo, hi = pieces[j]
            for q in peers:
                self.add_(C3[r, lo:hi], self.recv_peers[q, lo:hi])
            if after_step is not None:
                later += after_step(j, lo, hi)
            pending = nxt
        self.comm.wait(later)

    def _run_switch(self, sch: Schedule, steps) -> torch.Tensor:
        # none: the whole GEMM, then one reduce-scatter in the switch (block q of C is this
        # rank's part for q; the sum lands in block r). a2a along m: each step's P pieces.
        r, P = self.r, self.P
        if sch.granularity == "none":
            self.compute_alone()
            blocks = [self.C[self.block(q)] for q in range(P)]
            steps.wait(steps.start_reduce_scatter(blocks, blocks[r], tag=0))
        else:
            C3 = self.C.view(P, self.mb, -1)
            self._run_switch_m(sch.degree, sch.compute == "gemm_per_step", steps,
                               lambda j, lo, hi: steps.start_reduce_scatter(list(C3[:, lo:hi]), C3[r, lo:hi], tag=j))
        return self.C[self.block(r)]

    def _run_switch_m(self, d: int, per_step: bool, steps, start_step) -> None:
        # Step j computes row piece j of every block, then start_step(j, lo, hi) hands those
        # P pieces to the switch in one operation, reduced while step j+1's GEMMs run (they
        # write other rows). One step in flight behind the GEMMs, as the sm a2a pattern.
        P = self.P
        pieces = piece_bounds(self.mb, d)
        A3, C3 = self.A.view(P, self.mb, -1), self.C.view(P, self.mb, -1)
        pending: list = []
        for j, (lo, hi) in enumerate(pieces):
            if per_step:
                self.bmm(A3[:, lo:hi], self.W.expand(P, *self.W.shape), out=C3[:, lo:hi])
            else:
                for q in range(P):
                    self._gemm(self.block(q, lo, hi))
            works = start_step(j, lo, hi)
            steps.wait(pending)
            pending = works
        steps.wait(pending)

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
