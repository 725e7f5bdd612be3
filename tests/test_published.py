"""The published-measurements table: its reader on hand-made rows, the comparison against the
cost model, the fit, and the commands that print them."""

import csv
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.cli import FICCO, refused

import ficco_select.data.published as published
from ficco_select.data.published import COLUMNS, PublishedError, compare, fit, packaged, predict, read_published
from ficco_select.cli.main import main as cli
from ficco_select.costs import OP_CODES, US, collective_time, gemm_time, transfer_time
from ficco_select.hardware import load_hardware

ROOT = Path(__file__).resolve().parents[1]
URL = "https://example.org/benchmark"
AG_POINT = {"source": URL, "hardware": "H100 (SXM assumed)", "gpus": "8", "interconnect": "NVSwitch", "op": "ag_gemm",
            "m": "4096.0", "n": "53248.0", "k": "8192.0", "dtype": "bf16", "world_size": "8",
            "baseline": "NCCL all_gather then torch.matmul",
            "method": "torch.ops.symm_mem.fused_all_gather_matmul (async-TP)", "baseline_time_us": "900",
            "method_time_us": "800", "speedup": "1.125", "notes": "[grade A] hand-made"}
COLLECTIVE = {**{c: "" for c in COLUMNS}, "source": URL, "hardware": "H100", "gpus": "8",
              "op": "plain all_gather (NCCL)", "dtype": "bf16", "world_size": "8", "baseline_time_us": "40",
              "notes": "[grade A] message = full gathered buffer 8 MiB"}
GEMM = {**{c: "" for c in COLUMNS}, "source": URL, "hardware": "MI300X", "gpus": "1", "op": "plain GEMM (torch.matmul)",
        "m": "4096", "n": "4096", "k": "4096", "dtype": "bf16", "world_size": "1", "baseline_time_us": "300",
        "notes": "[grade B] derived"}
BUSBW = {**{c: "" for c in COLUMNS}, "source": URL, "hardware": "A100-SXM4-80GB", "gpus": "8 (inferred)",
         "op": "plain all_reduce (nccl-tests)", "notes": "[grade C] all_reduce busbw ~200 GB/s"}


def write(tmp_path, rows, name="points.csv"):
    path = tmp_path / name
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_each_kind_of_row_becomes_its_point(tmp_path):
    fused = {**AG_POINT, "method": "a fused Triton kernel", "method_time_us": "700", "speedup": ""}
    points = read_published(write(tmp_path, [AG_POINT, fused, COLLECTIVE, GEMM, BUSBW]))
    assert [p.kind for p in points] == ["overlap", "baseline", "collective", "gemm", "bandwidth"]
    overlap, baseline, collective, gemm, busbw = points
    assert (overlap.hardware, overlap.schedule, overlap.dtype, overlap.m, overlap.speedup) == (
        "h100-nvswitch", "shard.ring.dma", "bfloat16", 4096, 900 / 800)
    assert baseline.schedule == "" and baseline.method_us == 700.0  # a fused kernel: no schedule; its time kept
    assert (collective.op, collective.message_bytes, collective.world_size) == ("all_gather", 8 << 20, 8)
    assert (gemm.hardware, gemm.world_size, gemm.grade) == ("mi300x-8", 1, "B")
    assert (busbw.hardware, busbw.op, busbw.bandwidth_gbps, busbw.world_size) == ("a100-nvswitch", "all_reduce", 200.0, 8)


@pytest.mark.parametrize("change, needle", [
    ({"source": "kraken PR 2"}, "row 1, column 'source'"),
    ({"hardware": "(unknown)"}, "row 1, column 'hardware'"),
    ({"notes": "hand-made"}, "row 1, column 'notes'"),
    ({"baseline_time_us": "fast"}, "row 1, column 'baseline_time_us'"),
    ({"baseline_time_us": "-3"}, "row 1, column 'baseline_time_us'"),
    ({"m": "1024.5"}, "row 1, column 'm'"),
    ({"dtype": "int4"}, "row 1, column 'dtype'"),
    ({"op": "plain broadcast"}, "row 1, column 'op'"),
])
def test_a_bad_cell_is_named_by_file_row_and_column(tmp_path, change, needle):
    path = write(tmp_path, [{**AG_POINT, **change}])
    with pytest.raises(PublishedError, match=needle) as e:
        read_published(path)
    assert str(path) in str(e.value)


