"""Evaluate an XGBoost tree ensemble from its JSON model file, with NumPy only.

The runtime selector scores a handful of candidate schedules per decision; building an
XGBoost DMatrix (or importing xgboost, which pulls scikit-learn in) per call costs far
more than walking a few hundred small trees. Supported: ``gbtree`` boosters with
numerical splits and a single output (regression, ranking), as ``train`` produces.

Semantics follow XGBoost: at a node, go left if x[split] < threshold, right otherwise;
a missing (NaN) value follows ``default_left``; the margin is base_score + sum of leaves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class TreeEnsemble:
    """Arrays of every tree, padded to a common node count: (n_trees, n_nodes)."""

    def __init__(self, left, right, feature, threshold, default_left, value, base_score: float, n_features: int):
        self.left, self.right, self.feature = left, right, feature
        self.threshold, self.default_left, self.value = threshold, default_left, value
        self.base_score = base_score
        self.n_features = n_features

    @classmethod
    def load(cls, path: str | Path) -> "TreeEnsemble":
        return cls.from_json(json.loads(Path(path).read_text()))

    @classmethod
    def from_json(cls, model: dict) -> "TreeEnsemble":
        learner = model["learner"]
        booster = learner["gradient_booster"]
        if booster.get("name") != "gbtree":
            raise ValueError(f"unsupported booster {booster.get('name')!r}: only gbtree")
        params = learner["learner_model_param"]
        if int(params.get("num_class", "0")) > 1 or int(params.get("num_target", "1")) > 1:
            raise ValueError("unsupported model: more than one output")
        trees = booster["model"]["trees"]
        if any(t.get("categories_nodes") for t in trees):
            raise ValueError("unsupported model: categorical splits")
        width = max(len(t["left_children"]) for t in trees)

        def pad(key: str, dtype, fill) -> np.ndarray:
            out = np.full((len(trees), width), fill, dtype=dtype)
            for i, t in enumerate(trees):
                out[i, : len(t[key])] = t[key]
            return out

        left, right = pad("left_children", np.int32, -1), pad("right_children", np.int32, -1)
        return cls(left=left, right=right, feature=pad("split_indices", np.int32, 0),
                   threshold=pad("split_conditions", np.float32, 0.0),
                   default_left=pad("default_left", bool, False),
                   # a leaf's value is its split_condition in XGBoost's JSON
                   value=pad("split_conditions", np.float64, 0.0),
                   base_score=float(str(params["base_score"]).strip("[]")),
                   n_features=int(params["num_feature"]))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Margins (n_rows,) for X (n_rows, n_features); NaN means missing."""
        X = np.asarray(X, dtype=np.float32)
        n, t = X.shape[0], self.left.shape[0]
        node = np.zeros((n, t), dtype=np.int32)
        trees = np.arange(t)[None, :]
        rows = np.arange(n)[:, None]
        for _ in range(self.left.shape[1]):
            left = self.left[trees, node]
            is_leaf = left < 0
            if is_leaf.all():
                break
            x = X[rows, self.feature[trees, node]]
            go_left = np.where(np.isnan(x), self.default_left[trees, node], x < self.threshold[trees, node])
            nxt = np.where(go_left, left, self.right[trees, node])
            node = np.where(is_leaf, node, nxt)
        return self.base_score + self.value[trees, node].sum(axis=1)
