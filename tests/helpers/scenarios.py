"""Scenarios shared by the executor tests (cpu ranks and loopback)."""

from ficco_select import Scenario


def correctness_set(P: int, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[Scenario]:
    """Odd shapes (pieces of unequal size), both dtypes, uneven and extreme MoE routing."""
    out = []
    for dtype in dtypes:
        common = dict(group="test", dtype=dtype, world_size=P, hardware="cpu")
        out += [
            Scenario(op="ag_gemm", m=13 * P, n=3 * P, k=17, **common),
            Scenario(op="gemm_rs", m=11 * P, n=9, k=5 * P, **common),
            Scenario(op="a2a_gemm", m=23, n=7, k=19, imbalance=1.7, **common),
            Scenario(op="gemm_ar", m=9 * P, n=11, k=7 * P, **common),
            Scenario(op="gemm_a2a", m=21, n=13, k=9, imbalance=1.6, **common),
        ]
    # every token to one expert: most chunks are empty
    out += [Scenario(op=op, m=10, n=5, k=6, imbalance=float(P), group="test", dtype="float32", world_size=P,
                     hardware="cpu") for op in ("a2a_gemm", "gemm_a2a")]
    return out
