"""Features, the heuristic, every selector (one shared check), grouped evaluation without leakage."""

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ficco_select.data.catalog import catalog
from ficco_select.data.dataset import read_dataset
from ficco_select.data.simulate import simulate
from ficco_select import Scenario, candidates
from ficco_select.features import FEATURE_NAMES, FEATURE_SCHEMA_HASH, pair_features
from ficco_select.hardware import load_hardware
from ficco_select.schedule import BASELINE
from ficco_select.heuristic import HeuristicParams, choose, estimates
from ficco_select.train.evaluate import SPLITS, evaluate, folds, tables
from ficco_select.train.metrics import score, usable_rows
from ficco_select.train.selector_sets import all_selectors
from ficco_select.train.selectors import (AlwaysBaseline, Heuristic, Oracle, SimulatorSelector, XGBRanker, XGBTimeRegressor,
                                         reference_picks, with_features, with_reference_picks)
from ficco_select.runtime.selector import Selector as RuntimeSelector
import ficco_select.train.validation_outcomes as validation_module
from ficco_select.train.shipped import SLOWDOWN_CAP, ShippedPolicy, fit_abstention, fit_unseen_hardware

# Tier: end to end (training, MLflow, evaluation); deselect with -m "not slow"
pytestmark = pytest.mark.slow

MODELS = ["llama3-8b", "mixtral-8x7b", "gpt3-175b"]


@pytest.fixture(scope="module")
def small():
    frames = []
    for hw in ("mi300x-8", "h100-nvswitch"):
        spec = load_hardware(hw)
        recs = catalog("full", world_sizes=(2, 4, 8), hardware=hw, models=MODELS)
        frames.append(simulate([Scenario.from_record(r) for r in recs], spec, noise=0.03, seed=2))
    return pd.concat(frames, ignore_index=True)


def spying(base: type, seen: list, column: str = "hardware") -> type:
    """`base` (a selector class) whose every fit adds the set of its frame's `column` to `seen`."""
    class Spy(base):
        def fit(self, df):
            seen.append(set(df[column]))
            return super().fit(df)

    return Spy


def test_features_are_the_same_for_one_row_and_a_batch(small):
    recs = small[["group", "op", "m", "n", "k", "dtype", "world_size", "hardware", "imbalance"]].to_dict("records")
    hw = {h: load_hardware(h) for h in set(small["hardware"])}
    X = pair_features(recs, small["schedule"].tolist(), hw)
    assert X.shape == (len(small), len(FEATURE_NAMES)) and np.isfinite(X).all()
    for i in (0, 17, len(small) - 1):
        np.testing.assert_array_equal(pair_features([recs[i]], [small["schedule"].iloc[i]], hw)[0], X[i])
    assert len(FEATURE_SCHEMA_HASH) == 12


def test_the_feature_schema_hash_changes_with_a_formula_not_only_with_a_name(monkeypatch):
    import ficco_select.features.extract as build

    before = build.formula_digest()
    assert build.formula_digest() == before  # deterministic
    real = build.schedule_times

    def one_percent_slower(*args, **kwargs):
        out = dict(real(*args, **kwargs))
        out["time_s"] = out["time_s"] * 1.01
        return out

    monkeypatch.setattr(build, "schedule_times", one_percent_slower)
    assert build.formula_digest() != before
    monkeypatch.undo()
    assert build.formula_digest() == before and FEATURE_SCHEMA_HASH == build.feature_schema_hash()


def test_heuristics_are_always_legal_and_follow_their_rules():
    rng = np.random.default_rng(0)
    for hw_name in ("cpu", "mi300x-8", "h100-nvswitch", "l40s-pcie-8"):
        hw = load_hardware(hw_name)
        backend = "cpu" if hw_name == "cpu" else "sim"
        for _ in range(200):
            P = int(rng.choice([2, 3, 4, 8]))
            op = str(rng.choice(["ag_gemm", "gemm_rs", "a2a_gemm", "gemm_ar", "gemm_a2a"]))
            s = Scenario(group="r", op=op, m=int(rng.integers(1, 512)) * P, n=int(rng.integers(1, 512)) * P,
                         k=int(rng.integers(1, 512)) * P, dtype="float32", world_size=P, hardware=hw_name,
                         imbalance=float(rng.uniform(1, P)) if op in ("a2a_gemm", "gemm_a2a") else 1.0)
            assert choose(s, hw) in candidates(s, backend, hw)
    mi300x = load_hardware("mi300x-8")
    # nothing to overlap with: a GEMM of 8 rows and a huge transfer -> baseline
    tiny = Scenario(group="t", op="ag_gemm", m=8, n=8, k=65536, dtype="bfloat16", world_size=8, hardware="mi300x-8")
    assert choose(tiny, mi300x).is_baseline
    big = Scenario(group="t", op="ag_gemm", m=65536, n=16384, k=8192, dtype="bfloat16", world_size=8,
                   hardware="mi300x-8")
    assert not choose(big, mi300x).is_baseline  # both sides large: overlap pays


