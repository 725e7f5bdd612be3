"""``ficco advise`` where a decision puts the collective in the switch (``*.switch``): each
format names the framework's setting for it (TE's userbuffers multicast, NCCL's NVLS, vLLM's
symmetric-memory all-reduce, PyTorch's multimem all-gather) or says that it has none; a
machine without in-switch reduction (an A100) gets no switch advice at all."""

import dataclasses
import json

import pytest
from click.testing import CliRunner

from ficco_select.cli.main import main
from ficco_select.hardware import load_hardware
from ficco_select.heuristic import choose
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import parse
from ficco_select.train import advise as A
from ficco_select.train import advise_switch as S

LLAMA_70B = A.Model.from_catalog("llama3-70b")
TP8 = A.Layout(tp=8, seq=8192)
DECODE = ["--model", "llama3-70b", "--tp", "8", "--seq", "256", "--heuristic-only"]
"""A short sequence: the heuristic runs some of its all-gathers whole, in the switch, on a
machine whose spec reduces there."""
FORMATS = ("te", "vllm", "torchtitan")
SWITCH_WORDS = ("NVLS", "multimem", "UB_SKIPMC", "VLLM_ALLREDUCE_USE_SYMM_MEM", "switch:", ".switch", "in-switch")


def decisions(plan: dict) -> dict:
    return {name: Decision(parse(schedule), "model", 0.5) for name, schedule in plan.items()}


def by_gemm(advice: list) -> dict:
    return {a.gemm: a for a in advice}


