"""A scenario catalog built from the layer shapes of public model families.

Each model's public config (``MODELS``) is mapped onto the operators the selector decides
for, one transformer layer at a time, for tensor/sequence parallelism over P ranks
(Megatron-style: column-parallel GEMM after an all-gather of the sequence-sharded
activations, row-parallel GEMM before a reduce-scatter back to sequence shards):

    layer      op        m                    k                     n
    qkv        ag_gemm   tokens               hidden                (heads + 2*kv_heads) * head_dim
    attn_out   gemm_rs   tokens               heads * head_dim      hidden
    mlp_up     ag_gemm   tokens               hidden                2*intermediate (gate+up fused;
                                                                    intermediate if not gated)
    mlp_down   gemm_rs   tokens               intermediate          hidden
    moe_expert a2a_gemm  tokens*top_k/P       hidden                2*expert_intermediate
    attn_out_ar gemm_ar  tokens               heads * head_dim      hidden
    mlp_down_ar gemm_ar  tokens               intermediate          hidden
    moe_combine gemm_a2a tokens*top_k/P       expert_intermediate   hidden

The ``_ar`` layers are the same row-parallel projections without sequence parallelism
(what inference engines run, the activations replicated): GEMM, then all-reduce.
``moe_combine`` is the expert's down projection, then the all-to-all that returns the
tokens to their owners.

``tokens`` is batch x sequence on one tensor-parallel group; ``PHASES`` lists the token
counts per phase (decode, prefill, training). Tokens not divisible by P are padded up to
a multiple of P, as frameworks pad the sequence for sequence parallelism. For MoE layers
(expert parallelism, one expert group per rank) m is the mean number of tokens an
expert-rank receives; the experts of a rank are treated as one GEMM, and the load
imbalance takes the values of ``IMBALANCES``, clipped to [1, P].

Three scales:

- ``scale="full"``: the published numbers, for a GPU preset (default hardware
  ``h100-nvswitch``, world sizes 2, 4, 8). A (layer, P) pair whose sharded dim is not
  divisible by P is skipped.
- ``scale="cpu"``: the same shapes shrunk for the 2-core gloo backend (``SHRINK``). GEMM
  dims are divided by 32 and tokens by 16; dims are rounded to
  multiples of 8, and the sharded dim to a multiple of lcm(8, P), so the shape ratios of
  each model survive up to that rounding. Rows whose busiest rank does more than
  0.4 GFLOP are dropped, so a full sweep stays affordable on two
  cores (at the defaults: 32 of 972 rows, nearly all training rows of the largest models
  such as bloom-176b and llama3.1-405b). World sizes 2, 3, 4 (3 tests a
  non-power-of-two ring).
- ``scale="fabric"``: shrunk likewise for the cpu backend on a shaped fabric
  (``ficco measure --fabric``): dims divided by 4 and tokens by 64, rows above 1 GFLOP
  per rank dropped, so that a slower network still meets GEMMs it can hide behind.

Dtypes (``dtype_shares``): what jobs run on each machine. On a GPU every layer shape comes
in bfloat16 (what LLM training and serving run), and a deterministic share of them again
in float16, in fp8 (``float8_e4m3fn``, where the machine's spec has an fp8 peak; for
``ag_gemm`` and ``a2a_gemm`` only, whose collectives move the fp8 operands; recipes
reduce-scatter, all-reduce and combine the GEMM's wider output) and in float32 (TF32 on tensor cores), a minority. On the
cpu backend float32. A ``dtype`` argument gives every row that one dtype instead.

Records carry the scenario columns (``group`` is the model family, for
leave-one-family-out evaluation) plus ``model``, ``layer``, ``phase`` and ``tokens``,
which ``Scenario.from_record`` ignores.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pandas as pd

from ficco_select.hardware import HardwareSpec, load_hardware
from ficco_select.scenario import A2A_OPS, SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import BACKENDS, candidates


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    """Model name, e.g. ``llama3-8b``."""
    family: str
    """Family label (the ``group`` column) for leave-one-family-out evaluation, e.g. ``llama3``."""
    hidden: int
    """Model (residual stream) width."""
    intermediate: int
    """Dense MLP inner width; 0 if the model has no dense MLP layer."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (== heads without grouped-query attention)."""
    head_dim: int
    """Width of one attention head."""
    layers: int = 0
    """Transformer layers the model stacks (the config's ``num_hidden_layers``; GPT-3's paper table)."""
    experts: int = 0
    """Routed experts per MoE layer; 0 for dense models."""
    top_k: int = 0
    """Experts each token is routed to; 0 for dense models."""
    expert_intermediate: int = 0
    """Inner width of one routed expert's MLP; 0 for dense models."""
    gated_mlp: bool = True
    """MLPs are gated (SwiGLU/GeGLU: gate and up projections fused, 2x the columns);
    False for the plain GELU MLPs of GPT-3 and BLOOM."""
    source: str
    """The public config the numbers come from (Hugging Face config.json or paper table)."""
    note: str = ""
    """How the numbers map onto the layers here, or whether they were cross-checked."""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


