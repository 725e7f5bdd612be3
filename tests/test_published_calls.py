"""The selector's calls on published GPU points (``ficco_select.data.published_calls``): each verdict on
hand-made points whose picks are pinned, and the calls in `ficco sim validate --published`."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ficco_select.data.published import PublishedError
from ficco_select.data.published_calls import judge, judge_calls
from ficco_select.cli.main import main
from ficco_select.runtime import selector as selector_module
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.selector import Selector
from ficco_select.schedule import parse
from helpers.published import VALIDATION, write_table
ASYNC_TP_RS = "torch.ops.symm_mem.fused_matmul_reduce_scatter (PyTorch async-TP)"
ASYNC_TP_AG = "torch.ops.symm_mem.fused_all_gather_matmul (PyTorch async-TP)"
FUSED = "Flux GemmRS (ReduceScatter fused into the GEMM epilogue)"


def row(op="gemm_rs", m=512, n=4096, k=114688, method=FUSED, baseline_us=100.0, speedup=None, *,
        hardware="H100 (SXM)", dtype="bf16", source="https://example.org/bench") -> dict:
    """One collective + GEMM row in the published schema; `speedup` sets the method's time."""
    return {"source": source, "hardware": hardware, "gpus": "8", "interconnect": "NVSwitch", "op": op,
            "m": m, "n": n, "k": k, "dtype": dtype, "world_size": 8, "baseline": "NCCL then cuBLAS (serial)",
            "method": method, "baseline_time_us": baseline_us,
            "method_time_us": "" if speedup is None else round(baseline_us / speedup, 4),
            "speedup": "" if speedup is None else speedup, "notes": "[grade A] hand-made for a test"}


class Pinned:
    """A selector that picks `schedule` everywhere: the verdict rule under test, not a model."""
    model = None

    def __init__(self, schedule: str) -> None:
        self.schedule = parse(schedule)

    def select(self, scenario) -> Decision:
        return Decision(self.schedule, "heuristic", 0.0, "pinned")


def only_call(path: Path, selector) -> dict:
    report = judge_calls(path, selector)
    [call] = report["points"]
    return call


def test_the_baseline_where_every_measured_overlap_loses_is_right(tmp_path):
    # The heuristic alone runs the baseline here (validation rows 23-24: a small m, a long k).
    table = write_table(tmp_path / "t.csv", [row(method=ASYNC_TP_RS, speedup=0.8), row(speedup=0.7)])
    call = only_call(table, Selector())
    assert (call["pick"], call["decided_by"]) == ("none.sm", "heuristic")
    assert call["rows"] == [1, 2] and [m["speedup"] for m in call["measured"]] == [0.8, 0.7]
    assert call["verdict"] == "right" and not call["twin_loses_over_10pct"]


def test_the_baseline_where_a_fused_kernel_pays_1_2x_is_wrong(tmp_path):
    table = write_table(tmp_path / "t.csv", [row(method=ASYNC_TP_RS, speedup=0.8), row(speedup=1.2)])
    call = only_call(table, Pinned("none.sm"))
    assert call["verdict"] == "wrong" and "fused@row2 pays 1.200" in call["why"]


def test_an_overlap_pick_whose_twin_loses_0_8x_is_wrong_by_more_than_10_percent(tmp_path):
    # The twin (async-TP's fused op is shard.ring.dma) outweighs the fused kernel's win.
    table = write_table(tmp_path / "t.csv", [row(method=ASYNC_TP_RS, speedup=0.8), row(speedup=1.2)])
    call = only_call(table, Pinned("shard.ring.dma"))
    assert call["verdict"] == "wrong" and call["twin_speedup"] == 0.8 and call["twin_loses_over_10pct"]
    summary = judge_calls(table, Pinned("shard.ring.dma"))["summary"]
    assert (summary["wrong"], summary["twin_loses_over_10pct"]) == (1, 1)


def test_a_twin_losing_by_5_percent_is_wrong_but_not_far(tmp_path):
    table = write_table(tmp_path / "t.csv", [row(op="ag_gemm", m=4096, n=53248, k=4096, method=ASYNC_TP_AG,
                                                 speedup=0.95)])
    call = only_call(table, Pinned("shard.ring.dma"))
    assert call["verdict"] == "wrong" and not call["twin_loses_over_10pct"]