def test_a_device_without_a_preset_is_read_and_left_out_of_the_comparison(tmp_path):
    points = read_published(write(tmp_path, [AG_POINT, {**AG_POINT, "hardware": "RTX4090 (a GPU no preset describes)"}]))
    assert [p.hardware for p in points] == ["h100-nvswitch", ""]
    report = compare(points)
    assert [r["row"] for r in report["points"]] == [1] and report["unmatched"] == [2]


def test_a_collective_without_its_message_or_a_table_without_a_column_is_refused(tmp_path):
    with pytest.raises(PublishedError, match="row 2, column 'notes'"):
        read_published(write(tmp_path, [COLLECTIVE, {**COLLECTIVE, "notes": "[grade A] no size"}]))
    no_source = [{c: v for c, v in AG_POINT.items() if c != "source"}]
    with pytest.raises(PublishedError, match="column 'source' is missing"):
        read_published(write(tmp_path, no_source, "cut.csv"))
    with pytest.raises(PublishedError, match="no such file"):
        read_published(tmp_path / "absent.csv")


def test_the_committed_table_reads_whole_with_a_url_on_every_row():
    points = read_published(packaged())
    assert len(points) == 209 and all(p.source.startswith("https://") for p in points)
    assert sum(p.kind == "sm_collective" for p in points) == 45
    assert sum(p.kind == "overlap" for p in points) == 9


@pytest.mark.parametrize(("preset", "fields", "kinds", "held", "rows"), [
    ("b200-nvswitch", ("gemm_efficiency", "gemm_launch_us", "gemm_mem_efficiency"), ("gemm",), {}, None),
    ("b200-nvswitch", ("coll_bw_gbps", "coll_latency_us"), ("bandwidth", "collective"), {}, None),
    ("gb200-nvl72", ("coll_bw_gbps",), ("bandwidth", "collective"), {"coll_latency_us": 8.15}, None),
    ("b300-nvswitch", ("coll_bw_gbps", "coll_latency_us"), ("bandwidth",), {}, None),
    ("b200-nvswitch", ("sm_comm_latency_us",), ("sm_collective",), {}, None),  # B300's sm_bw_gbps held
    ("b300-nvswitch", ("sm_comm_latency_us", "sm_bw_gbps"), ("sm_collective",), {}, None),
    ("b300-nvswitch", ("gemm_efficiency", "gemm_launch_us", "gemm_mem_efficiency"), ("gemm",), {}, None),
])
def test_the_blackwell_presets_hold_what_their_published_rows_fit(preset, fields, kinds, held, rows):
    # The committed terms are the fit to the committed rows (GEMM efficiency times H100's
    # in-job / best-shape ratio, 0.827): refitting reproduces them.
    spec = load_hardware(preset)
    points = [p for p in read_published(packaged()) if rows is None or rows[0] <= p.row <= rows[1]]
    fitted, _ = fit(points, dataclasses.replace(spec, **held), fields=fields, kinds=kinds)
    for field in fields:
        committed = getattr(spec, field) / (0.827 if field == "gemm_efficiency" else 1.0)
        assert getattr(fitted, field) == pytest.approx(committed, rel=0.02), field


def test_predictions_are_the_cost_model_s(tmp_path):
    collective, gemm = read_published(write(tmp_path, [COLLECTIVE, GEMM]))
    h100, mi300x = load_hardware("h100-nvswitch"), load_hardware("mi300x-8")
    assert predict(collective, h100)["time_us"] == float(collective_time(h100, OP_CODES["ag_gemm"], (8 << 20) / 8, 8)) / US
    assert predict(gemm, mi300x)["time_us"] == float(gemm_time(mi300x, 4096, 4096, 4096, 2, 1307.4e12)) / US


