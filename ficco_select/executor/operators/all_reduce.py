"""gemm_ar: GEMM then all-reduce (row-parallel linear without sequence parallelism), every schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators.reduce_scatter import GemmReduceScatter
from ficco_select.executor.switch import switch_steps
from ficco_select.schedule import Schedule


GATHER_TAGS = 1 << 20
"""Tags of the all-gather hops: apart from every reduce-scatter tag of any schedule."""


class GemmAllReduce(GemmReduceScatter):
    """gemm_ar: out (m, n) = sum_q A_q @ W_q on every rank, A_r (m, k/P), W_r (k/P, n).

    An all-reduce is a reduce-scatter of row blocks followed by an all-gather of the
    reduced blocks, and every schedule is built so:
    - ``none``: the whole GEMM, then the whole all-reduce: the backend's own (gloo's,
      NCCL's) over the group, what a job runs without overlap; over the copy engines
      (``none.dma``), a ring reduce-scatter and a ring all-gather of C;
    - ``shard.ring``, ``ficco.d<d>.ring.*``: the reduce-scatter + all-gather form: the
      ``gemm_rs`` schedule of the same name (its reduce-scatter overlapped with the GEMM),
      then the ring all-gather of the reduced blocks;
    - ``ficco.d<d>.a2a.*.m``: the piece-wise all-reduce: step j computes row piece j of
      every block (m/d rows), sends each to its block's owner, and as soon as the owner has
      summed its piece it all-gathers it to every peer, while step j+1's GEMMs run.
    The output is C, whole, on every rank.
    """

    def _ring_all_gather(self) -> None:
        # Blocking ring all-gather of the reduced blocks of C, in place: at hop h forward
        # block (r-h) to r+1 and receive block (r-h-1) from r-1.
        r, P = self.r, self.P
        for h in range(P - 1):
            self.comm.exchange([(self.C[self.block((r - h) % P)], (r + 1) % P)],
                               [(self.C[self.block((r - h - 1) % P)], (r - 1) % P)], tag=GATHER_TAGS + h)

    def comm_alone(self):
        if isinstance(self.comm, P2PComm):
            # The backend's all-reduce, not a ring of point-to-point hops: on gloo every
            # schedule of hops ran the inference step of benchmarks/e2e_infer.py slower
            # than gloo's all_reduce, and a baseline slower than what a job runs labels
            # overlap a win where it loses.
            dist.all_reduce(self.C, group=self.comm.group)
            return
        self._ring_reduce_scatter()
        self._ring_all_gather()

    def reference(self) -> torch.Tensor:
        total = self.A.float() @ self.W.float()
        dist.all_reduce(total)
        return total

    def run(self, sch: Schedule) -> torch.Tensor:
        if sch.engine == "switch":
            return self._run_switch(sch, switch_steps(self.comm, self.scenario.op, sch))
        if sch.granularity == "none":  # the whole GEMM, then the whole all-reduce
            self.compute_alone()
            self.comm_alone()
            return self.C
        if sch.pattern == "a2a":
            self._run_piecewise(sch.degree, per_step=sch.compute == "gemm_per_step")
            return self.C
        own = super().run(sch)  # the reduce-scatter, overlapped or not: block r reduced
        if own.data_ptr() != self.C[self.block(self.r)].data_ptr():
            self.C[self.block(self.r)] = own  # column pieces reduce into out_n
        self._ring_all_gather()
        return self.C

    def _run_piecewise(self, d: int, per_step: bool) -> None:
        # gemm_rs's a2a steps (compute piece j of every block, send each to its owner, sum
        # the P partials of the own piece), each followed by the owner's all-gather of its
        # summed piece j into every peer's C. Piece j's all-gather is in flight while step
        # j+1's GEMMs run; the partials a peer's piece overwrites were sent (and waited) before.
        r, P = self.r, self.P
        peers = [q for q in range(P) if q != r]
        C3 = self.C.view(P, self.mb, -1)

        def all_gather(j: int, lo: int, hi: int) -> list:
            return self.comm.start_all_gather(C3[r, lo:hi], [(C3[q, lo:hi], q) for q in peers], tag=d + j)

        self._run_a2a_m(d, per_step, after_step=all_gather)

    def _run_switch(self, sch: Schedule, steps) -> torch.Tensor:
        # none.switch: the whole GEMM, then the one-call multimem all-reduce of C. a2a along
        # m: each step's P pieces (piece j of every block) all-reduced in one switch
        # operation while step j+1's GEMMs run.
        if sch.granularity == "none":
            self.compute_alone()
            steps.wait(steps.start_all_reduce([self.C], tag=0))
        else:
            C3 = self.C.view(self.P, self.mb, -1)
            self._run_switch_m(sch.degree, sch.compute == "gemm_per_step", steps,
                               lambda j, lo, hi: steps.start_all_reduce(list(C3[:, lo:hi]), tag=j))
        return self.C
