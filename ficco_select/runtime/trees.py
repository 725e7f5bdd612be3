"""Evaluate an XGBoost tree ensemble from its JSON model file, with NumPy only.

The runtime selector scores a handful of candidate schedules per decision; building an
XGBoost DMatrix (or importing xgboost, which pulls scikit-learn in) per call costs far
more than walking a few hundred small trees. Supported: ``gbtree`` boosters with
numerical splits and a single output (regression, ranking), as ``train`` produces.

Semantics follow XGBoost: at a node, go left if x[split] < threshold, right otherwise
(in float32); a missing (NaN) value follows ``default_left``; the margin is
base_score + sum of leaves.

Nothing in the file is trusted: ``from_json`` checks it before building anything and
raises ValueError naming the field, or the tree and node. Every tree's node arrays are
lists of one length with numbers of the right kind; walked from its root, every node
is reached once (no cycle, no shared child), has both children or none, its children
in range, its split index in [0, num_feature) and its threshold or leaf value finite
in float32; ``base_score`` is finite; ``num_feature`` equals the caller's feature count
when given (the runtime selector passes ``len(features.FEATURE_NAMES)``). Nodes no walk
reaches are never read, so they are not checked: XGBoost keeps the nodes its pruner
deleted (split index 2**31 - 1) in the arrays.

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

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

MAX_PADDED_SLOTS = 1 << 22
"""Largest n_trees * 2**depth accepted; deeper models are refused at load."""
KEEP_STARTS_UP_TO = 256
"""Row counts up to which predict keeps its starting arrays between calls; larger batches
are walked in blocks of this many rows."""
FLOAT32_MAX = float(np.finfo(np.float32).max)


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
    def load(cls, path: str | Path, expected_features: int | None = None) -> "TreeEnsemble":
        """From an XGBoost JSON file; ValueError naming the file and what is wrong in it."""
        model = read_json(path, "XGBoost JSON")
        try:
            return cls.from_json(model, expected_features)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_json(cls, model: Any, expected_features: int | None = None) -> "TreeEnsemble":
        """From a parsed XGBoost JSON model, checked first (see the module docstring)."""
        learner = _field(model, "learner", dict, "model")
        booster = _field(learner, "gradient_booster", dict, "learner")
        if booster.get("name") != "gbtree":
            raise ValueError(f"unsupported booster {booster.get('name')!r}: only gbtree")
        params = _field(learner, "learner_model_param", dict, "learner")
        where = "learner.learner_model_param"
        if _int_param(params, "num_class", where, "0") > 1 or _int_param(params, "num_target", where, "1") > 1:
            raise ValueError("unsupported model: more than one output")
        n_features = _int_param(params, "num_feature", where)
        if n_features < 1:
            raise ValueError(f"{where}.num_feature must be at least 1, got {n_features}")
        if expected_features is not None and n_features != expected_features:
            raise ValueError(f"{where}.num_feature is {n_features}, but the runtime builds {expected_features} "
                             "features; re-export a model trained with this version")
        base_score = _base_score(params, f"{where}.base_score")
        trees = _field(_field(booster, "model", dict, "gradient_booster"), "trees", list, "gradient_booster.model")
        if not trees:
            raise ValueError("unsupported model: no trees")
        tree_params = booster["model"].get("gbtree_model_param")
        if isinstance(tree_params, dict) and "num_trees" in tree_params:
            declared = _int_param(tree_params, "num_trees", "gradient_booster.model.gbtree_model_param")
            if declared != len(trees):
                raise ValueError(f"gradient_booster.model.gbtree_model_param.num_trees is {declared}, "
                                 f"but the file holds {len(trees)} trees (truncated?)")
        nodes = _checked_nodes(trees, n_features)
        columns, thresholds, leaf_values = _perfect_levels(nodes, n_features)
        return cls(columns, thresholds, leaf_values, base_score, n_features)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Margins (n_rows,) for X (n_rows, n_features); NaN means missing."""
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"predict: X must be (n_rows, {self.n_features}), got {X.shape}")
        n = X.shape[0]
        if n > KEEP_STARTS_UP_TO:  # a layer table's grid: in blocks whose walk stays in cache (~2x faster)
            return np.concatenate([self._predict(X[i:i + KEEP_STARTS_UP_TO])
                                   for i in range(0, n, KEEP_STARTS_UP_TO)])
        return self._predict(X)

    def _predict(self, X: np.ndarray) -> np.ndarray:
        n = X.shape[0]
        signed = np.concatenate([X, -X], axis=1)  # (n_rows, 2 * n_features)
        flat = signed.ravel()
        row_start, slot = self._start_for(n)
        slot = slot.copy()  # (n_rows, n_trees): the slot each row is at in each tree
        # Every index below is in range by construction: from_json checked every split index
        # and child of the trees (so columns < 2 * n_features and slots < n_trees * 2**d), and
        # X's width is checked above. take's mode="wrap" skips the error checks of the
        # default mode and is its fastest mode (~25% per take); it never wraps here.
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


