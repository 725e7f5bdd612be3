"""The rules of an exported selector (``selector.json``), parsed and checked once at load
(``Scope.from_meta``): where its model may decide, and what decides where it may not.

Every field, with its meaning and unit, is in docs/runtime.md ("selector.json, field by
field"); each attribute of ``Scope`` below says what it holds once parsed. Anything malformed
raises ValueError naming the field (``Selector.load`` turns it into a heuristic-only selector
and one warning). The file's version and feature schema are checked before
(``runtime/loading.py``). Training writes the file as ``Scope.to_meta`` gives it, from the
rules parsed here, so an export holds only what this module reads (``RULE_FIELDS``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ficco_select.hardware import HardwareSpec, fields_of, load_hardware, shipped_names, spec_as_dict, spec_from_dict
from ficco_select.runtime.decision import GATED
from ficco_select.runtime.loading import RULES_VERSION
from ficco_select.runtime.no_harm import NoHarmRule
from ficco_select.scenario import OPS
from ficco_select.schedule import parse

SELECTORS = ("xgb-regressor", "xgb-ranker")
"""Learned selectors an export may hold: a regressor predicts time (lower is better), a
ranker a score (higher is better)."""
RANGE_COLUMNS = ("m", "n", "k", "world_size")
"""training_ranges columns given as [low, high]."""
SEEN_COLUMNS = ("hardware", "dtype", "op")
"""training_ranges columns given as the list of values seen."""
DEFAULT_MIN_MARGIN = 0.01
"""The margin below which a model without a fitted ``abstention`` rule abstains."""
COST_MODEL = "cost_model"
"""The fallback that runs the cost model's pick (``no_harm.cost_model_pick``): the calibrated
simulator on the machine's spec, which the model learned from; on a GPU the do-no-harm rule
then judges it like any other overlap pick."""
FALLBACKS = ("heuristic", "baseline", COST_MODEL)
"""Where a fitted abstention rule may send a decision it does not trust, besides a fixed rule (a
schedule name: that schedule where it is legal, else the baseline) or a gated one (``GATED``
+ a schedule name: of that schedule and the baseline, the one the model predicts faster)."""
SPEC_RANGE_FIELDS = ("compute_units", "copy_engines", *fields_of("rate", "latency", "ceiling"))
"""Spec fields (with ``peak_tflops.<dtype>``) whose trained ranges bound the machines an
``unseen_hardware`` rule lets the model decide: every rate, latency and ceiling the cost
estimates read, and the counts the features read."""
MACHINE_KINDS = ("gpu", "cpu")
"""``unseen_hardware`` ranges are per kind of machine (``HardwareSpec.kind``)."""
ANY_KIND = "any"
"""``abstention.by_reason``'s entry for every kind of machine without one of its own."""
REASON_FALLBACKS = ("shape_range", "unseen_machine")
"""The abstention reasons ``abstention.by_reason`` gives fallbacks for (a low margin has the
margin rules; the other reasons go to the heuristic)."""
RULE_FIELDS = (
    "rules_version", "feature_schema_hash",  # checked by ``loading.read_export``
    "selector", "mlflow_run_id", "training_ranges.*", "hardware_specs.*",
    "unseen_dtype.dtype_bytes", "unseen_dtype.peak_tflops.*",
    "unseen_hardware.decide", "unseen_hardware.kinds.*.topologies", "unseen_hardware.kinds.*.any_topology",
    "unseen_hardware.kinds.*.spec_ranges.*",
    "abstention.min_margin", "abstention.fallback",
    "abstention.by_kind.*.min_margin", "abstention.by_kind.*.fallback",
    "abstention.by_op.*.min_margin", "abstention.by_op.*.fallback",
    "abstention.range_slack.*.*", "abstention.by_reason.*.*",
    "gpu_no_harm.split_us", "gpu_no_harm.small_margin", "gpu_no_harm.large_margin", "gpu_no_harm.measured",
    "gpu_no_harm.unfitted_margin",
)
"""Every field of ``selector.json`` the runtime reads, as dotted paths (``*``: any key; a
list, and a machine of ``hardware_specs``, is one field). ``to_meta`` writes these and no
other (tests/test_rules.py holds that the parser reads each)."""


