"""The rules as one object: ``Scope`` parses ``selector.json`` (``from_meta``) and writes it
(``to_meta``); training writes the file through both, so an export holds exactly what the
runtime reads (``RULE_FIELDS``), and ``evidence.json`` what it never reads."""

import json

import pytest

from ficco_select.runtime import loading
from ficco_select.runtime.loading import RULES_VERSION, read_export
from ficco_select.runtime.scope import DEFAULT_MIN_MARGIN, RULE_FIELDS, Scope
from helpers.exports import preference_model, spec_dict

HASH = loading.feature_schema_hash()
MAX_BYTES = 10_240
"""The most the default export's selector.json may weigh (as training writes it, indent=1)."""

FULL = {  # every optional field, as ``to_meta`` writes it (sorted lists, defaults left out)
    "rules_version": RULES_VERSION, "feature_schema_hash": HASH, "selector": "xgb-ranker", "mlflow_run_id": "r1",
    "training_ranges": {"m": [1, 65536], "n": [128, 106496], "k": [64, 57344], "world_size": [2, 8],
                        "hardware": ["h100-nvswitch", "mi300x-8", "node-a"], "dtype": ["bfloat16", "float32"],
                        "op": ["ag_gemm", "gemm_rs"]},
    "hardware_specs": {"node-a": spec_dict("node-a")},
    "unseen_dtype": {"dtype_bytes": [1.0, 4.0], "peak_tflops": {"cpu": [0.1, 0.2], "gpu": [47.9, 4305.6]}},
    "unseen_hardware": {"decide": "model", "kinds": {
        "gpu": {"topologies": ["fully_connected", "switch"], "spec_ranges": {"link_bw_gbps": [10.0, 900.0],
                                                                            "peak_tflops.bfloat16": [300.0, 2600.0]}},
        "cpu": {"any_topology": True, "spec_ranges": {"compute_units": [1.0, 1.0]}}}},
    "abstention": {"min_margin": 0.02, "fallback": "heuristic",
                   "by_kind": {"gpu": {"min_margin": 0.0, "fallback": "gated:shard.ring.sm"},
                               "cpu": {"min_margin": None, "fallback": "cost_model"}},
                   "by_op": {"gpu.ag_gemm": {"min_margin": 0.5, "fallback": "baseline"}},
                   "range_slack": {"gpu": {"m": 2.0, "n": 1.5}},
                   "by_reason": {"shape_range": {"gpu": "cost_model", "any": "shard.ring.sm"},
                                 "unseen_machine": {"cpu": "baseline"}}},
    "gpu_no_harm": {"split_us": 1000.0, "small_margin": 0.175, "large_margin": 0.0083, "unfitted_margin": 0.66,
                    "measured": ["h100-nvswitch"]},
}
LEAST = {"rules_version": RULES_VERSION, "feature_schema_hash": HASH, "selector": "xgb-regressor",
         "training_ranges": {}}


# -- walking a document --------------------------------------------------------------------
def _matches(path: tuple[str, ...], pattern: str) -> bool:
    parts = pattern.split(".")
    return len(parts) == len(path) and all(p in ("*", key) for p, key in zip(parts, path))


