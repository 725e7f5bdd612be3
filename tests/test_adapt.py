"""ficco adapt: the round logic (budget, no scenario measured twice, resume after a kill),
the choice of scenarios, and the spec's recalibration from a few measured scenarios."""

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from ficco_select.data.calibrate import recalibrate
from ficco_select.data.catalog import catalog
from ficco_select.data.simulate import simulate, simulate_rows
from ficco_select.hardware import load_hardware, spec_as_dict
from ficco_select.scenario import Scenario
from ficco_select.train import adapt as A
from ficco_select.train.selectors import with_features
from ficco_select.train.training_data import simulated

GRID = [Scenario.from_record(r) for r in catalog("full", hardware="mi300x-8", world_sizes=(2, 4),
                                                  models=["llama3-8b", "mixtral-8x7b"])]


@pytest.fixture(scope="module")
def base():
    return with_features(simulated("h100-nvswitch", world_sizes=(2, 4), share=0.25, seed=3))


def test_choose_respects_k_and_never_takes_a_measured_or_repeated_scenario():
    ids = [f"s{i}" for i in range(30)]
    groups = [i % 3 for i in range(30)]
    priority = [float(i) for i in range(30)]
    measured = {"s0", "s1", "s5"}
    picks = A.choose(ids, groups, 7, measured=measured, priority=priority)
    assert len(picks) == 7 == len(set(picks)) and not set(picks) & measured
    # round-robin over the strata, each stratum's most uncertain (lowest priority) first
    assert picks[:3] == ["s2", "s3", "s4"]
    random_picks = A.choose(ids, groups, 7, measured=measured, priority=None, seed=1)
    assert len(set(random_picks)) == 7 and not set(random_picks) & measured
    assert random_picks == A.choose(ids, groups, 7, measured=measured, priority=None, seed=1)
    assert len(A.choose(ids, groups, 100, measured=measured, priority=priority)) == 27  # all that is left
    assert A.choose(ids, groups, 0, measured=measured, priority=priority) == []


def test_recalibration_recovers_a_machine_whose_data_sheet_is_off():
    spec = load_hardware("mi300x-8")
    truth = A.perturbed(spec, "mi300x-8-test-truth", spread=1.3, seed=4)
    measured = simulate(GRID[::8], truth, noise=0.03, seed=0)
    fitted = recalibrate(spec, measured)
    want = simulate_rows(GRID, truth)["time_s"].to_numpy()
    error = {name: float(np.median(np.abs(np.log(simulate_rows(GRID, s)["time_s"].to_numpy() / want))))
             for name, s in (("start", spec), ("fitted", fitted))}
    assert error["fitted"] < error["start"] / 3, error
    assert recalibrate(spec, measured.iloc[:0]) is spec  # nothing measured: the spec as given


def test_recalibration_finds_a_dma_bandwidth_below_the_link():
    # A copy engine moves min(link share, dma_bw): a fit that pulls the link below the DMA
    # bandwidth leaves the DMA bandwidth without a gradient. This machine's copies are 18%
    # slower than its data sheet says while its link is close to it (l40s-pcie-8, seed 3);
    # one fit from the sheet left dma_bw at the sheet's 25 GB/s and pulled the link down.
    spec = load_hardware("l40s-pcie-8")
    truth = A.perturbed(spec, "l40s-pcie-8-test", spread=1.3, seed=3)
    assert truth.dma_bw_gbps < 0.9 * min(spec.dma_bw_gbps, truth.link_bw_gbps)
    grid = [Scenario.from_record(r) for r in catalog("full", hardware="l40s-pcie-8", world_sizes=(2, 4, 8))]
    measured = simulate([dataclasses.replace(s, hardware=truth.name) for s in grid[::20]], truth, noise=0.03, seed=1)
    fitted = recalibrate(dataclasses.replace(spec, name=truth.name), measured)
    assert abs(fitted.dma_bw_gbps / truth.dma_bw_gbps - 1) < 0.03, fitted.dma_bw_gbps
    assert abs(fitted.link_bw_gbps / truth.link_bw_gbps - 1) < 0.03, fitted.link_bw_gbps


class CountingMachine:
    """A simulated machine whose measure calls are counted and can be made to fail."""

    def __init__(self, fail_on_call: int | None = None):
        spec = load_hardware("mi300x-8")
        truth = A.perturbed(spec, "mi300x-8-test", spread=1.2, seed=1)
        self.machine = A.sim_machine("mi300x-8-test", spec, truth, GRID, seed=0)
        inner = self.machine.measure
        self.calls: list[list[str]] = []

        def measure(scenarios):
            self.calls.append([s.scenario_id for s in scenarios])
            if fail_on_call is not None and len(self.calls) == fail_on_call:
                raise KeyboardInterrupt("killed")
            return inner(scenarios)

        self.machine.measure = measure


