"""Do no harm on GPUs: an overlap pick ships only where its predicted gain beats the
simulator's demonstrated error.

Every GPU decision was learned from the simulator, and the simulator's overlap gains are
checked against published GPU measurements (``data/published/``): at each collective + GEMM
point, its best overlap gain over the best gain any real implementation measured there.
That log ratio is its *residual*; positive where it was too optimistic. The rule (fitted by
``data.no_harm.fit_no_harm`` on the calibration rows, stored in ``selector.json`` as
``gpu_no_harm``): on a GPU machine, a decision to overlap stands only if the cost model's
gain of the picked schedule over the serial baseline exceeds exp(margin) of its regime (the
serial baseline's simulated time below ``split_us``, or not), where the margin is a
quantile of that regime's residuals. Else the baseline runs. CPU machines are measured, not
simulated: the rule leaves them alone.

Plain Python + NumPy (``ficco_select.costs``): the runtime path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ficco_select.costs import GRANULARITY_CODES, OP_CODES, schedule_times
from ficco_select.hardware import HardwareSpec
from ficco_select.scenario import Scenario
from ficco_select.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class NoHarmRule:
    split_us: float
    """Regime boundary: the serial baseline's simulated time, us (0: one regime, ``large_margin``)."""
    small_margin: float
    """Log-gain an overlap pick must exceed where the baseline takes less than ``split_us``."""
    large_margin: float
    """The same, at or above ``split_us``."""

    def margin(self, baseline_us: float) -> float:
        return self.small_margin if baseline_us < self.split_us else self.large_margin

    @classmethod
    def from_meta(cls, rule: Any, where: str) -> "NoHarmRule":
        """selector.json's ``gpu_no_harm``; ValueError naming the field."""
        at = f"{where}: field 'gpu_no_harm"
        if not isinstance(rule, dict):
            raise ValueError(f"{at}' must be an object, got {rule!r}")
        values = {}
        for name, low in (("split_us", 0.0), ("small_margin", 0.0), ("large_margin", 0.0)):
            value = rule.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < low:
                raise ValueError(f"{at}.{name}' must be a finite number >= {low:g}, got {value!r}")
            values[name] = float(value)
        return cls(**values)


def predicted_gain(s: Scenario, hw: HardwareSpec, schedule: Schedule) -> tuple[float, float]:
    """The cost model's (serial baseline time in us, baseline time / `schedule`'s time) for `s`
    on `hw`: what the simulator would say this pick gains."""
    arrays = dict(op=np.array([OP_CODES[s.op]] * 2), m=float(s.m), n=float(s.n), k=float(s.k),
                  P=float(s.world_size), imbalance=float(s.imbalance), dtype_bytes=s.dtype_bytes,
                  peak=hw.peak_of(s.dtype) * 1e12,
                  gran=np.array([GRANULARITY_CODES["none"], GRANULARITY_CODES[schedule.granularity]]),
                  degree=np.array([1.0, float(schedule.degree or 1)]),
                  a2a=np.array([False, schedule.pattern == "a2a"]),
                  per_step=np.array([False, schedule.compute == "gemm_per_step"]),
                  split_n=np.array([False, schedule.split == "n"]),
                  dma=np.array([False, schedule.engine == "dma"]))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        baseline, picked = schedule_times(hw, **arrays)["time_s"]
    return float(baseline) * 1e6, float(baseline / picked)


def holds(rule: NoHarmRule, s: Scenario, hw: HardwareSpec, schedule: Schedule) -> tuple[bool, str]:
    """Whether an overlap pick stands under `rule`, and why not where it does not."""
    baseline_us, gain = predicted_gain(s, hw, schedule)
    margin = rule.margin(baseline_us)
    if math.isfinite(gain) and math.log(gain) > margin:
        return True, ""
    regime = "below" if baseline_us < rule.split_us else "at or above"
    return False, (f"predicted gain {gain:.3f} of {schedule.name} within the simulator's published error "
                   f"(x{math.exp(margin):.3f}, serial baseline {baseline_us:.0f} us, {regime} {rule.split_us:g} us): "
                   "the baseline does no harm")
