"""The runtime selector never raises and always returns a legal schedule (property test)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ficco_select import Scenario, candidates
from ficco_select.heuristic import backend_for
from ficco_select.hardware import load_hardware
from ficco_select.selector import Selector

SEL = Selector.load("/nonexistent/selector/folder")  # heuristic only, after one warning

sizes = st.one_of(st.integers(-5, 1 << 20), st.sampled_from([0, 1, 2, 3, 7, 8, 4096, 1 << 31]),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.none())
records = st.fixed_dictionaries({
    "group": st.one_of(st.text(max_size=8), st.none()),
    "op": st.one_of(st.sampled_from(["ag_gemm", "gemm_rs", "a2a_gemm"]), st.text(max_size=6)),
    "m": sizes, "n": sizes, "k": sizes,
    "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "float16", "bf16"]), st.text(max_size=5)),
    "world_size": st.one_of(st.integers(-2, 1100), st.sampled_from([2, 3, 4, 8]), st.none()),
    "hardware": st.sampled_from(["cpu", "mi300x-8", "h100-nvswitch", "l40s-pcie-8", "tpu-v9", ""]),
    "imbalance": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.just(1.0)),
})


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(records)
def test_select_never_raises_and_returns_a_legal_schedule(record):
    decision = SEL.select(record)
    assert decision.source in ("model", "heuristic", "fallback")
    try:
        scenario = Scenario.from_record(record)
    except Exception:
        assert decision.source == "fallback" and decision.schedule.is_baseline
        return
    if decision.source == "fallback":
        assert decision.schedule.is_baseline
        return
    hw = load_hardware(scenario.hardware)
    legal = candidates(scenario, backend_for(hw))
    assert not legal or decision.schedule in legal
    assert math.isfinite(decision.confidence)
