"""Our NumPy tree walker gives XGBoost's own margins, for the selectors train produces."""

import json

import numpy as np
import pytest
import xgboost as xgb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ficco_select.runtime.trees import TreeEnsemble
from helpers.exports import model_json, stump, tree_json


def xgb_margins(booster: xgb.Booster, X: np.ndarray) -> np.ndarray:
    return booster.predict(xgb.DMatrix(X, missing=np.nan), output_margin=True)


@pytest.mark.parametrize("kind", ["regressor", "ranker"])
def test_margins_match_xgboost(tmp_path, kind):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 9)).astype(np.float32)
    X[rng.random(X.shape) < 0.05] = np.nan  # missing values take the default branch
    y = np.nan_to_num(X[:, 0]) * 2 - np.nan_to_num(X[:, 3]) + rng.normal(scale=0.1, size=600)
    if kind == "regressor":
        model = xgb.XGBRegressor(n_estimators=60, max_depth=5, random_state=0).fit(X, y)
    else:
        qid = np.repeat(np.arange(60), 10)
        model = xgb.XGBRanker(n_estimators=60, max_depth=5, random_state=0).fit(X, (y > 0).astype(int), qid=qid)
    path = tmp_path / "m.json"
    model.get_booster().save_model(path)
    ours = TreeEnsemble.load(path).predict(X)
    theirs = model.get_booster().predict(xgb.DMatrix(X, missing=np.nan), output_margin=True)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Depth-6 trees as train makes them, with leaves at every depth and both default directions."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(1500, 12))
    X[:, 5] = rng.integers(0, 3, size=len(X))  # a few distinct values: exact-threshold ties
    X[rng.random(X.shape) < 0.1] = np.nan
    y = (np.sin(np.nan_to_num(X[:, 0]) * 3) + np.nan_to_num(X[:, 1]) * np.nan_to_num(X[:, 5])
         + np.isnan(X[:, 2]) + rng.normal(scale=0.2, size=len(X)))
    model = xgb.XGBRegressor(n_estimators=120, max_depth=6, learning_rate=0.1, min_child_weight=20,
                             random_state=0).fit(X, y)
    path = tmp_path_factory.mktemp("deep") / "m.json"
    model.get_booster().save_model(path)
    return path, model.get_booster(), X


def test_deep_trees_with_uneven_leaves_match_xgboost(deep_model):
    path, booster, X = deep_model
    trees = json.loads(path.read_text())["learner"]["gradient_booster"]["model"]["trees"]
    defaults = {bool(d) for t in trees for d, left in zip(t["default_left"], t["left_children"]) if left >= 0}
    assert defaults == {True, False}, "both default directions should occur"
    ours = TreeEnsemble.load(path)
    assert ours.depth == 6 and ours.n_trees == 120
    np.testing.assert_allclose(ours.predict(X), xgb_margins(booster, X), rtol=1e-5, atol=1e-5)


def test_values_at_and_around_every_threshold_match_xgboost(deep_model):
    # x == threshold goes right, one float32 step below goes left, as in XGBoost.
    path, booster, X = deep_model
    trees = json.loads(path.read_text())["learner"]["gradient_booster"]["model"]["trees"]
    splits = np.array([(f, c) for t in trees
                       for f, c, left in zip(t["split_indices"], t["split_conditions"], t["left_children"])
                       if left >= 0])
    rng = np.random.default_rng(2)
    rows = np.repeat(X[:1].astype(np.float32), len(splits) * 3, axis=0)
    for i, (f, c) in enumerate(splits):
        c = np.float32(c)
        for j, value in enumerate((c, np.nextafter(c, np.float32(-np.inf)), np.nextafter(c, np.float32(np.inf)))):
            rows[3 * i + j] = X[rng.integers(len(X))]
            rows[3 * i + j, int(f)] = value
    # all missing; and -0.0, which equals a 0.0 threshold (XGBoost refuses inf input)
    special = np.vstack([np.full((1, X.shape[1]), np.nan), np.full((1, X.shape[1]), -0.0)]).astype(np.float32)
    rows = np.vstack([rows, special])
    np.testing.assert_allclose(TreeEnsemble.load(path).predict(rows), xgb_margins(booster, rows),
                               rtol=1e-5, atol=1e-5)


def test_float64_input_is_rounded_to_float32_as_xgboost_does(deep_model):
    path, booster, X = deep_model
    X64 = X + 1e-9  # differences below float32 resolution must not change the branch taken
    np.testing.assert_allclose(TreeEnsemble.load(path).predict(X64), xgb_margins(booster, X64), rtol=1e-5, atol=1e-5)


def test_single_leaf_trees(tmp_path):
    X = np.random.default_rng(3).normal(size=(50, 4))
    model = xgb.XGBRegressor(n_estimators=5, max_depth=3).fit(X, np.full(50, 2.5))
    path = tmp_path / "flat.json"
    model.get_booster().save_model(path)
    ours = TreeEnsemble.load(path)
    assert ours.depth == 0
    np.testing.assert_allclose(ours.predict(X), xgb_margins(model.get_booster(), X), rtol=1e-5, atol=1e-5)


