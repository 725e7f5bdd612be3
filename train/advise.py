"""What to set in the frameworks that already overlap tensor-parallel collectives with their
GEMMs (``ficco advise``): ficco's decisions for a model's layers, on a machine, written in
the forms Megatron/TransformerEngine, vLLM and torchtitan take.

Every decision comes from the exported selector's own ``select()`` (its fallbacks and the
GPU do-no-harm rule included), one scenario per GEMM of a transformer layer under tensor
and sequence parallelism (``layer_gemms``: the layer shapes of ``data.catalog``). A
framework expresses fewer schedules than ficco decides between, so each decision is mapped
to the nearest one the framework runs (``te_entry``), and the advice says where that is not
the decision itself.

Sources (each format's keys and flags are read from these files):
- TransformerEngine ``initialize_ub``: ``TE_SOURCE``; Megatron's ``--tp-comm-overlap-cfg``
  is that function's ``ub_cfgs``, read with ``yaml.safe_load`` (``MEGATRON_SOURCE``).
- vLLM's sequence-parallel and async-TP passes: ``VLLM_SOURCE`` (their last release).
- torchtitan's async TP switch: ``TORCHTITAN_SOURCE``.
- where a decision puts the collective in the NVSwitch (``*.switch``): ``advise_switch``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from ficco_select.hardware import HardwareSpec
from ficco_select.runtime.decision import Decision
from ficco_select.scenario import Scenario
from ficco_select.schedule import Schedule, candidates, parse

TE_SOURCE = {"repo": "NVIDIA/TransformerEngine", "path": "transformer_engine/pytorch/module/base.py",
             "commit": "d0067d0da6cb01811b8072a7d304f0e00344ce2b", "function": "initialize_ub"}
MEGATRON_SOURCE = {"repo": "NVIDIA/Megatron-LM", "path": "megatron/training/initialize.py",
                   "commit": "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "function": "_initialize_tp_communicators"}
VLLM_SOURCE = {"package": "vllm==0.31.0", "path": "vllm/config/compilation.py (PassConfig), "
               "vllm/compilation/passes/fusion/sequence_parallelism.py"}
TORCHTITAN_SOURCE = {"repo": "pytorch/torchtitan", "path": "torchtitan/config/configs.py",
                     "commit": "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"}

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
"""``--dtype``: what the layers compute in. fp8 recipes gather fp8 operands but reduce the
GEMM's wider output: the all-gather GEMMs run in fp8, the reduce-scatter ones in bf16 (as
``data.catalog`` draws them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """The shapes of one transformer layer, and how many layers the model stacks."""

    name: str
    hidden: int
    ffn: int
    """Dense MLP inner width."""
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    gated: bool = True
    """Gated MLP (gate and up projections fused: 2x the columns of fc1)."""

    @classmethod
    def from_catalog(cls, name: str) -> "Model":
        """A model of ``data/models.csv`` (ValueError naming the known ones)."""
        from ficco_select.data.catalog import MODELS

        cfg = MODELS.get(name)
        if cfg is None:
            raise ValueError(f"--model {name!r}: not a catalog model; known: {', '.join(MODELS)} "
                             "(or give --hidden, --ffn, --heads and --layers)")
        if cfg.intermediate == 0 or cfg.layers == 0:
            raise ValueError(f"--model {name}: no dense MLP or no layer count in data/models.csv; "
                             "give --hidden, --ffn, --heads and --layers")
        return cls(name=name, hidden=cfg.hidden, ffn=cfg.intermediate, heads=cfg.heads, kv_heads=cfg.kv_heads,
                   head_dim=cfg.head_dim, layers=cfg.layers, gated=cfg.gated_mlp)

    @classmethod
    def custom(cls, *, hidden: int, ffn: int, heads: int, layers: int, kv_heads: int | None = None,
               gated: bool = True) -> "Model":
        if min(hidden, ffn, heads, layers) < 1 or hidden % heads:
            raise ValueError(f"--hidden {hidden} --ffn {ffn} --heads {heads} --layers {layers}: positive, "
                             "with hidden divisible by heads")
        kv = kv_heads or heads
        if heads % kv:
            raise ValueError(f"--kv-heads {kv}: must divide --heads {heads}")
        return cls(name=f"h{hidden}-ffn{ffn}", hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv,
                   head_dim=hidden // heads, layers=layers, gated=gated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How the job runs the model: tensor parallelism, tokens per step, dtype."""

    tp: int
    seq: int
    micro_batch: int = 1
    dtype: str = "bf16"
    sequence_parallel: bool = True
    context_parallel: int = 1

    @property
    def tokens(self) -> int:
        """Rows of each GEMM on one tensor-parallel group: what TE's userbuffers hold."""
        return self.seq * self.micro_batch // self.context_parallel


def check(model: Model, layout: Layout) -> None:
    """ValueError naming the option, before any decision, for a layout the model cannot take."""
    if layout.dtype not in DTYPES:
        raise ValueError(f"--dtype {layout.dtype}: one of {', '.join(DTYPES)}")
    if layout.tp < 2:
        raise ValueError(f"--tp {layout.tp}: tensor parallelism of at least 2 ranks has a collective to overlap")
    for what, value in (("heads", model.heads), ("kv heads", model.kv_heads), ("ffn", model.ffn)):
        if value % layout.tp:
            raise ValueError(f"--tp {layout.tp} does not divide the model's {what} ({value}): each rank holds a "
                             "whole share of them")
    if min(layout.seq, layout.micro_batch, layout.context_parallel) < 1 or layout.tokens % layout.tp:
        raise ValueError(f"--seq {layout.seq} x --micro-batch {layout.micro_batch} / --context-parallel "
                         f"{layout.context_parallel}: positive, and a multiple of --tp {layout.tp} (the sequence "
                         "is sharded over the tensor-parallel ranks)")


def check_machine(layout: Layout, spec: HardwareSpec) -> None:
    """ValueError naming the option and the machine where `spec` cannot run the layout: fp8
    layers on a machine without fp8 (no ``float8_e4m3fn`` peak: an A100, say)."""
    if layout.dtype == "fp8" and DTYPES["fp8"] not in spec.peak_tflops:
        raise ValueError(f"--dtype fp8: {spec.name} has no fp8 (its spec gives no {DTYPES['fp8']} peak); "
                         "advise bf16 or fp16 there")


# -- the GEMMs of a layer --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a transformer layer with its collective, under TE's name for it."""

    name: str
    op: str
    k: int
    n: int


def layer_gemms(model: Model) -> list[Gemm]:
    """The GEMMs ficco decides for one layer (TE's names; m is the layout's tokens): the
    column-parallel forward GEMMs after an all-gather (qkv, fc1), the row-parallel ones before
    a reduce-scatter (proj, fc2), and the backward GEMMs of the row-parallel ones, which
    all-gather the output gradient (proj_dgrad, fc2_dgrad). The other backward GEMMs overlap a
    whole independent collective (TE's ``bulk``), which is not a split ficco decides."""
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim
    attn = model.heads * model.head_dim
    fc1 = (2 if model.gated else 1) * model.ffn
    return [Gemm("qkv_fprop", "ag_gemm", model.hidden, qkv),  # the catalog's layers (data.catalog)
            Gemm("proj_fprop", "gemm_rs", attn, model.hidden),
            Gemm("fc1_fprop", "ag_gemm", model.hidden, fc1),
            Gemm("fc2_fprop", "gemm_rs", model.ffn, model.hidden),
            Gemm("proj_dgrad", "ag_gemm", model.hidden, attn),  # dY gathered, times proj's weight
            Gemm("fc2_dgrad", "ag_gemm", model.hidden, model.ffn)]


def scenario_of(gemm: Gemm, model: Model, layout: Layout, hardware: str, m: int | None = None) -> Scenario:
    dtype = DTYPES[layout.dtype] if layout.dtype != "fp8" or gemm.op == "ag_gemm" else "bfloat16"
    return Scenario(group=model.name, op=gemm.op, m=m or layout.tokens, n=gemm.n, k=gemm.k, dtype=dtype,
                    world_size=layout.tp, hardware=hardware)


def decide(select: Callable[[Scenario], Decision], model: Model, layout: Layout, hardware: str
           ) -> dict[str, Decision]:
    """Each GEMM's decision (``layer_gemms``) by `select` (an exported ``Selector.select``)."""
    check(model, layout)
    return {g.name: select(scenario_of(g, model, layout, hardware)) for g in layer_gemms(model)}


def provenance(decisions: dict[str, Decision]) -> dict:
    """Where the decisions came from: how many by each source, and the GPU rule's vetoes."""
    sources: dict[str, int] = {}
    for d in decisions.values():
        sources[d.source] = sources.get(d.source, 0) + 1
    return {"by_source": sources, "gpu_rule": sum(d.abstained == "no_harm" for d in decisions.values()),
            "per_gemm": {name: {"schedule": d.schedule.name, "source": d.source, "reason": d.reason}
                         for name, d in decisions.items()}}


# -- TransformerEngine / Megatron ---------------------------------------------------------------
TE_LAYERS = ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
             "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad")
