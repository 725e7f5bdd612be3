"""When the model does not decide: the checks of a scenario against what an export's model was
trained on (``Scope``), each ending in one of ``decision.ABSTENTION_REASONS``, and the
fallback the export fitted for that reason.

The order of the checks is the order users look for: the machine (not seen in training, or
seen with other numbers), the dtype, the operator, then the shape ranges (widened by the
validated slack). A machine or a dtype the model never saw is still the model's to decide
where the export's ``unseen_hardware`` / ``unseen_dtype`` rules say its features lie inside
what training covered; the decision's reason then says so (``unseen_note``).
"""

from __future__ import annotations

from ficco_select.hardware import HardwareSpec
from ficco_select.runtime.scope import ANY_KIND, Scope, spec_value
from ficco_select.scenario import DTYPES, Scenario

_NO_SLACK: dict = {}


def abstention_reason(scope: Scope, s: Scenario, hw: HardwareSpec) -> tuple[str, str]:
    """Why a model of `scope` should not decide `s` on `hw`: the reason's key
    (``ABSTENTION_REASONS``) and its text; ("", "") where the model decides."""
    for col, seen in scope.seen:  # hardware first: its message is the one users look for
        if getattr(s, col) not in seen:
            if col == "hardware":
                why = unseen_hardware_problem(scope, hw, s.dtype) if scope.unseen else ""
                if scope.unseen and not why:
                    continue  # the model decides it (its decision says so)
                # Outside the ranges of the trained machines of its kind, or no validated
                # rule (or no trained machine of its kind) lets the model decide it.
                return "unseen_machine", f"hardware {s.hardware} not seen in training" + (f" ({why})" if why else "")
            if col == "dtype":
                why = unseen_dtype_problem(scope, s.dtype, hw)
                if not why:
                    continue  # the model decides it (its decision says so)
                return "other", f"dtype {s.dtype} not seen in training ({why})"
            return "other", f"{col} {getattr(s, col)} not seen in training"
    trained = scope.specs.get(s.hardware)
    if trained is not None and trained != hw:
        return "unseen_machine", f"hardware {s.hardware}: the spec given differs from the one seen in training"
    slack = scope.range_slack.get(hw.kind, _NO_SLACK) if scope.range_slack else _NO_SLACK
    for col, lo, hi in scope.ranges:
        value = getattr(s, col)
        if not lo <= value <= hi:
            factor = slack.get(col, 1.0)
            if not lo / factor <= value <= hi * factor:
                widened = f", widened x{factor:.3g} by validation" if factor > 1 else ""
                return "shape_range", f"{col}={value} outside the training range [{lo}, {hi}]{widened}"
    return "", ""


def reason_fallback(scope: Scope, key: str, kind: str) -> str:
    """The fallback for abstention reason `key` on a `kind` of machine: the one the export's
    validation found best (``abstention.by_reason``: its kind's, else ``any``), else the heuristic."""
    by_reason = scope.fallback_by_reason
    return by_reason.get((key, kind), by_reason.get((key, ANY_KIND), "heuristic"))


def unseen_hardware_problem(scope: Scope, hw: HardwareSpec, dtype: str) -> str:
    """Why the model may not decide a machine it never saw, or "" if the export's
    ``unseen_hardware`` rule lets it (validated on held-out machines at training) and the
    machine lies inside the trained machines' spec ranges (of the peaks, only the scenario's
    dtype's: the one its features use)."""
    rule = scope.unseen.get(hw.kind)
    if rule is None:
        return f"no trained {hw.kind} machine"
    topologies, ranges = rule
    if topologies is not None and hw.topology not in topologies:
        return f"topology {hw.topology} not seen in training"
    for field, lo, hi in ranges:
        if field.startswith("peak_tflops."):
            if field != f"peak_tflops.{dtype}":
                continue
            value = hw.peak_of(dtype)  # as the features read it
        else:
            value = spec_value(hw, field)
        if value is not None and not lo <= value <= hi:
            return f"{field}={value:g} outside the trained machines' range [{lo:g}, {hi:g}]"
    return ""


def unseen_dtype_problem(scope: Scope, dtype: str, hw: HardwareSpec) -> str:
    """Why the model may not decide a dtype it never saw, or "" when the dtype's features
    (bytes per element, the machine's peak for it) lie inside the ranges training saw."""
    rule = scope.unseen_dtype
    if rule is None:
        return "the export records no dtype ranges"
    (lo, hi), peaks = rule
    size = DTYPES[dtype]
    if not lo <= size <= hi:
        return f"{size} bytes per element, outside the trained [{lo:g}, {hi:g}]"
    kind = hw.kind
    if kind not in peaks:
        return f"no trained {kind} machine"
    peak, (lo, hi) = hw.peak_of(dtype), peaks[kind]
    if not lo <= peak <= hi:
        return f"peak {peak:g} TFLOP/s on {hw.name}, outside the trained {kind} machines' [{lo:g}, {hi:g}]"
    return ""


def unseen_note(scope: Scope, s: Scenario) -> str:
    """What a model decision lies outside of: a machine or a dtype not seen in training."""
    seen = dict(scope.seen)
    notes = []
    if "hardware" in seen and s.hardware not in seen["hardware"]:
        notes.append(f"hardware {s.hardware} not seen in training: inside the trained machines' spec ranges, "
                     "where held-out machines showed the model ahead of the heuristic")
    if "dtype" in seen and s.dtype not in seen["dtype"]:
        notes.append(f"dtype {s.dtype} not seen in training: its bytes per element and peak lie inside "
                     "the trained ranges")
    return "; ".join(notes)
