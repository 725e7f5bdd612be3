"""An export's two files: ``selector.json``, the rules the runtime reads, and
``evidence.json``, what training found while fitting them, which the runtime never reads."""

import json


from ficco_select.runtime.scope import Scope
from ficco_select.runtime.selector import Selector
from ficco_select.train.shipped import rules_and_evidence
from helpers.exports import FULL_RANGES, RECORD, spec_dict, warnings_of, write_selector

FIGURES = {"validation_scenarios": 120, "validation_capture": 0.97, "validation_slowdowns": 0.01}
META = {
    "selector": "xgb-regressor", "training_ranges": {**FULL_RANGES, "hardware": ["mi300x-8", "node-a", "mi300x-8~1"]},
    "hardware_specs": {"node-a": spec_dict("node-a"), "mi300x-8~1": spec_dict("mi300x-8~1", devices=4)},
    "abstention": {"min_margin": 0.02, "fallback": "heuristic", **FIGURES,
                   "by_kind": {"gpu": {"min_margin": 0.03, "fallback": "baseline", **FIGURES}},
                   "by_op": {"gpu.ag_gemm": {"min_margin": None, "fallback": "shard.ring.sm", **FIGURES}},
                   "by_reason": {"shape_range": {"gpu": "cost_model"}},
                   "by_reason_validation": {"shape_range": {"gpu": {"fallback": "cost_model", "scenarios": 9}}}},
    "unseen_hardware": {"decide": "model", "validation": {"gpu": {"scenarios": 40, "ahead": True}},
                        "kinds": {"gpu": {"topologies": ["switch"], "spec_ranges": {"link_bw_gbps": [10.0, 900.0]},
                                          "widened_by": {"link_bw_gbps": 1.5}, "any_topology": False}},
                        "by_reason_validation": {"unseen_machine": {"gpu": {"fallback": "heuristic"}}}},
    "mlflow_run_id": "r1",
}


def test_every_validation_figure_leaves_the_rules_and_the_rules_read_the_same():
    rules, evidence = rules_and_evidence(META)
    text = json.dumps(rules)
    assert "validation" not in text and "widened_by" not in text and "~" not in json.dumps(rules["hardware_specs"])
    assert evidence["abstention.by_op.gpu.ag_gemm"] == FIGURES
    assert evidence["abstention"]["by_reason_validation"]["shape_range"]["gpu"]["scenarios"] == 9
    assert evidence["unseen_hardware"]["validation"]["gpu"]["ahead"]
    assert evidence["unseen_hardware.kinds.gpu"] == {"widened_by": {"link_bw_gbps": 1.5}}
    assert set(evidence["sampled_machines"]) == {"mi300x-8~1"} and evidence["mlflow_run_id"] == "r1"
    # What the runtime parses from the rules is what it parsed from everything, but the
    # sampled machine only training names.
    full, read = Scope.from_meta(META), Scope.from_meta(rules)
    assert read == Scope.from_meta({**META, "hardware_specs": {"node-a": spec_dict("node-a")}})
    assert set(full.specs) - set(read.specs) == {"mi300x-8~1"}


def test_the_evidence_file_never_changes_a_decision_nor_blocks_a_load(tmp_path, caplog):
    rules, evidence = rules_and_evidence(META)
    folder = write_selector(tmp_path / "sel", **{k: v for k, v in rules.items() if k != "training_ranges"})
    records = [RECORD, {**RECORD, "op": "gemm_rs"}, {**RECORD, "m": 1 << 30}, {**RECORD, "hardware": "node-a"}]
    without = [Selector.load(folder).select(r) for r in records]
    assert {d.source for d in without} >= {"model"}
    for text in (json.dumps(evidence), json.dumps(evidence)[:50], "[1, 2", json.dumps({"abstention": {"min_margin": 9}}),
                 json.dumps(rules)):  # whole, truncated, broken, another's, the rules in its place
        (folder / "evidence.json").write_text(text)
        caplog.clear()
        assert [Selector.load(folder).select(r) for r in records] == without
        assert warnings_of(caplog) == []