def test_rounds_spend_the_budget_and_measure_each_scenario_once(base, tmp_path):
    counting = CountingMachine()
    rounds = A.adapt(counting.machine, base, checkpoints=(0.0, 0.05, 0.15), strategy="active", out_dir=tmp_path)
    n = len(GRID)
    assert [r.measured for r in rounds] == [0, round(0.05 * n), round(0.15 * n)]
    measured = [sid for call in counting.calls for sid in call]
    assert len(measured) == len(set(measured)) == round(0.15 * n)
    assert all(0 <= r.scores["near_opt_2"] <= 1 for r in rounds)
    rows = pd.read_parquet(tmp_path / "measured.parquet")
    assert set(rows["scenario_id"]) == set(measured)


def test_a_killed_adapt_resumes_without_measuring_again(base, tmp_path):
    killed = CountingMachine(fail_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        A.adapt(killed.machine, base, checkpoints=(0.0, 0.05, 0.15), out_dir=tmp_path)
    first = set(killed.calls[0])  # round 1 finished and was saved; round 2 died measuring
    resumed = CountingMachine()
    rounds = A.adapt(resumed.machine, base, checkpoints=(0.0, 0.05, 0.15), out_dir=tmp_path)
    assert [r.measured for r in rounds] == [0, round(0.05 * len(GRID)), round(0.15 * len(GRID))]
    assert len(resumed.calls) == 1 and not set(resumed.calls[0]) & first  # round 2 only, nothing twice
    again = CountingMachine()
    assert len(A.adapt(again.machine, base, checkpoints=(0.0, 0.05, 0.15), out_dir=tmp_path)) == 3
    assert again.calls == []  # finished: nothing left to measure
    assert spec_as_dict(again.machine.spec) == rounds[-1].spec  # and the spec it adapted to, not the start's


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


def test_another_machine_s_folder_is_refused(base, tmp_path):
    A.adapt(CountingMachine().machine, base, checkpoints=(0.0,), out_dir=tmp_path)
    other = CountingMachine().machine
    other.name = "another-machine"
    with pytest.raises(ValueError, match="field 'machine'"):
        A.adapt(other, base, checkpoints=(0.0, 0.05), out_dir=tmp_path)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="strategy"):
        A.adapt(CountingMachine().machine, pd.DataFrame(), checkpoints=(0.0,), strategy="greedy")
    with pytest.raises(ValueError, match="checkpoints"):
        A.adapt(CountingMachine().machine, pd.DataFrame(), checkpoints=(0.2, 0.1))
    if not torch.cuda.is_available():  # one line, before any work
        with pytest.raises(ValueError, match="--backend cuda: CUDA is not available here"):
            A.run_adapt(hardware="mi300x-8", backend="cuda")
    with pytest.raises(ValueError, match="--hardware cpu"):  # the stand-in runs on the cpu spec only
        A.run_adapt(hardware="mi300x-8", backend="cuda", device="cpu")
    with pytest.raises(ValueError, match="--hardware cpu"):
        A.run_adapt(hardware="mi300x-8", backend="cpu")
    with pytest.raises(ValueError, match="--budget"):
        A.run_adapt(hardware="mi300x-8", budget=0)


@pytest.mark.gloo
def test_the_cpu_backend_measures_for_real_and_scores_against_the_committed_sweep(base, tmp_path):
    machine = A.cpu_machine("cpu-adapt-test", load_hardware("cpu"), tmp_path, progress=False)
    assert len(machine.grid) == 600 and {s.hardware for s in machine.grid} == {"cpu-adapt-test"}
    # The 20 smallest scenarios (seconds each, with `ficco measure`'s defaults): one round
    # measures one of them.
    machine.grid = sorted(machine.grid, key=lambda s: s.m * s.n * s.k * s.world_size)[:20]
    rounds = A.adapt(machine, base, checkpoints=(0.0, 0.05), out_dir=tmp_path)
    assert [r.measured for r in rounds] == [0, 1]
    rows = pd.read_parquet(tmp_path / "measured.parquet")
    assert set(rows["hardware"]) == {"cpu-adapt-test"} and rows["verified"].all()
    assert set(rows["scenario_id"]) <= {s.scenario_id for s in machine.grid}
    assert (tmp_path / "harness.parquet").exists()  # the harness's own crash-safe file
    scores = rounds[-1].scores
    assert scores["n"] == 19 and 0 < scores["ceiling"]["near_opt_2"] <= 1


