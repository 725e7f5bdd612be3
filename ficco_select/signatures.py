"""The inefficiency signatures: the columns every dataset carries per scenario, whoever
measured or simulated it (``ficco_select.data.dataset``). Plain names, no torch: reading a dataset
must not load the executor.

- ``t_comp_s``, ``t_comm_s``: the whole GEMM and the whole collective, each timed alone;
  ``ideal_speedup`` = (t_comp + t_comm) / max(t_comp, t_comm).
- ``dil_<g>``: decomposition inefficiency loss of the ring schedule at granularity `g`
  (the decomposed GEMMs back to back over the whole GEMM, minus 1).
- ``chunk_loss_<g>``: the collective moved in that schedule's pieces over moved whole, minus 1.
- ``cil_gemm_sm``, ``cil_overlap_sm``: contention inefficiency loss of the GEMM beside an
  ``sm`` transfer, and of the overlapped pair over the slower of the two alone.
"""

import math

import numpy as np

SIGNATURE_GRANULARITIES = ("shard", "d2", "d4", "dP")
SIGNATURE_COLUMNS = (
    ["t_comp_s", "t_comm_s", "ideal_speedup"]
    + [f"dil_{g}" for g in SIGNATURE_GRANULARITIES]
    + [f"chunk_loss_{g}" for g in SIGNATURE_GRANULARITIES]
    + ["cil_gemm_sm", "cil_overlap_sm"]
)


def signature(*, t_comp, t_comm, t_pair, gemm_slowdown, ring_comp: dict, ring_comm: dict) -> dict:
    """The signature columns from the runs that define them; numbers, or arrays element-wise.

    t_comp, t_comm: the whole GEMM and the whole collective, each alone. t_pair: the two
    overlapped (the GEMM beside the collective's ``sm`` transfers); gemm_slowdown: the GEMM's
    time in that pair over t_comp. ring_comp[g], ring_comm[g]: the ring schedule at granularity
    g with communication off / compute off (a missing or None entry, or NaN in an array: no
    such schedule is legal). The harness, the loopback sweep and the simulator all call this.
    """
    sig = {"t_comp_s": t_comp, "t_comm_s": t_comm,
           "ideal_speedup": (t_comp + t_comm) / np.maximum(t_comp, t_comm)}
    for column, runs, alone in (("dil", ring_comp, t_comp), ("chunk_loss", ring_comm, t_comm)):
        for g in SIGNATURE_GRANULARITIES:
            t = runs.get(g)
            sig[f"{column}_{g}"] = math.nan if t is None else t / alone - 1
    sig["cil_gemm_sm"] = gemm_slowdown - 1
    sig["cil_overlap_sm"] = t_pair / np.maximum(t_comp, t_comm) - 1
    return sig