def test_vllm_without_sequence_parallelism_runs_a_decode_all_reduce_in_the_switch_on_b300():
    b300 = load_hardware("b300-nvswitch")
    s = Scenario(group="g", op="gemm_ar", m=64, n=7168, k=12288, dtype="bfloat16", world_size=8,
                 hardware="b300-nvswitch")
    assert choose(s, b300).name == "none.switch"  # a decode all-reduce: the one-call multimem one
    ar = A.scenario_of(A.Gemm("o_proj", "gemm_ar", 8192, 8192), LLAMA_70B, A.Layout(tp=8, seq=64), "b300-nvswitch")
    assert Selector().select(ar).schedule.name == "none.switch"
    res = CliRunner().invoke(main, ["advise", "--model", "llama3-70b", "--tp", "8", "--seq", "64", "--hardware",
                                    "b300-nvswitch", "--format", "vllm", "--no-sequence-parallel", "--heuristic-only",
                                    "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    o_proj = [r for r in got["switch"] if r["gemm"] == "o_proj" and r["schedule"] == "none.switch"]
    assert len(o_proj) == 1 and 64 in o_proj[0]["tokens"] and o_proj[0]["op"] == "gemm_ar"
    assert o_proj[0]["env"] == ["VLLM_ALLREDUCE_USE_SYMM_MEM=1"]
    assert o_proj[0]["flags"] == ["--disable-custom-all-reduce"]
    assert set(got["switch_sources"]) == {"nccl", "vllm", "torch"}


def test_te_runs_a_switch_reduce_scatter_as_its_multicast_pipeline_and_says_where_it_has_none():
    plan = {"qkv_fprop": "ficco.d2.a2a.gemm_per_step.m.switch", "proj_fprop": "ficco.d4.a2a.gemm_per_step.m.switch",
            "fc1_fprop": "none.switch", "fc2_fprop": "shard.ring.dma", "proj_dgrad": "shard.ring.sm",
            "fc2_dgrad": "none.switch"}
    te = A.te_advice(decisions(plan), LLAMA_70B, TP8, "h100-nvswitch")
    got = by_gemm(S.te_switch(decisions(plan), te, LLAMA_70B, TP8))
    assert set(got) == {"qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_dgrad"}  # the *.switch ones, no other
    # proj_fprop: TE's pipeline of 4 chunks, each reduce-scattered in the switch by userbuffers multicast
    assert te["ub_cfgs"]["proj_fprop"]["method"] == "pipeline" and te["ub_cfgs"]["proj_fprop"]["num_splits"] == 4
    assert got["proj_fprop"].env == ("UB_SKIPMC=0",) and got["proj_fprop"].no_switch == ""
    assert "ficco.d4.a2a.gemm_per_step.m.switch" in got["proj_fprop"].setting
    # qkv_fprop: TE's all-gather overlap is a point-to-point ring: no switch, its nearest ring instead
    assert got["qkv_fprop"].setting == ""
    assert "TE userbuffers have no in-switch all-gather" in got["qkv_fprop"].no_switch
    assert "shard.ring.sm" in got["qkv_fprop"].no_switch and te["ub_cfgs"]["qkv_fprop"]["use_ce"] is False
    # fc1_fprop: switched off in Megatron, so NCCL's all-gather runs whole: NVLS
    assert te["model_parallel_config"] == {"tp_comm_overlap_disable_fc1": True}
    assert got["fc1_fprop"].env == ("NCCL_NVLS_ENABLE=1", "NCCL_ALGO=AllGather:NVLS") and got["fc1_fprop"].setting
    # fc2_dgrad: no switch of its own, Megatron keeps its overlap on: not in NCCL's NVLS
    assert "Megatron keeps this GEMM's overlap on" in got["fc2_dgrad"].no_switch
    assert te["ub_cfgs"]["fc2_dgrad"] == {"method": "ring_exchange"}
    # Every record is a setting or a line that the framework has none; the text says the same.
    for a in got.values():
        assert bool(a.setting) != bool(a.no_switch)
        assert a.line().startswith(f"switch: {a.gemm} ({a.op}): {a.schedule}: ")


def test_te_with_the_cost_model_runs_the_fastest_of_what_it_has_for_a_switch_all_gather():
    plan = {**dict.fromkeys(("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"), "shard.ring.dma"),
            "proj_fprop": "shard.ring.sm", "fc2_fprop": "shard.ring.sm",
            "fc1_fprop": "ficco.d4.a2a.gemm_per_step.m.switch"}
    spec = Selector().machine("h100-nvswitch")
    te = A.te_advice(decisions(plan), LLAMA_70B, TP8, "h100-nvswitch", pick=A.cost_model_pick(spec))
    (fc1,) = S.te_switch(decisions(plan), te, LLAMA_70B, TP8)
    runs = A.te_runs(te, next(g for g in A.layer_gemms(LLAMA_70B) if g.name == "fc1_fprop"))
    assert fc1.gemm == "fc1_fprop" and runs.name in fc1.no_switch and runs.engine != "switch"
    assert any(n.startswith("fc1_fprop: ") and A.TE_NO_SWITCH_ALL_GATHER in n for n in te["notes"])


def fixed(plan):
    """A policy deciding by op and token count (`plan(op, m)`): what `select` returns."""
    return lambda s: Decision(parse(plan(s.op, s.m)), "model", 0.5)


def test_vllm_says_its_symmetric_memory_all_reduce_below_the_pass_and_no_switch_in_its_fused_ops():
    def plan(op, m):
        if op == "gemm_ar":  # decode: whole, in the switch; a little more: pieces in the switch
            return "none.switch" if m <= 64 else "ficco.d2.a2a.gemm_per_step.m.switch" if m <= 256 else "none.sm"
        return "ficco.d2.a2a.gemm_per_step.m.switch" if m >= 4096 else "shard.ring.sm"

    got = S.vllm_switch(fixed(plan), LLAMA_70B, TP8, "h100-nvswitch", sp_min_token_num=1024)
    ar = {(a.gemm, a.schedule): a for a in got if a.op == "gemm_ar"}
    pieces = "ficco.d2.a2a.gemm_per_step.m.switch"
    assert set(ar) == {(k, s) for k in ("o_proj", "down") for s in ("none.switch", pieces)}
    whole = ar[("o_proj", "none.switch")]
    assert whole.tokens == (16, 32, 64) and whole.env == ("VLLM_ALLREDUCE_USE_SYMM_MEM=1",)
    assert whole.flags == ("--disable-custom-all-reduce",) and "multimem at TP 8" in whole.setting
    pieces = ar[("down", pieces)]
    assert pieces.tokens == (128, 256) and "runs whole, then the symmetric-memory multimem" in pieces.no_switch
    fused = {a.gemm: a for a in got if a.op != "gemm_ar"}
    assert set(fused) == set(A.VLLM_KINDS) and all(a.tokens[0] == 4096 for a in fused.values())
    assert "return_A true" in fused["qkv"].no_switch and "no in-switch reduction" in fused["o_proj"].no_switch
    # Without the pass every count is the plain all-reduce.
    plain = S.vllm_switch(fixed(plan), LLAMA_70B, TP8, "h100-nvswitch", sp_min_token_num=None)
    assert {a.gemm for a in plain} == {"o_proj", "down"}


@pytest.mark.parametrize("layout, why", [(A.Layout(tp=2, seq=8192), "at TP 2 it is two_shot on SMs"),
                                         (A.Layout(tp=8, seq=8192, dtype="fp16"), "takes bf16 only")])
def test_vllm_has_no_switch_all_reduce_at_tp_2_or_in_fp16(layout, why):
    got = S.vllm_switch(fixed(lambda op, m: "none.switch"), LLAMA_70B, layout, "h100-nvswitch", None)
    assert got and all(why in a.no_switch and not a.env for a in got)


def test_torchtitan_names_pytorch_s_multimem_all_gather_and_its_cutoff_or_nccl_s_nvls():
    plan = {"qkv_fprop": "none.switch", "proj_fprop": "none.switch", "fc1_fprop": "ficco.d2.a2a.gemm_per_step.m.switch",
            "fc2_fprop": "shard.ring.dma", "proj_dgrad": "shard.ring.dma", "fc2_dgrad": "shard.ring.dma"}
    short = A.Layout(tp=8, seq=S.TORCH_MULTIMEM_ROWS)
    on = by_gemm(S.torchtitan_switch(decisions(plan), LLAMA_70B, short, async_tp=True))
    assert "_should_use_multimem_all_gather_matmul" in on["qkv_fprop"].setting  # 2048 rows: PyTorch's multimem
    assert "runs none.switch" in on["fc1_fprop"].no_switch  # no multicast pieces: the whole gather in the switch
    assert "fused_matmul_reduce_scatter has no in-switch reduction" in on["proj_fprop"].no_switch
    longer = by_gemm(S.torchtitan_switch(decisions(plan), LLAMA_70B, A.Layout(tp=8, seq=4096), async_tp=True))
    assert "at 4096 this GEMM runs its pipelined all-gather matmul" in longer["qkv_fprop"].no_switch
    off = by_gemm(S.torchtitan_switch(decisions(plan), LLAMA_70B, short, async_tp=False))
    assert off["proj_fprop"].env == ("NCCL_NVLS_ENABLE=1", "NCCL_ALGO=ReduceScatter:NVLS") and off["proj_fprop"].setting
    assert off["fc1_fprop"].env == ("NCCL_NVLS_ENABLE=1", "NCCL_ALGO=AllGather:NVLS") and off["fc1_fprop"].no_switch


def advise(hardware: str, fmt: str, *json_flag: str):
    res = CliRunner().invoke(main, ["advise", *DECODE, "--hardware", hardware, "--format", fmt, *json_flag])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_names_the_switch_setting_or_says_it_has_none_on_h100(fmt):
    got = json.loads(advise("h100-nvswitch", fmt, "--json"))
    text = advise("h100-nvswitch", fmt)
    switch = [name for name, d in got["decisions"]["per_gemm"].items() if d["schedule"].endswith(".switch")]
    assert switch, got["decisions"]["per_gemm"]  # the heuristic runs some all-gathers whole in the switch here
    records = got["switch"]
    assert records and all(bool(r["setting"]) != bool(r["no_switch"]) for r in records)
    assert "nccl" in got["switch_sources"] and got["switch_sources"]["nccl"]["commit"] == S.NCCL_SOURCE["commit"]
    if fmt != "vllm":  # one record per GEMM decided *.switch
        assert [r["gemm"] for r in records] == switch
    else:  # vLLM's all-reduce kinds, below the pass's token count
        o_proj = next(g for g in A.layer_gemms(LLAMA_70B) if g.name == "proj_fprop")
        ar = A.scenario_of(o_proj.__class__(o_proj.name, "gemm_ar", o_proj.k, o_proj.n), LLAMA_70B,
                           A.Layout(tp=8, seq=256), "h100-nvswitch", m=16)
        assert Selector().select(ar).schedule.name == "none.switch"
        assert any(r["gemm"] == "o_proj" and 16 in r["tokens"] and "VLLM_ALLREDUCE_USE_SYMM_MEM=1" in r["env"]
                   for r in records)
    for r in records:
        assert any(line.startswith(f"switch: {r['gemm']} ({r['op']})") and r["schedule"] in line
                   for line in text.splitlines())
    knobs = {"te": "NCCL_ALGO=AllGather:NVLS", "vllm": "--disable-custom-all-reduce",
             "torchtitan": "NCCL_NVLS_ENABLE=1"}
    assert knobs[fmt] in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_advice_mentions_the_switch_on_a100(fmt):
    got = json.loads(advise("a100-nvswitch", fmt, "--json"))
    assert got["switch"] == [] and "switch_sources" not in got
    dumped = json.dumps(got)
    text = advise("a100-nvswitch", fmt)
    for word in SWITCH_WORDS:
        assert word not in dumped and word not in text, word