@pytest.mark.gloo
def test_the_cuda_path_adapts_through_measure_on_its_cpu_stand_in(base, tmp_path):
    # ficco adapt --backend cuda measures through `ficco measure --backend cuda`'s path; on the
    # CPU that path's stand-in (device "cpu": the loopback executor on CPU threads) runs it.
    cpu = load_hardware("cpu")
    machine = A.cuda_machine("cpu-cuda-test", cpu, A.cuda_grid(cpu), tmp_path, device="cpu", progress=False)
    assert len(machine.grid) == 600 and {s.hardware for s in machine.grid} == {"cpu-cuda-test"}
    machine.grid = machine.grid[:60:3]
    rounds = A.adapt(machine, base, checkpoints=(0.0, 0.05), out_dir=tmp_path)
    assert [r.measured for r in rounds] == [0, 1]
    assert rounds[-1].scores == {}  # a new GPU has no full sweep to score against
    rows = pd.read_parquet(tmp_path / "measured.parquet")
    assert set(rows["hardware"]) == {"cpu-cuda-test"} and rows["verified"].all() and len(rows) > 1
    harness = pd.read_parquet(tmp_path / "harness.parquet")  # measure's own crash-safe file
    assert len(harness) == len(rows) and set(harness["hardware"]) == {"cpu"}  # measured as the cpu spec's rows
    assert rounds[-1].spec["name"] == "cpu-cuda-test"


def test_a_cuda_grid_is_the_gpu_catalog_without_fp8_within_its_devices():
    h100 = load_hardware("h100-nvswitch")
    grid = A.cuda_grid(h100)
    assert grid and {s.hardware for s in grid} == {"h100-nvswitch"}
    assert "float8_e4m3fn" not in {s.dtype for s in grid} and {s.world_size for s in grid} == {2, 4, 8}
    assert "bfloat16" in {s.dtype for s in grid}


def test_the_cli_says_in_one_line_that_cuda_is_missing(tmp_path):
    from click.testing import CliRunner

    from ficco_select.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = CliRunner().invoke(main, ["adapt", "--hardware", "h100-nvswitch", "--backend", "cuda", "--out",
                                    str(tmp_path / "a"), "--no-track"])
    assert res.exit_code == 1 and res.output.strip().count("\n") == 0
    assert "CUDA is not available here" in res.output and not (tmp_path / "a").exists()


def test_a_run_that_ends_with_status_0_before_its_summary_exits_1(tmp_path, monkeypatch):
    # Whatever ends the run early with status 0 (a library's sys.exit(), a handler), a script
    # must not read it as done: the command says the summary was not written and exits 1.
    import sys

    from helpers.cli import refused

    def ends_early(*, out_dir, **options):
        Path(out_dir).mkdir(parents=True)  # a round measured and kept, then the process is told to leave
        sys.exit()

    monkeypatch.setattr(A, "run_adapt", ends_early)
    out = tmp_path / "a"
    refused(["adapt", "--hardware", "mi300x-8", "--out", out, "--no-track"],
            f"before {out / 'summary.json'} was written", "rerun the same command", written=out / "summary.json")


def test_register_refuses_a_folder_with_nothing_measured(tmp_path):
    # What it trains and registers, and the learning curve in its report: the bring-up
    # rehearsal's register step (tests/test_bringup.py), the same call on a measured folder.
    with pytest.raises(ValueError, match="nothing measured yet"):
        A.register_adapted(tmp_path / "adapt", debug=True, progress=False)


def test_finished_runs_become_curve_rows_and_a_folder_without_a_summary_is_named(tmp_path):
    from ficco_select.train.adapt_curve import curve_from_runs

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(
        '{"machine": "cpu-adapted", "backend": "cpu", "strategy": "random", "rounds": ['
        '{"fraction": 0.0, "measured": 0, "near_opt_2": 0.4, "speedup": 1.0, "simulator_near_opt_2": 0.3, '
        '"ceiling_near_opt_2": 0.9}, {"fraction": 0.1, "measured": 60, "near_opt_2": 0.5, "speedup": 1.1, '
        '"simulator_near_opt_2": 0.3, "ceiling_near_opt_2": 0.9}]}')
    curve = curve_from_runs([tmp_path / "run"])
    assert list(curve["fraction"]) == [0.0, 0.1] and set(curve["preset"]) == {"cpu-adapted on cpu"}
    assert list(curve["ceiling_near_opt_2"]) == [0.9, 0.9] and set(curve["strategy"]) == {"random"}
    with pytest.raises(ValueError, match="summary.json: no such file"):
        curve_from_runs([tmp_path])


