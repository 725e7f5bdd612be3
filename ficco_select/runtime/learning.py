"""The hook learns from the job it serves: each call shape's decision checked against a few
alternatives on the job's own timings, the measured best kept, and kept for the next job.

Off by default; ``configure(learn=True)`` or ``$FICCO_LEARN=1`` turns it on. A new call shape
then starts a ``Trial`` of its contenders (``Selector.contenders``: the decision, the model's
next best, the export's fitted fixed rule, the baseline), unless this machine's record
(``runtime/learned.py``) already holds the shape's measured choice: then it runs that, with
no trial. A trial is successive halving over rounds:

- a round runs each remaining contender ``CALLS_PER_ROUND`` times, interleaved (call i of
  the round runs contender i mod n), so that a drift of the machine falls on all alike;
- a contender's first call is a warm-up (its transport bound, its buffers made) and is
  checked against the reference: a wrong result drops it for good (a wrong schedule is
  never kept); the warm-up's time is not counted;
- at the round's end the ranks agree on every contender's time: each rank's median over
  its timed calls so far, the slowest rank's (one all-reduce of a few numbers per round,
  at the shape's next call, which every rank makes at the same point: no collective or
  sync per call);
- then, on the agreed times: a contender slower than the baseline by more than
  ``DROP_SLOWER`` is dropped at once; from the second round on (or where the best leads
  every other by ``CLEAR``) the slower half goes; one left, or ``MAX_ROUNDS`` rounds run:
  settled on the fastest.

Every rank runs the same contender at every call: the order is a function of the call count
and of agreed times alone. A trial costs at most ``MAX_ROUNDS * CALLS_PER_ROUND`` calls per
contender; its cost (the time its calls took beyond the settled choice's, by the agreed
times) is in ``report()``. At most ``TRIALS_AT_ONCE`` shapes of a group learn at once (a
serving job's token counts beyond run their decision): exploration stays bounded.

Timings: ``time.perf_counter`` around the call on the cpu; on CUDA two events on the call's
stream, read at the round's end (the one sync of a round).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import statistics

import torch
import torch.distributed as dist

from ficco_select.runtime.decision import Decision
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, Schedule

ENV = "FICCO_LEARN"
CALLS_PER_ROUND = 3
"""Calls of each contender per round (the first round's first is its warm-up)."""
MAX_ROUNDS = 4
DROP_SLOWER = 0.03
"""A contender this much slower than the baseline (agreed times) is dropped at its first round."""
CLEAR = 0.10
"""A lead this large over every other contender settles a trial after its first round."""
TRIALS_AT_ONCE = 64
"""Call shapes of one process group that may learn at the same time."""


def learn_from_env() -> bool:
    """Whether ``$FICCO_LEARN`` turns learning on (anything but "", "0")."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


@dataclasses.dataclass(eq=False)
class Trial:
    """One call shape's contenders, measured in the job until one is clearly fastest."""

    scenario: Scenario
    contenders: tuple[Schedule, ...]
    device: torch.device
    plans: list = dataclasses.field(default_factory=list)
    """One ``Plan`` per contender (``dispatch``), bound once; each refers back to this trial."""
    active: list[int] = dataclasses.field(default_factory=list)
    calls: int = 0
    """Calls of this shape so far: the same on every rank."""
    round_calls: int = 0
    rounds: int = 0
    times: list[list] = dataclasses.field(default_factory=list)
    """This rank's timed calls per contender: seconds, or (start, end) CUDA events until read."""
    warmed: set[int] = dataclasses.field(default_factory=set)
    wrong: set[int] = dataclasses.field(default_factory=set)
    """Contenders whose check against the reference failed on this rank."""
    agreed: list[list[float]] = dataclasses.field(default_factory=list)
    """Per round, every contender's agreed time (nan: not run that round)."""
    ran: list[int] = dataclasses.field(default_factory=list)
    """Calls each contender ran."""
    settled: int | None = None

    def __post_init__(self) -> None:
        n = len(self.contenders)
        self.active = list(range(n))
        self.times = [[] for _ in range(n)]
        self.ran = [0] * n

    # -- a call ----------------------------------------------------------------------------
    def next_contender(self, group: dist.ProcessGroup) -> int:
        """The contender this call runs: the round's next, the round ended first where it is
        done (the ranks agree on the times there). Settled: the settled one."""
        if self.settled is None and self.round_calls == len(self.active) * CALLS_PER_ROUND:
            self._end_round(group)
        if self.settled is not None:
            return self.settled
        i = self.active[self.round_calls % len(self.active)]
        self.round_calls += 1
        self.calls += 1
        self.ran[i] += 1
        return i

    def observe(self, i: int, elapsed) -> None:
        """Contender i's call took `elapsed` (seconds, or CUDA (start, end) events); a
        contender's first call is its warm-up, not counted."""
        if i in self.warmed:
            self.times[i].append(elapsed)
        else:
            self.warmed.add(i)

    def failed_check(self, i: int) -> None:
        self.wrong.add(i)

    # -- a round's end ---------------------------------------------------------------------
    def _end_round(self, group: dist.ProcessGroup) -> None:
        mine = [self._median(i) for i in range(len(self.contenders))]
        on = self.device if self.device.type == "cuda" else torch.device("cpu")
        agreed = torch.tensor(mine, dtype=torch.float64, device=on)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's: the time the group waits
        times = agreed.tolist()
        self.rounds += 1
        self.round_calls = 0
        self.agreed.append([t if i in self.active else math.nan for i, t in enumerate(times)])
        self.active = self._survivors(times)
        if len(self.active) == 1 or self.rounds >= MAX_ROUNDS:
            self.settled = min(self.active, key=lambda i: times[i])

    def _median(self, i: int) -> float:
        """This rank's median of contender i's timed calls (inf: its check failed; nan: none)."""
        if i in self.wrong:
            return math.inf
        times = self.times[i] = [_seconds(t) for t in self.times[i]]
        return statistics.median(times) if times else math.nan

    def _survivors(self, times: list[float]) -> list[int]:
        ok = [i for i in self.active if math.isfinite(times[i])]
        if not ok:  # every contender wrong or untimed: the baseline, PyTorch's own
            return [self.contenders.index(BASELINE)]
        base = self.contenders.index(BASELINE)
        if base in ok:
            ok = [i for i in ok if i == base or times[i] <= times[base] * (1 + DROP_SLOWER)]
        ok.sort(key=lambda i: times[i])
        clear = len(ok) > 1 and all(times[ok[0]] * (1 + CLEAR) <= times[i] for i in ok[1:])
        if clear:
            return ok[:1]
        if self.rounds >= 2:
            return ok[:math.ceil(len(ok) / 2)]
        return ok

    # -- what it found -----------------------------------------------------------------------
    def cost_s(self) -> float:
        """Time the trial's calls took beyond the settled contender's, by the agreed times
        (each contender's latest): what exploring this shape cost the job."""
        if self.settled is None or not self.agreed:
            return 0.0
        latest = [next((r[i] for r in reversed(self.agreed) if not math.isnan(r[i])), math.nan)
                  for i in range(len(self.contenders))]
        best = latest[self.settled]
        return sum(n * (latest[i] - best) for i, n in enumerate(self.ran)
                   if i != self.settled and math.isfinite(latest[i]))

    def entry(self) -> dict:
        """The settled trial as the machine's record keeps it (``learned.LearnedRecord``)."""
        return {"record": self.scenario.as_record(), "schedule": self.contenders[self.settled].name,
                "arms": {s.name: [r[i] for r in self.agreed if not math.isnan(r[i]) and math.isfinite(r[i])]
                         for i, s in enumerate(self.contenders)},
                "verified": {s.name: i not in self.wrong for i, s in enumerate(self.contenders)},
                "backend": self.device.type, "rounds": self.rounds, "explored_calls": self.calls,
                "cost_s": self.cost_s(),
                "settled_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    def summary(self) -> dict:
        """What ``report()`` says of this shape."""
        return {"contenders": [s.name for s in self.contenders],
                "settled": None if self.settled is None else self.contenders[self.settled].name,
                "rounds": self.rounds, "explored_calls": self.calls, "cost_s": self.cost_s(),
                "agreed_s": self.agreed[-1] if self.agreed else None}


def _seconds(t) -> float:
    if isinstance(t, tuple):  # CUDA events: the round's end waits for the last one
        start, end = t
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return t


def learned_decision(entry: dict, scenario: Scenario, candidates) -> Decision | None:
    """The decision a record's entry gives `scenario` (None where its schedule is no longer
    one of the shape's `candidates`: the grammar or the machine changed)."""
    name = entry.get("schedule")
    pick = next((c for c in candidates if c.name == name), None)
    if pick is None:
        return None
    return Decision(pick, "learned", 1.0, f"measured fastest on this machine in an earlier job "
                                          f"({entry.get('settled_at', '?')})")