"""``initialize_ub``'s layer names (``TE_SOURCE``, lines 336-365)."""
TE_ALL_GATHER = ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")
TE_REDUCE_SCATTER = ("proj_fprop", "fc2_fprop")
TE_BULK = {"qkv_dgrad": {"method": "bulk", "num_sm": 16, "cga_size": 2, "set_sm_margin": True},
           "qkv_wgrad": {"method": "bulk", "num_sm": 16, "cga_size": 2, "set_sm_margin": True},
           "fc1_dgrad": {"method": "bulk", "num_sm": 16, "cga_size": 2, "set_sm_margin": True},
           "fc1_wgrad": {"method": "bulk", "num_sm": 16, "cga_size": 2, "set_sm_margin": True}}
"""The bulk GEMMs, with ``initialize_ub``'s own defaults (``get_default_config``): ficco does not
decide them, and writing them out makes the file say what TE will run."""
PIPELINE_NUM_SM = 16
"""SMs of a ``pipeline`` reduce-scatter: TE's default (ficco decides the split, not the SM count)."""

TE_MAPPING = (
    ("none.*", "no overlap: the layer's GEMM, then its collective (Megatron's switches below)"),
    ("shard.ring.sm", "ring_exchange, use_ce false (the ring's sends by SM kernels)"),
    ("shard.ring.dma", "ring_exchange, use_ce true (copy engines; TE's default)"),
    ("ficco.d<d>.ring.*.<engine>", "ring_exchange as for shard.ring.<engine>: TE's ring moves whole shards "
                                   "(at two ranks a reduce-scatter's: pipeline, as below)"),
    ("ficco.d<d>.a2a.*.<engine> (all-gather)", "ring_exchange as for shard.ring.<engine>: TE pipelines only "
                                              "reduce-scatters"),
    ("ficco.d<d>.a2a.*.* (reduce-scatter)", "pipeline, num_splits d (d chunks along m, one GEMM each, each "
                                            f"reduce-scattered by {PIPELINE_NUM_SM} SMs while the next is computed)"),
)
"""How a decision becomes a TE method (``te_entry``), for the docs: the schedule patterns on
the left, TE's nearest setting on the right."""