def test_a_folder_resumes_only_with_the_options_and_files_it_was_made_with(base, tmp_path):
    options = dict(hardware="mi300x-8", backend="sim", start="mi300x-8", budget=0.1, rounds=4, strategy="active",
                   perturb=1.0, seed=0)
    out = tmp_path / "adapt"
    A.check_state(out, options)
    A.check_state(out, options)  # the same options: resumes
    with pytest.raises(ValueError, match=r"was made with --perturb 1.0, not 1.3: resuming would mix two runs"):
        A.check_state(out, {**options, "perturb": 1.3})
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="holds summary.json but no options.json: not a ficco adapt folder"):
        A.check_state(pipeline, options)
    assert (pipeline / "summary.json").read_text() == "{}"
    # A measured.parquet swapped for another machine's rows, or removed, is refused on resume.
    A.adapt(CountingMachine().machine, base, checkpoints=(0.0, 0.05), out_dir=out)
    measured = pd.read_parquet(out / "measured.parquet")
    from ficco_select.data.dataset import write_parquet_atomic

    write_parquet_atomic(measured.assign(hardware="cpu"), out / "measured.parquet")
    with pytest.raises(ValueError, match="holds rows of 'cpu'"):
        A.adapt(CountingMachine().machine, base, checkpoints=(0.0, 0.05, 0.1), out_dir=out)
    (out / "measured.parquet").unlink()
    with pytest.raises(ValueError, match="lacks .* scenario"):
        A.adapt(CountingMachine().machine, base, checkpoints=(0.0, 0.05, 0.1), out_dir=out)
    extra = '{"machine": "mi300x-8-test", "rounds": [{"measured": 0, "fraction": 0, "chosen": [], "spec": {}, ' \
            '"scores": {}, "extra": 1}]}'
    for bad, why in (("[1, 2]", "field 'machine'"), ('{"machine": "x"', "cannot be read as JSON"),
                     (extra, "field 'rounds' is malformed")):
        (out / "rounds.json").write_text(bad)
        with pytest.raises(ValueError, match=why):
            A.adapt(CountingMachine().machine, base, checkpoints=(0.0, 0.05), out_dir=out)
    (out / "rounds.json").unlink()
    (out / "pending.json").write_text('["a"]')
    with pytest.raises(ValueError, match="pending.json: expected an object"):
        A.adapt(CountingMachine().machine, base, checkpoints=(0.0, 0.05), out_dir=out)
    (out / "pending.json").write_text('{"fraction": 0.05, "chosen": ["not-a-scenario"]}')
    with pytest.raises(ValueError, match="pending.json: field 'chosen' names 1 scenario"):
        A.adapt(CountingMachine().machine, base, checkpoints=(0.0, 0.05), out_dir=out)


def test_a_recalibrated_spec_is_kept_only_where_the_adapted_model_picks_better_with_it(base):
    # checked_spec: cross-fitted over the measured scenarios, the model refitted under each
    # spec picks for the held-out ones; the recalibrated spec must do better, a tie keeps the start.
    spec = load_hardware("mi300x-8")
    truth = A.perturbed(spec, "mi300x-8-test", spread=1.3, seed=4)
    machine = A.sim_machine("mi300x-8-test", spec, truth, GRID, seed=0)
    measured = machine.measure(machine.grid[::4][:8])
    with machine.known():  # as in a run: the machine's name means the spec it believes
        assert A.checked_spec(machine, machine.spec, base, measured.iloc[:0]) is machine.spec  # nothing measured
        few = measured[measured["scenario_id"].isin(measured["scenario_id"].unique()[:3])]
        assert A.checked_spec(machine, machine.spec, base, few) is machine.spec  # too few to judge
        start = machine.spec
        got = A.checked_spec(machine, start, base, measured)
    assert got in (start, recalibrate(start, measured)) and machine.spec == start  # the machine believes the start again


def test_a_run_believes_its_own_spec_of_a_machine_the_training_data_names():
    # `ficco adapt --fabric RATE`: the training data names cpu-<rate> by its committed sweep's
    # profile; the run profiles the fabric afresh and believes that, refined round by round,
    # and a measurement inside a round writes the fabric's profile: none refuses another.
    from ficco_select.hardware import machines
    from ficco_select.train.training_data import training_machines

    with machines(training_machines(sampled_per_preset=1)):
        committed = load_hardware("cpu-500mbit")
        fresh = dataclasses.replace(committed, link_bw_gbps=committed.link_bw_gbps * 1.05, description="a fresh profile")
        machine = A.Machine("cpu-500mbit", fresh, [], measure=lambda scenarios: pd.DataFrame())
        with machine.known():
            assert load_hardware("cpu-500mbit") == fresh
            refined = dataclasses.replace(fresh, link_bw_gbps=fresh.link_bw_gbps * 2)
            machine.believe(refined)
            assert load_hardware("cpu-500mbit") == refined
            with machines([fresh], "the harness's profile", replace=True):  # a round's measurement
                assert load_hardware("cpu-500mbit") == fresh
            assert load_hardware("cpu-500mbit") == refined
        assert load_hardware("cpu-500mbit") == committed  # the run's belief ends with it