def test_the_heuristic_runs_the_fastest_estimate_that_saves_enough():
    from ficco_select.heuristic import _estimated_times, _families

    h100 = load_hardware("h100-nvswitch")
    for m in (256, 4096, 65536):
        s = Scenario(group="t", op="gemm_rs", m=m, n=8192, k=8192, dtype="bfloat16", world_size=8, hardware="h100-nvswitch")
        est, families = estimates(s, h100), _families(s, h100, "sim")
        times = _estimated_times(s, h100, est, families, fill=1.0)
        legal = [i for i, c in enumerate(families.schedules) if c in candidates(s, "sim", h100)]
        fastest = min(legal, key=lambda i: times[i])
        baseline = est["t_comp"] + est["t_comm"]
        for gain in (0.0, 0.2):
            want = families.schedules[fastest] if times[fastest] <= (1 - gain) * baseline else BASELINE
            assert choose(s, h100, HeuristicParams(min_gain=gain)) == want


@pytest.mark.parametrize("split", SPLITS)
def test_folds_never_leak_a_test_scenario_into_training(small, split):
    for name, train, test in folds(small, split):
        assert not set(small.loc[train, "scenario_id"]) & set(small.loc[test, "scenario_id"])
        assert test.any() and train.any()
        if split == "family":
            held = name.split("=", 1)[1]
            assert set(small.loc[test, "group"]) == {held} and held not in set(small.loc[train, "group"])
        if split == "hardware":
            held = name.split("=", 1)[1]
            assert held not in set(small.loc[train, "hardware"])
        if split == "topology":  # mi300x-8 is fully connected, h100-nvswitch a switch
            held = {"topology=fully_connected": "mi300x-8", "topology=switch": "h100-nvswitch"}[name]
            assert set(small.loc[test, "hardware"]) == {held} and held not in set(small.loc[train, "hardware"])
    assert split not in ("family", "hardware", "topology") or len(folds(small, split)) >= 2


def test_every_selector_fits_predicts_legal_schedules_deterministically(small):
    train, test = small[small["hardware"] == "mi300x-8"], small[small["hardware"] == "h100-nvswitch"]
    train = train[train["scenario_id"].isin(sorted(set(train["scenario_id"]))[::2])]  # legality needs no more
    legal = usable_rows(test).groupby("scenario_id")["schedule"].agg(set)
    for make in [type(s) for s in all_selectors()]:
        first = make().fit(train).predict(test)
        assert set(first) == set(legal.index), make.__name__
        assert all(first[sid] in legal[sid] for sid in first), make.__name__
        assert make().fit(train).predict(test) == first, f"{make.__name__} is not deterministic"


def test_learned_selectors_beat_always_baseline_in_distribution(small):
    rows = usable_rows(small)
    ids = sorted(set(rows["scenario_id"]))
    train = rows[rows["scenario_id"].isin(ids[::2])]
    test = rows[rows["scenario_id"].isin(ids[1::2])]
    base = score(test, AlwaysBaseline().predict(test))["oracle_capture"]
    for model in (XGBTimeRegressor(), XGBRanker(), Heuristic()):
        got = score(test, model.fit(train).predict(test))["oracle_capture"]
        assert got > base, type(model).__name__
    assert score(test, Oracle().predict(test))["oracle_capture"] == 1.0