MODELS_CSV = Path(__file__).with_name("models.csv")
"""The model table: one row per model, ``ModelConfig``'s fields as columns. The numbers are
the published ones; ``source`` says where they come from and ``note`` how they map here
or whether they were cross-checked."""


def read_models(path: Path = MODELS_CSV) -> list[ModelConfig]:
    """The models of a table in ``models.csv``'s format; a bad cell is refused naming its
    row (1-based, header excluded) and column."""
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    models = []
    with open(path, newline="") as f:
        for row, record in enumerate(csv.DictReader(f), start=1):
            values = {}
            for column, text in record.items():
                try:
                    if types[column] == "int":
                        values[column] = int(text)
                    elif types[column] == "bool":
                        values[column] = {"True": True, "False": False}[text]
                    else:
                        values[column] = text
                except (KeyError, ValueError):
                    raise ValueError(f"{path}: row {row}, column {column!r}: cannot read {text!r} "
                                     f"as {types.get(column, 'a known column')}") from None
            models.append(ModelConfig(**values))
    return models


_MODEL_LIST = read_models()
MODELS: dict[str, ModelConfig] = {m.name: m for m in _MODEL_LIST}

# Tokens (batch x sequence) on one tensor-parallel group, per phase, at full scale. One or
# two sizes per phase, spaced ~4x apart so that m spans 8..1024 at cpu scale (/16); more
# sizes would push the cpu catalog past ~600 rows, more than a CPU sweep should take.
PHASES: dict[str, tuple[int, ...]] = {
    # Decode: one new token per sequence, so tokens = concurrent sequences (batch 128).
    "decode": (128,),
    # Prefill: a short and a long prompt (or a few prompts) processed whole.
    "prefill": (1024, 4096),
    # Training: micro-batch x sequence length of one step (e.g. 4 x 4096).
    "training": (16384,),
}

IMBALANCES: tuple[float, ...] = (1.0, 1.5, 2.0)
"""Load imbalance (max / mean expert load) of MoE rows: balanced, mildly and badly skewed.
Clipped to [1, P] and deduplicated."""

LAYERS: tuple[str, ...] = ("qkv", "attn_out", "mlp_up", "mlp_down", "moe_expert", "attn_out_ar", "mlp_down_ar",
                           "moe_combine")



@dataclasses.dataclass(frozen=True)
class Shrink:
    """How a scale for the cpu backend shrinks the published shapes."""
    dims: int
    """GEMM dims (hidden, intermediate, head-derived) are divided by this."""
    tokens: int
    """Token counts are divided by this."""
    max_gflop_per_rank: float
    """Rows whose busiest rank's GEMM exceeds this many GFLOP are dropped."""


CPU_MAX_GFLOP_PER_RANK = 0.4
SHRINK: dict[str, Shrink] = {
    "cpu": Shrink(dims=32, tokens=16, max_gflop_per_rank=CPU_MAX_GFLOP_PER_RANK),
    # A shaped fabric moves bytes 4-16x slower than this host's loopback. Its GEMM must
    # grow to match, and a GEMM's work per byte moved grows with its unsharded dim (n for
    # an all-gather, k for a reduce-scatter), not with m: dims shrink less, tokens more.
    # On cpu-500mbit .. cpu-2gbit specs the simulator puts compute and communication within
    # 10x of each other in 70-82% of these rows (against 19-36% for the cpu scale's).
    "fabric": Shrink(dims=4, tokens=64, max_gflop_per_rank=1.0),
}
"""The scales shrunk for the cpu backend: ``cpu`` (this host's loopback) and ``fabric``."""
DIM_MULTIPLE = 8

GPU_DTYPE_SHARES: dict[str, float] = {"bfloat16": 1.0, "float16": 0.2, "float8_e4m3fn": 0.25, "float32": 0.1}
"""Share of a GPU catalog's layer shapes given each dtype: every one in bfloat16, a
deterministic share (by scenario id) in the others. fp8 only where the machine has an fp8
peak, and only for ``FP8_OPS``."""
FP8_OPS = ("ag_gemm", "a2a_gemm")
"""Operators whose collective moves fp8 operands in fp8 recipes (a reduce-scatter moves the
GEMM's wider output)."""