def test_an_overlap_pick_where_some_method_pays_is_right(tmp_path):
    table = write_table(tmp_path / "t.csv", [row(method=ASYNC_TP_RS, speedup=1.0), row(speedup=1.06)])
    assert only_call(table, Pinned("ficco.d2.a2a.gemm_per_step.m.sm"))["verdict"] == "right"
    # Its twin wins by less than 5% and the fused kernel pays: right too.
    assert only_call(table, Pinned("shard.ring.dma"))["verdict"] == "right"


@pytest.mark.parametrize("speedups, all_lose", [((1.02,), False), ((0.9, 0.7), True)])
def test_an_overlap_pick_without_a_twin_where_nothing_pays_is_unverifiable(tmp_path, speedups, all_lose):
    table = write_table(tmp_path / "t.csv", [row(speedup=s) for s in speedups])
    report = judge_calls(table, Pinned("ficco.d2.a2a.gemm_per_step.m.sm"))
    [call] = report["points"]
    assert call["verdict"] == "unverifiable" and call["twin_speedup"] is None
    assert report["summary"]["unverifiable_all_lose"] == int(all_lose)


def test_the_rule_at_its_edges():
    from ficco_select.data.published_calls import Measured

    fused = lambda s: [Measured(1, FUSED, "", s)]  # noqa: E731
    assert judge("none.sm", True, fused(1.05))[0] == "wrong"   # pays at exactly 5%
    assert judge("none.sm", True, fused(1.0))[0] == "unverifiable"  # 1.0 neither pays nor loses
    assert judge("none.sm", True, [])[0] == "unverifiable"  # nothing timed: no evidence either way
    twin = [Measured(1, ASYNC_TP_RS, "shard.ring.dma", 1.02)]
    assert judge("shard.ring.dma", False, twin)[0] == "unverifiable"  # a twin winning by less than 5%
    two_twins = [Measured(1, ASYNC_TP_RS, "shard.ring.dma", 0.8), Measured(2, ASYNC_TP_RS, "shard.ring.dma", 1.1)]
    assert judge("shard.ring.dma", False, two_twins)[:3:2] == ("right", 1.1)  # the best twin counts


def test_rows_group_into_points_and_devices_without_a_preset_are_not_compared(tmp_path):
    table = write_table(tmp_path / "t.csv", [
        row(speedup=0.7), row(method=ASYNC_TP_RS, speedup=0.8),  # one point
        row(dtype="fp16", speedup=0.7),  # another dtype: another point
        row(source="https://example.org/other", speedup=0.7),  # another source: another point
        row(hardware="SM90 (model not stated)", speedup=1.3), row(hardware="RTX4090", speedup=1.3)])
    report = judge_calls(table, Pinned("none.sm"))
    assert [c["rows"] for c in report["points"]] == [[1, 2], [3], [4]]
    assert report["not_compared"] == [5, 6]
    assert report["summary"] == {"points": 3, "right": 3, "wrong": 0, "unverifiable": 0, "twin_loses_over_10pct": 0,
                                 "unverifiable_all_lose": 0, "decided_by": {"heuristic": 3}}


def test_a_fused_rows_bad_method_time_names_the_file_row_and_column(tmp_path):
    table = write_table(tmp_path / "t.csv", [row(speedup=0.7), {**row(), "method_time_us": "fast"}])
    with pytest.raises(PublishedError, match=r"t\.csv: row 2, column 'method_time_us': a number is needed"):
        judge_calls(table, Pinned("none.sm"))


def test_a_fused_row_without_a_method_time_is_its_baseline_alone(tmp_path):
    table = write_table(tmp_path / "t.csv", [row()])
    call = only_call(table, Pinned("none.sm"))
    assert call["measured"] == [] and call["verdict"] == "unverifiable"


# -- the CLI ----------------------------------------------------------------------------------
@pytest.fixture
def no_export(monkeypatch, tmp_path):
    """The default selector is the heuristic alone, whatever this machine has exported."""
    monkeypatch.setattr(selector_module, "DEFAULT_PATH", tmp_path / "no-export")