MAX_JSON_BYTES = 512 << 20
"""The largest export file ``read_json`` reads (a 300-tree model is a few MB; layer tables of
a thousand layers a few hundred)."""


def read_json(path: str | Path, what: str = "JSON") -> Any:
    """A JSON file's contents; ValueError naming the file: missing, not a regular file (a
    FIFO would block the caller, a device such as /dev/zero never ends), over
    ``MAX_JSON_BYTES``, not text, not JSON. Never blocks: opened non-blocking, checked
    before a byte is read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder, not a file ({what})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{path}: a folder, not a file ({what})")
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file (a pipe, socket or device; expected {what})")
        if info.st_size > MAX_JSON_BYTES:
            raise ValueError(f"{path}: {info.st_size} bytes, over the {MAX_JSON_BYTES} an export file may have "
                             f"(expected {what})")
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(MAX_JSON_BYTES + 1)  # a file that grew since: never more than the limit
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"{path}: over the {MAX_JSON_BYTES} bytes an export file may have (expected {what})")
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (expected {what})") from None
    except (json.JSONDecodeError, RecursionError) as e:  # nesting deeper than Python's stack: not ours
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    finally:
        if fd is not None:
            os.close(fd)


# -- checking the file ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Nodes:
    """Every tree's nodes, concatenated (n_nodes,), children as flat indices (-1: leaf)."""

    first: np.ndarray
    """(n_trees,): each tree's root in the flat arrays."""
    left: np.ndarray
    right: np.ndarray
    split: np.ndarray
    condition: np.ndarray
    """float64: a leaf's value is its split_condition."""
    default_left: np.ndarray


_NODE_FIELDS = {  # field -> (NumPy kinds accepted, what the message asks for); an integer
    # beyond int64 makes NumPy pick uint64 or object: refused like any other non-integer
    "left_children": ("i", "integers"), "right_children": ("i", "integers"),
    "split_indices": ("i", "integers"), "split_conditions": ("if", "numbers"),
    "default_left": ("bi", "0/1 flags"),
}


def _checked_nodes(trees: list, n_features: int) -> _Nodes:
    """The trees' node arrays, checked; ValueError naming the tree and node (or field)."""
    arrays: dict[str, list[np.ndarray]] = {name: [] for name in _NODE_FIELDS}
    for t, tree in enumerate(trees):
        if not isinstance(tree, dict):
            raise ValueError(f"tree {t}: expected an object, got {type(tree).__name__}")
        if tree.get("categories_nodes"):
            raise ValueError("unsupported model: categorical splits")
        for name, (kinds, what) in _NODE_FIELDS.items():
            arrays[name].append(_node_array(tree, name, kinds, what, f"tree {t}"))
        size = len(arrays["left_children"][-1])
        for name in _NODE_FIELDS:
            if len(arrays[name][-1]) != size:
                raise ValueError(f"tree {t}: field '{name}' has {len(arrays[name][-1])} entries, "
                                 f"'left_children' {size}; a tree's node arrays have one length")
        if not size:
            raise ValueError(f"tree {t}: no nodes")
        tree_param = tree.get("tree_param")
        declared = tree_param.get("num_nodes") if isinstance(tree_param, dict) else None
        if declared is not None and str(declared) != str(size):
            raise ValueError(f"tree {t}: tree_param.num_nodes is {declared!r}, but its arrays hold {size} nodes")
    sizes = np.array([len(a) for a in arrays["left_children"]])
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    flat = {name: np.concatenate(a) for name, a in arrays.items()}
    left, right = flat["left_children"].astype(np.int64), flat["right_children"].astype(np.int64)
    owner = np.repeat(np.arange(len(trees)), sizes)

    def fail(node: int, problem: str) -> None:
        raise ValueError(f"tree {owner[node]}, node {node - first[owner[node]]}: {problem}")

    # Walk every tree from its root, a level at a time: each node reached must be reached
    # once, and each node's children are checked before the walk follows them.
    visits = np.zeros(len(left), np.int64)
    visits[first] = 1
    frontier = first
    while frontier.size:
        leaf = left[frontier] == -1
        lopsided = frontier[leaf != (right[frontier] == -1)]
        if lopsided.size:
            fail(lopsided[0], f"one child is -1 and the other is not (left {left[lopsided[0]]}, "
                              f"right {right[lopsided[0]]})")
        inner = frontier[~leaf]
        for side, children in (("left", left), ("right", right)):
            bad = inner[(children[inner] < 0) | (children[inner] >= sizes[owner[inner]])]
            if bad.size:
                fail(bad[0], f"{side} child {children[bad[0]]} outside the tree's nodes [0, {sizes[owner[bad[0]]]})")
        frontier = np.concatenate([left[inner], right[inner]]) + np.tile(first[owner[inner]], 2)
        np.add.at(visits, frontier, 1)
        again = frontier[visits[frontier] > 1]
        if again.size:
            fail(again[0], "reached twice (a cycle, or a node with two parents)")
    reached = visits > 0
    is_leaf = left == -1

    split = flat["split_indices"].astype(np.int64)
    bad = np.flatnonzero(reached & ~is_leaf & ((split < 0) | (split >= n_features)))
    if bad.size:
        fail(bad[0], f"split index {split[bad[0]]} outside [0, num_feature={n_features})")
    condition = flat["split_conditions"].astype(np.float64)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(reached & ~(np.abs(condition) <= FLOAT32_MAX))  # NaN, inf, or inf in float32
    if bad.size:
        what = "leaf value" if is_leaf[bad[0]] else "split threshold"
        fail(bad[0], f"{what} {float(condition[bad[0]])!r} (split_conditions) is not a finite float32")
    default_left = flat["default_left"]
    bad = np.flatnonzero(reached & (default_left != 0) & (default_left != 1))
    if bad.size:
        fail(bad[0], f"default_left {default_left[bad[0]].item()!r} is not 0 or 1")

    # Children as flat indices; a leaf keeps -1 (never followed).
    left = np.where(is_leaf, -1, left + first[owner])
    right = np.where(is_leaf, -1, right + first[owner])
    return _Nodes(first, left, right, split, condition, default_left.astype(bool))