def test_unsupported_models_are_refused(tmp_path):
    X = np.random.default_rng(1).normal(size=(90, 3))
    y = np.arange(90) % 3
    model = xgb.XGBClassifier(n_estimators=3).fit(X, y)
    path = tmp_path / "c.json"
    model.get_booster().save_model(path)
    with pytest.raises(ValueError, match="more than one output"):
        TreeEnsemble.load(path)


# -- hand-made models: what from_json must refuse ----------------------------------------------
# Other tests build their models with these helpers too (test_selector_runtime, test_runtime_fuzz).
def small_model() -> dict:
    """Two trees over 4 features. Tree 1: x0 < 0.5 ? (x1 < 1 ? -1 : 1) : 2, NaN in x1 goes left."""
    deep = tree_json([1, 3, -1, -1, -1], [2, 4, -1, -1, -1], [0, 1, 0, 0, 0], [0.5, 1.0, 2.0, -1.0, 1.0],
                     [0, 1, 0, 0, 0])
    return model_json([stump(3, 0.0, 0.25, -0.25), deep], num_feature=4)


def test_a_hand_made_model_evaluates_as_written():
    X = np.array([[0, 0, 0, 1], [0, 2, 0, 1], [1, 0, 0, -1], [0, np.nan, 0, 1], [np.nan, 0, 0, 1]])
    want = 0.5 + np.array([-0.25 - 1, -0.25 + 1, 0.25 + 2, -0.25 - 1, -0.25 + 2])  # NaN x0: right
    np.testing.assert_allclose(TreeEnsemble.from_json(small_model()).predict(X), want)
    with pytest.raises(ValueError, match=r"X must be \(n_rows, 4\)"):  # a row of another width
        TreeEnsemble.from_json(small_model()).predict(X[:, :3])


def _set(field, node, value, tree=1):
    def mutate(model):
        model["learner"]["gradient_booster"]["model"]["trees"][tree][field][node] = value
    return mutate


def _param(key, value):
    def mutate(model):
        model["learner"]["learner_model_param"][key] = value
    return mutate


def _tree(key, value, tree=1):
    def mutate(model):
        model["learner"]["gradient_booster"]["model"]["trees"][tree][key] = value
    return mutate


def _drop_last(field, tree=1):
    def mutate(model):
        model["learner"]["gradient_booster"]["model"]["trees"][tree][field].pop()
    return mutate


