"""Where ``ficco advise``'s decisions put a collective in the switch (a ``*.switch`` schedule:
NVLink SHARP, the NVSwitch reducing and multicasting), said in each framework's own terms: the
nearest setting the framework has, or that it has no switch for that GEMM and what runs
instead. Only GEMMs decided ``*.switch`` get a record, so a machine whose spec has no
``switch_reduce`` (an A100) gets none.

Every setting is read from these sources (repository or package, file, commit):
- the collective library any framework calls when it does not overlap: ``NCCL_SOURCE``;
- TransformerEngine's userbuffers: ``TE_MULTICAST_SOURCE``;
- vLLM's all-reduce and async-TP passes: ``VLLM_SWITCH_SOURCE``;
- PyTorch's async-TP ops, which torchtitan (and vLLM's pass) call: ``TORCH_SWITCH_SOURCE``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ficco_select.runtime.decision import Decision
from ficco_select.scenario import Scenario
from ficco_select.train.advise import (TE_SOURCE, TOKEN_GRID, VLLM_KINDS, Gemm, Layout, Model, layer_gemms,
                                       scenario_of, schedule_of_te, te_runs)

NCCL_SOURCE = {"repo": "NVIDIA/nccl", "commit": "5067397c2676d5aed50042fc39e5c8ee96eb0027", "version": "2.30.7",
               "path": "src/transport/nvls.cc (NCCL_PARAM(NvlsEnable, \"NVLS_ENABLE\", 2)), src/init.cc "
                       "(ncclFuncStr, ncclAlgoStr), src/graph/tuning.cc (NCCL_ALGO), src/device/generate.py "
                       "(NVLS for AllGather, ReduceScatter, AllReduce)"}
TE_MULTICAST_SOURCE = {"repo": TE_SOURCE["repo"], "commit": TE_SOURCE["commit"],
                       "path": "transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers-host.cpp "
                               "(UB_SKIPMC, use_mc), userbuffers/userbuffers.cu "
                               "(reducescatter2_userbuff_stridedoutput: "
                               "userbuffers_fp16_sum_inplace_gpu_mc_rs_oop, multimem.ld_reduce), comm_gemm_overlap.cpp "
                               "(CommOverlapBase::split_overlap_rs; CommOverlapP2PBase: ring_exchange, no multicast), "
                               "transformer_engine/pytorch/module/base.py (initialize_ub: no ub_cfgs key for it)"}
VLLM_SWITCH_SOURCE = {"package": "vllm==0.31.0",
                      "path": "vllm/envs.py (VLLM_ALLREDUCE_USE_SYMM_MEM, default 1), "
                              "vllm/distributed/device_communicators/symm_mem.py (SymmMemCommunicator, "
                              "_WORLD_SIZES_MULTIMEM), cuda_communicator.py (CudaCommunicator.all_reduce: the custom "
                              "all-reduce before symmetric memory), all_reduce_utils.py (CUSTOM_ALL_REDUCE_MAX_SIZES, "
                              "SYMM_MEM_ALL_REDUCE_MAX_SIZES), config/parallel.py (disable_custom_all_reduce), "
                              "compilation/passes/fusion/collective_fusion.py (fused_all_gather_matmul, return_A "
                              "left true)"}
TORCH_SWITCH_SOURCE = {"package": "torch==2.13.0", "path": "torch/distributed/_symmetric_memory/__init__.py "
                       "(_should_use_multimem_all_gather_matmul, _multimem_all_gather_matmul; "
                       "_fused_matmul_reduce_scatter has no multimem path), torch/_inductor/fx_passes/"
                       "micro_pipeline_tp.py (return_A false only where nothing else uses the gathered input)"}
SOURCES = {"nccl": NCCL_SOURCE, "te": TE_MULTICAST_SOURCE, "vllm": VLLM_SWITCH_SOURCE, "torch": TORCH_SWITCH_SOURCE}

NCCL_FUNCTIONS = {"ag_gemm": "AllGather", "gemm_rs": "ReduceScatter", "gemm_ar": "AllReduce"}
"""NCCL's names of each op's collective (``ncclFuncStr``), as ``NCCL_ALGO`` takes them."""
TORCH_MULTIMEM_ROWS = 2048
"""PyTorch's async-TP all-gather matmul multicasts the gathered input (then one matmul) at
most this many gathered rows (``_should_use_multimem_all_gather_matmul``: local_M x group size)."""
VLLM_MULTIMEM_TP = {"sm90": (4, 6, 8), "sm100": (6, 8), "sm103": (6, 8)}
"""TP sizes at which vLLM's symmetric-memory all-reduce is the multimem one
(``SymmMemCommunicator._WORLD_SIZES_MULTIMEM``); at others it is ``two_shot`` on SMs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchAdvice:
    """One GEMM decided ``*.switch``: what the framework runs for it, in its terms."""

    gemm: str
    op: str
    """The op decided (vLLM's row-parallel kinds: ``gemm_ar`` below the pass, ``gemm_rs`` above)."""
    schedule: str
    setting: str = ""
    """The nearest setting the framework has that puts this collective in the switch ("" if none)."""
    env: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    no_switch: str = ""
    """Where the framework has no switch for it: why, and what runs instead ("" if it has one)."""
    tokens: tuple[int, ...] = ()
    """Token counts this holds at (vLLM's, read over the grid; empty: the layout's own)."""

    def line(self) -> str:
        where = f" at {_counts(self.tokens)} tokens" if self.tokens else ""
        said = self.no_switch or self.setting
        knobs = " ".join((*self.env, *self.flags))
        return f"switch: {self.gemm} ({self.op}){where}: {self.schedule}: {said}" + (f" [{knobs}]" if knobs else "")


