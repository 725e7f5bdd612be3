"""``ficco advise`` (``ficco_select.train.advise``): the mapping of every schedule family onto
TransformerEngine's userbuffers methods, the YAML checked against TE's own keys, the
Megatron switches of a layer left without overlap, and the three formats from the command."""

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ficco_select.cli.main import main
from ficco_select.hardware import load_hardware
from ficco_select.runtime.decision import Decision
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates, parse
from ficco_select.train import advise as A

SCHEMA = json.loads((Path(__file__).parent / "golden" / "te_userbuffers_schema.json").read_text())
"""``initialize_ub``'s layer names, methods and per-layer keys with their types, written from
TransformerEngine's source (its ``source`` field: repository, file, commit, lines)."""
TYPES = {"bool": bool, "int": int, "str": str}
LLAMA_70B = A.Model.from_catalog("llama3-70b")
TP8 = A.Layout(tp=8, seq=8192)
H100 = load_hardware("h100-nvswitch")


def te_problems(ub_cfgs: dict) -> list[str]:
    """What ``initialize_ub`` would refuse or silently ignore in `ub_cfgs` (``SCHEMA``)."""
    problems = []
    reduce_scatter = set(SCHEMA["default_collective_per_layer"]["reduce_scatter"])
    for layer, cfg in ub_cfgs.items():
        if layer not in SCHEMA["layer_names"]:
            problems.append(f"{layer}: not a layer name (TE ignores it)")
            continue
        method = cfg.get("method")
        if method not in SCHEMA["methods"]:
            problems.append(f"{layer}: method {method!r}")
        if method == "pipeline" and layer not in reduce_scatter:
            problems.append(f"{layer}: pipeline on an all-gather layer")
        if layer in ("proj_wgrad", "fc2_wgrad") and method != "external":
            problems.append(f"{layer}: must be external")
        for key, value in cfg.items():
            spec = SCHEMA["keys"].get(key)
            if spec is None:
                problems.append(f"{layer}.{key}: not a key (TE raises TypeError)")
            elif type(value) is not TYPES[spec["type"]]:
                problems.append(f"{layer}.{key}: {type(value).__name__}, TE takes {spec['type']}")
            elif method not in spec["methods"]:
                problems.append(f"{layer}.{key}: the {method} method ignores it")
    return problems


def test_the_schema_check_finds_what_te_refuses():
    assert te_problems({"qkv_fprop": {"method": "ring_exchange", "num_sm": 1, "use_ce": True}}) == []
    assert te_problems({"qkv_fprop": {"method": "pipeline", "num_splits": 4}}) == [
        "qkv_fprop: pipeline on an all-gather layer"]
    assert te_problems({"qkv_fprop": {"method": "ring_exchange", "num_sm": "1", "splits": 2, "num_splits": 4},
                        "qkv_fprob": {}}) == [
        "qkv_fprop.num_sm: str, TE takes int", "qkv_fprop.splits: not a key (TE raises TypeError)",
        "qkv_fprop.num_splits: the ring_exchange method ignores it", "qkv_fprob: not a layer name (TE ignores it)"]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_every_schedule_family_maps_to_a_te_method_and_back_where_te_runs_it(op, P):
    s = Scenario(group="g", op=op, m=8192, n=8192, k=8192, dtype="bfloat16", world_size=P, hardware="h100-nvswitch")
    seen, engines = set(), set()
    for schedule in candidates(s, "sim", H100):  # the machine's engines: its switch too
        engines.add(schedule.engine)
        entry, lost = A.te_entry(op, schedule, P)
        layer = "qkv_fprop" if op == "ag_gemm" else "proj_fprop"
        if schedule.is_baseline:
            assert entry is None and lost == ""
            seen.add("none")
            continue
        assert te_problems({layer: entry}) == [], schedule.name
        multicast = schedule.engine == "switch"  # userbuffers on a multicast GPU (UB_SKIPMC unset)
        ran = A.schedule_of_te(op, entry, P, multicast=multicast)
        assert ran in candidates(s, "sim", H100)  # what TE runs is a schedule ficco scores
        if schedule.granularity == "shard":  # TE runs the shard ring itself, on SMs or copy engines
            assert entry["method"] == "ring_exchange" and entry["use_ce"] == (schedule.engine == "dma")
            assert ran == schedule and lost == ""
        elif op == "gemm_rs" and (schedule.pattern == "a2a" or P == 2):  # chunks along m, each reduce-scattered
            assert entry == {"method": "pipeline", "num_sm": A.PIPELINE_NUM_SM, "cga_size": 2,
                             "num_splits": schedule.degree, "set_sm_margin": True}
            assert (ran == schedule) == (lost == "")  # what TE cannot run is said
            assert ran.degree == schedule.degree and ran.split == "m" and ran.engine == ("switch" if multicast else "sm")
        elif multicast:  # an all-gather in the switch: TE's all-gather ring is point to point, on SMs
            assert entry["method"] == "ring_exchange" and lost == A.TE_NO_SWITCH_ALL_GATHER
            assert ran == parse("shard.ring.sm") and entry["use_ce"] is False
        else:  # finer rings, and pieces of an all-gather: TE's ring moves whole shards
            assert entry["method"] == "ring_exchange" and "whole shards" in lost
            assert ran == parse(f"shard.ring.{schedule.engine}")
        seen.add(entry["method"])
    assert seen == ({"none", "ring_exchange"} if op == "ag_gemm" else {"none", "ring_exchange", "pipeline"})
    assert engines == {"sm", "dma", "switch"}  # h100-nvswitch reduces in the switch: its schedules are mapped too