def test_compare_scores_speedups_and_wins(tmp_path):
    overlap, = read_published(write(tmp_path, [AG_POINT]))
    report = compare([overlap])
    row = report["points"][0]
    predicted = predict(overlap, load_hardware("h100-nvswitch"))
    assert row["predicted_speedup"] == round(predicted["time_us"] / predicted["method_us"], 3)
    assert row["agrees"] == (row["predicted_speedup"] > 1)  # measured 1.125: a win
    summary = report["presets"]["h100-nvswitch"]
    assert (summary["baselines"], summary["overlap_points"]) == (1, 1)


A2A_BUSBW = {**{c: "" for c in COLUMNS}, "source": URL, "hardware": "H100", "gpus": "8",
             "op": "plain all_to_all (nccl-tests alltoall_perf)", "world_size": "8",
             "notes": "[grade A] busbw 300 GB/s ((P - 1) shards / time); 64 MiB payload"}
A2A_TIMED = {**A2A_BUSBW, "op": "plain all_to_all (nccl-tests alltoall_perf)", "dtype": "bf16", "baseline_time_us": "250",
             "notes": "[grade C] message = full send buffer 64 MiB"}


def test_a_plain_all_to_all_is_a2a_gemm_s_collective_and_compare_predicts_it(tmp_path):
    busbw, timed = read_published(write(tmp_path, [A2A_BUSBW, A2A_TIMED]))
    assert (busbw.kind, busbw.op, busbw.hardware, busbw.bandwidth_gbps, busbw.message_bytes) == (
        "bandwidth", "all_to_all", "h100-nvswitch", 300.0, 64 << 20)
    assert (timed.kind, timed.op, timed.world_size, timed.message_bytes) == ("collective", "all_to_all", 8, 64 << 20)
    h100 = load_hardware("h100-nvswitch")
    moved = float(collective_time(h100, OP_CODES["a2a_gemm"], (64 << 20) / 8, 8))
    assert predict(timed, h100)["time_us"] == moved / US
    assert predict(busbw, h100)["bandwidth_gbps"] == pytest.approx(7 * (64 << 20) / 8 / moved / 1e9)
    report = compare([busbw, timed])
    assert [(r["row"], r["op"], r["hardware"]) for r in report["points"]] == [
        (1, "all_to_all", "h100-nvswitch"), (2, "all_to_all", "h100-nvswitch")]
    assert report["points"][0]["predicted_gbps"] > 0 and report["points"][1]["predicted_us"] > 0
    summary = report["presets"]["h100-nvswitch"]
    assert (summary["bandwidths"], summary["collectives"]) == (1, 1)

SM_ALL_REDUCE = {**{c: "" for c in COLUMNS}, "source": URL, "hardware": "B200", "gpus": "8",
                 "op": "plain all_reduce (symmetric memory)", "dtype": "bf16", "world_size": "8",
                 "baseline": "vLLM benchmark column symm_mem_two_shot (torch.ops.symm_mem.two_shot_all_reduce_)",
                 "baseline_time_us": "20", "notes": "[grade B] message = tensor 1 MiB"}