def test_sim_validate_published_prints_the_calls_and_their_counts(no_export):
    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(VALIDATION)])
    assert res.exit_code == 0, res.output
    assert "by the heuristic alone: no exported model" in res.output
    # GB300 TP8 (rows 84-94) times NCCL's LDMC all-reduce, a switch collective: none.sm there has no
    # measured twin (m = 256, 512, 1024: unverifiable), none.switch is the baseline measured.
    assert ("calls on 35 points: right 20, wrong 1 (twin loses by more than 10%: 0), unverifiable 14 "
            "(every measured method loses: 6); decided by heuristic 35") in res.output
    assert "pick none.sm (heuristic); measured fused@row94 1.095 -> UNVERIFIABLE: none.sm: no measured twin" in res.output
    assert "calls not compared (no preset is their device): rows 57, 58, 59" in res.output
    assert "rows 23,24" in res.output and "-> RIGHT: the baseline, where every measured method loses" in res.output

    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(VALIDATION), "--json"])
    calls = json.loads(res.output)["calls"]
    assert calls["selector"] == "heuristic" and calls["summary"]["right"] == 20


def test_sim_validate_published_judges_an_exported_model(tmp_path):
    from helpers.exports import write_selector

    folder = write_selector(tmp_path / "sel")
    table = write_table(tmp_path / "t.csv", [row(op="ag_gemm", m=4096, n=53248, k=4096, speedup=1.2)])
    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(table), "--model", str(folder), "--json"])
    assert res.exit_code == 0, res.output
    calls = json.loads(res.output)["calls"]
    assert calls["selector"] == "model" and calls["summary"]["decided_by"] == {"model": 1}
    assert calls["points"][0]["verdict"] == "right"


def test_sim_validate_refuses_a_model_folder_it_cannot_use(tmp_path):
    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(VALIDATION), "--model",
                                    str(tmp_path / "missing")])
    assert res.exit_code == 1 and "no usable exported selector there" in res.output
    res = CliRunner().invoke(main, ["sim", "validate", "--dataset", "x.parquet", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "--model and --fallback go with --published" in res.output


def test_sim_validate_published_judges_a_fallback_alone_under_the_models_gpu_rule(tmp_path):
    # --fallback cost_model: the cost model's pick at each point in the model's place; the
    # export's GPU do-no-harm rule still judges it (here a margin no simulated gain reaches).
    from helpers.exports import write_selector

    from ficco_select.hardware import load_hardware
    from ficco_select.runtime.no_harm import cost_model_pick
    from ficco_select.scenario import Scenario
    from ficco_select.schedule import legal_candidates

    table = write_table(tmp_path / "t.csv", [row(op="ag_gemm", m=16384, n=53248, k=16384, speedup=1.2)])
    free = write_selector(tmp_path / "free")
    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(table), "--model", str(free),
                                    "--fallback", "cost_model", "--json"])
    assert res.exit_code == 0, res.output
    calls = json.loads(res.output)["calls"]
    [call] = calls["points"]
    assert calls["selector"] == "cost_model fallback" and calls["summary"]["decided_by"] == {"cost_model": 1}
    s = Scenario(group="published", op="ag_gemm", m=16384, n=53248, k=16384, dtype="bfloat16", world_size=8,
                 hardware="h100-nvswitch")
    assert call["pick"] == cost_model_pick(s, load_hardware("h100-nvswitch"), legal_candidates(s, "cuda")).name
    assert call["verdict"] == "right" and not call["pick"].startswith("none.")
    strict = write_selector(tmp_path / "strict", gpu_no_harm={"split_us": 0.0, "small_margin": 0.0, "large_margin": 5.0})
    res = CliRunner().invoke(main, ["sim", "validate", "--published", str(table), "--model", str(strict),
                                    "--fallback", "cost_model", "--json"])
    [call] = json.loads(res.output)["calls"]["points"]
    assert call["pick"] == "none.sm" and call["verdict"] == "wrong"  # the baseline where overlap paid 1.2x