TE_NO_SWITCH_ALL_GATHER = ("TE userbuffers have no in-switch all-gather overlap (ring_exchange sends point to "
                           "point; multicast serves only its pipeline and bulk collectives)")
"""What TE cannot run of a switch all-gather (``advise_switch``: TE's multicast, source lines)."""


def te_entry(op: str, schedule: Schedule, world_size: int) -> tuple[dict | None, str]:
    """TE's ``ub_cfgs`` entry for `schedule` on a GEMM of `op` over `world_size` ranks (None:
    no overlap), and what of the decision it cannot express ("" if nothing)."""
    if schedule.is_baseline:
        return None, ""
    ring = {"method": "ring_exchange", "num_sm": 1, "cga_size": 1, "set_sm_margin": False, "aggregate": False,
            "use_ce": schedule.engine == "dma"}
    if op == "ag_gemm":
        if schedule.engine == "switch":
            return ring, TE_NO_SWITCH_ALL_GATHER
        return ring, "" if schedule.granularity == "shard" else "TE's ring moves whole shards"
    # At two ranks the pieces of a ring go to the one peer: TE's pipeline of chunks.
    if schedule.granularity == "shard" or (schedule.pattern == "ring" and world_size > 2):
        return ring, "" if schedule.granularity == "shard" else "TE's ring moves whole shards"
    lost = []
    if schedule.engine == "dma":
        lost.append("TE's pipeline reduce-scatters with SMs, not copy engines")
    if schedule.split != "m":
        lost.append("TE splits the GEMM along m")
    if schedule.compute != "gemm_per_step":
        lost.append("TE computes one GEMM per chunk")
    entry = {"method": "pipeline", "num_sm": PIPELINE_NUM_SM, "cga_size": 2, "num_splits": schedule.degree,
             "set_sm_margin": True}
    return entry, "; ".join(lost)