def test_an_sm_all_reduce_is_predicted_with_the_sm_transfers_of_a_schedule_s_steps(tmp_path):
    one_shot = {**SM_ALL_REDUCE, "baseline": "vLLM benchmark column ca_1stage"}
    nccl = {**SM_ALL_REDUCE, "baseline": "vLLM PyNcclCommunicator all_reduce (NCCL)"}
    two, one, library = read_published(write(tmp_path, [SM_ALL_REDUCE, one_shot, nccl]))
    assert [(p.kind, p.shots) for p in (two, one, library)] == [
        ("sm_collective", 2), ("sm_collective", 1), ("collective", 0)]
    b200, size = load_hardware("b200-nvswitch"), 1 << 20
    # Two shots: a reduce-scatter step, then an all-gather step, of 1/8 of the tensor to each of 7
    # peers at once, the reduce-scatter's adds; one shot: the whole tensor from each peer, its adds.
    step = float(transfer_time(b200, size / 8, 7, False, 8))
    adds = 7 * 3 * (size / 8) / (b200.mem_bw_gbps * 1e9)
    assert predict(two, b200)["time_us"] == pytest.approx((2 * step + adds) / US)
    whole = float(transfer_time(b200, size, 7, False, 8)) + 7 * 3 * size / (b200.mem_bw_gbps * 1e9)
    assert predict(one, b200)["time_us"] == pytest.approx(whole / US)
    # Its fixed cost is the sm transfer's (per step), not the library's; NCCL's is the library's.
    cheaper = dataclasses.replace(b200, sm_comm_latency_us=b200.sm_comm_latency_us - 1.0, coll_latency_us=1.0)
    assert predict(two, b200)["time_us"] - predict(two, cheaper)["time_us"] == pytest.approx(2.0)
    assert predict(one, b200)["time_us"] - predict(one, cheaper)["time_us"] == pytest.approx(1.0)
    assert predict(library, b200)["time_us"] == float(collective_time(b200, OP_CODES["gemm_ar"], size / 8, 8)) / US
    summary = compare([two, one, library])["presets"]["b200-nvswitch"]
    assert (summary["sm_collectives"], summary["collectives"]) == (2, 1)
    with pytest.raises(PublishedError, match="row 1, column 'baseline'.*all-reduce, the op says all_gather"):
        read_published(write(tmp_path, [{**SM_ALL_REDUCE, "op": "plain all_gather"}]))


def test_an_sm_transfer_s_bandwidth_caps_what_sm_steps_move_and_nothing_else():
    b300 = load_hardware("b300-nvswitch")
    off = dataclasses.replace(b300, sm_bw_gbps=0.0)
    at_link = dataclasses.replace(b300, sm_bw_gbps=b300.link_bw_gbps)
    sizes, link = np.array([0.0, 4096.0, 64 << 20]), b300.link_bw_gbps * 1e9
    # Off, or at the link's rate: the link's transfers, bit for bit.
    for concurrent in (1, 5):
        assert np.array_equal(transfer_time(off, sizes, concurrent, False, 6),
                              transfer_time(at_link, sizes, concurrent, False, 6))
        assert np.array_equal(transfer_time(off, sizes, concurrent, False, 6)[1:],
                              b300.sm_comm_latency_us * US + sizes[1:] / (link / concurrent))
    # Set: concurrent transfers share it (a switch port shares the link the same way).
    capped = dataclasses.replace(b300, sm_bw_gbps=300.0)
    assert float(transfer_time(capped, 64 << 20, 5, False, 6)) == pytest.approx(
        b300.sm_comm_latency_us * US + 5 * (64 << 20) / 300e9)
    full_mesh = dataclasses.replace(capped, topology="fully_connected")  # a link per peer: only the cap binds
    assert float(transfer_time(full_mesh, 64 << 20, 5, False, 6)) == pytest.approx(
        b300.sm_comm_latency_us * US + 5 * (64 << 20) / 300e9)
    # A copy engine's transfers are not SM loads and stores.
    assert np.array_equal(transfer_time(capped, sizes, 5, True, 6), transfer_time(off, sizes, 5, True, 6))


