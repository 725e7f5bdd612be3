"""The GPU do-no-harm rule: fitted on hand-made residuals, checked at load, applied at run time."""

import math

import pytest

from ficco_select.data.no_harm import MIN_POINTS, margins
from ficco_select.hardware import load_hardware
from ficco_select.runtime.no_harm import NoHarmRule, holds, predicted_gain
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import parse


def test_one_margin_where_the_regimes_agree():
    rule = margins([0.1, 0.2, 0.3, 0.2, 0.2, 0.3, 0.1, 0.2], [100, 200, 300, 400, 2000, 3000, 4000, 5000])
    assert rule["split_us"] == 0.0 and rule["small_margin"] == rule["large_margin"] == pytest.approx(0.2)


def test_two_margins_where_small_calls_are_over_promised():
    small, large = [0.4, 0.5, 0.6, 0.5], [0.0, 0.02, 0.01, 0.03]
    rule = margins(small + large, [100, 200, 300, 400, 2000, 3000, 4000, 5000], quantile=0.5, split_us=1000)
    assert rule["split_us"] == 1000 and rule["small_margin"] == pytest.approx(0.5)
    assert rule["large_margin"] == pytest.approx(0.015)


def test_an_under_promising_simulator_needs_no_margin():
    rule = margins([-0.3, -0.2, -0.1, -0.2], [100, 200, 300, 400])
    assert rule["small_margin"] == rule["large_margin"] == 0.0


def test_too_few_points_on_one_side_pool_the_regimes():
    rule = margins([0.9] * (MIN_POINTS - 1) + [0.0] * 6, [100] * (MIN_POINTS - 1) + [5000] * 6)
    assert rule["split_us"] == 0.0 and rule["points_small"] == MIN_POINTS - 1 + 6


def test_no_residuals_is_an_error():
    with pytest.raises(ValueError, match="no published residuals"):
        margins([], [])


@pytest.mark.parametrize("bad, field", [({"split_us": -1, "small_margin": 0, "large_margin": 0}, "split_us"),
                                        ({"split_us": 1, "small_margin": math.inf, "large_margin": 0}, "small_margin"),
                                        ({"split_us": 1, "small_margin": 0}, "large_margin"),
                                        ({"split_us": 1, "small_margin": 0, "large_margin": True}, "large_margin"),
                                        ([1, 2], "gpu_no_harm")])
def test_a_malformed_rule_is_refused_at_load_naming_its_field(bad, field):
    with pytest.raises(ValueError, match=field):
        NoHarmRule.from_meta(bad, "selector.json")


SCENARIO = Scenario(group="t", op="ag_gemm", m=4096, n=28672, k=8192, dtype="bfloat16", world_size=8,
                    hardware="h100-nvswitch")


def test_a_pick_stands_only_above_its_regimes_margin():
    hw = load_hardware("h100-nvswitch")
    pick = parse("shard.ring.dma")
    baseline_us, gain = predicted_gain(SCENARIO, hw, pick)
    assert gain > 1.05 and baseline_us > 0
    below = NoHarmRule(split_us=0.0, small_margin=0.0, large_margin=math.log(gain) - 0.01)
    above = NoHarmRule(split_us=0.0, small_margin=0.0, large_margin=math.log(gain) + 0.01)
    assert holds(below, SCENARIO, hw, pick)[0]
    stands, why = holds(above, SCENARIO, hw, pick)
    assert not stands and "the baseline does no harm" in why
    # The regime is the serial baseline's simulated time: a split above it uses the small margin.
    regime = NoHarmRule(split_us=baseline_us * 2, small_margin=math.log(gain) + 0.01, large_margin=0.0)
    assert not holds(regime, SCENARIO, hw, pick)[0]


def _selector(rule: dict) -> Selector:
    return Selector(meta={"selector": "xgb-regressor", "training_ranges": {}, "gpu_no_harm": rule})


def test_the_selector_runs_the_baseline_on_gpus_where_the_gain_is_within_the_error():
    free = _selector({"split_us": 0.0, "small_margin": 0.0, "large_margin": 0.0}).select(SCENARIO)
    assert not free.schedule.is_baseline  # the heuristic overlaps here
    strict = _selector({"split_us": 0.0, "small_margin": 0.0, "large_margin": 5.0}).select(SCENARIO)
    assert strict.schedule.is_baseline and strict.abstained and "no harm" in strict.reason
    assert Selector().select(SCENARIO).schedule == free.schedule  # the heuristic alone: no rule


def test_cpu_machines_are_measured_and_left_alone():
    cpu = Scenario(group="t", op="ag_gemm", m=2048, n=2048, k=2048, dtype="float32", world_size=2, hardware="cpu")
    strict = _selector({"split_us": 0.0, "small_margin": 0.0, "large_margin": 5.0})
    assert strict.select(cpu) == _selector({"split_us": 0.0, "small_margin": 0.0, "large_margin": 0.0}).select(cpu)


def test_layer_tables_give_the_rules_answer_too():
    """A layer met at several m is decided from its table: the rule holds there as well."""
    import dataclasses

    strict = _selector({"split_us": 0.0, "small_margin": 0.0, "large_margin": 5.0})
    for m in (2048, 4096, 8192, 16384):
        assert strict.select(dataclasses.replace(SCENARIO, m=m)).schedule.is_baseline
    assert strict._tables  # the later m came from the layer's table