def test_evaluate_reports_every_selector_per_split(small):
    res = evaluate(small, splits=("random", "hardware"), progress=False,
                   make_selectors=lambda: [XGBTimeRegressor(n_estimators=30), Heuristic(tune=False),
                                           AlwaysBaseline(), Oracle()])
    for split in ("random", "hardware"):
        mean = res["splits"][split]["mean"]
        assert set(mean) == {"xgb-regressor", "heuristic", "always-baseline", "ceiling"}
        assert mean["ceiling"]["oracle_capture"] == 1.0 and mean["always-baseline"]["speedup"] == 1.0
    assert len(res["splits"]["hardware"]["folds"]) == 2


def test_folds_fitted_in_worker_processes_score_as_folds_fitted_here(small):
    # A machine this process alone knows (read from a file, sampled around a preset): its
    # workers must know it by the same name and numbers.
    from ficco_select.hardware import machines
    from ficco_select.train.selector_sets import debug_selectors

    local = dataclasses.replace(load_hardware("mi300x-8"), name="mi300x-8-local", link_bw_gbps=200.0)
    recs = catalog("full", world_sizes=(2, 4), hardware="mi300x-8", models=MODELS)[::3]
    rows = simulate([Scenario.from_record({**r, "hardware": local.name}) for r in recs], local, noise=0.03, seed=3)
    df = pd.concat([small, rows], ignore_index=True)
    with machines([local], "a test"):
        here = evaluate(df, splits=("hardware", "family"), make_selectors=debug_selectors, progress=False)
        there = evaluate(df, splits=("hardware", "family"), make_selectors=debug_selectors, progress=False,
                         workers=2)
    assert len(here["splits"]["hardware"]["folds"]) == 3
    assert tables(there).keys() == tables(here).keys()
    for name, table in tables(here).items():
        pd.testing.assert_frame_equal(tables(there)[name], table)
    assert there["choices"] == here["choices"] and there["decisions"] == here["decisions"]


def test_the_simulator_selector_is_the_ceiling_on_sim_rows_and_calibrates_on_the_training_fold(small):
    # Sim rows: the model is their truth, so its argmin is the noise-free best.
    train, test = small[small["hardware"] == "mi300x-8"], small[small["hardware"] == "h100-nvswitch"]
    sim = SimulatorSelector().fit(train)
    assert sim.specs_ == {}  # nothing measured: the specs as given
    assert score(test, sim.predict(test))["near_opt_2"] == 1.0
    # Measured rows: calibrated on the training fold only; the test fold's times are never read.
    cpu = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet")
    ids = sorted(set(usable_rows(cpu)["scenario_id"]))[:80]
    train, test = cpu[cpu["scenario_id"].isin(ids[:60])], cpu[cpu["scenario_id"].isin(ids[60:])]
    sim = SimulatorSelector().fit(train)
    assert set(sim.specs_) == {"cpu"} and sim.specs_["cpu"].description == "calibrated on the training fold"
    chosen = sim.predict(test)
    legal = usable_rows(test).groupby("scenario_id")["schedule"].agg(set)
    assert set(chosen) == set(legal.index) and all(chosen[sid] in legal[sid] for sid in chosen)
    shuffled = test.assign(time_s=np.random.default_rng(0).permutation(test["time_s"].to_numpy()))
    assert sim.predict(shuffled) == chosen


