"""Hostile input for the runtime selector: random scenarios (wrong types, NaN and inf, huge
ints, bools, missing keys, unknown machines, spec paths to missing files, folders and
binary files, world sizes above a spec's devices) and hostile model folders (a valid
export mutated: corrupt trees, NaN scores, wrong feature count, truncated files, wrong
types, malformed selector.json).

The contract checked on every one: ``Selector.load`` and ``select`` never raise; a valid
scenario on known hardware within its devices gets the model's or the heuristic's choice,
legal there (``legal_candidates``) or the baseline; anything else gets the baseline with
source ``fallback``. Sized to run in well under a minute on two shared cores.
"""

import dataclasses
import json
import logging
import math
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ficco_select import Scenario
from ficco_select.features import FEATURE_NAMES
from ficco_select.hardware import HardwareSpec, is_spec_path, load_hardware, spec_from_dict
from ficco_select.heuristic import backend_for
from ficco_select.runtime.selector import Decision, Selector
from ficco_select.schedule import BASELINE, Schedule, legal_candidates
from helpers.exports import FULL_RANGES, PRESETS, preference_model, spec_dict, write_selector

FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
"""Fixed examples (derandomize): a failure here is reproducible, and so is the run time."""


@dataclasses.dataclass
class World:
    """An exported selector and the machines the fuzzed scenarios name."""

    folder: Path
    model_specs: dict
    """The export's hardware_specs, by name (known to its selector only)."""
    hardware: list[str]
    """Hardware values to draw: first the seven that resolve (presets, cpu, the export's
    machine, two good spec paths), then spec paths to bad files, then junk."""


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("fuzz")
    tag = uuid.uuid4().hex[:8]  # spec files register their names process-wide: keep them unique
    carried, box, small = f"carried-{tag}", f"box-{tag}", f"small-{tag}"
    (root / "box.yaml").write_text(yaml.safe_dump(spec_dict(box)))
    (root / "small.yaml").write_text(yaml.safe_dump(spec_dict(small, devices=4)))
    (root / "pathlike.yaml").write_text(yaml.safe_dump(spec_dict("my/node")))
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "broken.yaml").write_text("name: [unclosed\n")
    (root / "binary.yaml").write_bytes(b"\x00\xff\xfe\x81" * 64)
    (root / "folder.yaml").mkdir()
    specs = {carried: spec_dict(carried, devices=16, copy_engines=0)}
    ranges = {**FULL_RANGES, "world_size": [2, 64], "hardware": [*PRESETS, "cpu", carried, box, small]}
    folder = write_selector(root / "selector", training_ranges=ranges, hardware_specs=specs)
    paths = [str(root / name) for name in ("box.yaml", "small.yaml", "pathlike.yaml", "list.yaml", "broken.yaml",
                                            "binary.yaml", "folder.yaml", "missing.yaml")]
    junk = ["tpu-v9", "", "  ", "../../etc/passwd", "a\x00b.yaml", "x" * 5000 + ".yaml", str(root), "presets/cpu"]
    return World(folder, {k: load_spec(v) for k, v in specs.items()}, [*PRESETS, "cpu", carried, *paths, *junk])


def load_spec(fields: dict) -> HardwareSpec:
    return spec_from_dict(fields, "test")


def expected(raw, model_specs: dict) -> tuple[Scenario, HardwareSpec] | None:
    """(the scenario as decided, its spec) when it can run as described; None: the baseline."""
    try:
        s = raw if isinstance(raw, Scenario) else Scenario.from_record(raw)
    except Exception:  # noqa: BLE001
        return None
    hw = model_specs.get(s.hardware)
    if hw is None:
        try:
            hw = load_hardware(s.hardware)
        except Exception:  # noqa: BLE001
            return None
    if s.world_size > hw.devices and backend_for(hw) != "cpu":  # cpu ranks are processes
        return None
    if is_spec_path(s.hardware):
        s = dataclasses.replace(s, hardware=hw.name)
    return s, hw


