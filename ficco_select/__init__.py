"""ficco-select: the vocabulary every stage shares (scenario, schedule, hardware, costs,
heuristic, signatures). What a job runs lives below it: the operators in
``ficco_select.executor`` (torch) and the runtime in ``ficco_select.runtime`` (selector,
layer tables, torch ops, TP hooks); README.md draws the layers.

Light on purpose: importing this package pulls in neither torch nor pandas.
"""

from ficco_select.scenario import OPS, Scenario, ScenarioError
from ficco_select.schedule import BACKENDS, BASELINE, SHARD, Schedule, ScheduleError, candidates, is_legal, parse

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "BASELINE", "OPS", "SHARD", "Scenario", "ScenarioError", "Schedule",
    "ScheduleError", "candidates", "is_legal", "parse", "__version__",
]
