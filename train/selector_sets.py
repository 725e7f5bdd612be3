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


def shipping_selectors() -> list[BaseSelector]:
    """What ships and what it is read against (the default of ``ficco evaluate`` and
    ``ficco train``): the regressor of log(time / baseline) and the shipped policy built on
    it, with and without its GPU rule; the heuristic, the simulator, the two fixed schedules
    and the oracle. The shipped policy is built on the regressor: on the simulated rows of
    both hold-outs its bare argmin has the better tail (worst regret 1.02 and 1.10 against
    the ranker's 1.05 and 1.12, near-opt@2% 0.999 and 0.998), its margin is in log time, and
    it fits in less than half the ranker's time (it is fitted five times per fold)."""
    regressor = XGBTimeRegressor()
    shipped = ShippedPolicy(regressor)
    return [regressor, shipped, UnguardedShipped(shipped), Heuristic(), SimulatorSelector(), AlwaysBaseline(),
            AlwaysShard(), Oracle()]


def all_selectors() -> list[BaseSelector]:
    """The shipping set and three learned selectors that do not ship, fitted only on request
    (``--selectors all``): the ranker (behind the regressor on every simulated hold-out), the
    HGB classifier of the best schedule and the random forest (below the ranker on every
    split and metric)."""
    regressor, *rest = shipping_selectors()
    return [regressor, XGBRanker(), HGBClassifier(), RandomForestTime(), *rest]


def fast_selectors() -> list[BaseSelector]:
    """The shipping set, smaller, for the one-command pipeline's many folds on 2 cores."""
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
