"""Machines sampled around the presets: what they vary, that they are training data only,
and that a hold-out of a preset holds out the machines drawn around it."""

import numpy as np
import pandas as pd
import pytest

from ficco_select.data.catalog import catalog
from ficco_select.data.machines import SAMPLED_MARK, _DRAWN, base_machine, is_sampled, sampled_machines
from ficco_select.data.simulate import simulate
from ficco_select import Scenario
from ficco_select.hardware import known_machines, load_hardware, machines
from ficco_select.train.evaluate import SPLITS, folds
from ficco_select.train.metrics import usable_rows
from ficco_select.train.selectors import XGBTimeRegressor
from ficco_select.train.shipped import fit_unseen_hardware

PRESETS = ("h100-nvswitch", "mi300x-8")


def test_sampled_machines_vary_every_drawn_field_within_the_spread_and_make_no_name_known():
    presets = [load_hardware(p) for p in PRESETS]
    before = known_machines()
    drawn = sampled_machines(presets, per_preset=3, spread=3.0, seed=11)
    assert known_machines() == before  # sampling makes no name known: the job that trains on them does
    assert [m.name for m in drawn] == [f"{p}{SAMPLED_MARK}{i}" for p in PRESETS for i in range(3)]
    assert sampled_machines(presets, per_preset=3, spread=3.0, seed=11) == drawn  # deterministic
    for m in drawn:
        base = load_hardware(base_machine(m.name))
        assert is_sampled(m.name) and not is_sampled(base.name)
        assert (m.devices, m.tile_m, m.tile_n, m.topology) == (base.devices, base.tile_m, base.tile_n, base.topology)
        for field in ("mem_bw_gbps", "link_bw_gbps", "sm_comm_latency_us", "dma_latency_us"):
            assert 1 / 3 <= getattr(m, field) / getattr(base, field) <= 3, field
        ratio = {d: m.peak_tflops[d] / base.peak_tflops[d] for d in base.peak_tflops}
        assert 1 / 3 <= ratio["float32"] <= 3 and len({round(r, 9) for r in ratio.values()}) == 1  # one factor
        assert 1 <= m.copy_engines <= 16 and 0 < m.gemm_efficiency <= 0.95


def test_latin_hypercube_draws_reach_both_ends_of_each_range():
    # per preset and field, its machines fall in different thirds of [1/3, 3] (log scale)
    drawn = sampled_machines([load_hardware("h100-nvswitch")], per_preset=3, spread=3.0, seed=5)
    base = load_hardware("h100-nvswitch")
    for field in ("mem_bw_gbps", "link_bw_gbps", "dma_latency_us"):
        thirds = sorted(int((np.log(getattr(m, field) / getattr(base, field)) / np.log(3) + 1) / 2 * 3)
                        for m in drawn)
        assert thirds == [0, 1, 2], field
    assert len(_DRAWN) >= 12


SAMPLED = sampled_machines([load_hardware(p) for p in PRESETS], per_preset=2, spread=3.0, seed=3)


@pytest.fixture(scope="module")
def with_samples():
    frames = []
    for hw in [*(load_hardware(p) for p in PRESETS), *SAMPLED]:
        recs = catalog("full", world_sizes=(2, 8), hardware=hw, models=["llama3-8b", "mixtral-8x7b"])
        frames.append(simulate([Scenario.from_record(r) for r in recs], hw, noise=0.03, seed=1))
    return pd.concat(frames, ignore_index=True)


@pytest.fixture(autouse=True)
def sampled_known():
    """Each test is a job that knows the module's sampled machines by name."""
    with machines(SAMPLED, "the module's sampled machines"):
        yield


@pytest.mark.parametrize("split", SPLITS)
def test_sampled_machines_are_never_scored_and_leave_with_their_preset(with_samples, split):
    df = with_samples
    for name, train, test in folds(df, split):
        assert not any(is_sampled(h) for h in set(df.loc[test, "hardware"]))
        assert any(is_sampled(h) for h in set(df.loc[train, "hardware"]))
        if split == "hardware":
            held = name.split("=", 1)[1]
            assert not is_sampled(held)
            assert {base_machine(h) for h in set(df.loc[train, "hardware"])} == set(PRESETS) - {held}


def test_the_unseen_hardware_validation_holds_a_preset_out_with_its_samples(with_samples):
    fitted_on = []

    class Spy(XGBTimeRegressor):
        def fit(self, df):
            fitted_on.append({base_machine(h) for h in set(df["hardware"])})
            return super().fit(df)

    rule = fit_unseen_hardware(lambda: Spy(n_estimators=20), usable_rows(with_samples),
                               {"min_margin": 0.0, "fallback": "heuristic"})
    assert sorted(map(sorted, fitted_on)) == [["h100-nvswitch"], ["mi300x-8"]]
    assert rule["validation"]["gpu"]["scenarios"] == with_samples["scenario_id"].nunique()


def test_a_sampled_machine_name_means_one_machine_however_many_a_run_keeps():
    # The debug slice keeps one machine per preset, the full data three: in one process (a
    # bring-up rehearsal adapts on the full data, then registers on the debug slice) the
    # names they share must mean the same machines.
    import contextvars

    from ficco_select.train.training_data import sampled, training_machines

    few = {df["hardware"].iloc[0] for df in sampled(per_preset=1, share=0.05)}
    assert few and all(name.endswith(f"{SAMPLED_MARK}0") for name in few)

    def one_job() -> None:  # not this module's draw: a job of its own
        with machines(training_machines(sampled_per_preset=1)):
            with machines(training_machines(sampled_per_preset=3)):  # refused if a name now meant another machine
                pass

    contextvars.Context().run(one_job)
