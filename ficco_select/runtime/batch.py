"""A batch of raw rows decided by a selector (``ficco select``): each row's decision and the
reason of any fallback in its own record, so the selector's per-key warnings stay quiet on
this thread (``quiet``) and only on it."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ficco_select.hardware import hardware_name
from ficco_select.runtime.selector import Selector, log
from ficco_select.scenario import Scenario


class _QuietThread(logging.Filter):
    """Drops this module's records on a thread inside ``quiet()`` only: a batch of decisions
    that reports each fallback itself must not silence another thread deciding meanwhile
    (changing the logger's level would)."""

    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "quiet", False)


log.addFilter(_QuietThread())  # the selector's logger


@contextlib.contextmanager
def quiet():
    """This thread's selector warnings off inside (``decide_rows``); other threads unchanged."""
    before = getattr(_QuietThread.local, "quiet", False)
    _QuietThread.local.quiet = True
    try:
        yield
    finally:
        _QuietThread.local.quiet = before


def decide_rows(selector: Selector, records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The selector's decision on each raw row, in order (``ficco select``; never raises: a
    bad row is a fallback). Each: row (1-based), scenario_id (None for an invalid row),
    schedule, source, confidence, reason."""
    def decision(row: int, record: Mapping[str, Any]) -> dict:
        try:  # the id `ficco simulate` and `ficco measure` give the row: a spec file becomes its name
            named = {**record, "hardware": hardware_name(str(record.get("hardware", "")).strip())}
            scenario_id = Scenario.from_record(named).scenario_id
        except Exception:  # noqa: BLE001 - not a row a scenario reads (not even a mapping): the decision says why
            scenario_id = None
        d = selector.select(record)
        return {"row": row, "scenario_id": scenario_id, "schedule": d.schedule.name, "source": d.source,
                "confidence": d.confidence, "reason": d.reason}

    # Each fallback's reason is in the output: no warning per bad row on top of it.
    with quiet():
        return [decision(i, record) for i, record in enumerate(records, start=1)]