def decisions(plan: dict) -> dict:
    """Decisions of the layer's GEMMs as `plan` names them (what ``te_advice`` reads)."""
    return {name: Decision(parse(schedule), "model", 0.5) for name, schedule in plan.items()}


def test_a_layer_left_without_overlap_says_so_in_megatron_s_switches():
    on = {"qkv_fprop": "shard.ring.dma", "proj_fprop": "ficco.d4.a2a.gemm_per_piece.m.sm", "fc1_fprop": "none.sm",
          "fc2_fprop": "shard.ring.sm", "proj_dgrad": "shard.ring.dma", "fc2_dgrad": "none.sm"}
    te = A.te_advice(decisions(on), LLAMA_70B, TP8, "h100-nvswitch")
    assert te_problems(te["ub_cfgs"]) == []
    assert te["model_parallel_config"] == {"tp_comm_overlap_disable_fc1": True}  # fc1's all-gather ring off
    assert "fc1_fprop" not in te["ub_cfgs"] and "--disable-tp-comm-overlap-ag" not in te["megatron_flags"]
    assert any(n.startswith("fc2_dgrad: none.sm: no overlap decided") for n in te["notes"])  # no switch of its own
    assert te["ub_cfgs"]["fc2_dgrad"] == {"method": "ring_exchange"}  # so TE's default ring runs it
    assert te["ub_cfgs"]["proj_fprop"]["method"] == "pipeline" and te["ub_cfgs"]["fc2_fprop"]["use_ce"] is False
    assert set(A.TE_BULK) <= set(te["ub_cfgs"])
    # With the cost model: what TE cannot run as decided runs the fastest of what TE runs.
    finer = {**on, "qkv_fprop": "ficco.d4.ring.gemm_per_step.m.dma"}
    te = A.te_advice(decisions(finer), LLAMA_70B, TP8, "h100-nvswitch", pick=A.cost_model_pick(H100))
    assert te_problems(te["ub_cfgs"]) == []
    for name in ("qkv_fprop", "fc2_dgrad"):  # a finer ring; no switch of its own
        s = A.scenario_of(next(g for g in A.layer_gemms(LLAMA_70B) if g.name == name), LLAMA_70B, TP8, "h100-nvswitch")
        runs = A.schedule_of_te(s.op, te["ub_cfgs"][name], 8)
        assert runs in A.te_choices(s, H100) and any(n.startswith(name) and runs.name in n for n in te["notes"])
    # every all-gather off: the one switch; both reduce-scatters off: the other; nothing on: no overlap at all
    gathers_off = {**on, "qkv_fprop": "none.sm", "proj_dgrad": "none.dma"}
    te = A.te_advice(decisions(gathers_off), LLAMA_70B, TP8, "h100-nvswitch")
    assert "--disable-tp-comm-overlap-ag" in te["megatron_flags"] and te["model_parallel_config"] == {}
    nothing = dict.fromkeys(on, "none.sm")
    te = A.te_advice(decisions(nothing), LLAMA_70B, TP8, "h100-nvswitch")
    assert te["overlap"] is False and te["ub_cfgs"] == {} and te["megatron_flags"] == []


