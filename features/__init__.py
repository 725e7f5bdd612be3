"""Scenario (+ hardware, + schedule) -> feature matrix, defined once for training and runtime.

Plain records and NumPy arrays only (no pandas): the runtime selector imports this.
"""

from features.build import (
    FEATURE_NAMES,
    FEATURE_SCHEMA_VERSION,
    SCENARIO_FEATURES,
    SCHEDULE_FEATURES,
    feature_schema_hash,
    pair_features,
    schedule_axes,
)

__all__ = ["FEATURE_NAMES", "FEATURE_SCHEMA_HASH", "FEATURE_SCHEMA_VERSION", "SCENARIO_FEATURES",
           "SCHEDULE_FEATURES", "feature_schema_hash", "pair_features", "schedule_axes"]


def __getattr__(name: str):
    if name == "FEATURE_SCHEMA_HASH":  # computed on first use (features.build.feature_schema_hash)
        return feature_schema_hash()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