@dataclasses.dataclass(frozen=True)
class Scope:
    """What ``selector.json`` says about the model, checked once (``from_meta``)."""

    name: str | None = None
    """``selector``: the learned selector the model is (one of ``SELECTORS``); None: no export
    (the heuristic alone)."""
    run_id: str | None = None
    """``mlflow_run_id``: the training run that fitted the model and these rules, if given:
    what names the export (``ficco select``, the bring-up's export step)."""
    seen: tuple[tuple[str, frozenset], ...] = ()
    """(column, values seen in training) for the SEEN_COLUMNS the file gives."""
    ranges: tuple[tuple[str, float, float], ...] = ()
    """(column, low, high) for the RANGE_COLUMNS the file gives."""
    specs: Mapping[str, HardwareSpec] = dataclasses.field(default_factory=dict)
    """``hardware_specs``: the training data's non-preset machines, by name."""
    margin_rules: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"min_margin": DEFAULT_MIN_MARGIN, "fallback": "heuristic"})
    """``abstention``'s margin rules as selector.json writes them, checked (without
    ``abstention``: ``DEFAULT_MIN_MARGIN`` and the heuristic): ``min_margin`` (None: never)
    and ``fallback``, pooled; ``by_kind``, the same per kind of machine (``HardwareSpec.kind``:
    a model's margins mean more on one kind than on another); ``by_op``, per ``<kind>.<op>``
    (a fallback that suits most of a kind's scenarios can be the worst for one operator);
    either absent when the file has none. Read by ``decision.margin_rule``."""
    unseen: Mapping[str, tuple[frozenset, tuple[tuple[str, float, float], ...]]] = \
        dataclasses.field(default_factory=dict)
    """``unseen_hardware`` when its rule lets the model decide machines it never saw: per
    kind of machine (``HardwareSpec.kind``), (topologies seen, or None for any (``any_topology``:
    the file need not list them then), (spec field, low, high) ranges of the trained machines)."""
    fallback_by_reason: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    """``abstention.by_reason``: {(reason, kind or ``ANY_KIND``): fallback}: what runs where
    the model abstains for that reason, as validation at training found best."""
    range_slack: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    """``abstention.range_slack``: per kind of machine, {column: factor >= 1} by which the
    training range of m, n or k widens (validated on held-out model families at training)."""
    unseen_dtype: tuple[tuple[float, float], Mapping[str, tuple[float, float]]] | None = None
    """``unseen_dtype``: ((low, high) bytes per element, {kind: (low, high) peak TFLOP/s}) seen
    in training, if the export has them."""
    gpu_no_harm: NoHarmRule | None = None
    """``gpu_no_harm``: the GPU side of abstention (``runtime/no_harm.py``), if the export has it."""

    @property
    def ranker(self) -> bool:
        """Higher scores are better (``xgb-ranker``)."""
        return self.name == "xgb-ranker"

    @classmethod
    def from_meta(cls, meta: Any, where: str = "selector.json") -> "Scope":
        """ValueError naming `where` and the field for anything malformed."""
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(meta).__name__}")
        name = meta.get("selector")
        if name not in SELECTORS:
            raise ValueError(f"{where}: field 'selector' is {name!r}; expected one of {', '.join(SELECTORS)}")
        ranges = meta.get("training_ranges")
        if not isinstance(ranges, dict):
            raise ValueError(f"{where}: field 'training_ranges' must be an object "
                             f"(column -> range or values), got {type(ranges).__name__}")
        unknown = [col for col in ranges if col not in RANGE_COLUMNS + SEEN_COLUMNS]
        if unknown:
            raise ValueError(f"{where}: field 'training_ranges.{unknown[0]}' is not a scenario column this "
                             f"runtime checks ({', '.join(RANGE_COLUMNS + SEEN_COLUMNS)})")
        bounds = []
        for col in RANGE_COLUMNS:
            if col in ranges:
                pair = ranges[col]
                if not _is_range(pair):
                    raise ValueError(f"{where}: field 'training_ranges.{col}' must be [low, high], two finite "
                                     f"numbers with low <= high, got {pair!r}")
                bounds.append((col, pair[0], pair[1]))
        seen = []
        for col in SEEN_COLUMNS:
            if col in ranges:
                values = ranges[col]
                if not (isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values)):
                    raise ValueError(f"{where}: field 'training_ranges.{col}' must be a non-empty list of "
                                     f"strings, got {values!r}")
                seen.append((col, frozenset(values)))
        specs = meta.get("hardware_specs", {})
        if not isinstance(specs, dict):
            raise ValueError(f"{where}: field 'hardware_specs' must be an object (name -> spec), "
                             f"got {type(specs).__name__}")
        checked, presets = {}, shipped_names()
        for key, fields in specs.items():
            spec = spec_from_dict(fields, f"{where}, hardware_specs[{key!r}]")
            if spec.name != key:
                raise ValueError(f"{where}, hardware_specs[{key!r}]: field 'name' is {spec.name!r}, not the key")
            # A preset means one machine everywhere (as ``register_hardware`` holds): other
            # numbers under its name would decide, say, cpu scenarios as a GPU's, copy engines and all.
            if key in presets and load_hardware(key) != spec:
                raise ValueError(f"{where}, hardware_specs[{key!r}]: name {key!r} is a preset's, with other numbers; "
                                 "an export carries only machines of their own names")
            checked[key] = spec
        rule = meta.get("abstention")
        margin_rules, slack, by_reason = {"min_margin": DEFAULT_MIN_MARGIN, "fallback": "heuristic"}, {}, {}
        if rule is not None:
            margin_rules = _margin_rule(rule, f"{where}: field 'abstention")
            kinds = rule.get("by_kind", {})
            if not isinstance(kinds, dict) or not set(kinds) <= set(MACHINE_KINDS):
                raise ValueError(f"{where}: field 'abstention.by_kind' must be an object keyed by "
                                 f"{' or '.join(MACHINE_KINDS)}, got {kinds!r}")
            if kinds:  # absent when empty, so that an export without them parses to the same rules
                margin_rules["by_kind"] = {kind: _margin_rule(r, f"{where}: field 'abstention.by_kind.{kind}")
                                           for kind, r in kinds.items()}
            ops = rule.get("by_op", {})
            allowed = {f"{kind}.{op}" for kind in MACHINE_KINDS for op in OPS}
            if not isinstance(ops, dict) or not set(ops) <= allowed:
                bad = sorted(set(ops) - allowed) if isinstance(ops, dict) else ops
                raise ValueError(f"{where}: field 'abstention.by_op' must be an object keyed by "
                                 f"'<kind>.<op>' ({' or '.join(MACHINE_KINDS)}, then one of {', '.join(OPS)}), "
                                 f"got {bad!r}")
            if ops:
                margin_rules["by_op"] = {key: _margin_rule(r, f"{where}: field 'abstention.by_op.{key}")
                                         for key, r in ops.items()}
            slack = _range_slack(rule.get("range_slack", {}), f"{where}: field 'abstention.range_slack")
            by_reason = _by_reason(rule.get("by_reason", {}), f"{where}: field 'abstention.by_reason")
        run_id = meta.get("mlflow_run_id")
        if run_id is not None and not (isinstance(run_id, str) and run_id):
            raise ValueError(f"{where}: field 'mlflow_run_id' must be a non-empty string, got {run_id!r}")
        return cls(name=name, run_id=run_id, seen=tuple(seen), ranges=tuple(bounds), specs=checked,
                   margin_rules=margin_rules, range_slack=slack,
                   fallback_by_reason=by_reason,
                   unseen=_unseen_rule(meta.get("unseen_hardware"), where),
                   gpu_no_harm=(NoHarmRule.from_meta(meta["gpu_no_harm"], where)
                                if meta.get("gpu_no_harm") is not None else None),
                   unseen_dtype=_dtype_ranges(meta.get("unseen_dtype"), where))


    def to_meta(self) -> dict[str, Any]:
        """``selector.json`` holding exactly these rules (``Scope.from_meta`` of it gives them
        back), each field left out where absent means the same: the file an export ships.
        ValueError for the heuristic alone (no ``name``): it has no file."""
        if self.name is None:
            raise ValueError("selector.json: the rules of no model (field 'selector' unset) are no export's")
        from ficco_select.features import feature_schema_hash  # the one hash loading accepts

        doc: dict[str, Any] = {"rules_version": RULES_VERSION, "feature_schema_hash": feature_schema_hash(),
                               "selector": self.name}
        if self.run_id is not None:
            doc["mlflow_run_id"] = self.run_id
        doc["training_ranges"] = {**{col: [lo, hi] for col, lo, hi in self.ranges},
                                  **{col: sorted(values) for col, values in self.seen}}
        if self.specs:
            doc["hardware_specs"] = {name: spec_as_dict(spec) for name, spec in sorted(self.specs.items())}
        if self.unseen_dtype is not None:
            (low, high), peaks = self.unseen_dtype
            doc["unseen_dtype"] = {"dtype_bytes": [low, high],
                                   "peak_tflops": {kind: [lo, hi] for kind, (lo, hi) in peaks.items()}}
        if self.unseen:
            doc["unseen_hardware"] = {"decide": "model", "kinds": {
                kind: {**({"any_topology": True} if topologies is None else {"topologies": sorted(topologies)}),
                       "spec_ranges": {field: [lo, hi] for field, lo, hi in bounds}}
                for kind, (topologies, bounds) in self.unseen.items()}}
        if abstention := self._abstention():
            doc["abstention"] = abstention
        if (rule := self.gpu_no_harm) is not None:
            doc["gpu_no_harm"] = {"split_us": rule.split_us, "small_margin": rule.small_margin,
                                  "large_margin": rule.large_margin,
                                  **({"unfitted_margin": rule.unfitted_margin} if rule.unfitted_margin else {}),
                                  **({"measured": sorted(rule.measured)} if rule.measured else {})}
        return doc

    def _abstention(self) -> dict[str, Any]:
        """``abstention`` as ``to_meta`` writes it; {} where the defaults hold."""
        doc = {key: self.margin_rules[key] for key in ("min_margin", "fallback")}
        for key in ("by_kind", "by_op"):
            if self.margin_rules.get(key):
                doc[key] = {at: {"min_margin": r["min_margin"], "fallback": r["fallback"]}
                            for at, r in self.margin_rules[key].items()}
        if self.range_slack:
            doc["range_slack"] = {kind: dict(factors) for kind, factors in self.range_slack.items()}
        if self.fallback_by_reason:
            by_reason: dict[str, dict[str, str]] = {}
            for (reason, kind), fallback in self.fallback_by_reason.items():
                by_reason.setdefault(reason, {})[kind] = fallback
            doc["by_reason"] = by_reason
        default = {"min_margin": DEFAULT_MIN_MARGIN, "fallback": "heuristic"}
        return {} if doc == default else doc


