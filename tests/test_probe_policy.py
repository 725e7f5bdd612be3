"""The policy as a hostile caller drives it: records that are not scenarios (NaN, inf, huge,
negative, wrong types, unknown ops and dtypes, more ranks than the machine), rows that are not
even mappings, a spec path the OS refuses, batches mixing machines, specs whose provenance is
empty or all assumed, and exports whose fallbacks name switch schedules, with an
``unfitted_margin`` of 0 or 100. ``Selector.select``, ``decide_batch`` and ``decide_rows`` never
raise, and every decision is legal for its scenario on its machine's engines."""

import dataclasses
import logging
import math

import pytest
import yaml
from helpers.exports import write_selector
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ficco_select.hardware import HardwareError, load_hardware
from ficco_select.runtime import policy
from ficco_select.runtime.batch import decide_rows
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, SWITCH_OPS, backend_for, legal_candidates

MACHINES = ["h100-nvswitch", "h200-nvswitch", "mi300x-8", "l40s-pcie-8", "cpu"]
FALLBACKS = ["heuristic", "none.switch", "gated:none.switch", "cost_model", "ficco.d4.a2a.gemm_per_step.m.switch"]
LONG_PATH = "x" * 5000 + ".yaml"
"""A spec path longer than the OS looks up (ENAMETOOLONG, not 'no such file')."""


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    """Spec files of h100-nvswitch's numbers: the switch with no provenance, with every field
    assumed, and a fabric that does not reduce in the switch."""
    folder = tmp_path_factory.mktemp("specs")
    base = dataclasses.asdict(load_hardware("h100-nvswitch"))
    out = {}
    for name, provenance, switch in [("sw-empty", {}, True),
                                     ("sw-assumed", {f: "assumed" for f in base["provenance"]}, True),
                                     ("no-switch", base["provenance"], False)]:
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**base, "name": name, "provenance": provenance, "switch_reduce": switch,
                                        "switch_bw_gbps": base["switch_bw_gbps"] if switch else 0.0}))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def selectors(tmp_path_factory):
    """The heuristic alone, and exports whose margin rule sends every pick (min_margin 5) or
    none (0) to a fallback, under a GPU rule of unfitted_margin 0 or 100."""
    folder = tmp_path_factory.mktemp("exports")
    out = {"heuristic alone": Selector()}
    for fallback in FALLBACKS:
        for min_margin in (0.0, 5.0):
            for unfitted in (0.0, 100.0):
                name = f"{fallback} margin {min_margin} unfitted {unfitted}"
                path = write_selector(folder / name.replace(":", "_").replace(" ", "-"),
                                      abstention={"min_margin": min_margin, "fallback": fallback},
                                      gpu_no_harm={"split_us": 50.0, "small_margin": 0.0, "large_margin": 0.0,
                                                   "unfitted_margin": unfitted})
                out[name] = Selector.load(path)
    return out


def legal(decision: Decision, record) -> str:
    """Why `decision` is not legal for `record`, or ""."""
    if not isinstance(decision, Decision):
        return f"not a Decision: {decision!r}"
    try:
        scenario = Scenario.from_record(record)
        hw = load_hardware(scenario.hardware)
    except Exception:  # noqa: BLE001 - not a scenario here: the baseline only
        return "" if decision.schedule == BASELINE else f"{decision.schedule.name} for a record that is no scenario"
    if decision.schedule == BASELINE:
        return ""
    if decision.schedule.engine == "switch" and (not hw.switch_reduce or scenario.op not in SWITCH_OPS):
        return f"{decision.schedule.name} on {hw.name} ({scenario.op})"
    if decision.schedule not in legal_candidates(scenario, backend_for(hw.kind), hw):
        return f"{decision.schedule.name} is not a candidate of {scenario.scenario_id}"
    return ""


NUMBER = st.one_of(st.integers(-3, 1 << 41), st.sampled_from([0, 1, 1 << 62, -1, 4096]),
                   st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([True, "12", None]))
HOSTILE = st.fixed_dictionaries({
    "group": st.sampled_from(["g", "", 3]), "op": st.sampled_from([*SWITCH_OPS, "a2a_gemm", "gemm_a2a", "conv", None]),
    "m": NUMBER, "n": NUMBER, "k": NUMBER,
    "dtype": st.sampled_from(["bfloat16", "float32", "float16", "float8_e4m3fn", "int8", None]),
    "world_size": st.one_of(st.sampled_from([2, 3, 8, 16, 1000, 1, 0, -2]), NUMBER),
    "hardware": st.sampled_from([*MACHINES, "nope", "./missing.yaml", LONG_PATH, None, 5]),
    "imbalance": st.one_of(st.sampled_from([1.0, 2.5, 0.0]), st.floats(allow_nan=True, allow_infinity=True))})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(record=HOSTILE, which=st.integers(0, 1000))
