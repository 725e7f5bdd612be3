"""The shipped policy's rule for machines its model never saw (selector.json's
``unseen_hardware``): fitted on halves of each kind's machines held out in turn, it lets the
model decide an unseen machine only where validation found it ahead of the heuristic, and only
inside the trained machines' spec ranges widened by as much as the validation tested.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import pandas as pd

from ficco_select.data.machines import base_machine
from ficco_select.hardware import HardwareSpec, load_hardware
from ficco_select.runtime.decision import GATED
from ficco_select.runtime.scope import FALLBACKS, SPEC_RANGE_FIELDS, spec_value
from ficco_select.train.abstention_fit import _against_heuristic, _fallbacks_by_kind
from ficco_select.train.metrics import usable_rows
from ficco_select.train.selectors import BaseSelector
from ficco_select.train.validation_outcomes import _validation_outcomes, fixed_rule_schedules


def fit_unseen_hardware(make: Callable[[], BaseSelector], df: pd.DataFrame, abstention: dict,
                        kinds: Iterable[str] | None = None) -> dict:
    """The runtime's rule for machines the model never saw (selector.json's ``unseen_hardware``),
    fitted on `df`, the training side.

    Per kind of machine (gpu, cpu) with two or more machines: its machines are split in two
    halves; a model fitted on everything but one half decides that half's scenarios as the
    runtime would, with the `abstention` rule (``fit_abstention``). The model decides
    unseen machines of that kind only if there it is ahead of the heuristic: more scenarios
    within 2% of their best, and slowdowns within ``tail_guard`` or the heuristic's own
    share; and only those inside the spec ranges (and topologies) of the trained machines
    of that kind (``ficco_select.runtime.selector.SPEC_RANGE_FIELDS``), each range widened by the
    factor by which the validation's held-out machines lay outside their training half's
    (``widened_by``): the extrapolation the validation tested, no more. Machines of a
    topology not trained on are let in (``any_topology``) only if a held-out machine's
    topology was new to its training half.

    `kinds`: the kinds of machine to fit the rule for (default: every kind `df` has). A
    kind's rule and fallback are read only for machines of that kind, so an evaluation
    fits the kinds of its hold-out side's machines alone.
    """
    ok = usable_rows(df)
    specs = {h: load_hardware(h) for h in sorted(ok["hardware"].unique(), key=lambda h: zlib.crc32(h.encode()))}
    rule: dict = {"decide": "heuristic", "kinds": {}, "validation": {}}
    fixed = fixed_rule_schedules(ok)
    held_out = []  # every kind's validation outcomes on held-out machines
    present = {hw.kind for hw in specs.values()}
    for kind in sorted(present if kinds is None else present & set(kinds)):
        mine = [h for h, hw in specs.items() if hw.kind == kind]
        # Halves of machines with the machines sampled around them (``ficco_select.data.machines``),
        # so that a held-out machine is not in training under another name.
        bases = sorted({base_machine(h) for h in mine}, key=lambda h: zlib.crc32(h.encode()))
        if len(bases) < 2:
            rule["validation"][kind] = "fewer than two machines to hold out"
            continue
        halves = [[h for h in mine if base_machine(h) in bases[i::2]] for i in (0, 1)]
        v = pd.concat([_validation_outcomes(make().fit(ok[~ok["hardware"].isin(half)]), ok[ok["hardware"].isin(half)],
                                            sorted({*fixed, *_fixed_fallbacks(abstention)})) for half in halves],
                      ignore_index=True)
        held_out.append(v)
        rule["validation"][kind] = _against_heuristic(v, abstention)
        if rule["validation"][kind]["ahead"]:
            trained = [specs[h] for h in mine]
            fields = [*SPEC_RANGE_FIELDS, *(f"peak_tflops.{d}" for d in sorted(set.intersection(
                *(set(hw.peak_tflops) for hw in trained))))]
            # The validation had models decide machines outside their own training half's
            # ranges: the ranges are widened by as much (a factor per field) as it tested.
            split = [([specs[h] for h in mine if h not in half], [specs[h] for h in half]) for half in halves]
            tested = {f: max(_beyond(fit_on, held, f) for fit_on, held in split) for f in fields}
            ranges = {}
            for f in fields:
                lo, hi = min(spec_value(hw, f) for hw in trained), max(spec_value(hw, f) for hw in trained)
                ranges[f] = [lo / tested[f], hi * tested[f]] if lo > 0 else [lo, hi]
            # Likewise a topology: any, if a held-out machine's was new to its training half.
            new_topology = any({hw.topology for hw in held} - {hw.topology for hw in fit_on} for fit_on, held in split)
            rule["kinds"][kind] = {"topologies": sorted({hw.topology for hw in trained}), "spec_ranges": ranges,
                                   "widened_by": tested, "any_topology": new_topology}
    if rule["kinds"]:
        rule["decide"] = "model"
    else:
        del rule["kinds"]
    if held_out:
        # Where the model may not decide a machine it never saw (outside the trained machines'
        # ranges, or no rule lets it), the fallback that did best on the held-out machines.
        v = pd.concat(held_out, ignore_index=True)
        reasons = _fallbacks_by_kind({"unseen_machine": v}, fixed)
        rule["by_reason"], rule["by_reason_validation"] = reasons["by_reason"], reasons["validation"]
    return rule


def _fixed_fallbacks(abstention: dict) -> list[str]:
    """The schedules of the fixed-rule fallbacks (plain or gated) that `abstention` uses."""
    rules = [abstention, *abstention.get("by_kind", {}).values(), *abstention.get("by_op", {}).values()]
    return sorted({r["fallback"].removeprefix(GATED) for r in rules if r["fallback"] not in FALLBACKS})


def _beyond(trained: list[HardwareSpec], held: list[HardwareSpec], field: str) -> float:
    """How far (a factor >= 1) the held-out machines' `field` lies outside the trained ones' range."""
    values = [spec_value(hw, field) for hw in trained]
    lo, hi = min(values), max(values)
    if lo <= 0:
        return 1.0
    return max([1.0, *(max(lo / v, v / hi) for hw in held if (v := spec_value(hw, field)) and v > 0)])
