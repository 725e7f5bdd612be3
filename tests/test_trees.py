"""Our NumPy tree walker gives XGBoost's own margins, for the selectors train produces."""

import numpy as np
import pytest
import xgboost as xgb

from ficco_select.trees import TreeEnsemble


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


def test_unsupported_models_are_refused(tmp_path):
    X = np.random.default_rng(1).normal(size=(90, 3))
    y = np.arange(90) % 3
    model = xgb.XGBClassifier(n_estimators=3).fit(X, y)
    path = tmp_path / "c.json"
    model.get_booster().save_model(path)
    with pytest.raises(ValueError, match="more than one output"):
        TreeEnsemble.load(path)