def test_an_sm_all_to_all_is_one_step_of_sm_transfers_to_every_peer(tmp_path):
    deep_ep = {**A2A_BUSBW, "hardware": "B200", "op": "plain all_to_all (HybridEP dispatch)",
               "baseline": "HybridEP dispatch (16 SMs)"}
    sm_driven, library = read_published(write(tmp_path, [deep_ep, {**A2A_BUSBW, "hardware": "B200"}]))
    assert (sm_driven.kind, sm_driven.shots, library.kind, library.shots) == ("bandwidth", 1, "bandwidth", 0)
    b200, shard = load_hardware("b200-nvswitch"), (64 << 20) / 8
    step = float(transfer_time(b200, shard, 7, False, 8))
    assert predict(sm_driven, b200)["bandwidth_gbps"] == pytest.approx(7 * shard / step / 1e9)
    moved = float(collective_time(b200, OP_CODES["a2a_gemm"], shard, 8))
    assert predict(library, b200)["bandwidth_gbps"] == pytest.approx(7 * shard / moved / 1e9)
    assert predict(sm_driven, b200)["bandwidth_gbps"] < predict(sm_driven, dataclasses.replace(
        b200, sm_bw_gbps=0.0))["bandwidth_gbps"]


def test_a_fit_recovers_an_sm_transfer_s_bandwidth_and_fixed_cost(tmp_path):
    truth = dataclasses.replace(load_hardware("b300-nvswitch"), sm_comm_latency_us=4.5, sm_bw_gbps=300.0)
    rows = []
    for kib in (16, 256, 4096, 65536):
        point = {**SM_ALL_REDUCE, "hardware": "B300", "notes": f"[grade A] message = tensor {kib} KiB"}
        p, = read_published(write(tmp_path, [point], f"s{kib}.csv"))
        rows.append({**point, "baseline_time_us": repr(predict(p, truth)["time_us"])})
    start = dataclasses.replace(truth, sm_comm_latency_us=9.0, sm_bw_gbps=0.0)  # off: the fit starts below the link
    fitted, report = fit(read_published(write(tmp_path, rows)), start,
                         fields=("sm_comm_latency_us", "sm_bw_gbps"), kinds=("sm_collective",))
    assert (fitted.sm_comm_latency_us, fitted.sm_bw_gbps) == (pytest.approx(4.5, rel=0.01), pytest.approx(300, rel=0.01))
    assert report["after"]["sm_collective_ape_median"] < 0.01


def test_a_fit_recovers_an_sm_transfer_s_fixed_cost_from_sm_all_reduces(tmp_path):
    truth = dataclasses.replace(load_hardware("b300-nvswitch"), sm_comm_latency_us=4.5)
    rows = []
    for kib in (16, 256, 4096):
        point = {**SM_ALL_REDUCE, "hardware": "B300", "notes": f"[grade A] message = tensor {kib} KiB"}
        p, = read_published(write(tmp_path, [point], f"s{kib}.csv"))
        rows.append({**point, "baseline_time_us": repr(predict(p, truth)["time_us"])})
    fitted, report = fit(read_published(write(tmp_path, rows)), load_hardware("b300-nvswitch"),
                         fields=("sm_comm_latency_us",), kinds=("sm_collective",))
    assert fitted.sm_comm_latency_us == pytest.approx(4.5, rel=0.01)
    assert report["after"]["sm_collective_ape_median"] < 0.01


def test_a_fit_recovers_the_numbers_that_made_the_points(tmp_path):
    truth = dataclasses.replace(load_hardware("h100-nvswitch"), coll_latency_us=9.0, coll_bw_gbps=250.0)
    rows = []
    for mib in (2, 8, 32, 128):  # collectives "measured" on the truth
        point = {**COLLECTIVE, "notes": f"[grade A] message = full gathered buffer {mib} MiB"}
        p, = read_published(write(tmp_path, [point], f"c{mib}.csv"))
        rows.append({**point, "baseline_time_us": repr(predict(p, truth)["time_us"])})
    points = read_published(write(tmp_path, rows))
    start = dataclasses.replace(truth, coll_latency_us=20.0, coll_bw_gbps=400.0)
    fitted, report = fit(points, start, fields=("coll_latency_us", "coll_bw_gbps"), kinds=("collective",))
    assert fitted.coll_latency_us == pytest.approx(9.0, rel=0.01)
    assert fitted.coll_bw_gbps == pytest.approx(250.0, rel=0.01)
    assert report["rows"] == [1, 2, 3, 4] and report["after"]["collective_ape_median"] < 0.01
    with pytest.raises(PublishedError, match="no overlap or collective points of mi300x-8"):
        fit(points, load_hardware("mi300x-8"))
    with pytest.raises(PublishedError, match="cannot fit field 'topology'"):
        fit(points, start, fields=("topology",))


