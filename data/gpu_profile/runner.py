"""The section runner: a profiling run's state, its time budget, and the sections run against it.

A ``Run`` holds the profile being filled in (a JSON-ready dict) and rewrites
``profile.json`` atomically. ``run_sections`` runs each ``Section`` in its own thread,
against its share of the budget: a section that fails records its error and the next one
runs; one that does not return is abandoned and every later one skipped. ``write_on_term``
makes a timeout's SIGTERM leave a valid, partial profile.

The sections themselves (``gemm``, ``copies``, ``realized``) import this module, never the
reverse.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MIN_SECTION_S = 3.0
"""A section is skipped when less than this is left of the budget."""
GRACE_S = 20.0
"""How long past its share a section may run before it is declared hung and abandoned."""


class Skip(Exception):
    """A section cannot run here (its message says why); recorded as skipped, not failed."""


@dataclasses.dataclass(kw_only=True)
class Run:
    """One profiling run: its output file, budget and the profile being filled in."""

    out: Path
    """Folder of profile.json."""
    deadline: float
    """time.monotonic() at which every section must be done."""
    state: dict[str, Any]
    """The profile (JSON-ready); mutate only through put/append (they take the lock)."""
    preset: Any = None
    """HardwareSpec whose peaks gemm_efficiency is relative to (None: not loaded)."""
    device: str = "cuda"
    """Device the sections run on (``cpu`` only in tests and rehearsals: a dry run of the logic, not the GPU)."""
    tiny: bool = False
    """Each section's ``TINY_*`` shapes instead of its own: a rehearsal of the sections' logic
    in seconds on the CPU (``ficco bring-up --rehearse``), no measurement."""
    started: float = dataclasses.field(default_factory=time.monotonic)
    lock: Any = dataclasses.field(default_factory=threading.RLock)
    """Re-entrant: the SIGTERM handler takes it on the main thread, which may hold it."""
    dirty: bool = False

    @property
    def path(self) -> Path:
        return self.out / "profile.json"

    def put(self, *keys: str, value: Any) -> None:
        """state[k0][k1]...[kn] = value, creating objects on the way."""
        with self.lock:
            node = self.state
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value
            self.dirty = True

    def append(self, *keys: str, value: Any) -> None:
        """state[k0]...[kn].append(value), creating the list on the way."""
        with self.lock:
            node = self.state
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node.setdefault(keys[-1], []).append(value)
            self.dirty = True

    def write(self) -> None:
        """Rewrite profile.json atomically (a reader never sees half a file)."""
        with self.lock:
            self.state["elapsed_s"] = round(time.monotonic() - self.started, 1)
            text = json.dumps(_clean(self.state), indent=1, default=str, allow_nan=False)
            self.dirty = False
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.path)


def _clean(value: Any) -> Any:
    """A copy that is strict JSON: non-finite floats become null."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    max_s: float | None
    """Its share of the budget, seconds; None: whatever is left."""
    fn: Callable[[Run, float], None]
    """fn(run, until): measure until time.monotonic() reaches `until`, recording as it goes."""


def run_sections(run: Run, sections: Sequence[Section], *, grace_s: float = GRACE_S,
                 write_every_s: float = 5.0) -> bool:
    """Run the sections in order, each guarded and time-boxed; False if one hung.

    A section runs in a daemon thread so the main thread can keep writing the profile and
    can give up on a section that does not return (a hung kernel or a deadlocked loopback):
    it is marked ``timeout`` and every later section ``skipped`` (the GPU is not idle any
    more, later timings would be wrong).
    """
    for i, section in enumerate(sections):
        now = time.monotonic()
        left = run.deadline - now
        if left < MIN_SECTION_S:
            _status(run, section.name, "skipped", "skipped: time budget exhausted")
            continue
        until = now + (left if section.max_s is None else min(section.max_s, left))
        _status(run, section.name, "running", f"until +{until - run.started:.0f} s")
        run.write()
        log.info("section %s: up to %.0f s", section.name, until - now)
        outcome: dict[str, Any] = {}
        thread = threading.Thread(target=_guarded, args=(section, run, until, outcome), daemon=True,
                                  name=f"section-{section.name}")
        thread.start()
        last_write = time.monotonic()
        while thread.is_alive() and time.monotonic() < until + grace_s:
            thread.join(timeout=0.5)
            if run.dirty and time.monotonic() - last_write > write_every_s:
                try:
                    run.write()
                except (OSError, ValueError) as e:  # keep measuring; the next write may work
                    log.warning("could not write %s: %s", run.path, e)
                last_write = time.monotonic()
        elapsed = round(time.monotonic() - now, 1)
        if thread.is_alive():
            _status(run, section.name, "timeout", f"did not return {grace_s:.0f} s after its share; abandoned",
                    elapsed)
            for later in sections[i + 1:]:
                _status(run, later.name, "skipped", f"skipped: section {section.name} did not return")
            run.write()
            return False
        _status(run, section.name, outcome["status"], outcome.get("message", ""), elapsed,
                outcome.get("traceback"))
        log.info("section %s: %s in %.1f s %s", section.name, outcome["status"], elapsed,
                 outcome.get("message", ""))
        run.write()
    return True


def _guarded(section: Section, run: Run, until: float, outcome: dict[str, Any]) -> None:
    try:
        section.fn(run, until)
        outcome["status"] = "ok"
        if time.monotonic() > until:
            outcome["message"] = "ran out of its time share; results may be partial"
    except Skip as e:
        outcome.update(status="skipped", message=f"skipped: {e}")
    except BaseException as e:  # noqa: BLE001 - recorded; the next section runs
        outcome.update(status="error", message=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc(limit=8)[-4000:])
    finally:
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a broken context shows in the next section
                pass


def _status(run: Run, name: str, status: str, message: str = "", elapsed: float | None = None,
            tb: str | None = None) -> None:
    entry: dict[str, Any] = {"status": status, "message": message}
    if elapsed is not None:
        entry["elapsed_s"] = elapsed
    if tb:
        entry["traceback"] = tb
    run.put("sections", name, value=entry)


def write_on_term(run: Run):
    """On SIGTERM (a timeout's), mark unfinished sections ``interrupted``, write, and exit.
    Returns the handler it replaced (``signal.signal``'s), for the caller to put back."""

    def on_term(signum, frame) -> None:
        with run.lock:
            for entry in run.state["sections"].values():
                if entry["status"] in ("running", "pending"):
                    entry.update(status="interrupted", message=f"signal {signum}")
        run.write()
        os._exit(128 + signum)

    return signal.signal(signal.SIGTERM, on_term)