def nccl_env(op: str) -> tuple[str, ...]:
    """NCCL's NVLS for `op`'s whole collective: on (its default, 2, is on wherever the GPUs
    multicast; 0 turns it off), and pinned (``NCCL_ALGO``: every such collective of the process)."""
    return "NCCL_NVLS_ENABLE=1", f"NCCL_ALGO={NCCL_FUNCTIONS[op]}:NVLS"


def _nccl_whole(op: str, who: str) -> str:
    return (f"{who}: the whole {NCCL_FUNCTIONS[op]} by NCCL's NVLS algorithm (NCCL_NVLS_ENABLE on; NCCL_ALGO pins "
            f"every {NCCL_FUNCTIONS[op]} of the job to it, else NCCL's tuner picks NVLS by size)")


def switch_gemms(decisions: dict[str, Decision]) -> dict[str, Decision]:
    return {name: d for name, d in decisions.items() if d.schedule.engine == "switch"}


# -- TransformerEngine / Megatron ---------------------------------------------------------------
def te_switch(decisions: dict[str, Decision], te: dict, model: Model, layout: Layout) -> list[SwitchAdvice]:
    """For each GEMM decided ``*.switch``, what TE runs under `te` (``te_advice``'s): the
    pipeline's reduce-scatter in the switch (userbuffers multicast, ``UB_SKIPMC`` unset), NCCL's
    NVLS where Megatron leaves the GEMM without overlap, or that TE has none for it."""
    gemms = {g.name: g for g in layer_gemms(model)}
    out = []
    for name, d in switch_gemms(decisions).items():
        gemm, schedule = gemms[name], d.schedule.name
        runs = te_runs(te, gemm)
        entry = te["ub_cfgs"].get(name) if te["overlap"] else None
        pipeline = entry is not None and entry["method"] == "pipeline"
        if pipeline:  # userbuffers on a multicast GPU reduce the pipeline's chunks in the switch
            runs = schedule_of_te(gemm.op, entry, layout.tp, multicast=True)
        env = ("UB_SKIPMC=0",) if pipeline else ()
        if runs.is_baseline:
            out.append(SwitchAdvice(gemm=name, op=gemm.op, schedule=schedule, env=nccl_env(gemm.op),
                                    setting=_nccl_whole(gemm.op, "no overlap (Megatron's switches), so "
                                                        "torch.distributed runs it")))
        elif d.schedule.is_baseline:
            out.append(SwitchAdvice(gemm=name, op=gemm.op, schedule=schedule, env=env, no_switch=(
                f"Megatron keeps this GEMM's overlap on with its partner's, so its collective does not run whole in "
                f"NCCL's NVLS: this GEMM runs {runs.name} ({entry['method']}) instead")))
        elif pipeline:
            out.append(SwitchAdvice(
                gemm=name, op=gemm.op, schedule=schedule, env=env,
                setting=f"pipeline, num_splits {entry.get('num_splits', 4)} ({runs.name}): each chunk reduce-scattered "
                        "in the switch by userbuffers multicast (multimem.ld_reduce; bf16/fp16 output). UB_SKIPMC "
                        "unset or 0 is TE's default on a GPU with multicast, one setting for the whole job"))
        else:
            what = "all-gather" if gemm.op == "ag_gemm" else "reduce-scatter"
            out.append(SwitchAdvice(gemm=name, op=gemm.op, schedule=schedule, no_switch=(
                f"TE userbuffers have no in-switch {what} for it (ring_exchange sends point to point): this GEMM "
                f"runs {runs.name} ({entry['method']}) instead")))
    return out


