"""a2a_gemm: MoE all-to-all token dispatch then the local expert's GEMM, every schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ficco_select.executor.operators.base import CollectiveThenGemm, offsets, piece_bounds


class AllToAllGemm(CollectiveThenGemm):
    """a2a_gemm: MoE dispatch then the local expert's GEMM, with uneven token counts.

    X (sum_q c[r][q], k): tokens rank r routes, grouped by destination expert.
    X_recv (sum_q c[q][r], k): tokens for expert r, grouped by source rank.
    out (sum_q c[q][r], n) = X_recv @ W_r. The local chunk is read from X in place.
    """

    def _bind(self, X: torch.Tensor | None = None, W: torch.Tensor | None = None,
              send_sizes: list[int] | None = None, recv_sizes: list[int] | None = None) -> None:
        s, r, P = self.scenario, self.r, self.P
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

    def _gemm_local(self, lo: int = 0, hi: int | None = None) -> None:
        rows = self.recv_rows(self.r, lo, hi)
        if rows.stop > rows.start:
            self.mm(self.send_chunk(self.r, lo, hi), self.W, out=self.out[rows])

    def _gemm_recv(self, q: int, lo: int = 0, hi: int | None = None) -> None:
        rows = self.recv_rows(q, lo, hi)
        if rows.stop > rows.start:
            self.mm(self.X_recv[rows], self.W, out=self.out[rows])

    def _run_ring(self, d: int, per_step: bool) -> None:
        # The ring pattern of an all-to-all is pairwise: hop h exchanges with one peer each
        # way, send to r+h, receive from r-h; each chunk goes as d pieces. One step in
        # flight at a time.
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

    def _run_a2a(self, d: int, per_step: bool) -> None:
        # Step j pulls piece j of every peer's chunk at once; a GEMM per arriving piece
        # whatever per_step says (uneven chunks make no strided block: schedule.is_legal
        # refuses gemm_per_step here).
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