def fields(doc: dict, at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """`doc`'s fields: the paths RULE_FIELDS names, else each leaf (a path no pattern names)."""
    out = []
    for key, value in doc.items():
        path = (*at, key)
        if any(_matches(path, pattern) for pattern in RULE_FIELDS) or not isinstance(value, dict) or not value:
            out.append(path)
        else:
            out += fields(value, path)
    return out


class Reads(dict):
    """A JSON object that records which of its fields are read (by key, ``get`` or ``items``)."""

    def __init__(self, doc: dict, log: set, at: tuple[str, ...] = ()):
        super().__init__({k: Reads(v, log, (*at, k)) if isinstance(v, dict) else v for k, v in doc.items()})
        self._log, self._at = log, at

    def __getitem__(self, key):
        self._log.add((*self._at, key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key in self:
            self._log.add((*self._at, key))
        return super().get(key, default)

    def items(self):
        for key, value in super().items():
            self._log.add((*self._at, key))
            yield key, value

    def values(self):
        return [value for _, value in self.items()]


def read_by_the_runtime(doc: dict, tmp_path, monkeypatch) -> set:
    """The fields of `doc` that loading an export of it reads (``read_export``, ``Scope.from_meta``)."""
    log: set = set()
    watched = Reads(doc, log)
    folder = tmp_path / "export"
    folder.mkdir(exist_ok=True)
    (folder / "model.json").write_text(json.dumps(preference_model()))
    (folder / "selector.json").write_text(json.dumps(doc))
    real = loading.read_json
    monkeypatch.setattr(loading, "read_json",
                        lambda path, *a: watched if path.name == "selector.json" else real(path, *a))
    _, meta, _ = read_export(folder)
    assert meta is watched
    Scope.from_meta(meta)
    return log


def test_each_rule_field_is_read_by_the_runtime_and_written_back_as_read(tmp_path, monkeypatch):
    assert Scope.from_meta(FULL).to_meta() == FULL
    assert Scope.from_meta(LEAST).to_meta() == LEAST
    paths = fields(FULL)
    # The document names every rule field, and the runtime reads each field the document holds.
    assert {p for p in RULE_FIELDS if any(_matches(path, p) for path in paths)} == set(RULE_FIELDS)
    assert sorted(set(paths) - read_by_the_runtime(FULL, tmp_path, monkeypatch)) == []


def test_fields_at_their_defaults_are_left_out_and_parse_the_same():
    defaults = {**LEAST, "hardware_specs": {}, "unseen_hardware": {"decide": "heuristic"},
                "abstention": {"min_margin": DEFAULT_MIN_MARGIN, "fallback": "heuristic", "by_kind": {}, "by_op": {},
                               "range_slack": {}, "by_reason": {}},
                "gpu_no_harm": {**FULL["gpu_no_harm"], "measured": []}}
    scope = Scope.from_meta(defaults)
    assert scope.to_meta() == {**LEAST, "gpu_no_harm": {k: v for k, v in defaults["gpu_no_harm"].items()
                                                         if k != "measured"}}
    assert Scope.from_meta(scope.to_meta()) == scope
    # Topologies are not needed where any is let in, and not written then.
    kinds = {"cpu": {"topologies": ["switch"], "any_topology": True, "spec_ranges": {}}}
    scope = Scope.from_meta({**LEAST, "unseen_hardware": {"decide": "model", "kinds": kinds}})
    assert scope.to_meta()["unseen_hardware"]["kinds"] == {"cpu": {"any_topology": True, "spec_ranges": {}}}


def test_the_heuristic_alone_has_no_rules_file():
    with pytest.raises(ValueError, match="'selector' unset"):
        Scope().to_meta()


def test_the_name_and_run_are_the_rules_own():
    scope = Scope.from_meta(FULL)
    assert (scope.name, scope.run_id, scope.ranker) == ("xgb-ranker", "r1", True)
    assert not Scope.from_meta(LEAST).ranker and Scope.from_meta(LEAST).run_id is None
    with pytest.raises(ValueError, match="field 'mlflow_run_id'"):
        Scope.from_meta({**LEAST, "mlflow_run_id": 7})


# -- what training writes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    """``fitted_rules`` as ``ficco pipeline --debug`` fits them (its data slice, tiny
    models): every kind of machine, sampled machines, measured cpu machines of their own
    names; and the export's two files (``export_files``)."""
    from ficco_select.hardware import machines
    from ficco_select.train.pipeline import DEBUG_SCENARIOS_PER_MACHINE, debug_slice
    from ficco_select.train.run import export_files, fitted_rules
    from ficco_select.train.selectors import XGBTimeRegressor, with_features, with_reference_picks
    from ficco_select.train.training_data import default_training_data, training_machines

    with machines(training_machines((), default=True, sampled_per_preset=1)):
        df = debug_slice(default_training_data(sampled_per_preset=1), DEBUG_SCENARIOS_PER_MACHINE)
        meta = fitted_rules(XGBTimeRegressor(n_estimators=20, learning_rate=0.3),
                            with_reference_picks(with_features(df)), "0123456789abcdef", "run-1")
        selector, evidence = export_files(meta)
    return meta, selector, evidence


def test_training_writes_the_rules_as_the_runtime_reads_them(trained, tmp_path, monkeypatch):
    from ficco_select.train.shipped import rules_and_evidence

    meta, selector, _ = trained
    assert Scope.from_meta(selector).to_meta() == selector
    rules, split_off = rules_and_evidence(meta)
    sampled = set(split_off["sampled_machines"])
    assert sampled and sampled <= set(rules["training_ranges"]["hardware"])
    # The same rules, but the sampled machines' names: only training knows them.
    named = [h for h in rules["training_ranges"]["hardware"] if h not in sampled]
    assert Scope.from_meta(selector) == Scope.from_meta({**rules, "training_ranges": {
        **rules["training_ranges"], "hardware": named}})
    # unseen_hardware is written where its fit leaves the default (the debug slice's may not):
    # test_each_rule_field_is_read_by_the_runtime_and_written_back_as_read covers its fields.
    assert {"abstention", "gpu_no_harm", "hardware_specs"} <= set(selector)
    paths = fields(selector)
    assert sorted(p for p in paths if not any(_matches(p, pattern) for pattern in RULE_FIELDS)) == []
    assert sorted(set(paths) - read_by_the_runtime(selector, tmp_path, monkeypatch)) == []


def test_the_evidence_holds_what_the_runtime_never_reads(trained):
    meta, selector, evidence = trained
    assert "by_reason" in meta["abstention"] and "by_reason" not in meta["unseen_hardware"]  # the one copy
    for key in ("dataset_digest", "ficco_version", "feature_schema_version", "feature_names", "target"):
        assert key not in selector and evidence[key] == meta[key]
    assert set(evidence["gpu_no_harm"]) == {"quantile", "points", "points_small", "points_large", "worst_machine",
                                            "fitted_on"}
    assert "validation" not in json.dumps(selector) and "~" not in json.dumps(selector.get("hardware_specs", {}))
    assert evidence["abstention"]["validation_scenarios"] > 0 and evidence["sampled_machines"]
    assert evidence["mlflow_run_id"] == selector["mlflow_run_id"] == "run-1"  # names the export in both


def largest(selector: dict) -> dict:
    """`selector` (the default training data's rules) with every rule it may hold at its
    largest: a margin rule per kind and per operator on each, a slack and a fallback for every
    column, reason and kind, each kind's machines bounded on every spec field and dtype (any
    topology of three), every number 17 digits long. The machines and ranges stay the data's."""
    from ficco_select.runtime.scope import MACHINE_KINDS, REASON_FALLBACKS, SPEC_RANGE_FIELDS
    from ficco_select.scenario import DTYPES, OPS

    number, span = 0.12345678901234567, [0.12345678901234567, 12345.678901234567]
    rule = {"min_margin": number, "fallback": "gated:shard.ring.sm"}
    spec_fields = [*SPEC_RANGE_FIELDS, *(f"peak_tflops.{dtype}" for dtype in DTYPES)]
    doc = json.loads(json.dumps(selector))
    doc["abstention"] = {**rule, "by_kind": {kind: rule for kind in MACHINE_KINDS},
                         "by_op": {f"{kind}.{op}": rule for kind in MACHINE_KINDS for op in OPS},
                         "range_slack": {kind: {col: 1 + number for col in ("m", "n", "k")} for kind in MACHINE_KINDS},
                         "by_reason": {reason: {kind: "cost_model" for kind in (*MACHINE_KINDS, "any")}
                                       for reason in REASON_FALLBACKS}}
    doc["unseen_hardware"] = {"decide": "model", "kinds": {
        kind: {"topologies": ["fully_connected", "ring", "switch"], "spec_ranges": dict.fromkeys(spec_fields, span)}
        for kind in MACHINE_KINDS}}
    doc["unseen_dtype"] = {"dtype_bytes": [1, 4], "peak_tflops": dict.fromkeys(MACHINE_KINDS, span)}
    doc["gpu_no_harm"] = {"split_us": 1000 + number, "small_margin": number, "large_margin": number,
                          "unfitted_margin": 2 * number, "measured": ["h100-nvswitch", "mi300x-8"]}
    return Scope.from_meta(doc).to_meta()


def test_the_rules_of_the_default_export_fit_in_10_kb(trained):
    _, selector, _ = trained
    sizes = [len(json.dumps(doc, indent=1)) for doc in (selector, largest(selector))]
    print(f"selector.json: {sizes[0]} bytes; with every rule at its largest: {sizes[1]} bytes")
    assert sizes[0] < sizes[1] <= MAX_BYTES


def test_ficco_export_ships_only_the_rules_and_refuses_what_loading_would(trained):
    from ficco_select.train.export import export_rules

    meta, selector, _ = trained
    registered = {**selector, "feature_names": meta["feature_names"], "dataset_digest": "d",
                  "gpu_no_harm": {**selector["gpu_no_harm"], "quantile": 0.5, "fitted_on": "gpu-calibration.csv"}}
    assert export_rules(registered, "models:/m/1: selector.json") == selector
    with pytest.raises(ValueError, match="models:/m/1: selector.json: field 'feature_schema_hash'"):
        export_rules({**selector, "feature_schema_hash": "another"}, "models:/m/1: selector.json")
    with pytest.raises(ValueError, match="field 'abstention.fallback'"):
        export_rules({**selector, "abstention": {"min_margin": 0.1, "fallback": "nowhere"}}, "selector.json")
