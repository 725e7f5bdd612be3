"""What an export's ``selector.json`` holds beside the fitted rules: the ranges, dtypes and
machines the model was trained on (``runtime_meta``), the GPU do-no-harm rule, and the split of
training's findings into the rules the runtime reads and the evidence it never reads
(``rules_and_evidence``).
"""

from __future__ import annotations

import functools

import pandas as pd

from ficco_select.data.dataset import user_specs
from ficco_select.data.machines import SAMPLED_MARK
from ficco_select.features import FEATURE_NAMES, FEATURE_SCHEMA_HASH, FEATURE_SCHEMA_VERSION
from ficco_select.hardware import load_hardware
from ficco_select.runtime.loading import RULES_VERSION
from ficco_select.scenario import DTYPES
from ficco_select.train.metrics import usable_rows


def training_ranges(df: pd.DataFrame) -> dict:
    """Per scenario column, the range seen in training: the runtime abstains outside it."""
    ok = usable_rows(df)
    return {"m": [int(ok["m"].min()), int(ok["m"].max())], "n": [int(ok["n"].min()), int(ok["n"].max())],
            "k": [int(ok["k"].min()), int(ok["k"].max())],
            "world_size": [int(ok["world_size"].min()), int(ok["world_size"].max())],
            "hardware": sorted(ok["hardware"].unique()), "dtype": sorted(ok["dtype"].unique()),
            "op": sorted(ok["op"].unique())}


def dtype_ranges(df: pd.DataFrame) -> dict:
    """selector.json's ``unseen_dtype``: the bytes per element and, per kind of machine, the
    peaks (for each row's dtype, as the features read them) seen in training; the runtime lets
    the model decide a dtype it never saw inside them."""
    ok = usable_rows(df).drop_duplicates(["hardware", "dtype"])
    peaks: dict[str, list[float]] = {}
    for hardware, dtype in zip(ok["hardware"], ok["dtype"]):
        hw = load_hardware(hardware)
        peaks.setdefault(hw.kind, []).append(hw.peak_of(dtype))
    sizes = [DTYPES[d] for d in ok["dtype"]]
    return {"dtype_bytes": [min(sizes), max(sizes)],
            "peak_tflops": {kind: [min(values), max(values)] for kind, values in sorted(peaks.items())}}


def runtime_meta(name: str, df: pd.DataFrame) -> dict:
    """The fields of an export's ``selector.json`` that the runtime reads, for a model
    named `name` trained on `df` (``ficco_select.train.run`` adds provenance)."""
    return {"rules_version": RULES_VERSION, "selector": name, "feature_schema_version": FEATURE_SCHEMA_VERSION,
            "feature_schema_hash": FEATURE_SCHEMA_HASH, "feature_names": list(FEATURE_NAMES),
            "target": "log(time / baseline time)" if name == "xgb-regressor" else "rank score (higher is better)",
            "training_ranges": training_ranges(df), "unseen_dtype": dtype_ranges(df),
            "hardware_specs": user_specs(df), "gpu_no_harm": {**gpu_no_harm(), "measured": measured_gpus(df)}}


def measured_gpus(df: pd.DataFrame) -> list[str]:
    """The GPU machines with rows measured on their own ranks in `df` (the cuda backend's
    node mode, a process per GPU): there the GPU do-no-harm rule steps aside, since the model
    learned that machine's own truth. Loopback rows (every rank virtual on one GPU) time
    same-device copies, not the node's links: they do not count."""
    ok = usable_rows(df)
    if "backend" not in ok.columns or "hardware_fingerprint" not in ok.columns:
        return []
    node = (ok["backend"] == "cuda") & ~ok["hardware_fingerprint"].astype(str).str.endswith("-loopback")
    cuda = ok.loc[node, "hardware"].astype(str).unique()
    return sorted(h for h in cuda if load_hardware(h).kind == "gpu")


def rules_and_evidence(meta: dict) -> tuple[dict, dict]:
    """An export's ``selector.json`` (the rules the runtime reads) and ``evidence.json`` (what
    training found while fitting them, which the runtime never reads), from the full `meta`.

    Evidence: every ``validation*`` figure of the abstention and unseen-hardware rules (per
    kind and operator too), how far the unseen-hardware ranges were widened, and the specs of
    the sampled machines (``name~i``, ``data.machines``) that only training names."""
    def split(rules: dict, where: tuple[str, ...]) -> dict:
        kept = {}
        for key, value in rules.items():
            if key.startswith("validation") or key in ("by_reason_validation", "widened_by"):
                evidence.setdefault(".".join(where), {})[key] = value
            elif isinstance(value, dict) and key not in ("hardware_specs", "training_ranges"):
                kept[key] = split(value, (*where, key))
            else:
                kept[key] = value
        return kept

    evidence: dict = {}
    rules = split(meta, ())
    specs = rules.get("hardware_specs", {})
    sampled = {name: spec for name, spec in specs.items() if SAMPLED_MARK in name}
    if sampled:
        rules["hardware_specs"] = {name: spec for name, spec in specs.items() if name not in sampled}
        evidence["sampled_machines"] = sampled
    return rules, {"mlflow_run_id": meta.get("mlflow_run_id"), **evidence}


@functools.cache
def gpu_no_harm() -> dict:
    """selector.json's ``gpu_no_harm``: the GPU do-no-harm rule fitted on the committed
    calibration rows of the published record (``ficco_select.data.no_harm``); the same for every model."""
    from ficco_select.data.no_harm import fit_no_harm

    return fit_no_harm()