def schedule_of_te(op: str, entry: dict | None, world_size: int, multicast: bool = False) -> Schedule:
    """The schedule TE runs for `entry` on a GEMM of `op` over `world_size` ranks (None: no
    overlap): how a preset's entry is scored on the simulator beside ficco's advice. With
    `multicast` (userbuffers on a multicast GPU, ``UB_SKIPMC`` unset) a pipeline's chunks are
    reduce-scattered in the switch (``advise_switch.TE_MULTICAST_SOURCE``)."""
    if entry is None:
        return parse("none.sm")
    if entry["method"] == "ring_exchange":
        return parse(f"shard.ring.{'dma' if entry.get('use_ce', True) else 'sm'}")
    if entry["method"] == "pipeline" and op == "gemm_rs":
        pattern = "a2a" if world_size > 2 or multicast else "ring"  # one peer: the same schedule; no ring in the switch
        engine = "switch" if multicast else "sm"
        return parse(f"ficco.d{entry.get('num_splits', 4)}.{pattern}.gemm_per_step.m.{engine}")
    raise ValueError(f"method {entry['method']!r} on {op}: not a schedule ficco scores")


TE_DEFAULTS = {"ring_exchange": {"method": "ring_exchange"},
               "pipeline": {"method": "pipeline", "num_splits": 4}}
"""What TE runs for a decided GEMM that its config leaves at the default (``get_default_config``):
the all-gathers a copy-engine ring, the reduce-scatters a pipeline of 4 chunks."""


def te_runs(advice: dict, gemm: Gemm) -> Schedule:
    """The schedule TE runs for `gemm` under `advice` (``te_advice``'s, or a preset's in that
    form): its entry's, no overlap where Megatron's switches turn it off, else TE's default."""
    P = advice["tp"]
    if not advice["overlap"]:
        return schedule_of_te(gemm.op, None, P)
    off = set(advice["megatron_flags"])
    switched_off = (("--disable-tp-comm-overlap-ag" in off and gemm.name in TE_ALL_GATHER)
                    or ("--disable-tp-comm-overlap-rs" in off and gemm.name in TE_REDUCE_SCATTER)
                    or advice["model_parallel_config"].get(f"tp_comm_overlap_disable_{gemm.name.split('_')[0]}")
                    and gemm.name.endswith("_fprop") and gemm.name in TE_ALL_GATHER)
    if switched_off:
        return schedule_of_te(gemm.op, None, P)
    entry = advice["ub_cfgs"].get(gemm.name)
    if entry is None:
        entry = TE_DEFAULTS["ring_exchange" if gemm.name in TE_ALL_GATHER else "pipeline"]
    return schedule_of_te(gemm.op, entry, P)


Pick = Callable[[Scenario], Schedule]
"""Chooses among the schedules TE runs for a scenario (``cost_model_pick``)."""


def te_choices(scenario: Scenario, spec: HardwareSpec) -> list[Schedule]:
    """The overlapped schedules TE runs as they are (``te_entry`` loses nothing) for `scenario`
    on `spec` (its engines only: copy engines, the switch where the machine has them)."""
    return [c for c in candidates(scenario, "sim", spec)  # every backend's schedules, fp8 included
            if not c.is_baseline and te_entry(scenario.op, c, scenario.world_size)[1] == ""]