def test_the_commands_print_the_comparison_the_fit_and_the_map(tmp_path):
    runner = CliRunner()
    path = write(tmp_path, [AG_POINT, COLLECTIVE])
    shown = runner.invoke(cli, ["sim", "validate", "--published", str(path)])
    assert shown.exit_code == 0, shown.output
    assert "h100-nvswitch: median serial baseline APE" in shown.output and "shard.ring.dma" in shown.output
    # Another spec for a preset's points: its numbers, not the preset's.
    other = tmp_path / "slow.yaml"
    spec = json.loads(runner.invoke(cli, ["hardware", "show", "h100-nvswitch", "--json"]).output)
    import yaml
    other.write_text(yaml.safe_dump({**spec, "coll_bw_gbps": 30.0}))
    slow = json.loads(runner.invoke(cli, ["sim", "validate", "--published", str(path), "--json",
                                          "--hardware", f"h100-nvswitch={other}"]).output)
    fast = json.loads(runner.invoke(cli, ["sim", "validate", "--published", str(path), "--json"]).output)
    assert slow["points"][1]["predicted_us"] > 5 * fast["points"][1]["predicted_us"]
    assert runner.invoke(cli, ["sim", "validate"]).exit_code == 2  # --dataset or --published
    fitted = runner.invoke(cli, ["sim", "fit", "--published", str(path), "--hardware", "h100-nvswitch",
                                 "--fields", "coll_bw_gbps", "--kinds", "collective"])
    assert fitted.exit_code == 0 and "coll_bw_gbps" in fitted.output and "fitted to rows 2" in fitted.output
    bad = runner.invoke(cli, ["sim", "fit", "--published", str(path), "--hardware", "h100-nvswitch", "--set", "x=1"])
    assert bad.exit_code == 1 and "--set 'x=1'" in bad.output
    mapped = json.loads(runner.invoke(cli, ["sim", "map", "--hardware", "h100-nvswitch", "--dtype", "bfloat16",
                                            "--json"]).output)
    assert {r["op"] for r in mapped} == {"ag_gemm", "gemm_rs", "a2a_gemm", "gemm_ar", "gemm_a2a"}
    assert all(0 <= r["overlap_pays"] <= 1 and r["shard"] + r["ficco"] == pytest.approx(r["overlap_pays"])
               for r in mapped)


REPO = Path(__file__).parents[1]
PUBLISHED = REPO / "data" / "published"


# -- published tables --------------------------------------------------------------------
@pytest.fixture
def million_rows(tmp_path):
    """A published table of a million rows: the shortest committed row, repeated (~240 MB)."""
    header, *rows = (PUBLISHED / "gpu-calibration.csv").read_text().splitlines(keepends=True)
    row = min(rows, key=len)
    path = tmp_path / "million.csv"
    with path.open("w") as f:
        f.write(header)
        for _ in range(100):
            f.write(row * 10_000)
    yield path
    path.unlink()


