"""gemm_a2a: the MoE combine, the local expert's GEMM then the all-to-all that returns the
tokens to their owners, every schedule."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ficco_select.executor.operators.base import Operator, offsets, piece_bounds
from ficco_select.executor.switch import switch_steps
from ficco_select.schedule import Schedule


class GemmAllToAll(Operator):
    """gemm_a2a: the mirror of ``a2a_gemm``, with uneven token counts.

    X_recv (sum_q c[q][r], k): the tokens expert r received, grouped by source rank.
    Y (sum_q c[q][r], n) = X_recv @ W_r, computed chunk by chunk (piece by piece).
    out (sum_q c[r][q], n): the rows of the tokens rank r routed, grouped by expert in
    expert order (the layout of ``a2a_gemm``'s X): chunk q is what expert q returned.
    The local chunk's GEMM writes straight into ``out`` (it never travels).
    """

    def _bind(self, X_recv: torch.Tensor | None = None, W: torch.Tensor | None = None,
              send_sizes: list[int] | None = None, recv_sizes: list[int] | None = None) -> None:
        s, r, P = self.scenario, self.r, self.P
        if send_sizes is None:  # the scenario's synthetic routing (measurement)
            counts = s.token_counts()
            send_sizes, recv_sizes = counts[r], [counts[q][r] for q in range(P)]
        # The dispatch's names: send_sizes[q] tokens rank r routed to expert q (they come
        # back here), recv_sizes[q] tokens source q routed to this expert (they go back).
        self.send_sizes, self.recv_sizes = list(send_sizes), list(recv_sizes)
        self.send_off, self.recv_off = offsets(self.send_sizes), offsets(self.recv_sizes)
        self.X_recv = self._rand(sum(self.recv_sizes), s.k) if X_recv is None else X_recv
        self.W = self._rand(s.k, s.n) if W is None else W
        self.Y = self._empty(sum(self.recv_sizes), s.n)
        self.out = self._empty(sum(self.send_sizes), s.n)

    @functools.cached_property
    def contention_recv(self) -> torch.Tensor:  # what the contention probe receives into
        return self._empty(sum(self.recv_sizes), self.scenario.n)

    def _scratch(self):
        return [self.Y, self.out]

    def expert_rows(self, q: int, lo: int = 0, hi: int | None = None) -> slice:
        """Rows of X_recv and Y that source q's tokens occupy (piece [lo, hi))."""
        hi = self.recv_sizes[q] if hi is None else hi
        return slice(self.recv_off[q] + lo, self.recv_off[q] + hi)

    def owner_rows(self, q: int, lo: int = 0, hi: int | None = None) -> slice:
        """Rows of out that expert q's answers occupy (piece [lo, hi))."""
        hi = self.send_sizes[q] if hi is None else hi
        return slice(self.send_off[q] + lo, self.send_off[q] + hi)

    def _gemm_chunk(self, q: int, lo: int = 0, hi: int | None = None) -> None:
        """The GEMM of source q's tokens (piece [lo, hi)); the local chunk straight into out."""
        rows = self.expert_rows(q, lo, hi)
        if rows.stop > rows.start:
            dst = self.out[self.owner_rows(q, lo, hi)] if q == self.r else self.Y[rows]
            self.mm(self.X_recv[rows], self.W, out=dst)

    def _all_to_all(self) -> None:
        # Non-overlapped all-to-all over the point-to-point transport the overlapped
        # schedules use, as a2a_gemm's (a speedup never comes from a better transport).
        r, P = self.r, self.P
        peers = [q for q in range(P) if q != r]
        self.out[self.owner_rows(r)] = self.Y[self.expert_rows(r)]
        self.comm.exchange([(self.Y[self.expert_rows(q)], q) for q in peers],
                           [(self.out[self.owner_rows(q)], q) for q in peers], tag=0)

    def comm_alone(self):
        self._all_to_all()

    def _start_whole_collective(self):
        # The contention probe sends out's chunks (sized as the peers expect), so the GEMM
        # it times writes Y undisturbed.
        peers = [q for q in range(self.P) if q != self.r]
        return self.comm.start([(self.out[self.owner_rows(q)], q) for q in peers],
                               [(self.contention_recv[self.expert_rows(q)], q) for q in peers], tag=0)

    def compute_alone(self):
        self.mm(self.X_recv, self.W, out=self.Y)

    def reference(self) -> torch.Tensor:
        Y32 = self.X_recv.float() @ self.W.float()
        out = torch.empty(sum(self.send_sizes), self.scenario.n, device=self.device)
        dist.all_to_all_single(out, Y32, self.send_sizes, self.recv_sizes)
        return out

    def run(self, sch: Schedule) -> torch.Tensor:
        if sch.engine == "switch":
            switch_steps(self.comm, self.scenario.op, sch)  # refuses: the switch has no all-to-all
        if sch.granularity == "none":  # the whole GEMM, then the whole all-to-all
            self.compute_alone()
            self._all_to_all()
        elif sch.pattern == "ring":
            self._run_ring(sch.degree, per_step=sch.compute != "gemm_per_piece")
        else:
            self._run_a2a(sch.degree)
        return self.out

    def _run_ring(self, d: int, per_step: bool) -> None:
        # Pairwise hops as a2a_gemm's ring, the other way round: hop h sends the answers for
        # r+h and receives those from r-h, each chunk as d pieces. The GEMM of the next
        # transfer step (and the local chunk's, at first) runs while a step is in flight.
        r, P = self.r, self.P
        steps = [(h, j) for h in range(1, P) for j in range(d)]

        def gemm(t: int) -> None:
            h, j = steps[t]
            dst = (r + h) % P
            if not per_step:
                self._gemm_chunk(dst, *piece_bounds(self.recv_sizes[dst], d)[j])
            elif j == 0:  # the hop's whole chunk, before its first piece goes
                self._gemm_chunk(dst)

        def start(t: int):
            h, j = steps[t]
            dst, src = (r + h) % P, (r - h) % P
            slo, shi = piece_bounds(self.recv_sizes[dst], d)[j]
            rlo, rhi = piece_bounds(self.send_sizes[src], d)[j]
            return self.comm.start([(self.Y[self.expert_rows(dst, slo, shi)], dst)],
                                   [(self.out[self.owner_rows(src, rlo, rhi)], src)], tag=t)

        gemm(0)
        works = start(0)
        self._gemm_chunk(r)
        for t in range(len(steps)):
            if t + 1 < len(steps):
                gemm(t + 1)
            self.comm.wait(works)
            if t + 1 < len(steps):
                works = start(t + 1)

    def _run_a2a(self, d: int) -> None:
        # Step j computes piece j of every peer's chunk and sends each home at once; a GEMM
        # per piece (uneven chunks make no strided block: schedule.is_legal refuses
        # gemm_per_step here). Step j+1's GEMMs run while step j's pieces travel.
        r, P = self.r, self.P
        peers = [q for q in range(P) if q != r]
        send_pieces = {q: piece_bounds(self.recv_sizes[q], d) for q in range(P)}
        recv_pieces = {q: piece_bounds(self.send_sizes[q], d) for q in peers}

        def compute_and_send(j: int) -> list:
            for q in peers:
                self._gemm_chunk(q, *send_pieces[q][j])
            return self.comm.start([(self.Y[self.expert_rows(q, *send_pieces[q][j])], q) for q in peers],
                                   [(self.out[self.owner_rows(q, *recv_pieces[q][j])], q) for q in peers], tag=j)

        pending = compute_and_send(0)
        for j in range(d):
            self._gemm_chunk(r, *send_pieces[r][j])
            nxt = compute_and_send(j + 1) if j + 1 < d else []
            self.comm.wait(pending)
            pending = nxt
