"""features/: the design card's stage between ``data/`` and ``train/``: features of
(scenario, schedule) pairs.

Scenario features: operator, shapes (log2), dtype size, world size, imbalance, the
per-rank GEMM and shard, FLOPs, bytes moved, arithmetic intensity, the hardware's
numbers, and analytic estimates on that hardware (``ficco_select.costs``): compute and
communication time, their ratio, ideal overlap speedup, decomposition loss (DIL) and
chunking loss at d = 2 and 4. Measured signatures are not used: the runtime never has
them, and a model must see the same features in training and at runtime.

Schedule features: the schedule's axes, its piece sizes and estimated piece costs, and the
whole schedule's analytic time along its pipeline (``costs.schedule_times``, the
simulator's model on the machine's spec) over the baseline's and over the bound of a
perfect overlap, max(T_comp, T_comm).

The formulas are written once, in ``_feature_rows``; three doors call it:
``pair_features(records, schedules, hardware)`` -> (n_pairs, n_features) float64, NaN
where a value does not apply (training and evaluation); ``candidate_features(scenario,
schedules, hw)``, the rows of one scenario and its candidate schedules on Python floats
(the runtime selector's cache miss); ``grid_features(scenario, ms, schedules, hw)``, those
rows at every token count of ``ms`` at once (the runtime's layer tables).
"""

from ficco_select.features.extract import (FEATURE_NAMES, FEATURE_SCHEMA_VERSION, SCENARIO_FEATURES, SCHEDULE_FEATURES,
                              candidate_features, feature_schema_hash, formula_digest, grid_features,
                              pair_features, schedule_axes)

__all__ = [
    "FEATURE_NAMES", "FEATURE_SCHEMA_HASH", "FEATURE_SCHEMA_VERSION", "SCENARIO_FEATURES", "SCHEDULE_FEATURES",
    "candidate_features", "feature_schema_hash", "formula_digest", "grid_features", "pair_features",
    "schedule_axes",
]


def __getattr__(name: str):
    # FEATURE_SCHEMA_HASH is computed on first use (tens of ms), not at import: the
    # runtime's first decision imports this package and needs no hash.
    if name == "FEATURE_SCHEMA_HASH":
        return feature_schema_hash()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