def test_a_published_table_of_a_million_rows_is_refused_at_once(million_rows):
    for command in (["sim", "validate", "--published", million_rows],
                    ["sim", "fit", "--published", million_rows, "--hardware", "a100-nvswitch"]):
        start = time.monotonic()
        res = subprocess.run([*FICCO, *map(str, command)], cwd=REPO, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
        errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
        assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
        assert str(million_rows) in errors[0] and f"more than {published.MAX_ROWS} rows" in errors[0]
        assert took < 60, f"{command[:2]} took {took:.0f} s to refuse"


def test_every_committed_row_is_within_the_physical_bounds():
    for name in ("gpu-calibration.csv", "validation.csv"):
        assert read_published(PUBLISHED / name)


@pytest.mark.parametrize("point, change, column", [
    (GEMM, {"m": "1e300"}, "m"),
    (GEMM, {"n": str(2**31 + 1)}, "n"),
    (AG_POINT, {"k": "1e20"}, "k"),
    (AG_POINT, {"world_size": "1e300"}, "world_size"),
    ({**BUSBW, "gpus": "1e300 (inferred)"}, {}, "gpus"),
    (AG_POINT, {"baseline_time_us": "1e308"}, "baseline_time_us"),
    (AG_POINT, {"method_time_us": "3.6e12"}, "method_time_us"),
    (COLLECTIVE, {"notes": "[grade A] message = full gathered buffer 99999999999999 GiB"}, "notes"),
    (BUSBW, {"notes": "[grade C] all_reduce busbw ~9999999999 GB/s"}, "notes"),
])
def test_magnitudes_no_gpu_measures_are_refused_naming_file_row_and_column(tmp_path, point, change, column):
    path = write(tmp_path, [AG_POINT, {**point, **change}])
    for command in (["sim", "validate", "--published", path],
                    ["sim", "fit", "--published", path, "--hardware", "h100-nvswitch"]):
        refused(command, str(path), "row 2", f"column '{column}'")


def test_the_fixed_costs_of_a_call_are_what_call_costs_takes_out(tmp_path):
    # scripts/call_costs.py: a GEMM's difference is its launch, an all-gather's its library's
    # per-call latency (one phase), on hand-made points.
    # At a collective + GEMM point it prints the best overlap gain both ways beside the measured one.
    fused = {**AG_POINT, "method": "a fused Triton kernel", "method_time_us": "750", "speedup": "1.2"}
    path = write(tmp_path, [GEMM | {"m": "1", "n": "1280", "k": "8192"}, COLLECTIVE, fused])
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "call_costs.py"), str(path), "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(res.stdout)
    gemm, gather = out["rows"][:2]
    mi300x, h100 = load_hardware("mi300x-8"), load_hardware("h100-nvswitch")
    assert gemm["with_call_costs"] - gemm["without"] == pytest.approx(mi300x.gemm_launch_us - 0.001, abs=0.02)
    assert gather["with_call_costs"] - gather["without"] == pytest.approx(h100.coll_latency_us - 0.001, abs=0.02)
    gain, = out["best_gains"]
    best = predict(read_published(path)[2], h100)
    assert (gain["rows"], gain["measured"]) == ([3], round(900 / 750, 3))
    assert gain["with_call_costs"] == round(best["time_us"] / best["best_us"], 3) and gain["without"] > 0


@pytest.mark.parametrize("point, change, column", [
    (AG_POINT, {"baseline_time_us": "1e-300"}, "baseline_time_us"),
    (COLLECTIVE, {"baseline_time_us": "0.0000001"}, "baseline_time_us"),
    (GEMM, {"baseline_time_us": "1e-300"}, "baseline_time_us"),
    (AG_POINT, {"method_time_us": "1e-300"}, "method_time_us"),
    ({**AG_POINT, "method": "a fused kernel", "method_time_us": ""}, {"speedup": "1e-300"}, "speedup"),
    ({**AG_POINT, "method": "a fused kernel", "method_time_us": ""}, {"speedup": "1e308"}, "speedup"),
    (COLLECTIVE, {"notes": "[grade A] message = full gathered buffer 0.0000001 MiB"}, "notes"),
    (BUSBW, {"notes": "[grade C] all_reduce busbw ~0.0000001 GB/s"}, "notes"),
    (COLLECTIVE, {"world_size": "1"}, "world_size"),
    ({**BUSBW, "gpus": "1"}, {}, "gpus"),
])
def test_a_time_or_size_too_small_for_any_gpu_is_refused_naming_file_row_and_column(tmp_path, point, change, column):
    # Such a number, divided into an error, printed a 180-digit APE.
    path = write(tmp_path, [AG_POINT, {**point, **change}])
    for command in (["sim", "validate", "--published", path],
                    ["sim", "fit", "--published", path, "--hardware", "h100-nvswitch"]):
        refused(command, str(path), "row 2", f"column '{column}'")