# -- vLLM ----------------------------------------------------------------------------------------
VLLM_ALL_REDUCE_KINDS = ("o_proj", "down")
"""vLLM's row-parallel layer kinds: without the sequence-parallel pass (below its token count,
or off), each is its GEMM then an all-reduce (``gemm_ar``)."""


def vllm_switch(select: Callable[[Scenario], Decision], model: Model, layout: Layout, hardware: str,
                sp_min_token_num: int | None) -> list[SwitchAdvice]:
    """Per layer kind, the token counts (``TOKEN_GRID``) whose decision is ``*.switch``, with
    vLLM's nearest setting: below `sp_min_token_num` (or everywhere without the passes) the
    row-parallel kinds' all-reduce, which vLLM's symmetric-memory all-reduce can run in the
    switch; at and above it the async-TP pass's fused ops, which have no switch in vLLM."""
    gemms = {g.name: g for g in layer_gemms(model)}
    counts = [m for m in TOKEN_GRID if m % layout.tp == 0]
    plain = [m for m in counts if sp_min_token_num is None or m < sp_min_token_num]
    out = []
    for kind in VLLM_ALL_REDUCE_KINDS:
        gemm = dataclasses.replace(gemms[VLLM_KINDS[kind]], op="gemm_ar")
        for schedule, tokens in _switch_counts(select, gemm, model, layout, hardware, plain).items():
            out.append(_vllm_all_reduce(kind, schedule, tokens, layout))
    if sp_min_token_num is not None:
        fused = [m for m in counts if m >= sp_min_token_num]
        for kind, name in VLLM_KINDS.items():
            gemm = gemms[name]
            for schedule, tokens in _switch_counts(select, gemm, model, layout, hardware, fused).items():
                why = ("vLLM's async-TP pass calls PyTorch's fused_all_gather_matmul keeping the gathered input "
                       "(return_A true), so PyTorch's multimem all-gather never runs" if gemm.op == "ag_gemm" else
                       "PyTorch's fused_matmul_reduce_scatter, which vLLM's async-TP pass calls, has no in-switch "
                       "reduction")
                out.append(SwitchAdvice(gemm=kind, op=gemm.op, schedule=schedule, tokens=tokens, no_switch=(
                    f"{why}: this GEMM runs PyTorch's pipelined {gemm.op} (the pass's fuse_gemm_comms) instead")))
    return out


def _switch_counts(select, gemm: Gemm, model: Model, layout: Layout, hardware: str, counts) -> dict[str, tuple]:
    found: dict[str, list[int]] = {}
    for m in counts:
        schedule = select(scenario_of(gemm, model, layout, hardware, m=m)).schedule
        if schedule.engine == "switch":
            found.setdefault(schedule.name, []).append(m)
    return {name: tuple(ms) for name, ms in found.items()}


