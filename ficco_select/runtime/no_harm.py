"""Do no harm on GPUs: an overlap pick ships only where its predicted gain beats the
simulator's demonstrated error.

Every GPU decision was learned from the simulator, and the simulator's overlap gains are
checked against published GPU measurements (``data/published/``): at each collective + GEMM
point, its best overlap gain over the best gain any real implementation measured there.
That log ratio is its *residual*; positive where it was too optimistic. The rule (fitted by
``ficco_select.data.no_harm.fit_no_harm`` on the calibration rows, stored in ``selector.json`` as
``gpu_no_harm``): on a GPU machine, a decision to overlap stands only if the cost model's
gain of the picked schedule over the serial baseline exceeds exp(margin) of its regime (the
serial baseline's simulated time below ``split_us``, or not), where the margin is a
quantile of that regime's residuals. Else the baseline runs. A selector without an export
(the heuristic alone) has no rule. CPU machines are measured, not simulated: the rule
leaves them alone, and so it does a GPU machine whose own measured rows the model was
trained on (``measured``: a cuda sweep or ``ficco adapt``), where the truth is that
machine's, not the residuals of other GPUs.

Trust follows provenance. A spec says where each number came from (``HardwareSpec.provenance``:
measured, data sheet, assumed). A pick that replaces the baseline (an overlap, or the
collective in the switch) rests on the terms ``TRUST_TERMS`` names for it; where any of them
was not measured, the pick must clear ``unfitted_margin`` instead, a margin as wide as the
simulator's worst error on a generation whose terms were fitted (``ficco_select.data.no_harm``).

Plain Python + NumPy (``ficco_select.costs``): the runtime path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ficco_select.costs import GRANULARITY_CODES, OP_CODES, schedule_times
from ficco_select.hardware import HardwareSpec
from ficco_select.runtime.decision import Decision
from ficco_select.scenario import Scenario
from ficco_select.schedule import BASELINE, Schedule

MAX_MARGIN = 100.0
"""The largest margin a rule may hold, a log gain (x2.7e43 over the serial baseline). Any
margin above ln 2 already refuses every overlap over the same links (overlapping a GEMM with
its collective gains at most x2; fitted margins are below 0.2), and hand-written rules say
"never overlap" with 5 or 50; a larger number says nothing more, and past 709 ``exp`` cannot
even hold it. The fit clips at ln 1000 (``ficco_select.data.no_harm.FIT_MAX_MARGIN``)."""


@dataclasses.dataclass(frozen=True)
class NoHarmRule:
    split_us: float
    """Regime boundary: the serial baseline's simulated time, us (0: one regime, ``large_margin``)."""
    small_margin: float
    """Log-gain an overlap pick must exceed where the baseline takes less than ``split_us``."""
    large_margin: float
    """The same, at or above ``split_us``."""
    measured: frozenset[str] = frozenset()
    """GPU machines whose own measured rows the model was trained on: the rule steps aside there."""
    unfitted_margin: float = 0.0
    """Log-gain a pick must exceed where a term it rests on was not measured (``TRUST_TERMS``);
    0: the regime's margin alone (an export fitted before provenance was read)."""

    def margin(self, baseline_us: float) -> float:
        return self.small_margin if baseline_us < self.split_us else self.large_margin

    @classmethod
    def from_meta(cls, rule: Any, where: str) -> "NoHarmRule":
        """selector.json's ``gpu_no_harm``; ValueError naming the field."""
        at = f"{where}: field 'gpu_no_harm"
        if not isinstance(rule, dict):
            raise ValueError(f"{at}' must be an object, got {rule!r}")
        values = {}
        for name, high in (("split_us", math.inf), ("small_margin", MAX_MARGIN), ("large_margin", MAX_MARGIN),
                           ("unfitted_margin", MAX_MARGIN)):
            value = rule.get(name, 0.0 if name == "unfitted_margin" else None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 <= value <= high:
                within = ">= 0" if high == math.inf else f"in [0, {high:.4g}] (a log gain: at most x{math.exp(high):g})"
                raise ValueError(f"{at}.{name}' must be a finite number {within}, got {value!r}")
            values[name] = float(value)
        measured = rule.get("measured", [])
        if not isinstance(measured, list) or not all(isinstance(m, str) for m in measured):
            raise ValueError(f"{at}.measured' must be a list of machine names, got {measured!r}")
        return cls(**values, measured=frozenset(measured))


TRUST_TERMS: dict[str, tuple[str, ...]] = {
    "baseline": ("gemm_efficiency", "coll_latency_us", "coll_bw_gbps"),
    "overlap": ("overlap_efficiency", "overlap_call_us"),
    "dma": ("dma_bw_gbps",),
    "switch": ("switch_bw_gbps", "switch_latency_us"),
}
"""The spec terms a pick's predicted gain rests on: every pick is read against the serial
baseline (the GEMM's efficiency and the collective library's terms); an overlapped schedule
also on the overlap's realized fraction and per-call cost (fitted only where overlap points
were measured); a copy-engine or switch schedule on its engine's own terms. The link rate
and the ``sm`` transfer's terms are left out: every GPU's are a data sheet's or assumed, and
the overlap points that fitted the margins ran over them."""


def untrusted_terms(hw: HardwareSpec, schedule: Schedule) -> tuple[str, ...]:
    """The terms of ``TRUST_TERMS`` that `schedule`'s gain on `hw` rests on and that were not measured."""
    terms = TRUST_TERMS["baseline"]
    if not schedule.is_baseline:
        terms += TRUST_TERMS["overlap"]
    terms += TRUST_TERMS.get(schedule.engine, ())
    return tuple(f for f in terms if hw.source_of(f) != "measured")


def replaces_baseline(schedule: Schedule) -> bool:
    """Whether the rule judges `schedule`: an overlap, or the whole collective in the switch
    (a collective no measurement here ran)."""
    return not schedule.is_baseline or schedule.engine == "switch"


def predicted_gains(scenarios: Sequence[Scenario], hw: HardwareSpec,
                    schedules: Sequence[Schedule]) -> tuple[np.ndarray, np.ndarray]:
    """The cost model's serial baseline time (us) and gain (baseline time / schedule's time)
    of each (scenario, schedule) pair on `hw`, in one vectorized call: what the simulator
    would say each pick gains. A layer table's whole grid of m costs about one pair."""
    both = list(scenarios) * 2  # the baselines, then the picks
    picks = [None] * len(scenarios) + list(schedules)

    def column(values, dtype=float):
        return np.array(values, dtype=dtype)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = schedule_times(
            hw, op=column([OP_CODES[s.op] for s in both], int), m=column([s.m for s in both]),
            n=column([s.n for s in both]), k=column([s.k for s in both]), P=column([s.world_size for s in both]),
            imbalance=column([s.imbalance for s in both]), dtype_bytes=column([s.dtype_bytes for s in both]),
            peak=column([hw.peak_of(s.dtype) * 1e12 for s in both]),
            gran=column([GRANULARITY_CODES["none" if c is None else c.granularity] for c in picks], int),
            degree=column([1.0 if c is None else float(c.degree or 1) for c in picks]),
            a2a=column([c is not None and c.pattern == "a2a" for c in picks], bool),
            per_step=column([c is not None and c.compute == "gemm_per_step" for c in picks], bool),
            split_n=column([c is not None and c.split == "n" for c in picks], bool),
            dma=column([c is not None and c.engine == "dma" for c in picks], bool),
            switch=column([c is not None and c.engine == "switch" for c in picks], bool))["time_s"]
        baseline, picked = t[:len(scenarios)], t[len(scenarios):]
        return baseline * 1e6, baseline / picked


def cost_model_pick(s: Scenario, hw: HardwareSpec, candidates: Sequence[Schedule]) -> Schedule:
    """The candidate the cost model predicts fastest on `hw` (the largest gain over the
    serial baseline; ties to the earlier candidate): the calibrated simulator's own pick,
    what the learned model was distilled from. `candidates` holds the baseline."""
    _, gains = predicted_gains([s] * len(candidates), hw, candidates)
    gains = np.where(np.isfinite(gains), gains, 0.0)
    return candidates[int(np.argmax(gains))]


def predicted_gain(s: Scenario, hw: HardwareSpec, schedule: Schedule) -> tuple[float, float]:
    """``predicted_gains`` of one pair, as floats."""
    baseline_us, gain = predicted_gains([s], hw, [schedule])
    return float(baseline_us[0]), float(gain[0])


def verdicts(rule: NoHarmRule, scenarios: Sequence[Scenario], hw: HardwareSpec,
             schedules: Sequence[Schedule]) -> list[str]:
    """Per pair, "" where the overlap pick stands under `rule`, else why the baseline runs. A
    gain the cost model cannot give (not a finite positive number) never stands."""
    baseline_us, gains = predicted_gains(scenarios, hw, schedules)
    out = []
    for schedule, base, gain in zip(schedules, baseline_us, gains):
        margin = rule.margin(float(base))
        untrusted = untrusted_terms(hw, schedule) if rule.unfitted_margin > margin else ()
        if untrusted:
            margin = rule.unfitted_margin
        if math.isfinite(gain) and gain > 0 and math.log(gain) > margin:
            out.append("")
            continue
        if untrusted:
            sources = ", ".join(f"{f} ({hw.source_of(f)})" for f in untrusted)
            out.append(f"predicted gain {gain:.3f} of {schedule.name} rests on terms no measurement fitted on "
                       f"{hw.name}: {sources}; it must exceed x{_times(margin)}, the simulator's worst error "
                       "where terms were fitted: the baseline does no harm")
            continue
        regime = "below" if base < rule.split_us else "at or above"
        out.append(f"predicted gain {gain:.3f} of {schedule.name} within the simulator's published error "
                   f"(x{_times(margin)}, serial baseline {base:.4g} us, {regime} "
                   f"{rule.split_us:g} us): the baseline does no harm")
    return out


def _times(margin: float) -> str:
    """A margin as the gain it asks for: x1.191, or x2.69e+43 for one far past any gain."""
    gain = math.exp(min(margin, MAX_MARGIN))
    return f"{gain:.3f}" if gain < 1e6 else f"{gain:.3g}"


def refused(decision: Decision, why: str) -> Decision:
    """The baseline in place of `decision`, an overlap pick the rule refuses (`why`): the one
    form the direct path and the layer tables give."""
    return Decision(BASELINE, "fallback", 0.0, f"{decision.reason}; {why}" if decision.reason else why,
                    decision.abstained or "no_harm")


def holds(rule: NoHarmRule, s: Scenario, hw: HardwareSpec, schedule: Schedule) -> tuple[bool, str]:
    """Whether an overlap pick stands under `rule`, and why not where it does not."""
    (why,) = verdicts(rule, [s], hw, [schedule])
    return not why, why