def dtype_shares(hw: HardwareSpec) -> dict[str, float]:
    """{dtype: share of the layer shapes} that jobs run on `hw`: float32 on the cpu backend's
    machines (no copy engines), ``GPU_DTYPE_SHARES`` on GPUs (fp8 where the spec has a peak)."""
    if hw.kind == "cpu":
        return {"float32": 1.0}
    return {d: share for d, share in GPU_DTYPE_SHARES.items() if d in hw.peak_tflops}


def _drawn(scenario: Scenario, share: float) -> bool:
    """Whether `scenario` is in the `share` of its dtype's rows: a hash of its id, so the same
    scenario is drawn in every file, order and process."""
    return share >= 1 or zlib.crc32(scenario.scenario_id.encode()) < share * 2**32

DEFAULT_WORLD_SIZES = {"full": (2, 4, 8), "cpu": (2, 3, 4), "fabric": (2, 3, 4)}
DEFAULT_HARDWARE = {"full": "h100-nvswitch", "cpu": "cpu", "fabric": "cpu"}
EXTRA_COLUMNS: tuple[str, ...] = ("model", "layer", "phase", "tokens")
COLUMNS: tuple[str, ...] = SCENARIO_COLUMNS + EXTRA_COLUMNS


def layer_shapes(cfg: ModelConfig) -> list[tuple[str, str, int, int]]:
    """(layer, op, k, n) of one transformer layer at full scale; m depends on tokens and P."""
    attn_width = cfg.heads * cfg.head_dim
    mlp_factor = 2 if cfg.gated_mlp else 1
    shapes = [
        ("qkv", "ag_gemm", cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim),
        ("attn_out", "gemm_rs", attn_width, cfg.hidden),
    ]
    if cfg.intermediate:
        shapes += [
            ("mlp_up", "ag_gemm", cfg.hidden, mlp_factor * cfg.intermediate),
            ("mlp_down", "gemm_rs", cfg.intermediate, cfg.hidden),
        ]
    if cfg.is_moe:
        shapes.append(("moe_expert", "a2a_gemm", cfg.hidden, mlp_factor * cfg.expert_intermediate))
    # The row-parallel projections again, without sequence parallelism; the MoE combine.
    shapes.append(("attn_out_ar", "gemm_ar", attn_width, cfg.hidden))
    if cfg.intermediate:
        shapes.append(("mlp_down_ar", "gemm_ar", cfg.intermediate, cfg.hidden))
    if cfg.is_moe:
        shapes.append(("moe_combine", "gemm_a2a", cfg.expert_intermediate, cfg.hidden))
    return shapes


def _round_to(x: float, step: int) -> int:
    """Nearest positive multiple of step."""
    return max(step, step * round(x / step))


