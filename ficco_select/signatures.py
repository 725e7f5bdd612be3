"""The inefficiency signatures: the columns every dataset carries per scenario, whoever
measured or simulated it (``data.dataset``). Plain names, no torch: reading a dataset
must not load the executor.

- ``t_comp_s``, ``t_comm_s``: the whole GEMM and the whole collective, each timed alone;
  ``ideal_speedup`` = (t_comp + t_comm) / max(t_comp, t_comm).
- ``dil_<g>``: decomposition inefficiency loss of the ring schedule at granularity `g`
  (the decomposed GEMMs back to back over the whole GEMM, minus 1).
- ``chunk_loss_<g>``: the collective moved in that schedule's pieces over moved whole, minus 1.
- ``cil_gemm_sm``, ``cil_overlap_sm``: contention inefficiency loss of the GEMM beside an
  ``sm`` transfer, and of the overlapped pair over the slower of the two alone.
"""

SIGNATURE_GRANULARITIES = ("shard", "d2", "d4", "dP")
SIGNATURE_COLUMNS = (
    ["t_comp_s", "t_comm_s", "ideal_speedup"]
    + [f"dil_{g}" for g in SIGNATURE_GRANULARITIES]
    + [f"chunk_loss_{g}" for g in SIGNATURE_GRANULARITIES]
    + ["cil_gemm_sm", "cil_overlap_sm"]
)
