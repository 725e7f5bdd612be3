"""Training scores the fallbacks that ship: every fallback column of the validation outcomes,
and the reference picks every fold reads, are what the runtime's own dispatch
(``runtime.fallbacks.run_fallback``) runs for the same scenarios; and the scenarios the
validation counts as outside the ranges are those the runtime's check sends to its
``shape_range`` fallback (``train/fallback_picks.py``, ``train/validation_outcomes.py``,
``train/abstention_fit.py``)."""

import numpy as np
import pandas as pd
import pytest

from ficco_select.features import pair_features
from ficco_select.hardware import load_hardware
from ficco_select.heuristic import backend_for
from ficco_select.runtime.abstention import abstention_reason
from ficco_select.runtime.decision import GATED
from ficco_select.runtime.fallbacks import run_fallback
from ficco_select.runtime.scope import Scope
from ficco_select.scenario import Scenario
from ficco_select.schedule import legal_candidates
from ficco_select.train.abstention_fit import _beyond_ranges, _range_fallbacks, fold_scope
from ficco_select.train.metrics import true_times, usable_rows
from ficco_select.train.runtime_meta import training_ranges
from ficco_select.train.selectors import (AlwaysBaseline, SimulatorSelector, XGBTimeRegressor, reference_picks,
                                         scenario_records, with_features, with_reference_picks)
from ficco_select.train.training_data import simulated
from ficco_select.train.validation_outcomes import FIXED_PREFIX, _validation_outcomes, fixed_rule_schedules


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    # A machine with copy engines: its baselines (none.sm, none.dma) tie in the cost model.
    return with_features(simulated("h100-nvswitch", world_sizes=(2, 4, 8), share=0.05, seed=3))


def runtime(ok: pd.DataFrame) -> dict[str, tuple[Scenario, object, tuple]]:
    """Each scenario of `ok` as the runtime sees it: (scenario, spec, legal candidates)."""
    out = {}
    for rec in scenario_records(ok):
        sid = rec.pop("scenario_id")
        s = Scenario.from_record(rec)
        hw = load_hardware(s.hardware)
        out[sid] = (s, hw, legal_candidates(s, backend_for(hw), hw))
    return out


def runtime_scores(model, s: Scenario, hw, cands) -> np.ndarray:
    """The model's scores of every legal candidate of `s`, as the runtime's model scores them."""
    record = {c: getattr(s, c) for c in ("op", "m", "n", "k", "dtype", "world_size", "hardware", "imbalance")}
    return model.model_.predict(pair_features([record] * len(cands), list(cands), {hw.name: hw}))


def test_the_reference_picks_are_the_runtime_fallbacks_own(frame):
    framed = with_reference_picks(frame)
    scenarios = runtime(usable_rows(frame))
    for who in ("heuristic", "cost_model"):
        want = {sid: run_fallback(who, "low_margin", s, hw, "", cands).schedule.name
                for sid, (s, hw, cands) in scenarios.items()}
        assert reference_picks(framed, who) == want, who
    # The simulator's row reads its own picks: the same cost model, its ties broken by name
    # (a model's rule), where the runtime's cost model breaks them by candidate order.
    assert reference_picks(framed, "simulator") == SimulatorSelector().predict(frame)


def test_each_fallback_column_of_the_validation_is_the_time_of_what_run_fallback_runs_there(frame):
    ids = sorted(frame["scenario_id"].unique())
    train, val = frame[frame["scenario_id"].isin(ids[::2])], frame[frame["scenario_id"].isin(ids[1::2])]
    model = XGBTimeRegressor(n_estimators=20).fit(train)
    fixed = fixed_rule_schedules(usable_rows(train))
    scenarios = runtime(usable_rows(val))
    # Some candidates without a usable row (a failed measurement): on every third scenario the
    # cost model's own pick, on every seventh the serial baseline none.sm. The runtime still
    # picks among every legal candidate; a pick the frame cannot time counts as the baseline.
    lost = set()
    for i, (sid, (s, hw, cands)) in enumerate(scenarios.items()):
        if i % 3 == 0:
            lost.add((sid, run_fallback("cost_model", "", s, hw, "", cands).schedule.name))
        if i % 7 == 0:
            lost.add((sid, "none.sm"))
    failed = pd.Series(list(zip(val["scenario_id"], val["schedule"])), index=val.index).isin(lost)
    val = val.assign(status=np.where(failed, "error", val["status"]))
    ok = usable_rows(val)
    truth = dict(zip(zip(ok["scenario_id"], ok["schedule"]), true_times(ok)))
    baseline = AlwaysBaseline().predict(val)
    rules = ["heuristic", "cost_model", *fixed, *(f"{GATED}{name}" for name in fixed)]
    want, outside = {rule: [] for rule in rules}, 0
    for sid, (s, hw, cands) in sorted(scenarios.items()):
        scores = runtime_scores(model, s, hw, cands)
        for rule in rules:
            pick = run_fallback(rule, "low_margin", s, hw, "", cands, scores).schedule.name
            outside += (sid, pick) not in truth
            want[rule].append(truth.get((sid, pick), truth[(sid, baseline[sid])]))
    got = _validation_outcomes(model, val, fixed)
    assert outside > 0 and len(fixed) >= 2
    for rule in rules:
        column = f"t_{rule}" if rule in ("heuristic", "cost_model") else f"{FIXED_PREFIX}{rule}"
        np.testing.assert_array_equal(got[column].to_numpy(), np.array(want[rule]), err_msg=rule)


def test_the_scenarios_outside_the_ranges_are_those_the_runtime_sends_to_its_shape_range_fallback(frame):
    # The fold trains on world sizes 2 and 4: the runtime abstains on 8 for shape_range,
    # whatever m, n and k, as it does for m, n or k outside.
    train = frame[frame["world_size"] < 8]
    val = frame[~frame["scenario_id"].isin(set(train["scenario_id"]))]
    model = XGBTimeRegressor(n_estimators=20).fit(train)
    fixed = fixed_rule_schedules(usable_rows(train))
    v = _beyond_ranges(_validation_outcomes(model, val, fixed, fold_scope(train)), train)
    scope = Scope.from_meta({"selector": "xgb-regressor", "training_ranges": training_ranges(train)})
    want = [abstention_reason(scope, s, hw)[0] for _, (s, hw, _) in sorted(runtime(usable_rows(val)).items())]
    assert v["abstains"].tolist() == want
    assert (v["world_size"] == 8).all() and set(want) == {"shape_range"}
    assert (v["beyond_world_size"] == 2.0).all()
    got = _range_fallbacks(v, fixed)
    assert got["validation"]["shape_range"]["gpu"]["scenarios"] == len(v)
