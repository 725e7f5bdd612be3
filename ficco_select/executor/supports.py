"""Which calls of the tensor-parallel ops the executor's schedules run; the others run
PyTorch's own implementation. The eager ops (``runtime/ops.py``), the compile pass
(``runtime/compile.py``) and the layers' fast path (``runtime/tp.py``) all ask here.

Each function returns why PyTorch's implementation runs the call (what of it the
executor does not run), or None where the executor can. A size given as None is not known
yet (symbolic at compile time): it is not held against the call.
"""

from __future__ import annotations

REDUCE_OPS = ("sum", "avg")
"""The reductions the executor's reduce-scatter and all-reduce schedules run."""


def all_gather_matmul_unsupported(gather_dim: int, ndim: int, n_weights: int) -> str | None:
    """An all-gather along `gather_dim` of an `ndim`-dim shard, then `n_weights` matmuls."""
    if gather_dim % ndim == ndim - 1 or n_weights == 0:
        return "a gather of the contraction dim" if n_weights else "no weight"
    return None


def matmul_reduce_scatter_unsupported(reduce_op: str, extent: int | None, P: int) -> str | None:
    """A matmul whose result is reduced with `reduce_op` and scattered over P ranks along a dim
    of `extent`."""
    if reduce_op not in REDUCE_OPS or extent is not None and extent % P:
        return f"reduce op {reduce_op!r} / scatter extent {extent} over {P} ranks"
    return None


def matmul_all_reduce_unsupported(reduce_op: str, rows: int | None, P: int) -> str | None:
    """A matmul of `rows` rows all-reduced with `reduce_op` over P ranks (the executor's
    all-reduce schedules split the rows into P blocks)."""
    if reduce_op not in REDUCE_OPS or rows is not None and (rows % P or rows == 0):
        return f"reduce op {reduce_op!r} / {rows} rows over {P} ranks"
    return None