def test_select_never_raises_on_a_hostile_record_and_decides_legally(selectors, record, which):
    selector = list(selectors.values())[which % len(selectors)]
    logging.disable(logging.WARNING)
    try:
        why = legal(selector.select(record), record)
    finally:
        logging.disable(logging.NOTSET)
    assert not why, why


SHAPED = st.tuples(st.sampled_from([*SWITCH_OPS, "a2a_gemm", "gemm_a2a"]), st.integers(1, 1 << 16),
                   st.integers(1, 1 << 12), st.integers(1, 1 << 12), st.sampled_from([2, 4, 8, 16]),
                   st.sampled_from(["bfloat16", "float32", "float16"]))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=SHAPED, machine=st.sampled_from(["sw-empty", "sw-assumed", "no-switch", *MACHINES]),
       which=st.integers(0, 1000))
def test_every_decision_is_legal_and_unmeasured_switch_picks_are_refused(selectors, machines, shape, machine,
                                                                         which):
    op, m, n, k, P, dtype = shape
    hardware = machines.get(machine, machine)
    record = dict(group="g", op=op, m=m * P, n=n * P, k=k * P, dtype=dtype, world_size=P, hardware=hardware,
                  imbalance=1.0)
    name = list(selectors)[which % len(selectors)]
    decision = selectors[name].select(record)
    assert not legal(decision, record), legal(decision, record)
    if name.endswith("unfitted 100.0") and machine in ("sw-empty", "sw-assumed"):
        # every term assumed: no pick clears x2.7e43; the refused pick runs none.sm
        assert decision.schedule == BASELINE, (name, machine, decision)


def test_a_batch_mixing_machines_decides_as_select_does(selectors, machines):
    records = [dict(group="g", op=op, m=4096 * P, n=4096, k=8192, dtype="bfloat16", world_size=P, hardware=hw,
                    imbalance=1.0)
               for hw in [*machines.values(), *MACHINES, "nope"] for op in ("ag_gemm", "gemm_ar") for P in (2, 8, 64)]
    for name, selector in selectors.items():
        batch = selector.decide_batch(records)
        assert [d.schedule for d in batch] == [selector.select(r).schedule for r in records], name
        assert not [why for d, r in zip(batch, records) if (why := legal(d, r))], name
        assert selector.decide_batch([]) == []


def test_the_policy_takes_an_empty_batch(selectors):
    hw = load_hardware("h100-nvswitch")
    for selector in selectors.values():
        assert policy.decide(selector.rules, selector.model, [], hw) == []
        assert policy.decide_as(selector.rules, "none.switch", [], hw) == []
        assert policy.no_harm(selector.rules, [], [], hw) == []


@pytest.mark.parametrize("row", [None, [], "ag_gemm", 5, {"hardware": LONG_PATH}, {"hardware": "a/\0.yaml"}, {}])
def test_decide_rows_gives_a_fallback_for_any_row(row):
    # before: a row that is not a mapping raised TypeError, a path too long OSError
    (out,) = decide_rows(Selector(), [row])
    assert out["row"] == 1 and out["scenario_id"] is None
    assert out["schedule"] == "none.sm" and out["source"] == "fallback" and out["reason"]


def test_a_spec_path_the_os_refuses_is_a_hardware_error():
    with pytest.raises(HardwareError, match=r"\.yaml: cannot be read \(File name too long\)"):
        load_hardware(LONG_PATH)


def test_a_decision_refused_by_the_gpu_rule_is_none_sm(selectors, machines):
    # The heuristic picks none.switch for a small all-reduce on a switch fabric; with every
    # term assumed, the rule at unfitted_margin 100 refuses it: the baseline, none.sm.
    record = dict(group="g", op="gemm_ar", m=8, n=8192, k=8192, dtype="bfloat16", world_size=8, imbalance=1.0)
    alone = Selector().select({**record, "hardware": machines["sw-assumed"]})
    strict = selectors["heuristic margin 5.0 unfitted 100.0"].select({**record, "hardware": machines["sw-assumed"]})
    assert alone.schedule.engine == "switch" or not alone.schedule.is_baseline, alone
    assert strict.schedule == BASELINE and "no measurement fitted" in strict.reason, strict
    assert math.isfinite(strict.confidence)
