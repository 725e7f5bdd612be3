"""Reading an exported selector folder: ``selector.json`` (the rules, ``runtime/scope.py``)
and ``model.json`` (the trees, ``runtime/trees.py``), each checked before a decision trusts it.

An export is written by ``ficco export`` (``ficco_select.train.export``). Beside these two
files it may hold ``evidence.json`` (what training found while fitting the rules; never
read here) and precompiled layer tables (``runtime/layers.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ficco_select.features import FEATURE_NAMES, feature_schema_hash
from ficco_select.runtime.trees import TreeEnsemble, read_json

DEFAULT_PATH = Path(os.environ.get("FICCO_SELECTOR", Path.home() / ".cache" / "ficco-select" / "selector"))
"""Where ``ficco export`` puts the champion and ``Selector.load()`` looks for it."""

RULES_VERSION = 2
"""The version of ``selector.json``'s layout this runtime reads (field ``rules_version``). A
file of another version, or none (written before the field existed), is refused: its rules
may mean something else here."""


def read_export(folder: str | Path) -> tuple[Path, dict[str, Any], TreeEnsemble]:
    """The export at `folder` (a link resolved once, so that every file comes from one
    version: ``ficco export`` switches it atomically), its rules and its model.

    ValueError or OSError naming the file and field for anything this runtime cannot trust:
    another rules version, another feature schema, a malformed model."""
    folder = Path(os.path.realpath(folder))
    meta = check_version(read_json(folder / "selector.json"))
    model = TreeEnsemble.load(folder / "model.json", expected_features=len(FEATURE_NAMES))
    return folder, meta, model


def check_version(meta: Any, where: str = "selector.json") -> dict[str, Any]:
    """`meta` (``selector.json``'s document) if this runtime reads its layout and its model's
    features; else ValueError naming `where` and the field. The rules are ``Scope``'s to check."""
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    if (version := meta.get("rules_version")) != RULES_VERSION:
        said = "missing (a file from an older ficco-select)" if version is None else f"{version!r}"
        raise ValueError(f"{where}: field 'rules_version' is {said}, this runtime reads version "
                         f"{RULES_VERSION}; re-export the model with this version (ficco export)")
    if (stored := meta.get("feature_schema_hash")) != feature_schema_hash():
        raise ValueError(f"{where}: field 'feature_schema_hash' is {stored!r}, this code's is "
                         f"{feature_schema_hash()}; re-export a model trained with this version")
    return meta