def test_the_shipped_row_scores_the_runtime_policy_not_the_bare_model(small):
    rows = usable_rows(small)
    ids = sorted(set(rows["scenario_id"]))
    train, test = rows[rows["scenario_id"].isin(ids[::2])], rows[rows["scenario_id"].isin(ids[1::2])]
    bare = XGBRanker(n_estimators=40).fit(train).predict(test)
    shipped = ShippedPolicy(XGBRanker(n_estimators=40)).fit(train)
    assert set(shipped.predict(test)) == set(bare)
    assert {d.source for d in shipped.decisions_.values()} <= {"model", "heuristic", "fallback"}
    # A rule that trusts every margin: then it is the bare model, scored by the runtime's trees.
    trusting = {**shipped.meta_, "abstention": {"min_margin": 0.0, "fallback": "heuristic"}}
    shipped.runtime_ = RuntimeSelector(shipped.model_, trusting, layer_tables=False)
    chosen = shipped.predict(test)
    clear = [sid for sid, d in shipped.decisions_.items() if d.source == "model" and d.confidence > 1e-4]
    assert len(clear) > len(chosen) / 2  # (a float32 near-tie may go either way)
    assert all(chosen[sid] == bare[sid] for sid in clear)
    # Unseen hardware: the runtime abstains to its heuristic (untuned, as shipped), the bare model does not.
    unseen = ShippedPolicy(XGBRanker(n_estimators=40)).fit(train[train["hardware"] == "mi300x-8"],
                                                            unseen_machines=["h100-nvswitch"])
    held = test[test["hardware"] == "h100-nvswitch"]
    heuristic = Heuristic(tune=False).fit(held).predict(held)
    assert unseen.predict(held, guarded=False) == heuristic
    # As it ships, the GPU do-no-harm rule sends the heuristic's overlap picks within the
    # simulator's published error to the baseline.
    guarded = unseen.predict(held)
    assert {d.source for d in unseen.decisions_.values()} <= {"heuristic", "fallback"}
    assert all(guarded[sid] in (heuristic[sid], "none.sm") for sid in guarded)
    assert all(d.abstained == "unseen_machine" for d in unseen.decisions_.values() if d.source == "fallback")
    # A fitted policy pickles without its training frame, and decides the same after.
    again = pickle.loads(pickle.dumps(unseen))
    assert again.predict(held) == guarded and len(pickle.dumps(unseen)) < len(pickle.dumps(train)) / 4


def test_the_abstention_rule_is_fitted_on_validation_folds_of_the_training_side_only(small):
    rows = usable_rows(small)
    ids = sorted(set(rows["scenario_id"]))
    train = rows[rows["scenario_id"].isin(ids[::2])]
    fitted_on = []

    Spy = spying(XGBRanker, fitted_on, "scenario_id")

    rule = fit_abstention(lambda: Spy(n_estimators=30), train)
    assert len(fitted_on) == 2 and not fitted_on[0] & fitted_on[1]  # each validates on what the other fits
    assert fitted_on[0] | fitted_on[1] == set(train["scenario_id"])  # and never sees the test side
    # The heuristic, the baseline, or a fixed rule (gated or not) of a schedule the training side has.
    assert rule["fallback"] in ("heuristic", "baseline", *(f"{g}{name}" for g in ("", "gated:") for name in set(train["schedule"])))
    assert rule["validation_slowdowns"] <= rule["validation_tail_guard"]
    assert rule["validation_scenarios"] == train["scenario_id"].nunique()
    shipped = ShippedPolicy(XGBRanker(n_estimators=30)).fit(train)
    pooled = shipped.runtime_.rules.margin_rules
    assert (pooled["min_margin"], pooled["fallback"]) == (rule["min_margin"], rule["fallback"])


def test_the_shipped_policy_reuses_its_inner_fit_and_fits_the_unseen_hardware_rule_only_when_needed(small):
    rows = usable_rows(small)
    mi300x, h100 = rows[rows["hardware"] == "mi300x-8"], rows[rows["hardware"] == "h100-nvswitch"]
    fits = []

    Spy = spying(XGBRanker, fits)

    inner = Spy(n_estimators=20).fit(rows)  # as evaluate does: the bare row first, same frame
    shipped = ShippedPolicy(inner).fit(rows)
    assert len(fits) == 3  # the bare fit, then two validation fits for the margin rule: no refit
    shipped.predict(rows)
    assert len(fits) == 3 and "unseen_hardware" not in shipped.meta_  # every machine was trained on
    fits.clear()
    one = ShippedPolicy(Spy(n_estimators=20)).fit(mi300x, unseen_machines=["h100-nvswitch"])
    assert len(fits) == 3  # another frame: the inner model is fitted
    assert one.unseen_hardware_["decide"] == "heuristic"  # one machine: nothing to hold out, no fit
    assert all(hw == {"mi300x-8"} for hw in fits)  # on the training side only
    meta = one.meta_
    one.predict(h100)  # a machine it never saw: decided, nothing learned
    assert len(fits) == 3 and one.meta_ is meta and not any(isinstance(v, pd.DataFrame) for v in vars(one).values())
    # The heuristic decides; the GPU do-no-harm rule sends its picks within the published error to the baseline.
    assert {d.source for d in one.decisions_.values()} <= {"heuristic", "fallback"}
    assert all(d.abstained == "unseen_machine" for d in one.decisions_.values())


