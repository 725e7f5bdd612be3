"""The sets of selectors an evaluation scores (``TrainConfig.selectors`` names them)."""

from __future__ import annotations

from ficco_select.train.selectors import (
    AlwaysBaseline,
    AlwaysShard,
    BaseSelector,
    Heuristic,
    HGBClassifier,
    Oracle,
    RandomForestTime,
    SimulatorSelector,
    XGBRanker,
    XGBTimeRegressor,
)
from ficco_select.train.shipped import ShippedPolicy, UnguardedShipped


def all_selectors() -> list[BaseSelector]:
    """Every selector, learned ones first; reference points last. The shipped policy is
    built on the regressor of log(time / baseline): on the simulated rows of both hold-outs
    its bare argmin has the better tail (worst regret 1.02 and 1.10 against the ranker's
    1.05 and 1.12, near-opt@2% 0.999 and 0.998), its margin is in log time, and it fits in
    less than half the ranker's time (it is fitted five times per fold)."""
    regressor = XGBTimeRegressor()
    shipped = ShippedPolicy(regressor)
    return [regressor, XGBRanker(), shipped, UnguardedShipped(shipped), HGBClassifier(), RandomForestTime(), Heuristic(),
            SimulatorSelector(), AlwaysBaseline(), AlwaysShard(), Oracle()]


def fast_selectors() -> list[BaseSelector]:
    """The same selectors, smaller, for the one-command pipeline's many folds on 2 cores.
    Without three that do not ship (``ficco evaluate`` still scores them): the ranker
    (behind the regressor on every simulated hold-out, ahead on the measured cpu rows,
    where neither ships unguarded, and a quarter of the pipeline's time), the HGB
    classifier of the best schedule (near-opt@2% 0.38 against the ranker's 0.84 on the
    family hold-out) and the random forest (below the ranker on every split and metric)."""
    regressor = XGBTimeRegressor(n_estimators=100, learning_rate=0.12)  # ficco evaluate: 300 at 0.08
    shipped = ShippedPolicy(regressor)
    return [regressor, shipped, UnguardedShipped(shipped), Heuristic(tune_scenarios=150),
            SimulatorSelector(), AlwaysBaseline(), AlwaysShard(), Oracle()]


def debug_selectors() -> list[BaseSelector]:
    """Every kind the pipeline runs, tiny (20 trees, an untuned heuristic): ``ficco
    pipeline --debug`` checks that every stage runs, not how well."""
    regressor = XGBTimeRegressor(n_estimators=20, learning_rate=0.3)
    shipped = ShippedPolicy(regressor)
    return [regressor, shipped, UnguardedShipped(shipped), Heuristic(tune=False), SimulatorSelector(),
            AlwaysBaseline(), AlwaysShard(), Oracle()]
