"""What ``configure`` sets for the whole process: the defaults every process group's context
(``context.py``) starts from and follows."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from ficco_select.runtime.learning import learn_from_env
from ficco_select.runtime.telemetry import ENV as TELEMETRY_ENV
from ficco_select.schedule import Schedule

if TYPE_CHECKING:
    from ficco_select.runtime.selector import Selector

DECISION_CACHE_SIZE = 4096
"""Call shapes whose plan a process group keeps by default: every token count of a serving
engine up to 4096 (``benchmarks/hook_overhead.py --memory``: resident memory flat over 12,000 of them)."""

LAYER_TABLES_KEPT = 1024
"""Layers (a call's shape without its token count) whose decision table a process group keeps."""


def debug_checks() -> tuple[bool, str]:
    """Whether the environment turns the per-call check on (``Settings.check_calls``), and
    what decides it, as an error names it."""
    ours = os.environ.get("FICCO_CHECK_CALLS", "").strip()
    if ours:
        return ours != "0", f"FICCO_CHECK_CALLS={ours[:32]}"
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        return True, "TORCH_DISTRIBUTED_DEBUG=DETAIL"
    return False, "the default"


@dataclasses.dataclass
class Settings:
    """What ``configure`` sets."""

    selector: Selector | None = None
    hardware: str | None = None
    telemetry: str | None = dataclasses.field(default_factory=lambda: os.environ.get(TELEMETRY_ENV) or None)
    """The telemetry file (default: $FICCO_TELEMETRY, read when the settings are made)."""
    group_label: str = "runtime"
    schedule: Schedule | None = None
    """Pinned by the caller (benchmarks, debugging): runs wherever it is legal."""
    explore_every: int = 0
    """Every n-th call of a shape runs another candidate, in turn (0: never)."""
    check_calls: bool = dataclasses.field(default_factory=lambda: debug_checks()[0])
    """A debug mode, off by default: each call first checks that every rank passes the same
    call (``ops``), one blocking host collective per call, and the latest call's decision is
    kept (``last_decision``). On with PyTorch's own switch ($TORCH_DISTRIBUTED_DEBUG=DETAIL)
    or $FICCO_CHECK_CALLS=1 ($FICCO_CHECK_CALLS=0: off whatever PyTorch's says). Off is
    PyTorch's own collectives' contract: nothing per call. A group's ranks agree on it once
    (``ops.agree_on_the_check``)."""
    check_source: str = dataclasses.field(default_factory=lambda: debug_checks()[1])
    """What set ``check_calls``, as an error names it: ``FICCO_CHECK_CALLS=1``, ``configure(check_calls=True)``..."""
    learn: bool = dataclasses.field(default_factory=learn_from_env)
    """Correct each call shape's decision on the job's own timings (``runtime/learning.py``),
    off by default; on with $FICCO_LEARN=1."""
    learn_dir: str | None = None
    """Where the machine's record of measured decisions lives (None: $FICCO_LEARN_DIR, else
    ``~/.cache/ficco-select/learned``)."""
    cache_size: int = DECISION_CACHE_SIZE
    """Call shapes whose plan each process group keeps (least recently used first out)."""

    @property
    def watched(self) -> bool:
        """Whether each call is looked at beyond its plan: recorded (telemetry), checked and
        kept as ``last_decision`` (the debug mode), or counted (exploration). Otherwise a
        planned call is one lookup and the run."""
        return bool(self.telemetry or self.check_calls or self.explore_every)