def test_the_unseen_hardware_rule_holds_machines_out_of_the_fit_and_bounds_the_trained_specs(small, monkeypatch):
    rows = usable_rows(small)
    fitted_on = []

    Spy = spying(XGBRanker, fitted_on)

    abstention = {"min_margin": 0.0, "fallback": "heuristic"}
    rule = fit_unseen_hardware(lambda: Spy(n_estimators=20), rows, abstention)
    assert fitted_on == [{"h100-nvswitch"}, {"mi300x-8"}] or fitted_on == [{"mi300x-8"}, {"h100-nvswitch"}]
    gpu = rule["validation"]["gpu"]
    assert gpu["scenarios"] == rows["scenario_id"].nunique() and set(gpu["near_opt_2"]) == {"model", "heuristic"}
    ahead = (gpu["near_opt_2"]["model"] > gpu["near_opt_2"]["heuristic"]
             and gpu["slowdowns"]["model"] <= max(gpu["tail_guard"], gpu["slowdowns"]["heuristic"]))
    assert gpu["tail_guard"] >= SLOWDOWN_CAP
    assert gpu["ahead"] == ahead and rule["decide"] == ("model" if ahead else "heuristic")
    assert ("kinds" in rule) == ahead
    # Wherever the model may not decide an unseen machine, the fallback that did best on the
    # held-out machines: the most capture among the candidates within the tail guard.
    for reason in ("unseen_machine",):
        chosen = rule["by_reason_validation"][reason]["gpu"]
        assert rule["by_reason"][reason]["gpu"] == chosen["fallback"] and chosen["scenarios"] == gpu["scenarios"]
        allowed = [c["capture"] for c in chosen["candidates"].values() if c["slowdowns"] <= chosen["tail_guard"]]
        assert chosen["capture"] == max(allowed) == chosen["candidates"][chosen["fallback"]]["capture"]
        assert {"heuristic", "baseline", "cost_model"} < set(chosen["candidates"])  # and the fixed rules
    # Against a rival a model trained on one machine beats (always the baseline), the model
    # decides unseen machines inside the trained specs, widened as far as validation tested.
    fold_free = validation_module._fold_free_picks
    monkeypatch.setattr(validation_module, "_fold_free_picks", lambda val, view, fallback: (
        AlwaysBaseline().predict(val) if fallback == "heuristic" else fold_free(val, view, fallback)))
    rule = fit_unseen_hardware(lambda: Spy(n_estimators=20), rows, abstention)
    assert rule["validation"]["gpu"]["ahead"] and rule["decide"] == "model", rule["validation"]["gpu"]
    gpu = rule["kinds"]["gpu"]
    specs = [load_hardware(h) for h in ("mi300x-8", "h100-nvswitch")]
    assert gpu["topologies"] == sorted({s.topology for s in specs})
    assert gpu["any_topology"]  # each machine's topology was new to the model that decided it
    # widened by the factor the validation tested: each machine decided by a model
    # trained on the other alone, so the factor is how far apart their links are
    links = sorted(s.link_bw_gbps for s in specs)
    widened = gpu["widened_by"]["link_bw_gbps"]
    assert widened == pytest.approx(links[1] / links[0])
    assert gpu["spec_ranges"]["link_bw_gbps"] == pytest.approx([links[0] / widened, links[1] * widened])


def test_the_fallbacks_picked_once_per_scenario_are_their_own_picks_and_change_no_rule(small):
    framed = with_reference_picks(with_features(small))
    assert reference_picks(framed, "heuristic") == Heuristic(tune=False).predict(small)
    assert reference_picks(framed, "simulator") == SimulatorSelector().predict(small)
    assert reference_picks(small, "heuristic") is None  # a frame without them: decided as before
    make = lambda: XGBTimeRegressor(n_estimators=20)  # noqa: E731
    assert fit_abstention(make, framed) == fit_abstention(make, usable_rows(small))
    assert SimulatorSelector().fit(framed).predict(framed) == SimulatorSelector().predict(small)