def check(sel: Selector, raw, model_specs: dict) -> Decision:
    d = sel.select(raw)
    assert isinstance(d, Decision) and isinstance(d.schedule, Schedule)
    assert d.source in ("model", "heuristic", "fallback")
    assert math.isfinite(d.confidence) and 0.0 <= d.confidence <= 1.0
    assert sel.select(raw) == d  # the same answer again, through whatever was cached
    runs = expected(raw, model_specs)
    if runs is None:
        assert (d.schedule, d.source) == (BASELINE, "fallback"), (raw, d)
        return d
    s, hw = runs
    assert d.source in ("model", "heuristic"), (raw, d)  # errors go to the heuristic, never the baseline
    assert d.schedule in legal_candidates(s, backend_for(hw)) or d.schedule.is_baseline, (raw, d)
    return d


# -- hostile scenarios ------------------------------------------------------------------------
hostile = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.binary(max_size=4), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
dims = st.one_of(st.sampled_from([8, 64, 4096, 8192, 12288, 16384, 1 << 31, 1 << 40]),
                 st.integers(1, 1 << 12).map(lambda v: v * 64), st.integers(1, 100), hostile)
columns = {
    "group": st.one_of(st.just("llama3"), hostile),
    "op": st.one_of(st.sampled_from(["ag_gemm", "gemm_rs", "a2a_gemm"]), hostile),
    "m": dims, "n": dims, "k": dims,
    "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "float16", "bf16", "fp8"]), hostile),
    "world_size": st.one_of(st.sampled_from([2, 3, 4, 8, 16, 64, 1024]), hostile),
    "imbalance": st.one_of(st.just(1.0), st.floats(1.0, 8.0), hostile),
}


@st.composite
def records(draw, hardware: list[str]) -> dict:
    """A valid scenario on a drawn machine, then up to three columns dropped or made hostile."""
    P = draw(st.sampled_from([2, 3, 4, 8, 16, 64]))
    op = draw(st.sampled_from(["ag_gemm", "gemm_rs", "a2a_gemm"]))
    size = st.one_of(st.integers(1, 1 << 12), st.sampled_from([1 << 20, 1 << 34]))
    record = {"group": "llama3", "op": op, "m": P * draw(size), "n": P * draw(size), "k": P * draw(size),
              "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16"])), "world_size": P,
              "hardware": draw(st.one_of(st.sampled_from(hardware[:7]), st.sampled_from(hardware))),
              "imbalance": draw(st.floats(1.0, float(P))) if op == "a2a_gemm" else 1.0}
    n_hostile = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))  # about half the draws stay valid
    for col in draw(st.lists(st.sampled_from([*columns, "hardware"]), min_size=n_hostile, max_size=n_hostile,
                             unique=True)):
        if draw(st.booleans()):
            del record[col]
        else:
            record[col] = draw(columns.get(col, hostile))
    return record


def scenarios(world: World):
    return st.one_of(records(world.hardware), records(world.hardware), records(world.hardware), hostile)


HEURISTIC = Selector()


@pytest.fixture(scope="module")
def model_selector(world):
    sel = Selector.load(world.folder)
    assert sel.model is not None
    return sel


@settings(FUZZ, max_examples=600)
@given(data=st.data())
def test_hostile_scenarios_get_legal_decisions_without_raising(world, model_selector, data):
    raw = data.draw(scenarios(world))
    for sel in (model_selector, HEURISTIC):
        check(sel, raw, world.model_specs if sel is model_selector else {})
        try:  # the hot path: the same Scenario object again, found by its id
            s = Scenario.from_record(raw)
        except Exception:  # noqa: BLE001
            continue
        assert sel.select(s) is sel.select(s) == sel.select(raw)



def test_the_fuzzed_world_reaches_every_source(world, model_selector):
    # The property above means little if every draw fell back: these must all occur.
    base = {"group": "g", "op": "ag_gemm", "m": 8192, "n": 8192, "k": 8192, "dtype": "bfloat16", "world_size": 4}
    box = next(h for h in world.hardware if h.endswith("box.yaml"))
    carried = next(h for h in world.hardware if h.startswith("carried-"))
    sources = {h: check(model_selector, {**base, "hardware": h}, world.model_specs).source
               for h in ("mi300x-8", box, carried, "tpu-v9")}
    assert sources == {"mi300x-8": "model", box: "model", carried: "model", "tpu-v9": "fallback"}
    small = next(h for h in world.hardware if h.endswith("small.yaml"))
    d = check(model_selector, {**base, "world_size": 8, "hardware": small}, world.model_specs)
    assert d.source == "fallback" and "exceeds the 4 devices" in d.reason


