"""The five operators and every schedule of each, on one rank.

An operator object holds one rank's inputs, output and every work buffer, allocated
once before anything is timed (as a framework holds them). ``run(schedule)`` executes
one schedule and returns the output tensor; ``reference()`` computes the plain
"whole collective, then whole GEMM" result with torch's own collectives in float32,
independently of the schedule code, for verification.

Overlap structure shared by every schedule: post the transfers of step t+1 before
running the GEMMs that only need data of steps <= t, so the bytes move (on gloo's
threads, or a copy engine) while the GEMM runs on the caller's thread.

Modules: ``base`` (the Operator base class, piece arithmetic), one per operator
(``all_gather``: ag_gemm, ``reduce_scatter``: gemm_rs, ``all_to_all``: a2a_gemm,
``all_reduce``: gemm_ar, ``combine``: gemm_a2a),
``verify`` (TOLERANCE, relative_error), ``sizing`` (rank_buffer_bytes). This package's
public names are re-exported here: import them from ``ficco_select.executor.operators``.
"""

from __future__ import annotations

from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators.all_gather import AllGatherGemm
from ficco_select.executor.operators.all_reduce import GemmAllReduce
from ficco_select.executor.operators.all_to_all import AllToAllGemm
from ficco_select.executor.operators.base import (DTYPE_NAMES, TORCH_DTYPES, CollectiveThenGemm, Operator, dtype_name,
                                                  offsets, piece_bounds)
from ficco_select.executor.operators.combine import GemmAllToAll
from ficco_select.executor.operators.reduce_scatter import GemmReduceScatter
from ficco_select.executor.operators.sizing import rank_buffer_bytes
from ficco_select.executor.operators.verify import TOLERANCE, relative_error
from ficco_select.scenario import Scenario

__all__ = [
    "DTYPE_NAMES", "OPERATORS", "TOLERANCE", "TORCH_DTYPES", "AllGatherGemm", "AllToAllGemm", "CollectiveThenGemm",
    "GemmAllReduce", "GemmAllToAll", "GemmReduceScatter", "Operator", "build_operator", "dtype_name", "offsets",
    "piece_bounds", "rank_buffer_bytes", "relative_error",
]

OPERATORS: dict[str, type[Operator]] = {
    "ag_gemm": AllGatherGemm,
    "gemm_rs": GemmReduceScatter,
    "a2a_gemm": AllToAllGemm,
    "gemm_ar": GemmAllReduce,
    "gemm_a2a": GemmAllToAll,
}


def build_operator(scenario: Scenario, comm: P2PComm, **kw) -> Operator:
    """The operator of ``scenario.op`` for this rank; `kw` goes to its constructor."""
    return OPERATORS[scenario.op](scenario, comm, **kw)