@pytest.mark.parametrize("column", ["gpus", "speedup"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e308", "many"])
def test_a_gpus_or_speedup_cell_no_measurement_has_is_refused_naming_file_row_and_column(tmp_path, column, value):
    # Both cells are redundant on a row with its times and world size, and were never read there.
    path = write(tmp_path, [AG_POINT, {**AG_POINT, column: value}])
    refused(["sim", "validate", "--published", path], str(path), "row 2", f"column '{column}'")


def test_a_speedup_its_times_contradict_is_refused(tmp_path):
    baseline, method = float(AG_POINT["baseline_time_us"]), float(AG_POINT["method_time_us"])
    path = write(tmp_path, [AG_POINT, {**AG_POINT, "speedup": f"{1.5 * baseline / method:.3f}"}])
    refused(["sim", "validate", "--published", path], str(path), "row 2", "column 'speedup'",
            "baseline_time_us / method_time_us")
    within = write(tmp_path, [AG_POINT, {**AG_POINT, "speedup": f"{1.01 * baseline / method:.3f}"}], "within.csv")
    assert len(read_published(within)) == 2  # a published figure's rounding


def test_a_row_beyond_its_machine_s_devices_is_refused_naming_file_row_and_column(tmp_path):
    # A spec describes one node: a 16-GPU measurement says nothing of its terms (the device-count rule).
    path = write(tmp_path, [AG_POINT, {**AG_POINT, "world_size": "16", "gpus": "16"}])
    for command in (["sim", "validate", "--published", path],
                    ["sim", "fit", "--published", path, "--hardware", "h100-nvswitch"]):
        refused(command, str(path), "row 2", "column 'world_size'", "exceeds the 8 devices of h100-nvswitch")
    import yaml
    small = tmp_path / "four.yaml"
    small.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "ficco_select" / "presets" / "h100-nvswitch.yaml")
                                                      .read_text()), "name": "four", "devices": 4}))
    refused(["sim", "validate", "--published", write(tmp_path, [AG_POINT], "one.csv"),
             "--hardware", f"h100-nvswitch={small}"], "one.csv", "row 1", "column 'world_size'", "4 devices")


@pytest.mark.parametrize("setting, field", [
    ("devices=2.5", "devices"), ("link_bw_gbps=-5", "link_bw_gbps"), ("mem_bw_gbps=nan", "mem_bw_gbps"),
    ("coll_bw_gbps=1e308", "coll_bw_gbps"), ("gemm_efficiency=0", "gemm_efficiency"),
    ("dma_bw_gbps=fast", "dma_bw_gbps"), ("compute_units=inf", "compute_units"),
])
def test_a_set_number_no_machine_has_is_refused_naming_the_field(tmp_path, setting, field):
    path = write(tmp_path, [AG_POINT, COLLECTIVE])
    refused(["sim", "fit", "--published", path, "--hardware", "h100-nvswitch", "--set", setting],
            f"--set {setting}", f"field '{field}'")


def test_set_takes_only_a_spec_s_numbers(tmp_path):
    path = write(tmp_path, [AG_POINT, COLLECTIVE])
    for setting in ("name=other", "topology=ring", "peak_tflops=5", "x=1", "devices"):
        refused(["sim", "fit", "--published", path, "--hardware", "h100-nvswitch", "--set", setting],
                f"--set '{setting}'", "a number of the spec")