def _pad_to(x: int, step: int) -> int:
    return -(-x // step) * step


def _sharded_dim(op: str) -> str | None:
    return {"ag_gemm": "n", "gemm_rs": "k", "gemm_ar": "k"}.get(op)


def _scale_dims(op: str, k: int, n: int, P: int, factor: int) -> tuple[int, int]:
    """A shrunk scale: (k, n) divided by `factor`, keeping the sharded dim divisible by P."""
    sharded_step = DIM_MULTIPLE * P // math.gcd(DIM_MULTIPLE, P)
    k_step = sharded_step if _sharded_dim(op) == "k" else DIM_MULTIPLE
    n_step = sharded_step if _sharded_dim(op) == "n" else DIM_MULTIPLE
    return _round_to(k / factor, k_step), _round_to(n / factor, n_step)


def catalog(
    scale: str = "cpu",
    world_sizes: tuple[int, ...] | None = None,
    dtype: str | None = None,
    hardware: str | HardwareSpec | None = None,
    models: list[str] | None = None,
    sample: float | None = None,
) -> list[dict[str, Any]]:
    """Scenario records (dicts, columns ``COLUMNS``) for the chosen models, in a fixed order.

    `dtype`: every row in that dtype; None: the machine's mix (``dtype_shares``).
    `sample`: keep only this share of the rows, drawn by scenario id (``_drawn``: a larger
    share keeps every row a smaller one kept, so a sweep of it can grow by resuming).
    Order: model, phase, tokens, world size, layer, imbalance, dtype. Duplicate scenarios
    (e.g. two decode sizes that pad to the same token count at cpu scale) keep the first row.
    """
    if scale not in DEFAULT_WORLD_SIZES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {', '.join(DEFAULT_WORLD_SIZES)}")
    shrink = SHRINK.get(scale)
    world_sizes = tuple(world_sizes or DEFAULT_WORLD_SIZES[scale])
    spec = hardware if isinstance(hardware, HardwareSpec) else None
    hardware = spec.name if spec is not None else hardware or DEFAULT_HARDWARE[scale]
    names = list(models) if models is not None else list(MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    if sample is not None and not 0 < sample <= 1:
        raise ValueError(f"--sample {sample}: a share of the rows, in (0, 1]")
    if shrink and dtype is not None and dtype not in BACKENDS["cpu"].dtypes:
        raise ValueError(f"the cpu backend does not run {dtype}; use one of {', '.join(BACKENDS['cpu'].dtypes)}")
    shares = {dtype: 1.0} if dtype is not None else dtype_shares(spec or load_hardware(hardware))

    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for name in names:
        cfg = MODELS[name]
        for phase, token_counts in PHASES.items():
            for full_tokens in token_counts:
                base_tokens = full_tokens
                if shrink:
                    base_tokens = max(1, round(full_tokens / shrink.tokens))
                for P in world_sizes:
                    tokens = _pad_to(base_tokens, P)
                    for layer, op, k, n in layer_shapes(cfg):
                        if shrink:
                            k, n = _scale_dims(op, k, n, P, shrink.dims)
                        sharded = _sharded_dim(op)
                        if sharded and {"k": k, "n": n}[sharded] % P:
                            continue  # full scale: this layer cannot be split evenly over P
                        if op in A2A_OPS:
                            # tokens is a multiple of P, so this is exact; at least 1 row.
                            m = max(1, tokens * cfg.top_k // P)
                            imbalances = sorted({min(max(i, 1.0), float(P)) for i in IMBALANCES})
                        else:
                            m, imbalances = tokens, [1.0]
                        for imbalance, (row_dtype, share) in itertools.product(imbalances, shares.items()):
                            if row_dtype.startswith("float8") and op not in FP8_OPS and dtype is None:
                                continue
                            record = {
                                "group": cfg.family, "op": op, "m": m, "n": n, "k": k,
                                "dtype": row_dtype, "world_size": P, "hardware": hardware,
                                "imbalance": imbalance,
                                "model": cfg.name, "layer": layer, "phase": phase, "tokens": tokens,
                            }
                            scenario = Scenario.from_record(record)
                            if not _drawn(scenario, share) or (sample is not None and not _drawn(scenario, sample)):
                                continue
                            if shrink:
                                if scenario.busiest_rank_gflop() > shrink.max_gflop_per_rank:
                                    continue  # too slow to sweep on two cores
                                if len(candidates(scenario, "cpu")) < 2:
                                    continue  # nothing to choose between
                            if scenario.scenario_id in seen:
                                continue
                            seen.add(scenario.scenario_id)
                            records.append(record)
    return records


def write_catalog(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Write records as CSV, or Parquet if `path` ends in .parquet, atomically.

    The table is written to a temporary file in the same directory and renamed over
    `path`, so a reader never sees a half-written catalog.
    """
    path = Path(path)
    if path.suffix not in (".csv", ".parquet"):
        raise ValueError(f"{path}: catalogs are .csv or .parquet files")
    columns = list(COLUMNS) + [c for r in records[:1] for c in r if c not in COLUMNS]
    table = pd.DataFrame(records, columns=columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if path.suffix == ".parquet":
            table.to_parquet(tmp, index=False)
        else:
            table.to_csv(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def catalog_to_file(scale: str, out, *, world_sizes: tuple[int, ...] | None, models: list[str] | None,
                    dtype: str | None, hardware: str | None, sample: float | None = None) -> dict[str, Any]:
    """``ficco catalog``: write the catalog's scenario table to `out`; its summary (counts by
    op, families, models). Raises ValueError, ScenarioError."""
    records = catalog(scale, world_sizes=world_sizes, dtype=dtype, hardware=hardware, models=models, sample=sample)
    write_catalog(out, records)
    counts: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    for r in records:
        counts[r["op"]] = counts.get(r["op"], 0) + 1
        dtypes[r["dtype"]] = dtypes.get(r["dtype"], 0) + 1
    return {"out": out, "scenarios": len(records), "by_op": counts, "by_dtype": dtypes,
            "families": sorted({r["group"] for r in records}),
            "models": sorted({r["model"] for r in records} & set(MODELS))}
