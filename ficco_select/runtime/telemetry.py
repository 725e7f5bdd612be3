"""Opt-in telemetry: every schedule the torch helpers execute, with its measured time.

Off unless ``$FICCO_TELEMETRY`` (or ``configure(telemetry=...)`` in ``ficco_select.runtime.torch_ops``)
names a file. One JSON object per line, appended with a single ``write`` so that ranks
sharing a file do not interleave and a killed job loses at most its last line; a
``{rank}`` in the path gives each rank its own file. ``ficco train --telemetry FILE``
turns the lines into labeled dataset rows (``ficco_select.data.telemetry``).

A line (version ``TELEMETRY_VERSION``)::

    {"v": 1, <the scenario-table columns>, "scenario_id": ..., "schedule": "ficco.d2...",
     "source": "model"|"heuristic"|"fallback", "rank": 0, "call": 3, "time_s": 0.0012,
     "verified": true|false|null, "rel_error": float|null, "backend": "cpu", "ts": "...Z"}

``call`` counts the executions of that (scenario, schedule) in the process, so the n-th
call on every rank is the same collective (its time is the slowest rank's). ``verified``
is null except on the first execution of a (scenario, schedule) in a process, which is
checked against the plain reference (a wrong schedule is never a label).

What it costs a call (``runtime/dispatch.py``): on the cpu backend, two clock reads; on CUDA,
two events recorded on the call's stream, read once the GPU has passed them (a query per
call, no host synchronization; the oldest is waited for only when 256 are unread, and the
rest at ``reset()`` or exit). The first call of each (scenario, schedule) also runs the
reference to check it.

Runtime path: standard library only.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path

from ficco_select.runtime.caches import BoundedCache

log = logging.getLogger("ficco_select.runtime.telemetry")

TELEMETRY_VERSION = 1
ENV = "FICCO_TELEMETRY"
CALLS_KEPT = 1 << 16
"""(scenario, schedule) pairs whose call count a writer keeps (least recently used out: a
pair seen again after its eviction counts from 0)."""


class Telemetry:
    """Appends telemetry lines to one file; never raises into the caller's job."""

    def __init__(self, path: str | Path, rank: int = 0) -> None:
        self.path = Path(str(path).replace("{rank}", str(rank)))
        self.rank = rank
        self._calls: BoundedCache[tuple[str, str], int] = BoundedCache(CALLS_KEPT)
        self._broken = False

    def next_call(self, scenario_id: str, schedule: str) -> int:
        key = (scenario_id, schedule)
        n = self._calls.get(key, 0)
        self._calls.put(key, n + 1)
        return n

    def record(self, record: dict, *, schedule: str, source: str, call: int, time_s: float,
               verified: bool | None = None, rel_error: float | None = None, backend: str = "cpu") -> None:
        if self._broken:
            return
        line = {"v": TELEMETRY_VERSION, **record, "schedule": schedule, "source": source, "rank": self.rank,
                "call": call, "time_s": time_s, "verified": verified, "rel_error": rel_error, "backend": backend,
                "ts": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")}
        try:
            data = (json.dumps(line) + "\n").encode()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except Exception as e:  # noqa: BLE001 - telemetry must not break the job
            self._broken = True
            log.warning("ficco-select: telemetry to %s disabled: %s", self.path, e)