# -- hostile model folders ----------------------------------------------------------------------
PROBES = [
    {"group": "g", "op": "ag_gemm", "m": 8192, "n": 8192, "k": 8192, "dtype": "bfloat16", "world_size": 8,
     "hardware": "mi300x-8"},
    {"group": "g", "op": "gemm_rs", "m": 16384, "n": 12288, "k": 49152, "dtype": "bfloat16", "world_size": 8,
     "hardware": "h100-nvswitch"},
    {"group": "g", "op": "a2a_gemm", "m": 2048, "n": 4096, "k": 4096, "dtype": "float16", "world_size": 4,
     "hardware": "l40s-pcie-8", "imbalance": 2.5},
    {"group": "g", "op": "ag_gemm", "m": 8192, "n": 8192, "k": 8192, "dtype": "bfloat16", "world_size": 16,
     "hardware": "mi300x-8"},
    {"group": "g", "op": "ag_gemm", "m": 64, "n": 64, "k": 64, "dtype": "float32", "world_size": 2, "hardware": "cpu"},
    {"group": "g", "op": "ag_gemm", "m": -1, "n": 8, "k": 8, "dtype": "float32", "world_size": 2, "hardware": "cpu"},
]


def trees_of(model):
    return model["learner"]["gradient_booster"]["model"]["trees"]


def _tree_field(field, node, value, tree=0):
    def mutate(model, meta):
        trees_of(model)[tree][field][node] = value
    return mutate


def _model_param(key, value):
    def mutate(model, meta):
        model["learner"]["learner_model_param"][key] = value
    return mutate


def _meta(key, value):
    def mutate(model, meta):
        meta[key] = value
    return mutate


REFUSED = {  # mutations of a valid export that load must refuse (heuristic-only selector)
    "split index out of range": _tree_field("split_indices", 0, len(FEATURE_NAMES)),
    "split index negative": _tree_field("split_indices", 0, -2, tree=3),
    "NaN leaf": _tree_field("split_conditions", 1, float("nan")),
    "inf threshold": _tree_field("split_conditions", 0, float("-inf"), tree=2),
    "NaN base_score": _model_param("base_score", "NaN"),
    "cycle": _tree_field("left_children", 0, 0, tree=1),
    "child out of range": _tree_field("right_children", 0, 3),
    "one child missing": _tree_field("right_children", 0, -1),
    "wrong num_feature": _model_param("num_feature", str(len(FEATURE_NAMES) - 1)),
    "num_feature not a number": _model_param("num_feature", [47]),
    "trees not a list": lambda model, meta: model["learner"]["gradient_booster"]["model"].__setitem__("trees", "x"),
    "a tree not an object": lambda model, meta: trees_of(model).__setitem__(0, None),
    "learner params a list": lambda model, meta: model["learner"].__setitem__("learner_model_param", [1]),
    "selector.json a list": lambda model, meta: "[]",
    "unknown selector": _meta("selector", "xgb-forest"),
    "training_ranges a string": _meta("training_ranges", "m: 1..8"),
    "a range of three": _meta("training_ranges", {**FULL_RANGES, "m": [1, 2, 3]}),
    "hardware not strings": _meta("training_ranges", {**FULL_RANGES, "hardware": [None]}),
    "hardware_specs bad": _meta("hardware_specs", {"n1": {"name": "n1"}}),
}