def test_the_gpu_rule_steps_aside_on_a_gpu_machine_whose_own_measured_rows_trained_the_model(tmp_path):
    import pandas as pd

    from ficco_select.train.shipped import measured_gpus

    # Training side, hand-made rows: node-mode cuda rows of h100-nvswitch count; loopback rows
    # of h200-nvswitch (every rank on one GPU: same-device copies) and simulated rows do not.
    rows = pd.DataFrame({
        "scenario_id": ["a", "b", "c", "d"], "schedule": ["none.sm"] * 4, "status": ["ok"] * 4, "verified": [True] * 4,
        "time_s": [1.0] * 4, "backend": ["cuda", "cuda", "sim", "cpu"],
        "hardware": ["h100-nvswitch", "h200-nvswitch", "mi300x-8", "cpu"],
        "hardware_fingerprint": ["x-node", "y-loopback", "", "z"]})
    assert measured_gpus(rows) == ["h100-nvswitch"]
    assert measured_gpus(rows[rows["hardware"] != "h100-nvswitch"]) == []  # the next export, without them
    # Runtime side, a hand-made export: a margin no simulated gain reaches vetoes the model's
    # overlap pick on every GPU but the measured one.
    strict = {"split_us": 0.0, "small_margin": 0.0, "large_margin": 50.0}
    ranges = {**FULL_RANGES, "hardware": ["mi300x-8", "h100-nvswitch"]}
    trusting = {"min_margin": 0.0, "fallback": "heuristic"}
    ruled = Selector.load(write_selector(tmp_path / "ruled", training_ranges=ranges, abstention=trusting,
                                         gpu_no_harm=strict))
    measured = Selector.load(write_selector(tmp_path / "measured", training_ranges=ranges, abstention=trusting,
                                            gpu_no_harm={**strict, "measured": ["h100-nvswitch"]}))
    for hardware in ("mi300x-8", "h100-nvswitch"):
        d = ruled.select({**RECORD, "hardware": hardware})
        assert d.schedule.is_baseline and d.abstained == "no_harm"
    d = measured.select({**RECORD, "hardware": "h100-nvswitch"})
    assert d.source == "model" and not d.schedule.is_baseline
    assert measured.select({**RECORD, "hardware": "mi300x-8"}).abstained == "no_harm"




def test_the_gpu_rule_stays_on_for_a_spec_file_under_a_measured_machines_name_with_other_numbers(tmp_path):
    import yaml

    # The export learned node-a's own measured rows (a GPU machine it carries), so the GPU rule
    # steps aside there. A spec file naming node-a with its numbers is that machine; one naming
    # it with other numbers is a machine the model never measured: decided as an unseen
    # machine, and the rule judges the pick.
    strict = {"split_us": 0.0, "small_margin": 0.0, "large_margin": 50.0, "measured": ["node-a"]}
    ranges = {**FULL_RANGES, "hardware": ["mi300x-8", "node-a"]}
    sel = Selector.load(write_selector(tmp_path / "sel", training_ranges=ranges,
                                       hardware_specs={"node-a": spec_dict("node-a")},
                                       abstention={"min_margin": 0.0, "fallback": "heuristic"}, gpu_no_harm=strict))
    same, other = tmp_path / "same.yaml", tmp_path / "other.yaml"
    same.write_text(yaml.safe_dump(spec_dict("node-a")))
    other.write_text(yaml.safe_dump(spec_dict("node-a", link_bw_gbps=spec_dict("node-a")["link_bw_gbps"] * 2)))
    by_name = sel.select({**RECORD, "hardware": "node-a"})
    assert by_name.source == "model" and not by_name.schedule.is_baseline
    assert sel.measured("node-a") and sel.measured(str(same)) and not sel.measured(str(other))
    assert sel.select({**RECORD, "hardware": str(same)}) == by_name
    # The heuristic decides the unseen machine (an overlap here); the rule sends it to the baseline.
    d = sel.select({**RECORD, "hardware": str(other)})
    assert d.abstained == "unseen_machine" and "differs from the one seen in training" in d.reason, d
    assert d.schedule.is_baseline and d.source == "fallback" and "the baseline does no harm" in d.reason, d
