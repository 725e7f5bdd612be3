"""Published collectives the switch reduces or multicasts (``switch_collective`` points): read,
predicted with ``costs.switch_collective_time``, fitted, refused where a cell is bad, and the
calls that pick the switch judged by their twin alone."""

import dataclasses

import pytest
from click.testing import CliRunner

from ficco_select.cli.main import main
from ficco_select.costs import OP_CODES, US, switch_collective_time
from ficco_select.data.published import PublishedError, compare, fit, read_published
from ficco_select.data.published_calls import Measured, judge
from ficco_select.hardware import load_hardware
from helpers.published import write_table

MULTIMEM = "PyTorch torch.ops.symm_mem.multimem_all_reduce_ (vLLM column symm_mem_multimem)"


def switch_row(mib: float, us, *, op="all_reduce", hardware="H100", P=8, baseline=MULTIMEM) -> dict:
    return {"source": "https://example.org/bench", "hardware": hardware, "gpus": str(P), "interconnect": "NVSwitch",
            "op": f"plain {op} (multimem)", "m": "", "n": "", "k": "", "dtype": "bf16", "world_size": str(P),
            "baseline": baseline, "method": "", "baseline_time_us": str(us), "method_time_us": "", "speedup": "",
            "notes": f"[grade A] message = {mib:g} MiB; hand-made for a test"}


@pytest.mark.parametrize("op, code", [("all_reduce", "gemm_ar"), ("reduce_scatter", "gemm_rs"), ("all_gather", "ag_gemm")])
def test_a_multimem_collective_is_read_as_a_switch_point_and_predicted_by_the_switch(tmp_path, op, code):
    [point] = read_published(write_table(tmp_path / "t.csv", [switch_row(4, 30.0, op=op)]))
    assert (point.kind, point.op, point.world_size, point.message_bytes) == ("switch_collective", op, 8, 4 * 2**20)
    hw = load_hardware("h100-nvswitch")
    expected = float(switch_collective_time(hw, OP_CODES[code], 4 * 2**20 / 8, 8)) / US
    [row] = compare([point])["points"]
    assert row["predicted_us"] == pytest.approx(expected, abs=0.01)
    # The library's collective is not the switch's: the same row timed by NCCL is a plain collective.
    [nccl] = read_published(write_table(tmp_path / "n.csv", [switch_row(4, 30.0, op=op, baseline="NCCL (default)")]))
    assert nccl.kind == "collective"


def test_the_fit_recovers_the_switch_terms_of_rows_the_cost_model_made(tmp_path):
    truth = dataclasses.replace(load_hardware("h100-nvswitch"), switch_bw_gbps=300.0, switch_latency_us=6.0)
    sizes = (0.5, 2, 8, 32, 128)
    rows = [switch_row(mib, round(float(switch_collective_time(truth, OP_CODES["gemm_ar"], mib * 2**20 / 8, 8)) / US, 4))
            for mib in sizes]
    fitted, report = fit(read_published(write_table(tmp_path / "t.csv", rows)), load_hardware("h100-nvswitch"),
                         fields=("switch_bw_gbps", "switch_latency_us"), kinds=("switch_collective",))
    assert fitted.switch_bw_gbps == pytest.approx(300.0, rel=0.01)
    assert fitted.switch_latency_us == pytest.approx(6.0, rel=0.01)
    assert report["rows"] == [1, 2, 3, 4, 5] and report["after"]["switch_collective_ape_median"] < 0.01


@pytest.mark.parametrize("cell, value, column", [("baseline_time_us", "fast", "baseline_time_us"),
                                                 ("baseline_time_us", "0.01", "baseline_time_us"),
                                                 ("notes", "[grade A] no size stated", "notes")])
def test_a_switch_row_with_a_bad_cell_names_the_file_row_and_column(tmp_path, cell, value, column):
    bad = {**switch_row(1, 20.0), cell: value}
    table = write_table(tmp_path / "t.csv", [switch_row(2, 25.0), bad])
    with pytest.raises(PublishedError, match=rf"t\.csv: row 2, column '{column}'"):
        read_published(table)


def test_a_switch_row_on_a_machine_whose_switch_does_not_reduce_is_refused(tmp_path):
    points = read_published(write_table(tmp_path / "t.csv", [switch_row(1, 20.0, hardware="A100")]))
    with pytest.raises(PublishedError, match=r"t\.csv: row 1, column 'baseline'.*switch_reduce: false"):
        compare(points)


def test_a_serial_baseline_that_reduces_in_the_switch_is_predicted_as_none_switch(tmp_path):
    gemm = {**switch_row(1, 40.0), "op": "gemm_ar", "m": "64", "n": "7168", "k": "12288",
            "baseline": "torch.mm then NCCL LDMC all-reduce (serial)", "notes": "[grade A] hand-made"}
    [ldmc] = read_published(write_table(tmp_path / "t.csv", [gemm]))
    [nccl] = read_published(write_table(tmp_path / "n.csv", [{**gemm, "baseline": "torch.mm then NCCL all_reduce"}]))
    assert (ldmc.kind, ldmc.baseline_schedule, nccl.baseline_schedule) == ("baseline", "none.switch", "none.sm")
    switch_us, library_us = (compare([p])["points"][0]["predicted_us"] for p in (ldmc, nccl))
    assert switch_us != library_us


def twin(speedup: float) -> Measured:
    return Measured(row=3, method="_multimem_all_gather_matmul", schedule="none.switch", speedup=speedup)


FUSED_WIN = Measured(row=2, method="a fused kernel", schedule="", speedup=1.3)
FUSED_LOSS = Measured(row=2, method="a fused kernel", schedule="", speedup=0.7)


@pytest.mark.parametrize("pick, measured, verdict", [
    ("none.switch", [FUSED_LOSS], "unverifiable"),  # not "the baseline": the library's baseline was measured
    ("none.switch", [FUSED_WIN], "unverifiable"),   # another method's win says nothing of the switch
    ("none.switch", [FUSED_LOSS, twin(1.087)], "right"),
    ("none.switch", [FUSED_WIN, twin(0.9)], "wrong"),
    ("none.switch", [twin(1.02)], "unverifiable"),
    ("ficco.d2.a2a.gemm_per_step.m.switch", [FUSED_WIN], "unverifiable"),
])
def test_a_switch_pick_is_judged_by_its_twin_alone(pick, measured, verdict):
    assert judge(pick, pick.startswith("none."), measured)[0] == verdict


def test_none_switch_is_the_baseline_where_the_measured_baseline_reduces_in_the_switch():
    assert judge("none.switch", True, [FUSED_LOSS], measured_baseline="none.switch")[0] == "right"
    assert judge("none.switch", True, [FUSED_WIN], measured_baseline="none.switch")[0] == "wrong"
    # There the library's own collective is the unmeasured one.
    verdict, why, _ = judge("none.sm", True, [FUSED_LOSS], measured_baseline="none.switch")
    assert verdict == "unverifiable" and "none.switch" in why


def test_validate_prints_the_switch_collectives_median_ape(tmp_path):
    table = write_table(tmp_path / "t.csv", [switch_row(0.5, 11.0), switch_row(128, 631.0)])
    result = CliRunner().invoke(main, ["sim", "validate", "--published", str(table)])
    assert result.exit_code == 0, result.output
    assert "switch_collective" in result.output and "h100-nvswitch: median switch_collective APE" in result.output