def _node_array(tree: dict, name: str, kinds: str, what: str, where: str) -> np.ndarray:
    values = tree.get(name)
    if not isinstance(values, list):
        raise ValueError(f"{where}: field '{name}' must be a list of {what}, got {type(values).__name__}")
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as e:  # ragged, nested or odd values
        raise ValueError(f"{where}: field '{name}' must be a list of {what} ({e})") from None
    if values and (array.ndim != 1 or array.dtype.kind not in kinds):
        raise ValueError(f"{where}: field '{name}' must be a list of {what}, got entries of type {array.dtype}")
    return array


def _field(mapping: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(mapping, dict):
        raise ValueError(f"{where} must be an object, got {type(mapping).__name__}")
    if key not in mapping:
        raise ValueError(f"{where}.{key} is missing (not an XGBoost JSON model?)")
    value = mapping[key]
    if not isinstance(value, kind):
        raise ValueError(f"{where}.{key} must be a JSON {'object' if kind is dict else 'array'}, "
                         f"got {type(value).__name__}")
    return value


def _int_param(params: dict, key: str, where: str, default: str | None = None) -> int:
    """XGBoost writes its model parameters as strings: "47"."""
    value = params.get(key, default)
    if value is None:
        raise ValueError(f"{where}.{key} is missing")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}") from None


def _base_score(params: dict, where: str) -> float:
    """A finite number, written "5E-1" or (XGBoost >= 3) "[5E-1]"."""
    value = params.get("base_score")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        score = float(str(value).strip().strip("[]"))
    except ValueError:
        raise ValueError(f"{where} must be one number, got {value!r}") from None
    if not abs(score) <= FLOAT32_MAX:
        raise ValueError(f"{where} is {value!r}, not a finite number")
    return score


def _perfect_levels(nodes: _Nodes, n_features: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Per-level (columns, thresholds) and the leaf values of the padded perfect trees."""
    left, right, default_left = nodes.left, nodes.right, nodes.default_left
    is_leaf = left < 0
    condition = nodes.condition.astype(np.float32)
    column = np.where(default_left, nodes.split + n_features, nodes.split)
    threshold = np.where(default_left, -condition, np.nextafter(condition, np.float32(-np.inf)))
    bit0 = np.where(default_left, left, right)
    bit1 = np.where(default_left, right, left)

    n_trees = len(nodes.first)
    columns, thresholds = [], []
    node = nodes.first  # (n_trees * 2**d,) the flat node behind each slot of the current level
    while not is_leaf[node].all():
        if n_trees << (len(columns) + 1) > MAX_PADDED_SLOTS:
            raise ValueError(f"unsupported model: trees deeper than {len(columns)} levels are too large "
                             f"to pad ({n_trees} trees)")
        leaf_here = is_leaf[node]
        columns.append(np.where(leaf_here, 0, column[node]))
        thresholds.append(np.where(leaf_here, np.float32(0), threshold[node]).astype(np.float32))
        node = np.stack([np.where(leaf_here, node, bit0[node]), np.where(leaf_here, node, bit1[node])], axis=1).ravel()
    leaf_values = nodes.condition[node]
    return columns, thresholds, leaf_values
