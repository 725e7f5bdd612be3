"""ficco-select runtime: the schedule vocabulary, the executor, and (later) the selector.

Light on purpose: importing this package pulls in neither torch nor pandas; the
executor (torch) lives in ``ficco_select.executor``.
"""

from ficco_select.scenario import OPS, Scenario, ScenarioError
from ficco_select.schedule import (BACKENDS, BASELINE, SHARD, Schedule, ScheduleError,
                                   candidates, is_legal, parse)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "BASELINE", "OPS", "SHARD", "Scenario", "ScenarioError", "Schedule",
    "ScheduleError", "candidates", "is_legal", "parse", "__version__",
]