CORRUPT = {  # name: (mutation of small_model, what the error must say)
    "split index = num_feature": (_set("split_indices", 1, 4),
                                  r"tree 1, node 1: split index 4 outside \[0, num_feature=4\)"),
    "split index negative": (_set("split_indices", 0, -1, tree=0), r"tree 0, node 0: split index -1"),
    "child beyond the tree": (_set("left_children", 1, 9), r"tree 1, node 1: left child 9 outside"),
    "child negative": (_set("right_children", 0, -3), r"tree 1, node 0: right child -3 outside"),
    "one child -1": (_set("right_children", 1, -1), r"tree 1, node 1: one child is -1 and the other is not"),
    "cycle to the root": (_set("left_children", 1, 0), r"tree 1, node 0: reached twice"),
    "a node with two parents": (_set("right_children", 1, 2), r"tree 1, node 2: reached twice"),
    "both children the same": (_set("right_children", 1, 3), r"tree 1, node 3: reached twice"),
    "arrays of different lengths": (_drop_last("split_conditions"), r"tree 1: field 'split_conditions' has 4 entries"),
    "num_nodes disagrees": (_tree("tree_param", {"num_nodes": "9"}), r"tree 1: tree_param.num_nodes is '9'"),
    "NaN threshold": (_set("split_conditions", 0, float("nan")), r"tree 1, node 0: split threshold nan"),
    "inf leaf": (_set("split_conditions", 3, float("inf")), r"tree 1, node 3: leaf value inf"),
    "leaf beyond float32": (_set("split_conditions", 2, 1e39, tree=0), r"tree 0, node 2: leaf value 1e\+39"),
    "NaN base_score": (_param("base_score", "[NaN]"), r"base_score is '\[NaN\]', not a finite number"),
    "inf base_score": (_param("base_score", "inf"), r"base_score is 'inf'"),
    "two base scores": (_param("base_score", "[1,2]"), r"base_score must be one number"),
    "num_feature not a number": (_param("num_feature", "four"), r"num_feature must be an integer"),
    "children not a list": (_tree("left_children", "1,3"), r"tree 1: field 'left_children' must be a list"),
    "a float child": (_set("left_children", 0, 1.5), r"tree 1: field 'left_children' must be a list of integers"),
    "a string split index": (_set("split_indices", 0, "0"),
                             r"tree 1: field 'split_indices' must be a list of integers"),
    "an index beyond int64": (_set("left_children", 0, 2 ** 64), r"tree 1: field 'left_children' must be a list of"),
    "default_left 2": (_set("default_left", 0, 2), r"tree 1, node 0: default_left 2 is not 0 or 1"),
    "a tree that is not an object": (lambda m: m["learner"]["gradient_booster"]["model"]["trees"].__setitem__(0, [1]),
                                     r"tree 0: expected an object"),
    "a tree lost": (lambda m: m["learner"]["gradient_booster"]["model"]["trees"].pop(),
                    r"num_trees is 2, but the file holds 1 trees"),
    "no learner": (lambda m: m.pop("learner"), r"model.learner is missing"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_models_are_refused_naming_the_tree_and_node(case):
    mutate, message = CORRUPT[case]
    model = small_model()
    mutate(model)
    with pytest.raises(ValueError, match=message):
        TreeEnsemble.from_json(model)


def test_the_file_is_named_and_num_feature_must_match_the_runtime(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(small_model()))
    assert TreeEnsemble.load(path, expected_features=4).n_features == 4
    with pytest.raises(ValueError, match=r"model.json: learner.learner_model_param.num_feature is 4, but the "
                                         r"runtime builds 47 features"):
        TreeEnsemble.load(path, expected_features=47)
    path.write_text(json.dumps(small_model())[:-20])  # truncated
    with pytest.raises(ValueError, match=r"model.json: not valid JSON"):
        TreeEnsemble.load(path)
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"model.json: not a text file"):
        TreeEnsemble.load(path)


def test_nodes_the_pruner_deleted_are_not_read(tmp_path):
    # XGBoost's exact updater prunes by gamma and keeps the deleted nodes in the arrays, with
    # split index 2**31 - 1 and no parent reaching them: refusing those would refuse good models.
    rng = np.random.default_rng(4)
    X = rng.normal(size=(500, 5))
    y = X[:, 0] + rng.normal(size=500) * 2
    booster = xgb.train({"tree_method": "exact", "gamma": 50, "max_depth": 6}, xgb.DMatrix(X, label=y), 10)
    path = tmp_path / "pruned.json"
    booster.save_model(path)
    trees = json.loads(path.read_text())["learner"]["gradient_booster"]["model"]["trees"]
    assert any(int(t["tree_param"]["num_deleted"]) for t in trees), "no deleted nodes: nothing tested"
    np.testing.assert_allclose(TreeEnsemble.load(path, expected_features=5).predict(X), xgb_margins(booster, X),
                               rtol=1e-5, atol=1e-5)


@st.composite
def random_trees(draw, n_features: int = 5) -> list[dict]:
    """1-4 valid trees of random shape (depth <= 5), nodes numbered in a random order."""
    trees = []
    for _ in range(draw(st.integers(1, 4))):
        shape = [None]  # node -> (left, right) or None for a leaf; grown breadth-first
        frontier = [(0, 0)]
        while frontier:
            node, depth = frontier.pop(0)
            if depth < 5 and draw(st.booleans()):
                shape[node] = (len(shape), len(shape) + 1)
                shape += [None, None]
                frontier += [(len(shape) - 2, depth + 1), (len(shape) - 1, depth + 1)]
        order = [0] + draw(st.permutations(range(1, len(shape))))  # old id -> new id
        n = len(shape)
        left, right, split, cond, default = [-1] * n, [-1] * n, [0] * n, [0.0] * n, [0] * n
        for old, kids in enumerate(shape):
            new = order[old]
            cond[new] = draw(st.floats(-4, 4, width=32))
            if kids is not None:
                left[new], right[new] = order[kids[0]], order[kids[1]]
                split[new] = draw(st.integers(0, n_features - 1))
                default[new] = int(draw(st.booleans()))
        trees.append(tree_json(left, right, split, cond, default))
    return trees


def walk(trees: list[dict], row: np.ndarray) -> float:
    """XGBoost's rule, node by node: x < threshold goes left (float32), NaN follows default_left."""
    total = 0.0
    for t in trees:
        node = 0
        while t["left_children"][node] != -1:
            x = np.float32(row[t["split_indices"][node]])
            go_left = bool(t["default_left"][node]) if np.isnan(x) else x < np.float32(t["split_conditions"][node])
            node = t["left_children"][node] if go_left else t["right_children"][node]
        total += t["split_conditions"][node]
    return total


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(trees=random_trees(), data=st.data())
def test_random_valid_trees_in_any_node_order_evaluate_as_walked(trees, data):
    values = st.one_of(st.floats(-5, 5, width=32), st.just(float("nan")), st.sampled_from([-1.0, 0.0, 1.0]))
    X = np.array(data.draw(st.lists(st.lists(values, min_size=5, max_size=5), min_size=1, max_size=6)))
    ours = TreeEnsemble.from_json(model_json(trees, num_feature=5, base_score="0.25")).predict(X)
    np.testing.assert_allclose(ours, [0.25 + walk(trees, row) for row in X], rtol=1e-6, atol=1e-6)
