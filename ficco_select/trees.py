"""Evaluate an XGBoost tree ensemble from its JSON model file, with NumPy only.

The runtime selector scores a handful of candidate schedules per decision; building an
XGBoost DMatrix (or importing xgboost, which pulls scikit-learn in) per call costs far
more than walking a few hundred small trees. Supported: ``gbtree`` boosters with
numerical splits and a single output (regression, ranking), as ``train`` produces.

Semantics follow XGBoost: at a node, go left if x[split] < threshold, right otherwise
(in float32); a missing (NaN) value follows ``default_left``; the margin is
base_score + sum of leaves.

Layout, built once at load so that a prediction is a few NumPy calls per tree level:
every tree is padded to a perfect binary tree of the ensemble's depth D, stored level by
level over all trees (level d has n_trees * 2**d slots; slot t * 2**d + i is node i of
tree t at that level), so the child of slot p is 2p + bit with no child arrays to read.
A leaf above level D fills the slots of its whole subtree, so a walk that reaches it
early just keeps landing on copies of it. Each node asks one question, ``row[col] <= thr``
of the row extended with its negation, [x, -x]; ``bit`` = the answer:

- default right (NaN goes right): ``x <= prev_float32(threshold)``, i.e. x < threshold;
  bit 1 is the left child. NaN compares false: bit 0, right.
- default left (NaN goes left): ``-x <= -threshold``, i.e. x >= threshold; bit 1 is the
  right child. NaN compares false: bit 0, left.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MAX_PADDED_SLOTS = 1 << 22
"""Largest n_trees * 2**depth accepted; deeper models are refused at load."""
KEEP_STARTS_UP_TO = 256
"""Row counts up to which predict keeps its starting arrays between calls."""


class TreeEnsemble:
    """An XGBoost ensemble laid out as perfect trees, level by level.

    ``columns[d]``, ``thresholds[d]``: (n_trees * 2**d,) the question of each slot at
    level d (column into [x, -x], float32 threshold); ``leaf_values``: (n_trees * 2**D,).
    """

    def __init__(self, columns: list[np.ndarray], thresholds: list[np.ndarray], leaf_values: np.ndarray,
                 base_score: float, n_features: int) -> None:
        self.columns, self.thresholds, self.leaf_values = columns, thresholds, leaf_values
        self.base_score = base_score
        self.n_features = n_features
        self.n_trees = leaf_values.size >> len(columns)
        self.depth = len(columns)
        self._start: dict[int, tuple[np.ndarray, np.ndarray]] = {}

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
        if not trees:
            raise ValueError("unsupported model: no trees")
        if any(t.get("categories_nodes") for t in trees):
            raise ValueError("unsupported model: categorical splits")
        n_features = int(params["num_feature"])
        base_score = float(str(params["base_score"]).strip("[]"))
        columns, thresholds, leaf_values = _perfect_levels(trees, n_features)
        return cls(columns, thresholds, leaf_values, base_score, n_features)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Margins (n_rows,) for X (n_rows, n_features); NaN means missing."""
        X = np.asarray(X, dtype=np.float32)
        n = X.shape[0]
        signed = np.concatenate([X, -X], axis=1)  # (n_rows, 2 * n_features)
        flat = signed.ravel()
        row_start, slot = self._start_for(n)
        slot = slot.copy()  # (n_rows, n_trees): the slot each row is at in each tree
        # Every index below is in range by construction: take's mode="wrap" avoids the error
        # checks of the default mode and is its fastest mode (~25% per take).
        if self.depth:
            # Level 0: every row is at the root, so the questions are the same for all rows.
            slot += slot
            slot += signed.take(self.columns[0], axis=1, mode="wrap") <= self.thresholds[0]
        for columns, thresholds in zip(self.columns[1:], self.thresholds[1:]):
            at = columns.take(slot, mode="wrap")
            at += row_start
            bit = flat.take(at, mode="wrap") <= thresholds.take(slot, mode="wrap")
            slot += slot
            slot += bit
        return self.base_score + self.leaf_values.take(slot, mode="wrap").sum(axis=1)

    def _start_for(self, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(row offsets into the flat [x, -x] rows, root slots), both (n_rows, n_trees).

        Kept for the small row counts of runtime decisions (one row per candidate).
        """
        start = self._start.get(n_rows)
        if start is None:
            row_start = np.repeat(np.arange(n_rows) * (2 * self.n_features), self.n_trees).reshape(n_rows, -1)
            roots = np.tile(np.arange(self.n_trees), (n_rows, 1))
            start = (row_start, roots)
            if n_rows <= KEEP_STARTS_UP_TO:
                self._start[n_rows] = start
        return start


def _perfect_levels(trees: list[dict], n_features: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Per-level (columns, thresholds) and the leaf values of the padded perfect trees."""
    sizes = np.array([len(t["left_children"]) for t in trees])
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # each tree's root in the flat node arrays
    owner = np.repeat(np.arange(len(trees)), sizes)

    def flat(key: str, dtype) -> np.ndarray:
        return np.concatenate([np.asarray(t[key], dtype=dtype) for t in trees])

    left, right = flat("left_children", np.int64), flat("right_children", np.int64)
    is_leaf = left < 0
    left = np.where(is_leaf, -1, left + first[owner])
    right = np.where(is_leaf, -1, right + first[owner])
    split = flat("split_indices", np.int64)
    condition = flat("split_conditions", np.float32)  # a leaf's value is its split_condition
    default_left = flat("default_left", bool)

    column = np.where(default_left, split + n_features, split)
    threshold = np.where(default_left, -condition, np.nextafter(condition, np.float32(-np.inf)))
    bit0 = np.where(default_left, left, right)
    bit1 = np.where(default_left, right, left)

    columns, thresholds = [], []
    node = first  # (n_trees * 2**d,) the flat node behind each slot of the current level
    while not is_leaf[node].all():
        if len(trees) << (len(columns) + 1) > MAX_PADDED_SLOTS:
            raise ValueError(f"unsupported model: trees deeper than {len(columns)} levels are too large "
                             f"to pad ({len(trees)} trees)")
        leaf_here = is_leaf[node]
        columns.append(np.where(leaf_here, 0, column[node]))
        thresholds.append(np.where(leaf_here, np.float32(0), threshold[node]).astype(np.float32))
        node = np.stack([np.where(leaf_here, node, bit0[node]), np.where(leaf_here, node, bit1[node])], axis=1).ravel()
    leaf_values = flat("split_conditions", np.float64)[node]
    return columns, thresholds, leaf_values