def test_the_unseen_machine_rule_is_fitted_for_the_kinds_asked_only(small):
    rows = usable_rows(small)
    fitted_on = []

    Spy = spying(XGBTimeRegressor, fitted_on)

    abstention = {"min_margin": 0.0, "fallback": "heuristic"}
    every = fit_unseen_hardware(lambda: Spy(n_estimators=20), rows, abstention)
    assert len(fitted_on) == 2
    assert fit_unseen_hardware(lambda: Spy(n_estimators=20), rows, abstention, kinds={"gpu"}) == every
    fitted_on.clear()
    rule = fit_unseen_hardware(lambda: Spy(n_estimators=20), rows, abstention, kinds={"cpu"})  # no cpu machine here
    assert fitted_on == [] and rule == {"decide": "heuristic", "validation": {}}


def test_two_splits_holding_out_the_same_rows_share_one_fit(small):
    # mi300x-8 is the only fully connected machine here and h100 the only switched one: the
    # topology folds hold out what the hardware folds do.
    fits = []

    Counted = spying(XGBTimeRegressor, fits, "scenario_id")

    make = lambda: [Counted(n_estimators=20), Heuristic(tune=False), Oracle()]  # noqa: E731
    res = evaluate(small, splits=("hardware", "topology"), make_selectors=make, progress=False)
    assert len(fits) == 2
    by_machine = {"mi300x-8": load_hardware("mi300x-8").topology, "h100-nvswitch": load_hardware("h100-nvswitch").topology}
    for hw, topology in by_machine.items():
        assert res["splits"]["topology"]["folds"][f"topology={topology}"] == res["splits"]["hardware"]["folds"][f"hardware={hw}"]
    alone = evaluate(small, splits=("topology",), make_selectors=make, progress=False)
    assert alone["splits"]["topology"]["folds"] == res["splits"]["topology"]["folds"]


def test_mixed_backends_get_a_table_of_their_own(small):
    cpu = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet")
    mixed = pd.concat([small, cpu[cpu["scenario_id"].isin(sorted(set(cpu["scenario_id"]))[:40])]],
                      ignore_index=True)
    res = evaluate(mixed, splits=("hardware",), progress=False,
                   make_selectors=lambda: [Heuristic(tune=False), AlwaysBaseline(), Oracle()])
    by_backend = res["splits"]["hardware"]["by_backend"]
    assert set(by_backend) == {"cpu", "sim"}
    assert by_backend["cpu"]["ceiling"]["n"] == 40
    assert by_backend["sim"]["ceiling"]["n"] == small["scenario_id"].nunique()
    assert by_backend["sim"]["ceiling"]["near_opt_2"] == 1.0  # noise-free truth
    # The simulated rows mix dtypes (the catalog's GPU mix): a table per dtype too; the cpu
    # rows hold float32 alone, so no cpu table per dtype.
    sim_dtypes = sorted(set(small["dtype"]))
    assert len(sim_dtypes) > 1
    by_dtype = res["splits"]["hardware"]["by_dtype"]
    assert set(by_dtype) == {f"sim.{d}" for d in sim_dtypes}
    assert sum(v["ceiling"]["n"] for v in by_dtype.values()) == small["scenario_id"].nunique()
    names = list(tables(res))
    per_op = {n for n in names if n.count(".") == 3}  # hardware.<backend>.<dtype>.<op>
    assert per_op and all(n.startswith(("hardware.sim.bfloat16.", "hardware.cpu.float32.")) for n in per_op)
    assert set(names) - per_op == {"hardware", "hardware.cpu", "hardware.sim", *(f"hardware.sim.{d}" for d in sim_dtypes)}


def test_ficco_evaluate_prints_a_table_per_split_and_per_backend(small, tmp_path):
    from click.testing import CliRunner

    from ficco_select.data.dataset import write_parquet_atomic
    from ficco_select.cli.main import main

    cpu = read_dataset(Path(__file__).parents[1] / "data" / "measured" / "cpu_catalog.parquet")
    sim_path, cpu_path = tmp_path / "sim.parquet", tmp_path / "cpu.parquet"
    write_parquet_atomic(small, sim_path)
    write_parquet_atomic(cpu[cpu["scenario_id"].isin(sorted(set(cpu["scenario_id"]))[:40])], cpu_path)
    res = CliRunner().invoke(main, ["evaluate", "--dataset", str(sim_path), "--dataset", str(cpu_path),
                                    "--splits", "hardware", "--no-progress"])
    assert res.exit_code == 0, res.output
    for heading in ("== hardware (mean over 3 folds) ==", "== hardware.cpu (cpu scenarios, 3 folds pooled) ==",
                    "== hardware.sim (sim scenarios, 3 folds pooled) =="):
        assert heading in res.output


