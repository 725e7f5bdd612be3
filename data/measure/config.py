"""How a measurement is taken: the timing policy of one scenario's schedules, and the
configuration of a sweep (the policy plus how ranks run). Every backend reads them: the
cpu backend's gloo ranks (``gloo.py``), the node mode (``node.py``) and the loopback
executor (``loopback_scenario.loopback_rows``).
"""

from __future__ import annotations

import dataclasses
import math
import os

from ficco_select.schedule import TIE


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimingPolicy:
    """How one scenario's schedules are timed, re-measured and labelled
    (``harness.measure_scenario``, ``loopback_scenario.loopback_rows``, ``ficco_select.data.labels``)."""

    warmup: int = 2
    """Untimed passes before timing."""
    reps: int = 10
    """Timed repetitions per schedule."""
    noisy_spread: float = 0.05
    """A schedule whose relative spread (IQR / median) exceeds this is re-measured."""
    max_remeasure: int = 1
    """Re-measurement rounds (every schedule again; each adds `reps` pooled repetitions)
    before a noisy schedule is kept with its `noisy` flag set."""
    tie_floor: float = TIE
    """A schedule is a near-tie of the best unless its repetitions show it more than this
    much slower (``ficco_select.data.labels.best_labels``)."""
    min_rep_s: float = 0.01
    """Shortest timed repetition, s: a repetition runs a function back to back as many times
    as the scenario's baseline needs to last this long (the same count for every function of
    the scenario, ``harness.runs_per_rep``), and its time is the total over that count; 0:
    one run per repetition. The defaults (10 ms, 10 repetitions, one re-measure round of every
    schedule) against the old 1 run x 5 (``benchmarks/repeatability.py``, 30 scenarios):
    best agreement 0.87 -> 0.93, median tau 0.67 -> 0.76, at 5x the sweep time; 20 ms
    repetitions were no better on tau. Settings this close differ by less than the
    benchmark's own noise on 30 scenarios; docs/measuring.md has the table."""
    max_runs: int = 64
    """At most this many runs per repetition."""

    def timing(self) -> dict:
        """This policy's settings, as a measured dataset records them (``ficco_select.data.dataset.TIMING_KEY``):
        rows timed with other settings are never joined to its rows."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TimingPolicy)}


class MeasureError(RuntimeError):
    """A measurement job failed: a rank died, raised, or hung past the timeout."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasureConfig(TimingPolicy):
    """What a measurement sweep needs: the timing policy (``TimingPolicy``'s fields) and how
    to run the ranks."""
    timeout_s: float = 300.0
    """A job with no progress (no verification or timed pass finished) for this long is
    killed as hung."""
    threads_per_rank: int | None = None
    """Intra-op threads per rank; None: the machine's cores divided by world size, at least 1."""
    seed: int = 0
    """Seed of the random inputs (with scenario id and rank)."""
    pin_cores: bool = False
    """Pin each rank (and so its gloo threads) to its own cores. Off by default: on a
    2-vCPU machine a pinned rank's transport thread waits for a scheduler slice behind
    its own GEMM or poll loop, which made repetitions bimodal (1 ms vs 4 ms) here."""
    fault: str | None = None
    """For tests only: ``exit@R[/GROUP]`` (rank R dies), ``hang@R[/GROUP]`` (rank R
    hangs; at the first scenario, or at the first of that group),
    ``corrupt@SCHEDULE`` (that schedule's output is altered before verification)."""

    def __post_init__(self) -> None:
        # Refused before any rank starts: nan or inf seconds would fail every scenario, and a
        # rerun would skip them as done. Messages name the `ficco measure` option too.
        if self.reps < 5:
            raise ValueError(f"reps (--reps): at least 5 timed repetitions are needed, got {self.reps}")
        if self.warmup < 0:
            raise ValueError(f"warmup (--warmup): must be >= 0, got {self.warmup}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s (--timeout {self.timeout_s}): must be a finite number of seconds > 0")
        if not (math.isfinite(self.min_rep_s) and self.min_rep_s >= 0):
            raise ValueError(f"min_rep_s (--min-rep-s {self.min_rep_s}): must be a finite number of seconds >= 0")

    def threads(self, world_size: int) -> int:
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        return max(1, (os.cpu_count() or 1) // world_size)
