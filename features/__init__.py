"""Scenario (+ hardware, + schedule) -> feature matrix, defined once for training and runtime.

Plain records and NumPy arrays only (no pandas): the runtime selector imports this.
"""

from features.build import (FEATURE_NAMES, FEATURE_SCHEMA_HASH, FEATURE_SCHEMA_VERSION,
                            SCENARIO_FEATURES, SCHEDULE_FEATURES, pair_features, schedule_axes)

__all__ = ["FEATURE_NAMES", "FEATURE_SCHEMA_HASH", "FEATURE_SCHEMA_VERSION", "SCENARIO_FEATURES",
           "SCHEDULE_FEATURES", "pair_features", "schedule_axes"]