def test_ficco_advise_writes_each_format_from_the_selector(tmp_path):
    runner = CliRunner()
    base = ["advise", "--model", "llama3-70b", "--tp", "8", "--seq", "8192", "--hardware", "h100-nvswitch",
            "--heuristic-only"]  # the heuristic decides, as the runtime would without an export
    out = tmp_path / "ub.yaml"
    res = runner.invoke(main, [*base, "--format", "te", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert yaml.safe_load(out.read_text()) == got["te"]["ub_cfgs"]  # Megatron's loading: yaml.safe_load
    assert te_problems(got["te"]["ub_cfgs"]) == []
    assert got["decisions"]["by_source"] == {"heuristic": 6}
    assert set(got["decisions"]["per_gemm"]) == {g.name for g in A.layer_gemms(LLAMA_70B)}
    assert out.read_text().startswith("# ficco advise --format te: llama3-70b")
    vllm = runner.invoke(main, [*base, "--format", "vllm", "--json"])
    assert vllm.exit_code == 0, vllm.output
    v = json.loads(vllm.output)["vllm"]
    assert set(v["thresholds"]) == {"qkv", "o_proj", "gate_up", "down"}
    if v["sp_min_token_num"] is not None:
        config = json.loads(v["flags"][v["flags"].index("--compilation-config") + 1])
        assert config == {"pass_config": {"enable_sp": True, "fuse_gemm_comms": True,
                                          "sp_min_token_num": v["sp_min_token_num"]}}
    titan = runner.invoke(main, [*base, "--format", "torchtitan"])
    assert titan.exit_code == 0 and "async TP:" in titan.output and "--parallelism.tensor_parallel_degree 8" in titan.output
    assert ("--compile.enable_async_tensor_parallel" in titan.output) == ("async TP: on" in titan.output)


def test_the_machine_may_be_one_the_exported_selector_carries(tmp_path):
    from helpers.exports import FULL_RANGES, spec_dict, write_selector

    folder = write_selector(tmp_path / "sel", hardware_specs={"node-x": spec_dict("node-x")},
                            training_ranges={**FULL_RANGES, "hardware": ["node-x"]})
    args = ["advise", "--model", "llama3-8b", "--tp", "4", "--seq", "4096", "--hardware", "node-x",
            "--selector", str(folder), "--format", "te", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["decisions"]["by_source"].get("model", 0) >= 1 and got["measured_machine"] is False
    res = CliRunner().invoke(main, [*args[:-5], "--heuristic-only", "--format", "te"])
    assert res.exit_code != 0 and "--hardware node-x: not a preset" in res.output  # only that selector knows it


def test_an_existing_out_is_refused_and_left_as_it_was(tmp_path):
    out = tmp_path / "ub.yaml"
    out.write_text("mine")
    res = CliRunner().invoke(main, ["advise", "--model", "llama3-70b", "--tp", "8", "--seq", "8192", "--hardware",
                                    "h100-nvswitch", "--format", "te", "--out", str(out)])
    assert res.exit_code != 0 and "exists; nothing is overwritten" in res.output and out.read_text() == "mine"


def test_a_machine_without_copy_engines_is_advised_only_what_its_sms_run(tmp_path):
    # A GPU spec with zero copy engines: every decision, and so every ring, drives its sends
    # with SMs (use_ce false); nothing asks for copy engines it does not have.
    spec = yaml.safe_load((Path(__file__).parents[1] / "ficco_select" / "presets" / "h100-nvswitch.yaml").read_text())
    spec.update(name="h100-no-ce", copy_engines=0)
    path = tmp_path / "no-ce.yaml"
    path.write_text(yaml.safe_dump(spec))
    res = CliRunner().invoke(main, ["advise", "--model", "llama3-70b", "--tp", "8", "--seq", "8192", "--hardware",
                                    str(path), "--format", "te", "--heuristic-only", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert not any(d["schedule"].endswith(".dma") for d in got["decisions"]["per_gemm"].values())
    rings = [c for c in got["te"]["ub_cfgs"].values() if c["method"] == "ring_exchange"]
    assert all(c["use_ce"] is False for c in rings) and te_problems(got["te"]["ub_cfgs"]) == []


@pytest.mark.parametrize("args, needle", [
    (["--model", "nope"], "--model 'nope': not a catalog model"),
    (["--model", "llama3-70b", "--tp", "3"], "--tp 3 does not divide the model's heads"),
    (["--hidden", "4096", "--ffn", "11008"], "give --model NAME, or all of --hidden, --ffn, --heads and --layers"),
    (["--model", "llama3-70b", "--hardware", "not-a-machine"], "--hardware not-a-machine: not a preset"),
    (["--model", "llama3-70b", "--no-sequence-parallel"], "runs on sequence-parallel activations"),
    (["--model", "llama3-70b", "--format", "vllm", "--out", "x.yaml"], "--out writes the userbuffers YAML"),
])
def test_ficco_advise_refuses_in_one_line_naming_the_option(args, needle):
    base = {"--tp": "8", "--seq": "8192", "--hardware": "h100-nvswitch", "--format": "te"}
    for i in range(0, len(args) - 1):
        if args[i] in base:
            base[args[i]] = args[i + 1]
    given = [a for i, a in enumerate(args) if not (a in base or (i and args[i - 1] in base))]
    res = CliRunner().invoke(main, ["advise", *given, *(x for kv in base.items() for x in kv)])
    assert res.exit_code != 0 and needle in res.output, res.output
    assert "Traceback" not in res.output


ADVISE_H100 = ["advise", "--model", "llama3-70b", "--tp", "8", "--seq", "8192", "--hardware", "h100-nvswitch"]


def corrupt_exports(tmp_path: Path) -> dict[str, Path]:
    from helpers.exports import write_selector

    broken_json = write_selector(tmp_path / "broken-json")
    (broken_json / "selector.json").write_text("{ not json")
    no_model = write_selector(tmp_path / "no-model")
    (no_model / "model.json").unlink()
    return {"missing": tmp_path / "missing", "broken-json": broken_json, "no-model": no_model}


@pytest.mark.parametrize("which", ["missing", "broken-json", "no-model"])
def test_a_selector_the_user_names_that_cannot_be_read_is_refused_not_replaced_by_the_heuristic(tmp_path, which):
    folder = corrupt_exports(tmp_path)[which]
    out = tmp_path / "ub.yaml"
    from helpers.cli import refused
    refused([*ADVISE_H100, "--format", "te", "--selector", folder, "--out", out], f"--selector {folder}",
            written=out)
    refused([*ADVISE_H100, "--format", "vllm", "--selector", folder], f"--selector {folder}")


def test_heuristic_only_asks_for_the_heuristic_and_a_selector_with_it_is_refused(tmp_path):
    res = CliRunner().invoke(main, [*ADVISE_H100, "--format", "te", "--heuristic-only", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["decisions"]["by_source"] == {"heuristic": 6}
    from helpers.cli import refused
    refused([*ADVISE_H100, "--format", "te", "--heuristic-only", "--selector", tmp_path], "--heuristic-only",
            "--selector")


@pytest.mark.parametrize("fmt", ["te", "vllm", "torchtitan"])
def test_fp8_on_a_machine_without_fp8_is_refused_naming_the_machine(tmp_path, fmt):
    # A100 has no fp8 tensor cores: its spec gives no float8_e4m3fn peak.
    from helpers.cli import refused
    refused(["advise", "--model", "llama3-70b", "--tp", "8", "--seq", "8192", "--hardware", "a100-nvswitch",
             "--dtype", "fp8", "--format", fmt, "--heuristic-only"], "--dtype fp8", "a100-nvswitch", "no fp8")
    res = CliRunner().invoke(main, [*ADVISE_H100, "--dtype", "fp8", "--format", fmt, "--heuristic-only"])
    assert res.exit_code == 0, res.output  # H100 has fp8


def test_a_gpu_spec_without_copy_engines_is_advised_as_a_gpu_not_a_cpu(tmp_path):
    # Its kind is the spec's own field: a preset copied with copy_engines 0 stays a GPU (the GPU
    # heuristic, the device-count rule), where inferring the kind from copy engines made it a cpu.
    spec = yaml.safe_load((Path(__file__).parents[1] / "ficco_select" / "presets" / "h100-nvswitch.yaml").read_text())
    spec.update(name="h100-no-ce-kind", copy_engines=0)
    path = tmp_path / "no-ce.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_hardware(path).kind == "gpu"
    res = CliRunner().invoke(main, ["advise", "--hidden", "8192", "--ffn", "28672", "--heads", "64", "--layers", "80",
                                    "--tp", "16", "--seq", "8192", "--hardware", str(path), "--format", "te",
                                    "--heuristic-only", "--json"])
    assert res.exit_code == 0, res.output
    per_gemm = json.loads(res.output)["decisions"]["per_gemm"].values()
    assert all("world_size 16 exceeds the 8 devices" in d["reason"] for d in per_gemm), per_gemm
