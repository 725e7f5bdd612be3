"""Trust follows provenance: every preset says where each number came from, and the GPU
do-no-harm rule asks a pick resting on terms no measurement fitted to clear a wider margin."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from ficco_select.data.no_harm import fit_no_harm, residuals, worst_machine
from ficco_select.data.published import packaged
from ficco_select.hardware import (HardwareError, datasheet_names, fields_of, load_hardware,
                                   preset_names)
from ficco_select.hardware_spec import PROVENANCES
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.no_harm import (NoHarmRule, TRUST_TERMS, predicted_gain, untrusted_terms,
                                          verdicts)
from ficco_select.runtime.policy import no_harm
from ficco_select.runtime.scope import Scope
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, parse

NUMBERS = [f for f in fields_of("count", "peak", "topology", "rate", "latency", "fraction", "ceiling", "kind", "flag")]
RULE = NoHarmRule(split_us=1000.0, small_margin=0.2, large_margin=0.01, unfitted_margin=0.7)


@pytest.mark.parametrize("name", preset_names() + datasheet_names())
def test_every_preset_says_where_each_number_came_from(name):
    spec = load_hardware(name)
    assert set(spec.provenance) == set(NUMBERS), sorted(set(NUMBERS) ^ set(spec.provenance))
    assert set(spec.provenance.values()) <= set(PROVENANCES)


def test_the_fitted_terms_of_the_trained_gpus_are_measured_and_the_copied_ones_are_not():
    h100, b300 = load_hardware("h100-nvswitch"), load_hardware("b300-nvswitch")
    assert [h100.source_of(f) for f in ("gemm_efficiency", "coll_bw_gbps", "dma_bw_gbps", "overlap_efficiency")] \
        == ["measured"] * 4
    assert b300.source_of("coll_bw_gbps") == "measured"  # fitted on B300 / GB300 rows
    assert b300.source_of("dma_bw_gbps") == "assumed"  # H100's copy rate scaled by the link ratio
    assert b300.source_of("overlap_efficiency") == "assumed"  # no Blackwell overlap point fitted it
    assert load_hardware("cpu").source_of("sm_comm_latency_us") == "measured"  # calibrated on this machine
    h800 = load_hardware("h800-nvswitch")  # Hopper: H100's fitted overlap terms, its own scaled copy rate
    assert (h800.source_of("overlap_efficiency"), h800.source_of("dma_bw_gbps")) == ("measured", "assumed")


@pytest.mark.parametrize("provenance, field", [({"dma_bw_gbps": "guessed"}, "provenance.dma_bw_gbps"),
                                               ({"colour": "measured"}, "provenance.colour"),
                                               ("measured", "provenance")])
def test_a_bad_provenance_is_refused_naming_the_file_and_field(tmp_path, provenance, field):
    doc = dataclasses.asdict(load_hardware("h100-nvswitch"))
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({**doc, "name": "my-node", "provenance": provenance}))
    with pytest.raises(HardwareError, match=rf"node.yaml.*'{field}'"):
        load_hardware(path)


def test_a_spec_file_without_provenance_is_assumed_throughout(tmp_path):
    doc = {k: v for k, v in dataclasses.asdict(load_hardware("h100-nvswitch")).items() if k != "provenance"}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({**doc, "name": "my-node"}))
    spec = load_hardware(path)
    assert spec == dataclasses.replace(load_hardware("h100-nvswitch"), name="my-node")  # the same numbers
    assert {spec.source_of(f) for f in NUMBERS} == {"assumed"}


def test_the_terms_a_pick_rests_on_follow_its_engine():
    h100 = load_hardware("h100-nvswitch")
    assert untrusted_terms(h100, parse("ficco.d2.ring.gemm_per_step.m.sm")) == ()
    assert untrusted_terms(h100, parse("shard.ring.dma")) == ()
    assert untrusted_terms(h100, parse("none.switch")) == ()  # fitted on multimem all-reduces
    h800 = load_hardware("h800-nvswitch")  # H100's switch terms scaled by the link ratio: assumed
    assert untrusted_terms(h800, parse("none.switch")) == TRUST_TERMS["switch"]
    b300 = load_hardware("b300-nvswitch")
    assert set(untrusted_terms(b300, parse("shard.ring.dma"))) == {"overlap_efficiency", "overlap_call_us",
                                                                   "dma_bw_gbps"}


def _overlap_gaining(hw, low: float, high: float) -> tuple[Scenario, object, float]:
    """A scenario on `hw` and an overlap schedule whose predicted gain lies in (low, high)."""
    for m in (1024, 2048, 4096, 8192, 16384, 32768):
        for op in ("ag_gemm", "gemm_rs"):
            s = Scenario(group="g", op=op, m=m, n=8192, k=8192, dtype="bfloat16", world_size=8, hardware=hw.name)
            for name in ("shard.ring.dma", "ficco.d2.ring.gemm_per_step.m.dma", "ficco.d4.a2a.gemm_per_step.m.dma"):
                schedule = parse(name)
                base_us, gain = predicted_gain(s, hw, schedule)
                if base_us >= RULE.split_us and low < gain < high:
                    return s, schedule, gain
    raise AssertionError(f"no overlap on {hw.name} gains between x{low} and x{high}")


def test_an_overlap_on_measured_terms_clears_the_regime_margin_and_on_assumed_ones_the_wider_one():
    h100 = load_hardware("h100-nvswitch")
    s, schedule, gain = _overlap_gaining(h100, math.exp(RULE.large_margin), math.exp(RULE.unfitted_margin))
    assert verdicts(RULE, [s], h100, [schedule]) == [""]
    # The same machine, its copy-engine rate taken from a data sheet: the pick no longer stands.
    sheet = dataclasses.replace(h100, provenance={**h100.provenance, "dma_bw_gbps": "datasheet"})
    (why,) = verdicts(RULE, [s], sheet, [schedule])
    assert "dma_bw_gbps (datasheet)" in why and "x2.014" in why, why  # exp(0.7)
    # An export fitted before provenance was read (no unfitted margin) keeps the regime's margin.
    old = dataclasses.replace(RULE, unfitted_margin=0.0)
    assert verdicts(old, [s], sheet, [schedule]) == [""]


def test_the_collective_in_the_switch_replaces_the_baseline_only_past_the_wider_margin():
    h800 = load_hardware("h800-nvswitch")
    s = Scenario(group="g", op="gemm_ar", m=1024, n=7168, k=12288, dtype="bfloat16", world_size=8,
                 hardware="h800-nvswitch")
    switch = parse("none.switch")
    _, gain = predicted_gain(s, h800, switch)
    assert 1.0 < gain < math.exp(RULE.unfitted_margin), gain  # the assumed terms promise a gain
    rules = Scope(name="xgb-regressor", gpu_no_harm=RULE)
    (decided,) = no_harm(rules, [Decision(switch, "model", 0.5)], [s], h800)
    assert decided.schedule == BASELINE and "switch_bw_gbps (assumed)" in decided.reason
    measured = dataclasses.replace(h800, provenance={**h800.provenance, "switch_bw_gbps": "measured",
                                                     "switch_latency_us": "measured"})
    (decided,) = no_harm(rules, [Decision(switch, "model", 0.5)], [s], measured)
    assert math.log(gain) > RULE.small_margin and decided.schedule == switch


def test_the_wider_margin_is_the_worst_machine_s_over_promise_at_every_size():
    fit = fit_no_harm()
    worst = worst_machine(residuals(packaged()))
    assert worst["points"] >= 4 and worst["median_residual"] > fit["large_margin"]
    assert fit["unfitted_margin"] == max(fit["small_margin"], fit["large_margin"], worst["median_residual"])
    assert fit["worst_machine"] == worst


def test_the_worst_machine_is_the_one_the_simulator_over_promises_most():
    records = ([{"hardware": "a", "residual": r} for r in (0.1, 0.2, 0.3, 0.4)]
               + [{"hardware": "b", "residual": r} for r in (-0.1, 0.5, 0.6, 0.7)]
               + [{"hardware": "c", "residual": 2.0}] * 3)  # too few points to say
    assert worst_machine(records) == {"hardware": "b", "median_residual": 0.55, "points": 4}
    assert worst_machine([{"hardware": "a", "residual": -0.2}] * 5)["median_residual"] == 0.0  # under-promises
