"""ag_gemm: all-gather then GEMM (sequence/tensor-parallel column linear), every schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators.base import CollectiveThenGemm, piece_bounds
from ficco_select.scenario import Scenario


class AllGatherGemm(CollectiveThenGemm):
    """ag_gemm: out (m, n/P) = AG(A) @ W_r, A_r (m/P, k), W_r (k, n/P).

    A_r lives in its slot of the all-gather buffer A_full (m, k), as with symmetric
    memory; so no schedule, baseline included, copies the local shard.
    """

    def _set_up(self, scenario: Scenario, comm: P2PComm, seed: int, device: str) -> None:
        super()._set_up(scenario, comm, seed, device)
        self.ms = scenario.m // self.P  # rows per shard

    def _bind(self, A_shard: torch.Tensor | None = None, W: torch.Tensor | None = None) -> None:
        s, r = self.scenario, self.r
        self.A_full = self._empty(s.m, s.k)
        self.A_full[r * self.ms:(r + 1) * self.ms] = self._rand(self.ms, s.k) if A_shard is None else A_shard
        self.W = self._rand(s.k, s.n // self.P) if W is None else W
        self.out = self._empty(s.m, s.n // self.P)

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

