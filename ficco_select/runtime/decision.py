"""What the runtime selector answers for a scenario: a schedule, where it came from, how sure."""

from __future__ import annotations

import dataclasses

from ficco_select.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class Decision:
    schedule: Schedule
    source: str
    """``model``, ``heuristic`` or ``fallback``."""
    confidence: float
    """Model: predicted relative gap between the best and second-best candidate (0..1);
    heuristic and fallback: 0."""
    reason: str = ""