def _range_slack(slack: Any, at: str) -> dict:
    """{kind: {column: factor >= 1}}; ValueError naming the field (`at` + "...")."""
    if not isinstance(slack, dict) or not set(slack) <= set(MACHINE_KINDS):
        raise ValueError(f"{at}' must be an object keyed by {' or '.join(MACHINE_KINDS)}, got {slack!r}")
    out = {}
    for kind, factors in slack.items():
        if not isinstance(factors, dict) or not set(factors) <= set(RANGE_COLUMNS):
            raise ValueError(f"{at}.{kind}' must map columns of {', '.join(RANGE_COLUMNS)} to factors, got {factors!r}")
        for col, factor in factors.items():
            if not (_is_number(factor) and factor >= 1):
                raise ValueError(f"{at}.{kind}.{col}' must be a finite number >= 1, got {factor!r}")
        out[kind] = {col: float(f) for col, f in factors.items()}
    return out


def _by_reason(rule: Any, at: str) -> dict:
    """{(reason, kind): fallback}; ValueError naming the field (`at` + "...")."""
    if not isinstance(rule, dict) or not set(rule) <= set(REASON_FALLBACKS):
        bad = sorted(set(rule) - set(REASON_FALLBACKS)) if isinstance(rule, dict) else rule
        raise ValueError(f"{at}' must be an object keyed by {', '.join(REASON_FALLBACKS)}, got {bad!r}")
    out = {}
    for reason, kinds in rule.items():
        if not isinstance(kinds, dict) or not set(kinds) <= {*MACHINE_KINDS, ANY_KIND}:
            raise ValueError(f"{at}.{reason}' must be an object keyed by {', '.join((*MACHINE_KINDS, ANY_KIND))}, "
                             f"got {kinds!r}")
        for kind, fallback in kinds.items():
            if fallback not in FALLBACKS:
                try:  # a fixed rule; not gated: the model's scores are what the abstention distrusts
                    parse(fallback if isinstance(fallback, str) else "")
                except ValueError:
                    raise ValueError(f"{at}.{reason}.{kind}' must be one of {', '.join(FALLBACKS)} or a schedule "
                                     f"name, got {fallback!r}") from None
            out[(reason, kind)] = fallback
    return out