def export(folder: Path, model, meta, *, model_text: str | None = None, meta_text: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.json").write_text(model_text if model_text is not None else json.dumps(model))
    (folder / "selector.json").write_text(meta_text if meta_text is not None else json.dumps(meta))
    return folder


def valid_export(world: World) -> tuple[dict, dict]:
    return (json.loads((world.folder / "model.json").read_text()),
            json.loads((world.folder / "selector.json").read_text()))


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_mutated_export_is_refused_with_one_warning(world, case, tmp_path, caplog):
    model, meta = valid_export(world)
    replaced = REFUSED[case](model, meta)
    folder = export(tmp_path / "sel", model, meta, meta_text=replaced)
    with caplog.at_level(logging.WARNING, logger="ficco_select.runtime.selector"):
        sel = Selector.load(folder)
    assert sel.model is None
    assert len([r for r in caplog.records if r.name == "ficco_select.runtime.selector"]) == 1
    for raw in PROBES:
        assert check(sel, raw, world.model_specs).source != "model"


FILE_DAMAGE = ["truncated model.json", "truncated selector.json", "binary model.json", "model.json a folder",
               "no model.json", "no selector.json", "empty selector.json", "the folder a file", "no folder"]


@pytest.mark.parametrize("case", FILE_DAMAGE)
def test_damaged_files_give_a_heuristic_only_selector(world, case, tmp_path):
    model, meta = valid_export(world)
    folder = export(tmp_path / "sel", model, meta)
    model_path, meta_path = folder / "model.json", folder / "selector.json"
    if case == "truncated model.json":
        model_path.write_text(model_path.read_text()[: len(model_path.read_text()) // 2])
    elif case == "truncated selector.json":
        meta_path.write_text(meta_path.read_text()[:40])
    elif case == "binary model.json":
        model_path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00" * 10)
    elif case == "model.json a folder":
        model_path.unlink()
        model_path.mkdir()
    elif case == "no model.json":
        model_path.unlink()
    elif case == "no selector.json":
        meta_path.unlink()
    elif case == "empty selector.json":
        meta_path.write_text("")
    elif case == "the folder a file":
        folder = model_path
    else:
        folder = tmp_path / "nothing"
    sel = Selector.load(folder)
    assert sel.model is None
    for raw in PROBES:
        check(sel, raw, {})


def json_paths(value, prefix=()):
    """Every (path) into a JSON value: keys of objects, indices of arrays."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_paths(v, (*prefix, i))


json_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5), st.sampled_from(["[NaN]", "47", "-1", "gbtree", "xgb-ranker", "1e40"]),
    st.lists(st.integers(-3, 50), max_size=4), st.just({}), st.just([]),
)


def mutate_at(root, path, value, delete: bool):
    if not path:
        return value
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return root


def value_at(root, path):
    for key in path:
        root = root[key]
    return root


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_randomly_mutated_exports_never_raise_and_decide_legally(world, data):
    # Mutations: junk anywhere, a key deleted, or a number changed to another of its kind
    # (these often load: then the model must still decide legally); maybe a file cut short.
    model, meta = valid_export(world)
    for name in data.draw(st.lists(st.sampled_from(["model.json", "selector.json"]), min_size=1, max_size=3)):
        doc = model if name == "model.json" else meta
        path = data.draw(st.sampled_from(list(json_paths(doc))))
        how = data.draw(st.sampled_from(["number", "number", "junk", "delete"]))
        current = value_at(doc, path)
        if how == "number" and isinstance(current, (int, float)) and not isinstance(current, bool):
            value = data.draw(st.integers(-2, 60) if isinstance(current, int) else st.floats(-1e6, 1e6, width=32))
        else:
            value = data.draw(json_junk)
        doc = mutate_at(doc, path, value, delete=how == "delete" and bool(path))
        model, meta = (doc, meta) if name == "model.json" else (model, doc)
    texts = [json.dumps(model), json.dumps(meta)]
    if data.draw(st.integers(0, 3)) == 0:
        i = data.draw(st.integers(0, 1))
        texts[i] = texts[i][: data.draw(st.integers(0, len(texts[i])))]
    with tempfile.TemporaryDirectory() as tmp:
        folder = export(Path(tmp), None, None, model_text=texts[0], meta_text=texts[1])
        sel = Selector.load(folder)
    # Loaded: the machines are what the (mutated, yet accepted) selector.json carries.
    specs = {k: load_spec(v) for k, v in json.loads(texts[1]).get("hardware_specs", {}).items()} \
        if sel.model is not None else {}
    for raw in PROBES:
        check(sel, raw, specs)


def test_the_valid_export_is_not_refused(world):
    # The mutations above start from a model that loads and decides.
    model, meta = valid_export(world)
    assert model == preference_model() and meta["hardware_specs"]
    sel = Selector.load(world.folder)
    assert sel.model is not None and sel.select(PROBES[0]).source == "model"
