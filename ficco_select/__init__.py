"""ficco-select runtime: the schedule vocabulary (scenario, schedule, hardware, costs),
the executor (``ficco_select.executor``, torch), the runtime selector
(``ficco_select.runtime.selector``) and the framework hooks (``torch_ops``, ``tp``).

Light on purpose: importing this package pulls in neither torch nor pandas.
"""

from ficco_select.scenario import OPS, Scenario, ScenarioError
from ficco_select.schedule import BACKENDS, BASELINE, SHARD, Schedule, ScheduleError, candidates, is_legal, parse

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "BASELINE", "OPS", "SHARD", "Scenario", "ScenarioError", "Schedule",
    "ScheduleError", "candidates", "is_legal", "parse", "__version__",
]