def _dtype_ranges(rule: Any, where: str) -> tuple | None:
    """``unseen_dtype``: ((low, high) bytes, {kind: (low, high) peak}); None without it."""
    if rule is None:
        return None
    at = f"{where}: field 'unseen_dtype"
    if not isinstance(rule, dict) or not isinstance(rule.get("peak_tflops"), dict) \
            or not set(rule["peak_tflops"]) <= set(MACHINE_KINDS):
        raise ValueError(f"{at}' must be an object with 'dtype_bytes' [low, high] and 'peak_tflops' "
                         f"{{{' or '.join(MACHINE_KINDS)}: [low, high]}}, got {rule!r}")
    if not _is_range(rule.get("dtype_bytes")):
        raise ValueError(f"{at}.dtype_bytes' must be [low, high], two finite numbers with low <= high, "
                         f"got {rule.get('dtype_bytes')!r}")
    for kind, pair in rule["peak_tflops"].items():
        if not _is_range(pair):
            raise ValueError(f"{at}.peak_tflops.{kind}' must be [low, high], two finite numbers with low <= high, "
                             f"got {pair!r}")
    low, high = rule["dtype_bytes"]
    return (float(low), float(high)), {kind: (float(lo), float(hi)) for kind, (lo, hi) in rule["peak_tflops"].items()}


