"""ficco-select: the vocabulary every stage shares (scenario, schedule, hardware, costs,
heuristic, signatures). What a job runs lives below it: the operators in
``ficco_select.executor`` (torch) and the runtime in ``ficco_select.runtime`` (selector,
layer tables, torch ops, TP hooks); README.md draws the layers.

Light on purpose: importing this package pulls in neither torch nor pandas.
"""

from pathlib import Path as _Path

# The stages (data/, features/, train/) sit beside this package in a checkout, as the design
# card lays it out, and inside it once installed (pyproject's package-dir): either way they
# import as ficco_select.data, ficco_select.features and ficco_select.train, and nothing
# generic lands on the user's import path. In a checkout only these three map in (_stages.py).
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "train").is_dir() and (_checkout / "train" / "bringup.py").is_file():
    from ficco_select._stages import stage_entry as _stage_entry

    __path__.append(_stage_entry(_checkout))

from ficco_select.scenario import OPS, Scenario, ScenarioError
from ficco_select.schedule import BACKENDS, BASELINE, SHARD, Schedule, ScheduleError, candidates, is_legal, parse

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "BASELINE", "OPS", "SHARD", "Scenario", "ScenarioError", "Schedule",
    "ScheduleError", "candidates", "is_legal", "parse", "__version__",
]
