"""Hostile calls and inputs of the runtime ops, the selector and the training commands:
every rank refuses a call its ranks disagree on, a score refuses a truth that lacks
schedules, a cpu scenario never gets a copy-engine schedule, a resumed adaptation measures
what an uninterrupted one does, and the pipeline validates its datasets before any work.
"""

import dataclasses
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from ficco_select import Scenario, candidates
from ficco_select.hardware import load_hardware
from ficco_select.runtime import torch_ops
from ficco_select.runtime.selector import Selector
from helpers.exports import FULL_RANGES, spec_dict, warnings_of, write_selector
from helpers.ranks import counting_checks, rand, spawn


# -- ranks that disagree on a call's shapes ------------------------------------------------
def _raises_on_this_rank(call, *needles: str) -> None:
    with pytest.raises(ValueError) as caught:
        call()
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def check_disagreeing_ranks(rank: int, P: int, tmp: Path) -> None:
    # The debug mode, off by default, turned on by PyTorch's own switch (read when ficco's
    # settings are made: here, at reset).
    assert not torch_ops.dispatch.checks_calls()
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    torch_ops.reset()
    torch_ops.configure(selector=Selector(), hardware="cpu")
    assert torch_ops.dispatch.checks_calls()
    gen = torch.Generator().manual_seed(rank)
    g = dist.group.WORLD.group_name
    m = 4 if rank == 0 else 6  # rows of this rank's shard
    B = rand(gen, 8, 6)
    ag = lambda rows: torch_ops.all_gather_matmul(rand(gen, rows, 8), [B], 0, g)  # noqa: E731
    _raises_on_this_rank(lambda: ag(m), "all_gather_matmul", "rank 1", "(6, 8)", "(4, 8)")
    # A shape every rank has passed before, then one rank's new one: still refused on both.
    ag(4)
    _raises_on_this_rank(lambda: ag(m), "all_gather_matmul", "rank 1", "(6, 8)", "(4, 8)")
    _raises_on_this_rank(lambda: torch_ops.matmul_reduce_scatter(rand(gen, 2 * m, 8), B, "sum", 0, g),
                         "matmul_reduce_scatter", "rank 1", "(12, 8)", "(8, 8)")
    _raises_on_this_rank(lambda: torch_ops.matmul_all_reduce(rand(gen, 2 * m, 8), B, "sum", g),
                         "matmul_all_reduce", "rank 1", "(12, 8)", "(8, 8)")
    k = 8 if rank == 0 else 6  # the experts' contraction dim
    _raises_on_this_rank(lambda: torch_ops.all_to_all_matmul(rand(gen, 6, k), rand(gen, k, 5), [3, 3], [3, 3], g),
                         "all_to_all_matmul", "rank 1", "(6, 6)", "(6, 8)")
    # Rank 1 expects 4 rows from rank 0, which sends it 3.
    expects = [3, 3] if rank == 0 else [4, 3]
    _raises_on_this_rank(lambda: torch_ops.all_to_all_matmul(rand(gen, 6, 8), rand(gen, 8, 5), expects, [3, 3], g),
                         "all_to_all_matmul", "rank 1 expects 4 rows from rank 0", "sends it 3")
    _raises_on_this_rank(lambda: torch_ops.matmul_all_to_all(rand(gen, 6, 8), rand(gen, 8, 5), expects, [3, 3], g),
                         "matmul_all_to_all", "rank 1 expects 4 rows from rank 0", "sends it 3")
    n = 5 if rank == 0 else 7
    _raises_on_this_rank(lambda: torch_ops.matmul_all_to_all(rand(gen, 6, 8), rand(gen, 8, n), [3, 3], [3, 3], g),
                         "matmul_all_to_all", "rank 1", "(8, 7)", "(8, 5)")
    # The group is still in step: a call the ranks agree on runs.
    A_shard = rand(gen, 4, 8)
    _, [got] = torch_ops.all_gather_matmul(A_shard, [B], 0, g)
    full = torch.empty(P * 4, 8)
    dist.all_gather_into_tensor(full, A_shard)
    torch.testing.assert_close(got, full @ B)


@pytest.mark.gloo
def test_ranks_passing_different_shapes_raise_on_every_rank(tmp_path):
    spawn(check_disagreeing_ranks, 2, tmp_path)