def test_range_slack_widens_only_where_the_model_was_ahead_outside_the_ranges():
    import pandas as pd

    from ficco_select.train.abstention_fit import _range_slack

    n = 40
    v = pd.DataFrame({"kind": ["gpu"] * n + ["cpu"] * n, "op": "ag_gemm", "margin": 1.0,
                      "beyond_m": 1.0, "beyond_n": [3.0] * (n // 2) + [1.0] * (n // 2) + [2.0] * n, "beyond_k": 1.0,
                      "beyond_world_size": 1.0,
                      "t_best": 1.0, "t_baseline": 1.5,
                      # gpu: the model finds the best, the heuristic does not; cpu: the reverse
                      "t_model": [1.0] * n + [1.4] * n, "t_heuristic": [1.3] * n + [1.0] * n})
    v["abstains"] = np.where(v["beyond_n"] > 1, "shape_range", "")  # the runtime's verdict
    slack = _range_slack(v, {"min_margin": 0.0, "fallback": "heuristic"})
    assert slack == {"gpu": {"m": 3.0, "n": 3.0, "k": 3.0}}  # one factor: the largest tested
    assert _range_slack(v.iloc[:10], {"min_margin": 0.0, "fallback": "heuristic"}) == {}  # too few outside


def test_the_headline_table_is_the_family_hold_out_in_bfloat16_and_comes_first():
    metrics = {"heuristic": {"n": 1, "near_opt_2": 0.5}}
    block = {"mean": metrics, "folds": {}, "by_backend": {"sim": metrics, "cpu": metrics},
             "by_dtype": {"sim.bfloat16": metrics, "sim.float16": metrics}}
    names = list(tables({"splits": {"hardware": block, "family": block}}))
    assert names[0] == "family.sim.bfloat16"
    assert set(names) == {f"{s}{v}" for s in ("hardware", "family")
                          for v in ("", ".sim", ".cpu", ".sim.bfloat16", ".sim.float16")}


def test_the_best_schedule_classifier_fits_a_best_schedule_that_one_scenario_has_among_many():
    # Over 10,000 scenarios scikit-learn's early stopping holds out a stratified split, which
    # fails on a class of one; the classifier must fit all the same.
    from ficco_select.train.selectors import FEATURE_COLUMNS, HGBClassifier

    rng = np.random.default_rng(0)
    n = 10_050
    names = np.where(np.arange(n) == 0, "ficco.d4.ring.gemm_per_step.m.sm", "shard.ring.sm")
    frame = pd.DataFrame({"scenario_id": np.repeat([f"s{i}" for i in range(n)], 2),
                          "schedule": np.ravel(np.column_stack([np.full(n, "none.sm"), names])),
                          "time_s": np.ravel(np.column_stack([np.ones(n), np.full(n, 0.5)])),
                          "status": "ok", "verified": True})
    frame = pd.concat([frame, pd.DataFrame(rng.random((2 * n, len(FEATURE_COLUMNS))), columns=list(FEATURE_COLUMNS))],
                      axis=1)
    model = HGBClassifier(max_iter=5).fit(frame)
    assert set(model.model_.classes_) == {"shard.ring.sm", "ficco.d4.ring.gemm_per_step.m.sm"}


def test_the_command_names_every_selector_set_and_the_default_fits_only_what_ships():
    from ficco_select.cli.train_cmds import SELECTOR_SET_NAMES
    from ficco_select.train.config import SELECTOR_SETS, TrainConfig

    assert SELECTOR_SET_NAMES == tuple(SELECTOR_SETS)
    default = {s.name for s in TrainConfig().make_selectors()}
    assert {"xgb-regressor", "shipped", "heuristic", "ceiling"} <= default
    assert not default & {"xgb-ranker", "hgb-classifier", "random-forest"}
    assert {"xgb-ranker", "hgb-classifier", "random-forest"} <= {s.name for s in SELECTOR_SETS["all"]()}
