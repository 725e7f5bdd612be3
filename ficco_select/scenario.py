"""Scenarios: one (collective + GEMM) operator instance on one machine.

A scenario is what the executor measures, the simulator predicts and the selector
decides for. Its columns are the scenario-table contract of DESIGN.md:

    group, op, m, n, k, dtype, world_size, hardware  (+ imbalance for a2a_gemm, gemm_a2a)

Shapes are global (before sharding); P = world_size:
- ``ag_gemm``:  rank r holds A_r (m/P, k) and W_r (k, n/P); out = AG(A) @ W_r, (m, n/P).
- ``gemm_rs``:  rank r holds A_r (m, k/P) and W_r (k/P, n); out = row block r of
  sum_q A_q @ W_q, (m/P, n).
- ``a2a_gemm``: MoE expert parallelism with one expert per rank. m is the mean number of
  tokens each expert receives; ``imbalance`` = max expert load / mean expert load (1 =
  balanced, P = every token to one expert). Rank r sends ``token_counts()[r][q]`` tokens
  (rows of k features) to rank q, whose expert W_q is (k, n); out = rows received by r,
  in source-rank order, @ W_r.
- ``gemm_ar``:  rank r holds A_r (m, k/P) and W_r (k/P, n); out = sum_q A_q @ W_q, (m, n),
  on every rank (the row-parallel linear without sequence parallelism).
- ``gemm_a2a``: the MoE combine, the mirror of ``a2a_gemm``: expert r holds the tokens it
  received, X_recv (sum_q counts[q][r], k) grouped by source rank, and W_r (k, n); it
  computes X_recv @ W_r and returns each source's rows to it. out on rank r: the rows of
  the tokens r routed, (sum_q counts[r][q], n), grouped by expert in expert order.
  ``imbalance`` and ``token_counts()`` as for ``a2a_gemm``.

This module is on the runtime path: plain Python only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Literal

Op = Literal["ag_gemm", "gemm_rs", "a2a_gemm", "gemm_ar", "gemm_a2a"]
OPS: tuple[str, ...] = ("ag_gemm", "gemm_rs", "a2a_gemm", "gemm_ar", "gemm_a2a")
A2A_OPS: tuple[str, ...] = ("a2a_gemm", "gemm_a2a")
"""The MoE all-to-all operators: uneven token counts (``imbalance``), m tokens per expert."""
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
"""Supported dtypes (torch's names) and their size in bytes. ``float8_e4m3fn`` is the fp8 of
fp8 training and serving recipes: its operands are what the all-gather and the all-to-all
move; its GEMMs accumulate and write in a wider type, which the cost model ignores (the
catalog gives fp8 to ``ag_gemm`` and ``a2a_gemm`` only, whose collectives move fp8)."""
DTYPE_ALIASES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                 "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}

SCENARIO_COLUMNS: tuple[str, ...] = (
    "group", "op", "m", "n", "k", "dtype", "world_size", "hardware", "imbalance",
)
"""Columns of a scenario table; ``imbalance`` may be omitted (defaults to 1.0)."""
REQUIRED_COLUMNS = SCENARIO_COLUMNS[:-1]
LAYER_COLUMNS: tuple[str, ...] = ("op", "n", "k", "dtype", "world_size", "hardware", "imbalance")
"""What identifies a layer (``Scenario.layer``): every column but ``m`` and the ``group`` label."""


MAX_EXTENT = 2**31 - 1
"""The largest m, n or k: BLAS libraries (cuBLAS, hipBLASLt, MKL's LP64) take a GEMM's
dims as 32-bit ints."""
MAX_WORLD_SIZE = 2**16
"""The largest world size: beyond any process group a GEMM's collective spans."""


class ScenarioError(ValueError):
    """A scenario (or a row of a scenario table) is invalid; says where and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    group: str
    """Label for grouped evaluation, usually the model family (e.g. ``llama3-8b``)."""
    op: str
    """Operator: one of ``OPS``."""
    m: int
    """Rows of the activation (tokens); for ``a2a_gemm`` and ``gemm_a2a`` mean tokens per expert."""
    n: int
    """Output features (columns of the weight)."""
    k: int
    """Reduction dimension (input features)."""
    dtype: str
    """Element type: one of ``DTYPES`` (``float32``, ``bfloat16``, ``float16``, ``float8_e4m3fn``)."""
    world_size: int
    """Number of ranks P."""
    hardware: str
    """Hardware preset name (``cpu`` for the cpu backend) or spec file."""
    imbalance: float = 1.0
    """``a2a_gemm`` and ``gemm_a2a`` only: max expert load / mean expert load, in [1, world_size]."""
    layer: tuple = dataclasses.field(init=False, repr=False, compare=False)
    """The values of LAYER_COLUMNS: in serving and with variable sequence lengths only m
    changes between calls of a layer (``ficco_select.runtime.layers``)."""

    def __post_init__(self) -> None:
        self.validate()
        self._set_hash()

    # The hash, computed once: the runtime selector looks scenarios up by value on a miss.
    def __hash__(self) -> int:
        return self._hash

    def _set_hash(self) -> None:
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, c) for c in SCENARIO_COLUMNS)))
        # The layer key, built once: the runtime looks every new m of a layer up by it.
        object.__setattr__(self, "layer", tuple(getattr(self, c) for c in LAYER_COLUMNS))

    def __getstate__(self) -> dict[str, Any]:
        # str hashes differ between processes: a pickled scenario takes its hash along only
        # to have it recomputed where it is loaded (a stale one would miss equal scenarios).
        state = dict(self.__dict__)
        state.pop("_hash", None)
        state.pop("layer", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._set_hash()

    # -- validation -------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field; raise ScenarioError naming the field (column) at fault."""
        if not isinstance(self.group, str) or not self.group:
            raise ScenarioError("column 'group': must be a non-empty string")
        if self.op not in OPS:
            raise ScenarioError(f"column 'op': unknown op {self.op!r}; expected one of {', '.join(OPS)}")
        for dim in ("m", "n", "k", "world_size"):
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ScenarioError(f"column '{dim}': must be a positive integer, got {value!r}")
            limit = MAX_WORLD_SIZE if dim == "world_size" else MAX_EXTENT
            if value > limit:
                raise ScenarioError(f"column '{dim}': {value:.3g} exceeds {limit}, the largest {dim} taken")
        if self.world_size < 2:
            raise ScenarioError(f"column 'world_size': must be at least 2, got {self.world_size}")
        if self.dtype not in DTYPES:
            raise ScenarioError(
                f"column 'dtype': unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}"
            )
        if not isinstance(self.hardware, str) or not self.hardware:
            raise ScenarioError("column 'hardware': must be a non-empty string")
        imb = self.imbalance
        if isinstance(imb, bool) or not isinstance(imb, (int, float)) or not (imb == imb):
            raise ScenarioError(f"column 'imbalance': must be a number, got {imb!r}")
        if self.op in A2A_OPS:
            if not 1.0 <= imb <= self.world_size:
                raise ScenarioError(
                    f"column 'imbalance': must lie in [1, world_size={self.world_size}] for {self.op}, got {imb}"
                )
        elif imb != 1.0:
            raise ScenarioError(f"column 'imbalance': only a2a_gemm and gemm_a2a take an imbalance, got {imb} "
                                f"for {self.op}")
        # Sharding divisibility: every rank must hold an equal shard of the sharded dim.
        P = self.world_size
        if self.op == "ag_gemm":
            _divisible("m", self.m, P)
            _divisible("n", self.n, P)
        elif self.op in ("gemm_rs", "gemm_ar"):
            # gemm_ar: row blocks of m/P for its reduce-scatter + all-gather form (a job's
            # other m runs plain mm + all_reduce: ficco_select.runtime.torch_ops).
            _divisible("m", self.m, P)
            _divisible("k", self.k, P)

    # -- identity ---------------------------------------------------------------------
    def as_record(self) -> dict[str, Any]:
        return {col: getattr(self, col) for col in SCENARIO_COLUMNS}

    @functools.cached_property  # frozen: computed once per object
    def scenario_id(self) -> str:
        """Deterministic id from the columns: the same scenario has the same id everywhere."""
        rec = self.as_record()
        rec["imbalance"] = round(float(rec["imbalance"]), 6)
        payload = json.dumps(rec, sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(payload.encode()).hexdigest()[:16]

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    @classmethod
    def from_record(cls, record: Mapping[str, Any], *, row: int | None = None) -> "Scenario":
        """Build from a plain mapping (a table row); errors name the row and column."""
        where = f"row {row}, " if row is not None else ""
        missing = [c for c in REQUIRED_COLUMNS if c not in record or _is_missing(record[c])]
        if missing:
            raise ScenarioError(f"{where}column '{missing[0]}': missing value")
        try:
            kwargs: dict[str, Any] = {}
            for col in ("group", "op", "hardware"):
                kwargs[col] = str(record[col]).strip()
            kwargs["dtype"] = DTYPE_ALIASES.get(str(record["dtype"]).strip(), str(record["dtype"]).strip())
            for col in ("m", "n", "k", "world_size"):
                kwargs[col] = _as_int(record[col], col)
            imb = record.get("imbalance", 1.0)
            kwargs["imbalance"] = 1.0 if _is_missing(imb) else _as_float(imb, "imbalance")
            return cls(**kwargs)
        except ScenarioError as e:
            raise ScenarioError(f"{where}{e}") from None

    # -- a2a routing --------------------------------------------------------------------
    def token_counts(self) -> list[list[int]]:
        """counts[src][dst]: tokens rank src sends to expert dst (a2a_gemm; for gemm_a2a the
        tokens expert dst returns to rank src).

        Expert 0 is the hot expert with load imbalance * m; the others share the rest
        evenly. Each expert's load is split over the source ranks as evenly as integers
        allow. Deterministic: a function of (m, world_size, imbalance) only.
        """
        P, m = self.world_size, self.m
        hot = round(self.imbalance * m)
        rest = P * m - hot
        loads = [hot] + _even_split(rest, P - 1)
        counts = [[0] * P for _ in range(P)]
        for dst, load in enumerate(loads):
            for src, c in enumerate(_even_split(load, P, rotate=dst)):
                counts[src][dst] = c
        return counts


    # -- per-rank work --------------------------------------------------------------------
    def rank_gemms(self) -> list[tuple[int, int, int]]:
        """(M, N, K) of every rank's whole GEMM, as the executor runs it (integers).

        ``ag_gemm`` (m, n/P, k) and ``gemm_rs``, ``gemm_ar`` (m, n, k/P) on every rank;
        ``a2a_gemm``, ``gemm_a2a`` (tokens expert r receives, n, k) on rank r, from
        ``token_counts()``. The cost model's
        smooth version (the busiest rank only, no rounding) is ``ficco_select.costs.rank_work``.
        """
        P = self.world_size
        if self.op == "ag_gemm":
            return [(self.m, self.n // P, self.k)] * P
        if self.op in ("gemm_rs", "gemm_ar"):
            return [(self.m, self.n, self.k // P)] * P
        counts = self.token_counts()
        return [(sum(row[r] for row in counts), self.n, self.k) for r in range(P)]

    def busiest_rank_gflop(self) -> float:
        """GFLOP of the largest per-rank GEMM (the hot expert's rank for the MoE ops)."""
        return max(2 * M * N * K for M, N, K in self.rank_gemms()) / 1e9


def _even_split(total: int, parts: int, rotate: int = 0) -> list[int]:
    """Split total into `parts` integers differing by at most one (extras rotate)."""
    base, extra = divmod(total, parts)
    return [base + (1 if (i - rotate) % parts < extra else 0) for i in range(parts)]


def _divisible(col: str, value: int, P: int) -> None:
    if value % P:
        raise ScenarioError(
            f"column '{col}': {value} is not divisible by world_size={P}; every rank needs an equal shard"
        )


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v) or (isinstance(v, str) and not v.strip())


def _is_bool(v: Any) -> bool:
    # True is an int to Python (and NumPy's bool_ converts to 1.0): a table cell that says
    # True is a mistake, not the number 1.
    return isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"))


def _as_int(v: Any, col: str) -> int:
    if _is_bool(v):
        raise ScenarioError(f"column '{col}': must be a positive integer, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ScenarioError(f"column '{col}': must be a positive integer, got {v!r}") from None
    if f != int(f) if f == f and abs(f) != float("inf") else True:
        raise ScenarioError(f"column '{col}': must be a positive integer, got {v!r}")
    return int(f)


def _as_float(v: Any, col: str) -> float:
    if _is_bool(v):
        raise ScenarioError(f"column '{col}': must be a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ScenarioError(f"column '{col}': must be a number, got {v!r}") from None