def cost_model_pick(spec: HardwareSpec) -> Pick:
    """The policy's cost model (``runtime.no_harm.cost_model_pick``, the ``cost_model``
    fallback's) choosing among what TE runs (``te_choices``) on `spec`."""
    from ficco_select.runtime.no_harm import cost_model_pick as policy_pick

    return lambda scenario: policy_pick(scenario, spec, te_choices(scenario, spec))


def te_advice(decisions: dict[str, Decision], model: Model, layout: Layout, hardware: str,
              pick: Pick | None = None) -> dict:
    """The userbuffers config for ``--tp-comm-overlap-cfg`` (``ub_cfgs``: the bulk GEMMs at TE's
    defaults, each decided GEMM that overlaps with its method), Megatron's switches for the
    GEMMs left without overlap, and what could not be said in TE's terms.

    Two cases TE cannot run as decided: an overlapped schedule it has no method for (a finer
    ring, copy engines on a pipeline), and a GEMM decided without overlap whose switch it
    shares with one decided with (``proj_dgrad``, ``fc2_dgrad``, one of the reduce-scatters).
    Both run an overlapped schedule TE has: `pick`'s (the CLI's: the calibrated cost
    model's fastest of ``te_choices``), else the nearest method (``te_entry``)."""
    gemms = {g.name: g for g in layer_gemms(model)}
    off = {name for name, d in decisions.items() if d.schedule.is_baseline}
    ag_off = [n for n in TE_ALL_GATHER if n in off]
    rs_off = [n for n in TE_REDUCE_SCATTER if n in off]
    if len(ag_off) == len(TE_ALL_GATHER) and len(rs_off) == len(TE_REDUCE_SCATTER):
        return {"ub_cfgs": {}, "overlap": False, "megatron_flags": [], "model_parallel_config": {}, "tp": layout.tp,
                "notes": ["no GEMM gains from overlap here: leave --tp-comm-overlap off"]}
    flags, config = ["--tp-comm-overlap", "--tp-comm-overlap-cfg", "<this file>", "--sequence-parallel"], {}
    switched_off, forced_on = set(), set()
    if len(ag_off) == len(TE_ALL_GATHER):
        flags.append("--disable-tp-comm-overlap-ag")
        switched_off |= set(ag_off)
    else:
        for name, field in (("qkv_fprop", "tp_comm_overlap_disable_qkv"), ("fc1_fprop", "tp_comm_overlap_disable_fc1")):
            if name in ag_off:
                config[field] = True  # ModelParallelConfig fields without a command-line flag
                switched_off.add(name)
        forced_on |= {n for n in ag_off if n in ("proj_dgrad", "fc2_dgrad")}
    if len(rs_off) == len(TE_REDUCE_SCATTER):
        flags.append("--disable-tp-comm-overlap-rs")
        switched_off |= set(rs_off)
    else:
        forced_on |= set(rs_off)
    ub_cfgs: dict[str, dict] = dict(TE_BULK)
    notes = []
    for name, d in decisions.items():
        if name in switched_off:
            continue
        scenario = scenario_of(gemms[name], model, layout, hardware)
        entry, lost = te_entry(gemms[name].op, d.schedule, layout.tp)
        if name in forced_on:
            lost = ("no overlap decided, but Megatron switches its overlap with another GEMM's, decided with: "
                    "it stays on")
        if lost:
            if pick is not None:
                chosen = pick(scenario)
                entry = te_entry(gemms[name].op, chosen, layout.tp)[0]
                lost += f"; the cost model's fastest of what TE runs: {chosen.name}"
            elif entry is None:
                entry = TE_DEFAULTS["ring_exchange" if name in TE_ALL_GATHER else "pipeline"]
                lost += " with TE's default"
            notes.append(f"{name}: {d.schedule.name}: {lost}")
        ub_cfgs[name] = entry
    ub_cfgs = {name: ub_cfgs[name] for name in TE_LAYERS if name in ub_cfgs}  # TE's order
    return {"ub_cfgs": ub_cfgs, "overlap": True, "megatron_flags": flags, "model_parallel_config": config,
            "tp": layout.tp, "notes": notes}