def _margin_rule(rule: Any, at: str) -> dict[str, Any]:
    """{"min_margin", "fallback"} of an abstention rule, checked; ValueError naming the field
    (`at` + "...")."""
    if not isinstance(rule, dict):
        raise ValueError(f"{at}' must be an object (min_margin, fallback), got {type(rule).__name__}")
    threshold, fallback = rule.get("min_margin"), rule.get("fallback")
    if threshold is not None and not (_is_number(threshold) and threshold >= 0):
        raise ValueError(f"{at}.min_margin' must be a finite number >= 0 or null, got {threshold!r}")
    if fallback not in FALLBACKS:
        try:
            parse(fallback.removeprefix(GATED) if isinstance(fallback, str) else "")
        except ValueError:
            raise ValueError(f"{at}.fallback' must be one of {', '.join(FALLBACKS)} or a schedule name "
                             f"(gated: or not), got {fallback!r}") from None
    return {"min_margin": threshold, "fallback": fallback}


def _unseen_rule(rule: Any, where: str) -> dict:
    """``unseen_hardware``: {"decide": "model" | "heuristic", "kinds": {kind: {"topologies":
    [...], "spec_ranges": {field: [low, high]}}}, ...evidence}; {} unless the model decides."""
    if rule is None:
        return {}
    if not isinstance(rule, dict) or rule.get("decide") not in ("model", "heuristic"):
        raise ValueError(f"{where}: field 'unseen_hardware' must be an object whose 'decide' is model or "
                         f"heuristic, got {rule!r}")
    if rule["decide"] == "heuristic":
        return {}
    kinds = rule.get("kinds")
    if not isinstance(kinds, dict) or not kinds or not set(kinds) <= set(MACHINE_KINDS):
        raise ValueError(f"{where}: field 'unseen_hardware.kinds' must be a non-empty object keyed by "
                         f"{' or '.join(MACHINE_KINDS)} (-> topologies and spec_ranges), got {kinds!r}")
    out = {}
    for kind, block in kinds.items():
        at = f"{where}: field 'unseen_hardware.kinds.{kind}"
        if not isinstance(block, dict):
            raise ValueError(f"{at}' must be an object, got {type(block).__name__}")
        any_topology = block.get("any_topology", False)
        if not isinstance(any_topology, bool):
            raise ValueError(f"{at}.any_topology' must be true or false, got {any_topology!r}")
        topologies, ranges = block.get("topologies"), block.get("spec_ranges")
        # With any topology let in, the trained ones are not needed (``to_meta`` leaves them out).
        if (topologies is not None or not any_topology) and not (
                isinstance(topologies, list) and topologies and all(isinstance(t, str) for t in topologies)):
            raise ValueError(f"{at}.topologies' must be a non-empty list of strings (unless any_topology), "
                             f"got {topologies!r}")
        if not isinstance(ranges, dict):
            raise ValueError(f"{at}.spec_ranges' must be an object (field -> [low, high]), got {ranges!r}")
        bounds = []
        for field, pair in ranges.items():
            if not (field in SPEC_RANGE_FIELDS or field.startswith("peak_tflops.")):
                raise ValueError(f"{at}.spec_ranges.{field}' is not a spec field this runtime checks "
                                 f"({', '.join(SPEC_RANGE_FIELDS)}, peak_tflops.<dtype>)")
            if not _is_range(pair):
                raise ValueError(f"{at}.spec_ranges.{field}' must be [low, high], two finite numbers with "
                                 f"low <= high, got {pair!r}")
            bounds.append((field, float(pair[0]), float(pair[1])))
        out[kind] = (None if any_topology else frozenset(topologies), tuple(bounds))
    return out


def spec_value(hw: HardwareSpec, field: str) -> float | None:
    """A SPEC_RANGE_FIELDS value of `hw`, or ``peak_tflops.<dtype>`` (None if the spec has no such dtype)."""
    if field.startswith("peak_tflops."):
        return hw.peak_tflops.get(field.split(".", 1)[1])
    return float(getattr(hw, field))


def _is_range(pair: Any) -> bool:
    """[low, high]: two finite numbers with low <= high."""
    return (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_is_number(v) for v in pair)
            and pair[0] <= pair[1])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
