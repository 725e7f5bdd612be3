"""Exported selectors made by hand: XGBoost JSON trees (``tree_json``, ``stump``,
``model_json``), a model with one best candidate wherever the schedule axes vary
(``preference_model``), an export folder around it (``write_selector``), a machine spec
under another name (``spec_dict``), the scenario most tests decide (``RECORD``) and the
selector's warnings (``warnings_of``)."""

import json
from pathlib import Path

from ficco_select.hardware import load_hardware

RECORD = {"group": "llama3", "op": "ag_gemm", "m": 4096, "n": 10240, "k": 8192, "dtype": "bfloat16",
          "world_size": 8, "hardware": "mi300x-8", "imbalance": 1.0}
"""A Llama-3 all-gather GEMM on an MI300X node: what a hand-made selector decides."""


def tree_json(left, right, split, cond, default_left=None) -> dict:
    """One tree in XGBoost's JSON layout (the fields the runtime reads, plus tree_param)."""
    return {"left_children": list(left), "right_children": list(right), "split_indices": list(split),
            "split_conditions": list(cond), "default_left": list(default_left or [0] * len(left)),
            "categories_nodes": [], "tree_param": {"num_nodes": str(len(left)), "size_leaf_vector": "1"}}


def stump(feature: int, threshold: float, below: float, above: float) -> dict:
    """x[feature] < threshold -> `below`, else (or missing) `above`."""
    return tree_json([1, -1, -1], [2, -1, -1], [feature, 0, 0], [threshold, below, above])


def model_json(trees: list[dict], num_feature: int, base_score="[5E-1]") -> dict:
    """A gbtree regression model as XGBoost >= 3 saves it (base_score in brackets)."""
    return {"learner": {
        "gradient_booster": {"name": "gbtree", "model": {
            "gbtree_model_param": {"num_parallel_tree": "1", "num_trees": str(len(trees))}, "trees": trees}},
        "learner_model_param": {"base_score": base_score, "num_class": "0", "num_feature": str(num_feature),
                                "num_target": "1"}}}


PRESETS = ["mi300x-8", "h100-nvswitch", "l40s-pcie-8"]
FULL_RANGES = {"m": [1, 1 << 40], "n": [1, 1 << 40], "k": [1, 1 << 40], "world_size": [2, 8],
               "hardware": PRESETS, "dtype": ["float32", "bfloat16", "float16"],
               "op": ["ag_gemm", "gemm_rs", "a2a_gemm"]}


def preference_model(**kw) -> dict:
    """Stumps on schedule axes whose sum has one best candidate wherever these axes vary:
    degree >= 4 (-1) and >= 8 (-1 more), a2a (-0.5), gemm_per_step (-0.25), dma (-0.125), an
    m split (-0.0625). Margins of at least 0.0625, so the model decides rather than abstains."""
    from ficco_select.features import FEATURE_NAMES

    col = FEATURE_NAMES.index
    trees = [stump(col("degree"), 3.0, 0.0, -1.0), stump(col("degree"), 6.0, 0.0, -1.0),
             stump(col("pattern_a2a"), 0.5, 0.0, -0.5),
             stump(col("gemm_per_step"), 0.5, 0.0, -0.25), stump(col("engine_dma"), 0.5, 0.0, -0.125),
             stump(col("split_n"), 0.5, -0.0625, 0.0)]
    return model_json(trees, num_feature=kw.pop("num_feature", len(FEATURE_NAMES)), **kw)


def write_selector(folder: Path, model: dict | None = None, **meta) -> Path:
    """An exported selector folder: model.json and selector.json (`meta` overrides fields)."""
    from ficco_select.features import FEATURE_SCHEMA_HASH
    from ficco_select.runtime.loading import RULES_VERSION

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.json").write_text(json.dumps(model if model is not None else preference_model()))
    meta = {"rules_version": RULES_VERSION, "selector": "xgb-regressor", "feature_schema_hash": FEATURE_SCHEMA_HASH,
            "training_ranges": FULL_RANGES, **meta}
    (folder / "selector.json").write_text(json.dumps(meta))
    return folder


def spec_dict(name: str, **fields) -> dict:
    """Every HardwareSpec field: mi300x-8's numbers under another name."""
    import dataclasses

    return {**dataclasses.asdict(load_hardware("mi300x-8")), "name": name, **fields}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ficco_select.runtime.selector" and r.levelname == "WARNING"]