def check_unchecked_calls(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime import library  # noqa: F401 - registers torch.ops.ficco

    gen = torch.Generator().manual_seed(0)
    g = dist.group.WORLD.group_name
    A_shard, B = rand(gen, 4, 8), rand(gen, 8, 6)
    try:
        with counting_checks() as checks:
            torch_ops.configure(check_calls=False)
            _, [got] = torch_ops.all_gather_matmul(A_shard, [B], 0, g)
            torch_ops.matmul_reduce_scatter(got, B.t().contiguous(), "sum", 0, g)
            assert checks == []  # no check, and the ops still run
            torch_ops.configure(check_calls=True)
            torch_ops.all_gather_matmul(A_shard, [B], 0, g)
            assert len(checks) == 1

            # A caller that vouches for its calls (run_check=False: DTensor's styles, the compile
            # pass) skips the check, forward and backward, the job's setting on.
            A, W = A_shard.clone().requires_grad_(), B.clone().requires_grad_()
            _, [y] = torch_ops.all_gather_matmul(A, [W], 0, g, run_check=False)
            z = torch_ops.matmul_reduce_scatter(y, W.t(), "sum", 0, g, run_check=False)
            r = torch_ops.matmul_all_reduce(z, W, "sum", g, run_check=False)
            r.sum().backward()
            torch.ops.ficco.all_gather_matmul(A_shard, [B], 0, g, False)
            torch.ops.ficco.matmul_reduce_scatter(got, B.t().contiguous(), "sum", 0, g, False)
            torch.ops.ficco.matmul_all_reduce(got, B.t().contiguous(), "sum", g, False)
            assert len(checks) == 1, checks
            assert A.grad is not None and W.grad is not None

            # Checked calls check their backward too (a rank whose loss skips an op is caught there).
            _, [y] = torch_ops.all_gather_matmul(A, [W], 0, g)
            y.sum().backward()
            assert len(checks) == 3, checks
    finally:
        torch_ops.reset()


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, True),
    ({"TORCH_DISTRIBUTED_DEBUG": "INFO"}, False),
    ({"FICCO_CHECK_CALLS": "1"}, True),
    ({"FICCO_CHECK_CALLS": "0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, False),
])
def test_the_per_call_check_is_a_debug_mode_off_by_default(monkeypatch, env, on):
    from ficco_select.runtime import dispatch

    for name in ("TORCH_DISTRIBUTED_DEBUG", "FICCO_CHECK_CALLS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert dispatch.Settings().check_calls is on


@pytest.mark.gloo
def test_a_job_may_turn_the_per_call_check_off(tmp_path):
    spawn(check_unchecked_calls, 2, tmp_path)


# -- an export that redefines a preset machine -----------------------------------------------
CPU_SCENARIOS = [{"group": "t", "op": op, "m": 256, "n": 256, "k": 256, "dtype": "float32", "world_size": 2,
                  "hardware": "cpu", "imbalance": 1.0}
                 for op in ("ag_gemm", "gemm_rs", "gemm_ar", "a2a_gemm", "gemm_a2a")]


def test_an_export_giving_the_cpu_preset_gpu_numbers_never_makes_select_pick_a_gpu_schedule(tmp_path, caplog):
    ranges = {**FULL_RANGES, "hardware": ["cpu"], "op": sorted({r["op"] for r in CPU_SCENARIOS})}
    folder = write_selector(tmp_path / "sel", training_ranges=ranges,
                            hardware_specs={"cpu": spec_dict("cpu")})  # mi300x-8's numbers, dma engines and all
    sel = Selector.load(folder)
    for record in CPU_SCENARIOS:
        d = sel.select(record)
        legal = candidates(Scenario.from_record(record), "cpu")
        assert d.schedule in legal and d.schedule.engine != "dma", (record["op"], d)
    assert sel.model is None, "the export was used"
    [warning] = warnings_of(caplog)
    assert "hardware_specs['cpu']" in warning and "preset" in warning, warning
    # The preset's own numbers under its name are no contradiction: that export is used.
    same = write_selector(tmp_path / "same", training_ranges=ranges,
                          hardware_specs={"cpu": dataclasses.asdict(load_hardware("cpu"))})
    assert Selector.load(same).model is not None



# -- a truth that lacks schedules ------------------------------------------------------------
def _catalog_slice(tmp_path: Path, scenarios: int = 40):
    from ficco_select.data.dataset import read_dataset

    df = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet")
    keep = list(dict.fromkeys(df["scenario_id"]))[:scenarios]
    return df[df["scenario_id"].isin(keep)].reset_index(drop=True)


def _thinned(tmp_path: Path) -> Path:
    """The slice with every schedule but the baseline and shard.ring.sm dropped from all but 4 scenarios."""
    from ficco_select.data.dataset import write_parquet_atomic

    df = _catalog_slice(tmp_path)
    whole = set(list(dict.fromkeys(df["scenario_id"]))[:4])
    kept = df[df["scenario_id"].isin(whole) | df["schedule"].isin(["none.sm", "shard.ring.sm"])]
    path = tmp_path / "thin.parquet"
    write_parquet_atomic(kept.reset_index(drop=True), path)
    return path


def test_select_truth_refuses_a_dataset_lacking_most_schedules(tmp_path):
    from click.testing import CliRunner

    from ficco_select.data.dataset import write_parquet_atomic
    from ficco_select.cli.main import main
    from helpers.cli import refused

    thin = _thinned(tmp_path)
    refused(["select", "--truth", thin, "--heuristic-only"], "--truth", "thin.parquet", "36 of 40 scenarios lack",
            "ficco.d2.ring.gemm_per_piece.m.sm")
    # The same scenarios with every schedule are scored.
    whole = tmp_path / "whole.parquet"
    write_parquet_atomic(_catalog_slice(tmp_path), whole)
    res = CliRunner().invoke(main, ["select", "--truth", str(whole), "--heuristic-only"])
    assert res.exit_code == 0, res.output
    assert "== all" in res.output


def test_train_refuses_a_dataset_lacking_most_schedules(tmp_path, monkeypatch):
    from helpers.cli import refused

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "train"
    refused(["train", "--dataset", _thinned(tmp_path), "--selectors", "debug", "--splits", "random",
             "--out", out, "--no-progress"], "thin.parquet", "36 of 40 scenarios lack", written=out)
    assert not (tmp_path / "mlflow.db").exists(), "a training run was started"


# -- the pipeline's datasets -------------------------------------------------------------------
def test_pipeline_validates_its_datasets_before_any_work(tmp_path, monkeypatch):
    from ficco_select.data.dataset import write_parquet_atomic
    from helpers.cli import refused

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    df = _catalog_slice(tmp_path, scenarios=8)
    negative = df.copy()
    negative.loc[5, "time_s"] = -negative.loc[5, "time_s"]
    write_parquet_atomic(negative, tmp_path / "negative.parquet")
    write_parquet_atomic(df.drop(columns=["near_best"]), tmp_path / "nocol.parquet")
    out = tmp_path / "pipeline"
    for name, needles in {"negative.parquet": ("row 5", "column 'time_s'"),
                          "nocol.parquet": ("column 'near_best' is missing",)}.items():
        refused(["pipeline", "--dataset", tmp_path / name, "--debug", "--no-export", "--no-progress", "--out", out],
                name, *needles, written=out)
    assert not (tmp_path / "mlflow.db").exists(), "a training run was started"


# -- a resumed simulated adaptation ------------------------------------------------------------
ADAPT_GRID_MODELS = ["llama3-8b", "mixtral-8x7b"]


def _sim_machine(kill_on_call: int | None = None):
    """The machine `ficco adapt --backend sim --perturb 1.2` builds, made anew as a restarted
    process makes it; its `kill_on_call`-th measurement dies as a killed process would."""
    from ficco_select.data.catalog import catalog
    from ficco_select.train import adapt as A

    spec = load_hardware("mi300x-8")
    grid = [Scenario.from_record(r) for r in catalog("full", hardware="mi300x-8", world_sizes=(2, 4),
                                                      models=ADAPT_GRID_MODELS)]
    machine = A.sim_machine("mi300x-8-resume", spec, A.perturbed(spec, "mi300x-8-resume", spread=1.2, seed=1),
                            grid, seed=7)
    inner, calls = machine.measure, []

    def measure(scenarios):
        calls.append(len(scenarios))
        if len(calls) == kill_on_call:
            raise KeyboardInterrupt("killed")
        return inner(scenarios)

    machine.measure = measure
    return machine


def test_a_resumed_sim_adapt_measures_what_an_uninterrupted_one_does(tmp_path):
    from ficco_select.data.dataset import read_dataset
    from ficco_select.train import adapt as A
    from ficco_select.train.selectors import with_features
    from ficco_select.train.training_data import simulated

    base = with_features(simulated("h100-nvswitch", world_sizes=(2, 4), share=0.25, seed=3))
    plan = dict(checkpoints=(0.0, 0.05, 0.1), strategy="active", seed=7)
    A.adapt(_sim_machine(), base, out_dir=tmp_path / "whole", **plan)
    with pytest.raises(KeyboardInterrupt):  # killed measuring round 2: round 1 is saved
        A.adapt(_sim_machine(kill_on_call=2), base, out_dir=tmp_path / "resumed", **plan)
    A.adapt(_sim_machine(), base, out_dir=tmp_path / "resumed", **plan)

    def rows(folder):
        df = read_dataset(tmp_path / folder / "measured.parquet")
        return df.drop(columns=["created_at"]).sort_values(["scenario_id", "schedule"]).reset_index(drop=True)

    whole, resumed = rows("whole"), rows("resumed")
    assert whole["scenario_id"].nunique() == round(0.1 * len(_sim_machine().grid))
    pd.testing.assert_frame_equal(resumed, whole)