def te_yaml(advice: dict, header: Sequence[str]) -> str:
    """The userbuffers config as the YAML file Megatron reads (``yaml.safe_load``), with
    `header` as comment lines."""
    import yaml

    body = yaml.safe_dump(advice["ub_cfgs"], sort_keys=False) if advice["ub_cfgs"] else "{}\n"
    return "".join(f"# {line}\n" for line in header) + body


# -- vLLM ----------------------------------------------------------------------------------------
VLLM_KINDS = {"qkv": "qkv_fprop", "o_proj": "proj_fprop", "gate_up": "fc1_fprop", "down": "fc2_fprop"}
"""vLLM's layer kinds under sequence parallelism and async TP, by the TE name of their GEMM."""
TOKEN_GRID = tuple(2 ** i for i in range(4, 17))
"""Token counts the thresholds are read on: 16 to 65536."""


def threshold(select: Callable[[Scenario], Decision], gemm: Gemm, model: Model, layout: Layout, hardware: str,
              grid: Sequence[int] = TOKEN_GRID) -> int | None:
    """The fewest tokens (on `grid`, multiples of the TP size) from which overlap pays at every
    larger count: the decision is not the baseline there; None if it pays at none."""
    counts = [m for m in grid if m % layout.tp == 0]
    pays = [not select(scenario_of(gemm, model, layout, hardware, m=m)).schedule.is_baseline for m in counts]
    first = None
    for m, ok in zip(reversed(counts), reversed(pays)):
        if not ok:
            break
        first = m
    return first


def vllm_advice(select: Callable[[Scenario], Decision], model: Model, layout: Layout, hardware: str) -> dict:
    """Per layer kind, the token count below which overlap does not pay; and the one threshold
    vLLM's pass takes (``sp_min_token_num``): the largest of the kinds that pay somewhere."""
    check(model, layout)
    gemms = {g.name: g for g in layer_gemms(model)}
    kinds = {kind: threshold(select, gemms[name], model, layout, hardware) for kind, name in VLLM_KINDS.items()}
    paying = [t for t in kinds.values() if t is not None]
    if not paying:
        return {"thresholds": kinds, "sp_min_token_num": None, "flags": [],
                "notes": ["overlap pays for no layer kind at any token count: keep sequence parallelism and async "
                          "TP off"]}
    sp_min = max(paying)
    config = {"pass_config": {"enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": sp_min}}
    notes = [f"{kind}: overlap pays at no token count here; the pass turns it on with the others"
             for kind, t in kinds.items() if t is None]
    return {"thresholds": kinds, "sp_min_token_num": sp_min,
            "flags": ["--tensor-parallel-size", str(layout.tp), "--compilation-config", json.dumps(config)],
            "notes": notes}


# -- torchtitan --------------------------------------------------------------------------------
def torchtitan_advice(select: Callable[[Scenario], Decision], model: Model, layout: Layout, hardware: str) -> dict:
    """Async TP on or off for the whole model (torchtitan's one switch): on where overlap pays
    for most of a training step's decided GEMMs at the layout's tokens, with the share of
    GEMMs and of (GEMM, token count) pairs on the grid where it pays."""
    decisions = decide(select, model, layout, hardware)
    at_tokens = sum(not d.schedule.is_baseline for d in decisions.values()) / len(decisions)
    counts = [m for m in TOKEN_GRID if m % layout.tp == 0]
    pairs = [not select(scenario_of(g, model, layout, hardware, m=m)).schedule.is_baseline
             for g in layer_gemms(model) for m in counts]
    on = at_tokens > 0.5
    flags = ["--parallelism.tensor_parallel_degree", str(layout.tp)]
    if on:
        flags += ["--compile.enable", "--compile.components", "model", "--compile.enable_async_tensor_parallel"]
    return {"async_tp": on, "share_at_tokens": round(at_tokens, 3), "share_over_grid": round(sum(pairs) / len(pairs), 3),
            "tokens": layout.tokens, "flags": flags,
            "per_gemm": {name: d.schedule.name for name, d in decisions.items()},
            "notes": ["before torchtitan commit 73759474 (2026-08-12; releases v0.2.0-v0.2.2) the switch is "
                      "--parallelism.enable_async_tensor_parallel",
                      "PyTorch's async-TP ops choose their own kernels by size; this says whether overlap pays"]}