def _vllm_all_reduce(kind: str, schedule: str, tokens: tuple[int, ...], layout: Layout) -> SwitchAdvice:
    """vLLM's all-reduce in the switch: its symmetric-memory multimem all-reduce, which its
    custom all-reduce (SMs) otherwise pre-empts under CUSTOM_ALL_REDUCE_MAX_SIZES."""
    tp = layout.tp
    archs = [arch for arch, sizes in VLLM_MULTIMEM_TP.items() if tp in sizes]
    if not archs:
        sizes = {arch: ", ".join(map(str, tps)) for arch, tps in VLLM_MULTIMEM_TP.items()}
        return SwitchAdvice(gemm=kind, op="gemm_ar", schedule=schedule, tokens=tokens, no_switch=(
            f"vLLM's symmetric-memory all-reduce is multimem only at TP {sizes['sm90']} (sm90) or {sizes['sm100']} "
            f"(sm100, sm103): at TP {tp} it is two_shot on SMs, and this all-reduce runs there or in vLLM's custom "
            "all-reduce instead"))
    if layout.dtype == "fp16":
        return SwitchAdvice(gemm=kind, op="gemm_ar", schedule=schedule, tokens=tokens, no_switch=(
            "vLLM's symmetric-memory all-reduce takes bf16 only: this fp16 all-reduce runs in vLLM's custom "
            "all-reduce (SMs) or NCCL instead"))
    env, flags = ("VLLM_ALLREDUCE_USE_SYMM_MEM=1",), ("--disable-custom-all-reduce",)
    where = f"multimem at TP {tp} on {', '.join(archs)}, up to SYMM_MEM_ALL_REDUCE_MAX_SIZES"
    if schedule == "none.switch":
        return SwitchAdvice(gemm=kind, op="gemm_ar", schedule=schedule, tokens=tokens, env=env, flags=flags, setting=(
            f"the GEMM, then vLLM's symmetric-memory all-reduce (torch multimem_all_reduce_; {where}); "
            "--disable-custom-all-reduce keeps vLLM's custom all-reduce, on SMs, from taking it first"))
    return SwitchAdvice(gemm=kind, op="gemm_ar", schedule=schedule, tokens=tokens, env=env, flags=flags, no_switch=(
        "vLLM has no all-reduce of GEMM pieces in the switch for this layer (its fused GEMM-AR multimem kernel binds "
        "Kimi-K3 and DeepSeek-V4.1 projections only): this GEMM runs whole, then the symmetric-memory multimem "
        f"all-reduce (none.switch; {where}) instead"))


# -- torchtitan --------------------------------------------------------------------------------
def torchtitan_switch(decisions: dict[str, Decision], model: Model, layout: Layout, async_tp: bool
                      ) -> list[SwitchAdvice]:
    """For each GEMM decided ``*.switch``: with async TP off, DTensor's collective by NCCL's
    NVLS; with it on, PyTorch's symmetric-memory ops, which multicast only an all-gather of at
    most ``TORCH_MULTIMEM_ROWS`` rows whose gathered input the graph does not keep."""
    gemms = {g.name: g for g in layer_gemms(model)}
    out = []
    for name, d in switch_gemms(decisions).items():
        op, schedule = gemms[name].op, d.schedule.name
        if not async_tp:
            said = _nccl_whole(op, "async TP off, so DTensor's collective runs whole")
            if d.schedule.is_baseline:
                out.append(SwitchAdvice(gemm=name, op=op, schedule=schedule, env=nccl_env(op), setting=said))
            else:
                out.append(SwitchAdvice(gemm=name, op=op, schedule=schedule, env=nccl_env(op), no_switch=(
                    f"torchtitan overlaps no GEMM with async TP off: {said}, then the GEMM, instead")))
        elif op == "ag_gemm" and layout.tokens <= TORCH_MULTIMEM_ROWS:
            said = ("PyTorch's multimem all-gather, then one matmul (_should_use_multimem_all_gather_matmul: at most "
                    f"{TORCH_MULTIMEM_ROWS} gathered rows, here {layout.tokens}), where the compiled graph does not "
                    "keep the gathered input (return_A false); a training step keeps it for the weight gradient, and "
                    "then PyTorch's pipelined all-gather matmul runs")
            if d.schedule.is_baseline:
                out.append(SwitchAdvice(gemm=name, op=op, schedule=schedule, setting=said))
            else:
                out.append(SwitchAdvice(gemm=name, op=op, schedule=schedule, no_switch=(
                    f"PyTorch multicasts no pieces beside the GEMM: this GEMM runs none.switch ({said}) instead")))
        elif op == "ag_gemm":
            out.append(SwitchAdvice(gemm=name, op=op, schedule=schedule, no_switch=(
                f"PyTorch's async TP multicasts only up to {TORCH_MULTIMEM_ROWS} gathered rows "
                f"(_should_use_multimem_all_gather_matmul): at {layout.tokens} this GEMM runs its pipelined "
                "all-gather matmul instead")))
        else:
            out.append(SwitchAdvice(gemm=name, op=op, schedule=schedule, no_switch=(
                "PyTorch's fused_matmul_reduce_scatter has no in-switch reduction: this GEMM runs its pipelined "
                "reduce-scatter instead")))
    return out


def as_json(advice: list[SwitchAdvice]) -> list[dict]:
    return [dataclasses.asdict(a) for a in advice]


def _counts(tokens: tuple[int, ...]) -> str:
    return ", ".join(map(str, tokens))
