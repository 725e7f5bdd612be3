"""Our NumPy tree walker gives XGBoost's own margins, for the selectors train produces."""

import json

import numpy as np
import pytest
import xgboost as xgb

from ficco_select.trees import TreeEnsemble


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
