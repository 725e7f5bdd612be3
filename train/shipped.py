"""The policy that ships: a learned selector inside the runtime ``Selector``, with the rules
that tell it when to abstain, fitted on validation folds of the training side.

- ``fit_abstention``: the margin threshold and fallback with the most expected speed on
  validation scenarios whose slowdowns stay within a tail guard: ``SLOWDOWN_CAP``, or the
  labels' own best's slowdown share where noise makes that higher (one rule, and one per
  kind of machine, and one per operator on a kind);
- ``fit_unseen_hardware``: how far outside the trained machines' specs the model may decide;
- ``ShippedPolicy``: the runtime selector around the model and those rules, scored in the
  tables as users get it; ``runtime_meta`` / ``training_ranges``: what ``selector.json`` holds.
"""

from __future__ import annotations

import functools
import json
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from ficco_select.data.dataset import user_specs
from ficco_select.data.machines import SAMPLED_MARK, base_machine
from ficco_select.features import FEATURE_NAMES, FEATURE_SCHEMA_HASH, FEATURE_SCHEMA_VERSION
from ficco_select.hardware import HardwareSpec, load_hardware
from ficco_select.runtime.decision import GATED, margin_rule, pick_with_margin
from ficco_select.runtime.loading import RULES_VERSION
from ficco_select.runtime.scope import (
    ANY_KIND,
    DEFAULT_MIN_MARGIN,
    FALLBACKS,
    SPEC_RANGE_FIELDS,
    spec_value,
)
from ficco_select.runtime.selector import Selector as RuntimeSelector
from ficco_select.runtime.trees import TreeEnsemble
from ficco_select.scenario import DTYPES
from ficco_select.schedule import BASELINE, TIE
from ficco_select.train.metrics import NEAR_OPT, true_times, usable_rows
from ficco_select.train.selectors import (
    AlwaysBaseline,
    BaseSelector,
    Heuristic,
    SimulatorSelector,
    XGBRanker,
    XGBTimeRegressor,
    clone,
    feature_pairs,
    legal_schedules,
    reference_picks,
    scenario_records,
)


def training_ranges(df: pd.DataFrame) -> dict:
    """Per scenario column, the range seen in training: the runtime abstains outside it."""
    ok = usable_rows(df)
    return {"m": [int(ok["m"].min()), int(ok["m"].max())], "n": [int(ok["n"].min()), int(ok["n"].max())],
            "k": [int(ok["k"].min()), int(ok["k"].max())],
            "world_size": [int(ok["world_size"].min()), int(ok["world_size"].max())],
            "hardware": sorted(ok["hardware"].unique()), "dtype": sorted(ok["dtype"].unique()),
            "op": sorted(ok["op"].unique())}


def dtype_ranges(df: pd.DataFrame) -> dict:
    """selector.json's ``unseen_dtype``: the bytes per element and, per kind of machine, the
    peaks (for each row's dtype, as the features read them) seen in training; the runtime lets
    the model decide a dtype it never saw inside them."""
    ok = usable_rows(df).drop_duplicates(["hardware", "dtype"])
    peaks: dict[str, list[float]] = {}
    for hardware, dtype in zip(ok["hardware"], ok["dtype"]):
        hw = load_hardware(hardware)
        peaks.setdefault(hw.kind, []).append(hw.peak_of(dtype))
    sizes = [DTYPES[d] for d in ok["dtype"]]
    return {"dtype_bytes": [min(sizes), max(sizes)],
            "peak_tflops": {kind: [min(values), max(values)] for kind, values in sorted(peaks.items())}}


def runtime_meta(name: str, df: pd.DataFrame) -> dict:
    """The fields of an export's ``selector.json`` that the runtime reads, for a model
    named `name` trained on `df` (``ficco_select.train.run`` adds provenance)."""
    return {"rules_version": RULES_VERSION, "selector": name, "feature_schema_version": FEATURE_SCHEMA_VERSION,
            "feature_schema_hash": FEATURE_SCHEMA_HASH, "feature_names": list(FEATURE_NAMES),
            "target": "log(time / baseline time)" if name == "xgb-regressor" else "rank score (higher is better)",
            "training_ranges": training_ranges(df), "unseen_dtype": dtype_ranges(df),
            "hardware_specs": user_specs(df), "gpu_no_harm": {**gpu_no_harm(), "measured": measured_gpus(df)}}


def measured_gpus(df: pd.DataFrame) -> list[str]:
    """The GPU machines with rows measured on their own ranks in `df` (the cuda backend's
    node mode, a process per GPU): there the GPU do-no-harm rule steps aside, since the model
    learned that machine's own truth. Loopback rows (every rank virtual on one GPU) time
    same-device copies, not the node's links: they do not count."""
    ok = usable_rows(df)
    if "backend" not in ok.columns or "hardware_fingerprint" not in ok.columns:
        return []
    node = (ok["backend"] == "cuda") & ~ok["hardware_fingerprint"].astype(str).str.endswith("-loopback")
    cuda = ok.loc[node, "hardware"].astype(str).unique()
    return sorted(h for h in cuda if load_hardware(h).kind == "gpu")


def rules_and_evidence(meta: dict) -> tuple[dict, dict]:
    """An export's ``selector.json`` (the rules the runtime reads) and ``evidence.json`` (what
    training found while fitting them, which the runtime never reads), from the full `meta`.

    Evidence: every ``validation*`` figure of the abstention and unseen-hardware rules (per
    kind and operator too), how far the unseen-hardware ranges were widened, and the specs of
    the sampled machines (``name~i``, ``data.machines``) that only training names."""
    def split(rules: dict, where: tuple[str, ...]) -> dict:
        kept = {}
        for key, value in rules.items():
            if key.startswith("validation") or key in ("by_reason_validation", "widened_by"):
                evidence.setdefault(".".join(where), {})[key] = value
            elif isinstance(value, dict) and key not in ("hardware_specs", "training_ranges"):
                kept[key] = split(value, (*where, key))
            else:
                kept[key] = value
        return kept

    evidence: dict = {}
    rules = split(meta, ())
    specs = rules.get("hardware_specs", {})
    sampled = {name: spec for name, spec in specs.items() if SAMPLED_MARK in name}
    if sampled:
        rules["hardware_specs"] = {name: spec for name, spec in specs.items() if name not in sampled}
        evidence["sampled_machines"] = sampled
    return rules, {"mlflow_run_id": meta.get("mlflow_run_id"), **evidence}


@functools.cache
def gpu_no_harm() -> dict:
    """selector.json's ``gpu_no_harm``: the GPU do-no-harm rule fitted on the committed
    calibration rows of the published record (``ficco_select.data.no_harm``); the same for every model."""
    from ficco_select.data.no_harm import fit_no_harm

    return fit_no_harm()


SLOWER_BY = TIE
"""A choice is a slowdown when its true time exceeds the baseline's by more than this."""
SLOWDOWN_CAP = 0.01
"""The fitted abstention rule allows slowdowns in at most this share of validation scenarios."""


def fit_abstention(make: Callable[[], BaseSelector], df: pd.DataFrame, folds: int = 2) -> dict:
    """The runtime's abstention rule for models built by ``make()`` (an XGBoost selector),
    fitted on validation folds of `df`, the training side (never a test fold).

    The data are split into `folds` by model family (the ``group`` column; by scenario when
    there are fewer families); a model fitted on the other folds decides each held-out
    scenario as the runtime would: its pick and the margin between its two best candidates
    (the runtime's ``min_margin`` unit, the model's own). The rule is the margin threshold
    and fallback (``heuristic``, untuned as it ships, ``baseline``, or a fixed rule: a schedule
    that at least half the scenarios have, run where legal, or gated: run where the model
    predicts it faster than the baseline) with the most expected
    speed (capture of the best's speed, on the truth) among those whose slowdowns (more than
    ``SLOWER_BY`` slower than the baseline, on the truth) stay within ``tail_guard``. The
    threshold is in each model's units, but what it guarantees is the same for every
    model. One rule over every validation scenario, one per kind of machine (gpu, cpu;
    ``by_kind``, with at least ``MIN_KIND_SCENARIOS`` of them), since a model can be sure
    on one kind and guess on the other, and one per operator on a kind (``by_op``, with at
    least ``MIN_OP_SCENARIOS``): on cpu, shard-level overlap is the best fixed rule for the
    all-gather and reduce-scatter ops and the worst for the all-reduce, whose baseline is
    gloo's own. Returns selector.json's ``abstention`` plus the
    validation figures.
    """
    ok = usable_rows(df)
    key = ok["group"] if ok["group"].nunique() >= folds else ok["scenario_id"]
    # Dealt round-robin in a fixed shuffled order, so that every fold gets some groups.
    order = sorted(set(key), key=lambda v: (zlib.crc32(str(v).encode()), str(v)))
    fold_of = key.map({v: i % folds for i, v in enumerate(order)})
    fixed = fixed_rule_schedules(ok)
    parts = [_beyond_ranges(_validation_outcomes(make().fit(ok[fold_of != f]), ok[fold_of == f], fixed), ok[fold_of != f])
             for f in range(folds) if (fold_of != f).any() and (fold_of == f).any()]
    if not parts:  # nothing to validate on: the runtime's own default
        return {"min_margin": DEFAULT_MIN_MARGIN, "fallback": "heuristic", "validation_scenarios": 0}
    v = pd.concat(parts, ignore_index=True)
    by_kind = {kind: _margin_rule(rows) for kind, rows in v.groupby("kind") if len(rows) >= MIN_KIND_SCENARIOS}
    by_op = {f"{kind}.{op}": _margin_rule(rows) for (kind, op), rows in v.groupby(["kind", "op"])
             if len(rows) >= MIN_OP_SCENARIOS}
    rule = {**_margin_rule(v), **({"by_kind": by_kind} if by_kind else {}), **({"by_op": by_op} if by_op else {})}
    slack = _range_slack(v, rule)
    reasons = _range_fallbacks(v, fixed)
    return {**rule, "range_slack": slack, **({"by_reason": reasons["by_reason"]} if reasons["by_reason"] else {}),
            "by_reason_validation": reasons["validation"]}


SLACK_COLUMNS = ("m", "n", "k")
"""Shape columns whose training ranges a validated ``range_slack`` may widen (world size
has a hold-out of its own and is never widened)."""
MIN_OUTSIDE_SCENARIOS = 20
"""Validation scenarios outside their fold's training ranges needed to judge the model there."""


def _beyond_ranges(v: pd.DataFrame, train: pd.DataFrame) -> pd.DataFrame:
    """`v` with ``beyond_<col>``: how far (a factor >= 1) each validation scenario's shape lies
    outside the ranges of the fold it was judged against (`train`)."""
    ok = usable_rows(train)
    out = v.copy()
    for col in SLACK_COLUMNS:
        lo, hi = float(ok[col].min()), float(ok[col].max())
        value = v[col].to_numpy(float)
        out[f"beyond_{col}"] = np.maximum(1.0, np.maximum(lo / value, value / hi))
    return out


def _range_slack(v: pd.DataFrame, abstention: dict) -> dict:
    """selector.json's ``abstention.range_slack``: per kind of machine, the factor by which the
    runtime may let the model decide shapes outside the training ranges ({column: factor}).

    The validation folds hold model families out, so some of their scenarios lie outside the
    ranges their model was trained on: where the model (under `abstention`) was there ahead
    of the heuristic (more scenarios within 2% of their best, slowdowns within
    ``tail_guard`` or the heuristic's own share), the ranges widen by as much as those
    scenarios lay outside them, no more; elsewhere they stay as trained. One factor for the
    three columns, the largest tested in any: the features see shapes as log2 values and as
    the analytic estimates built on them, so a factor outside is the same step whichever
    dimension takes it (and the held-out families rarely stretch every dimension at once)."""
    out = {}
    for kind, rows in v.groupby("kind"):
        beyond = rows[[f"beyond_{c}" for c in SLACK_COLUMNS]].to_numpy(float)
        outside = rows[(beyond > 1).any(axis=1)]
        if len(outside) < MIN_OUTSIDE_SCENARIOS:
            continue
        if _against_heuristic(outside, abstention)["ahead"]:
            out[kind] = dict.fromkeys(SLACK_COLUMNS, float(beyond.max()))
    return out


def _range_fallbacks(v: pd.DataFrame, fixed: Sequence[str]) -> dict:
    """``abstention.by_reason``'s ``shape_range``: per kind of machine, the fallback
    (``_best_fallback``) with the most expected speed on the validation scenarios that lay
    outside their fold's training ranges (m, n or k): they are the nearest evidence of what
    does well outside the ranges. A kind with fewer than
    ``MIN_OUTSIDE_SCENARIOS`` of them takes the choice made on every kind's (``any``); with
    fewer still, the heuristic. Returns {"by_reason": {reason: {kind: fallback}},
    "validation": {reason: {kind: figures}}}."""
    outside = (v[[f"beyond_{c}" for c in SLACK_COLUMNS]].to_numpy(float) > 1).any(axis=1)
    return _fallbacks_by_kind({"shape_range": v[outside]}, fixed)


def _fallbacks_by_kind(rows_of: dict[str, pd.DataFrame], fixed: Sequence[str]) -> dict:
    """For each reason's validation outcomes in `rows_of`: the best fallback per kind of machine
    with ``MIN_OUTSIDE_SCENARIOS`` or more, and (``any``) for the kinds with fewer, on their
    scenarios pooled where those reach ``MIN_OUTSIDE_SCENARIOS``. ``any`` serves only kinds
    without a choice of their own, so it is judged on theirs: one kind's evidence says
    little of another's (the cost model's pick is the truth's own on simulated GPU rows,
    not on measured cpu rows). A kind without either keeps the heuristic."""
    by_reason, validation = {}, {}
    for reason, rows in rows_of.items():
        groups = [(kind, r) for kind, r in rows.groupby("kind") if len(r) >= MIN_OUTSIDE_SCENARIOS]
        rest = rows[~rows["kind"].isin([kind for kind, _ in groups])]
        if len(rest) >= MIN_OUTSIDE_SCENARIOS:
            groups.append((ANY_KIND, rest))
        for kind, r in groups:
            best = _best_fallback(r, fixed)
            by_reason.setdefault(reason, {})[kind] = best["fallback"]
            validation.setdefault(reason, {})[kind] = best
    return {"by_reason": by_reason, "validation": validation}


def _best_fallback(v: pd.DataFrame, fixed: Sequence[str]) -> dict:
    """Among the heuristic, the baseline, the cost model's pick and the plain fixed rules
    (`fixed`), the fallback with the most expected speed (capture of the best's speed, on the
    truth) on validation outcomes `v` whose slowdowns stay within ``tail_guard(v)`` (the
    baseline always does); ties to more scenarios within 2% of their best, then in that
    order of candidates. With its figures and every candidate's.

    Outside the trained ranges the model extrapolates a distillation of the cost model, while
    the cost model reads the machine's spec as it is. On simulated rows its pick is the
    truth's own argmin, so there it wins by construction: what it is worth on real GPUs is
    judged on published points (``ficco sim validate --published``), under the GPU
    do-no-harm rule that the runtime applies to it as to every overlap pick. On measured
    rows it competes on their truth."""
    t_best, slow_at = v["t_best"].to_numpy(float), (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float)
    guard, best, candidates = tail_guard(v), None, {}
    for preference, fallback in enumerate([*FALLBACKS, *fixed]):
        t = _fallback_times(v, fallback)
        capture, near, slow = float(np.mean(t_best / t)), float(np.mean(t <= NEAR_OPT * t_best)), float(np.mean(t > slow_at))
        candidates[fallback] = {"capture": capture, "near_opt_2": near, "slowdowns": slow}
        if slow <= guard and (best is None or (capture, near, -preference) > best[0]):
            best = ((capture, near, -preference), fallback, near, slow)
    (capture, _, _), fallback, near, slow = best
    return {"fallback": fallback, "scenarios": len(v), "capture": capture, "near_opt_2": near, "slowdowns": slow,
            "tail_guard": guard, "candidates": candidates}


def with_machine_fallbacks(abstention: dict, unseen: dict) -> dict:
    """`abstention` (``fit_abstention``'s) with the ``unseen_machine`` fallbacks that ``fit_unseen_hardware`` chose on held-out machines in ``by_reason``."""
    chosen = unseen.get("by_reason", {})
    if not chosen:
        return abstention
    return {**abstention, "by_reason": {**abstention.get("by_reason", {}), **chosen}}


def _against_heuristic(v: pd.DataFrame, abstention: dict) -> dict:
    """The runtime policy (the model under `abstention`) against the heuristic on validation
    outcomes `v`: each one's share within 2% of the best and of slowdowns, and whether the
    policy is ahead: more near-best scenarios, slowdowns within ``tail_guard(v)`` (the
    labels' own best's share where noise makes that exceed the cap, as for every rule
    fitted here) or the heuristic's own share."""
    policy = _apply_rule(v, abstention)
    best, base = NEAR_OPT * v["t_best"].to_numpy(float), (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float)
    heuristic = v["t_heuristic"].to_numpy(float)
    near = {"model": float(np.mean(policy <= best)), "heuristic": float(np.mean(heuristic <= best))}
    slow = {"model": float(np.mean(policy > base)), "heuristic": float(np.mean(heuristic > base))}
    guard = tail_guard(v)
    ahead = near["model"] > near["heuristic"] and slow["model"] <= max(guard, slow["heuristic"])
    return {"scenarios": len(v), "near_opt_2": near, "slowdowns": slow, "tail_guard": guard, "ahead": ahead}


MIN_KIND_SCENARIOS = 50
"""Validation scenarios of one kind of machine needed to fit that kind its own rule."""
MIN_OP_SCENARIOS = 20
"""Validation scenarios of one operator on one kind of machine needed to fit it its own rule
(one scenario moves its shares by 5% at most). The rule picks among a handful of fallbacks
and a threshold, under the same tail guard, so it needs fewer than a kind's."""


def _margin_rule(v: pd.DataFrame) -> dict:
    """The threshold and fallback that ``fit_abstention`` picks on validation outcomes `v`:
    the most expected speed (``capture``: the mean of best time / time run, on the truth)
    among the rules whose slowdowns stay within ``tail_guard(v)``; ties go to more scenarios
    within 2% of their best, then to the lower threshold (the model decides more), then to
    the heuristic, the baseline, then fixed rules (each plain, then gated: of its schedule and
    the baseline, the one the model predicts faster). A fixed rule among the fallbacks,
    with a threshold of None among the thresholds, makes the rule never worse on validation
    than that fixed rule alone."""
    margin, t_model = v["margin"].to_numpy(float), v["t_model"].to_numpy(float)
    slow_at, t_best = (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float), v["t_best"].to_numpy(float)
    guard = tail_guard(v)
    thresholds = [0.0, *np.quantile(np.unique(margin), np.linspace(0, 1, 101)).tolist(), None]  # None: never trust
    # Every threshold at once: with the scenarios sorted by margin, a threshold trusts the
    # model on a suffix of them, the first `untrusted[i]` going to the fallback.
    order = np.argsort(margin, kind="stable")
    untrusted = np.array([len(v) if th is None else np.searchsorted(margin[order], th, side="left")
                          for th in thresholds])

    def share(model: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        """Per threshold: the mean over scenarios of `model` where trusted, `fallback` elsewhere."""
        suffix = np.concatenate([[0.0], np.cumsum(model[order][::-1])])[::-1]
        prefix = np.concatenate([[0.0], np.cumsum(fallback[order])])
        return (suffix[untrusted] + prefix[untrusted]) / len(v)

    def figures(t: np.ndarray) -> tuple[np.ndarray, ...]:  # slowdown, near-best, speed (best / time)
        return (t > slow_at).astype(float), (t <= NEAR_OPT * t_best).astype(float), t_best / t

    of_model = figures(t_model)
    # Not the cost model: inside the ranges the model is its distillation, and on simulated
    # truth its pick is the truth's own argmin, so "never trust the model" would always win.
    fallbacks = ["heuristic", "baseline", *(c.removeprefix(FIXED_PREFIX) for c in v.columns if c.startswith(FIXED_PREFIX))]
    best = None
    for preference, fallback in enumerate(fallbacks):
        slow, near, capture = (share(m, f) for m, f in zip(of_model, figures(_fallback_times(v, fallback))))
        for i, threshold in enumerate(thresholds):
            if slow[i] <= guard:
                rank = (capture[i], near[i], -(np.inf if threshold is None else threshold), -preference)
                if best is None or rank > best[0]:
                    best = (rank, threshold, fallback, float(capture[i]), float(near[i]), float(slow[i]),
                            1 - untrusted[i] / len(v))
    _, threshold, fallback, capture, near, slow, trusted = best
    return {"min_margin": threshold, "fallback": fallback, "validation_scenarios": len(v),
            "validation_capture": capture, "validation_near_opt_2": near, "validation_slowdowns": slow,
            "validation_tail_guard": guard, "validation_model_share": float(trusted)}


def _fallback_times(v: pd.DataFrame, fallback: str) -> np.ndarray:
    """The true time of `fallback` (heuristic, baseline or a fixed rule's schedule) on each
    validation scenario of `v`."""
    column = f"t_{fallback}" if fallback in FALLBACKS else f"{FIXED_PREFIX}{fallback}"
    return v[column].to_numpy(float)


def tail_guard(v: pd.DataFrame) -> float:
    """The share of validation scenarios `v` a fitted rule may slow down: ``SLOWDOWN_CAP``, or
    the labels' own best's share (``t_oracle`` slower than the baseline on the truth) where
    that is higher. On measured rows judged on a second sweep, a perfect learner of the
    first sweep's labels slows some scenarios down by noise alone: a cap below that would
    forbid the model any decision, however good."""
    if "t_oracle" not in v.columns:
        return SLOWDOWN_CAP
    oracle_slow = float(np.mean(v["t_oracle"].to_numpy(float) > (1 + SLOWER_BY) * v["t_baseline"].to_numpy(float)))
    return max(SLOWDOWN_CAP, oracle_slow)


def _under_rule(margin: np.ndarray, t_model: np.ndarray, t_fallback: np.ndarray,
                threshold: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Per validation scenario: whether the runtime trusts the model under a margin rule
    (None: never), and the true time of what it then runs (the model's pick, else the fallback's)."""
    trust = margin >= threshold if threshold is not None else np.zeros(len(margin), bool)
    return trust, np.where(trust, t_model, t_fallback)


def _apply_rule(v: pd.DataFrame, abstention: dict) -> np.ndarray:
    """The true time of what the runtime runs on each validation scenario under `abstention`
    (its rule for the scenario's operator on its kind of machine, else for its kind, else the
    pooled one: the runtime selector's order)."""
    out = np.empty(len(v))
    for kind, op in set(zip(v["kind"], v["op"])):
        rule = margin_rule(abstention, kind, op)
        at = ((v["kind"] == kind) & (v["op"] == op)).to_numpy()
        rows = v[at]
        out[at] = _under_rule(rows["margin"].to_numpy(float), rows["t_model"].to_numpy(float),
                              _fallback_times(rows, rule["fallback"]), rule["min_margin"])[1]
    return out


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


def _validation_outcomes(model: BaseSelector, val: pd.DataFrame, fixed: Sequence[str] = ()) -> pd.DataFrame:
    """Per scenario of `val`: the model's pick's true time and margin, and the true times of
    the runtime's heuristic, the cost model's pick, the baseline, the best, the labels' own best (``t_oracle``) and
    each `fixed` rule (``FIXED_PREFIX`` + name: that schedule where the scenario has it, else
    the baseline)."""
    ok, X = feature_pairs(val)
    raw = model.model_.predict(X)
    lower_is_better = -raw if isinstance(model, XGBRanker) else raw
    truth = true_times(ok).to_numpy(float)
    sid, names = ok["scenario_id"].to_numpy(object), ok["schedule"].to_numpy(str)
    at, margin = pick_with_margin(lower_is_better, names, sid)
    first = pd.DataFrame({"t": truth[at], "margin": margin}, index=pd.Index(sid[at], name="sid")).sort_index()
    ids = first.index.tolist()  # plain strings: iterating an Arrow-backed index is slow
    table = _CandidateTable(ids, sid, names, truth, lower_is_better)
    t_best = pd.Series(truth).groupby(sid).min()
    # The labels' own best, timed on the truth: on measured rows with a second sweep, the
    # repeat oracle, whose slowdowns are what noise alone costs a perfect learner.
    labelled, _ = pick_with_margin(np.log(ok["time_s"].to_numpy(float)), names, sid)
    t_oracle = pd.Series(truth[labelled], index=sid[labelled])
    # The runtime's fallbacks, as it runs them: the heuristic untuned, the cost model on each
    # machine's spec as given (picked once per scenario where the frame carries them).
    heuristic = reference_picks(val, "heuristic") or Heuristic(tune=False).predict(val)
    cost_model = reference_picks(val, "cost_model") or SimulatorSelector().predict(val)
    baseline_of = AlwaysBaseline().predict(val)
    baseline = table.column([baseline_of[s] for s in ids])
    kind_of = {h: load_hardware(h).kind for h in set(ok["hardware"].unique())}
    columns = ok.groupby("scenario_id", sort=False)[["hardware", "op", *SLACK_COLUMNS]].first().reindex(first.index)
    return pd.DataFrame({
        "kind": columns["hardware"].map(kind_of).to_numpy(),
        "op": columns["op"].to_numpy(),
        **{c: columns[c].to_numpy(float) for c in SLACK_COLUMNS},
        "margin": first["margin"].to_numpy(float),
        "t_model": first["t"].to_numpy(float),
        "t_heuristic": table.time(table.column([heuristic[s] for s in ids])),
        "t_cost_model": table.time(table.column([cost_model[s] for s in ids])),
        "t_baseline": table.time(baseline),
        "t_best": t_best.reindex(first.index).to_numpy(float),
        "t_oracle": t_oracle.reindex(first.index).to_numpy(float),
        # Each fixed rule: its schedule where the scenario has it, else the baseline; and
        # gated, the one of the two the model predicts faster.
        **{f"{FIXED_PREFIX}{rule}": table.time(table.fixed_rule(rule, baseline))
           for rule in (*fixed, *(f"{GATED}{name}" for name in fixed))},
    })


class _CandidateTable:
    """Every candidate's true time and model score as a (scenario x schedule) table, for the
    validation's fallbacks: a whole column of scenarios per rule, as ``fixed_rule_pick``
    decides each one."""

    def __init__(self, ids: list[str], sid: np.ndarray, names: np.ndarray, truth: np.ndarray,
                 scores: np.ndarray) -> None:
        self.schedules = pd.Index(sorted(set(names)))
        row, col = pd.Index(ids).get_indexer(sid), self.schedules.get_indexer(names)
        shape = (len(ids), len(self.schedules))
        self.has = np.zeros(shape, bool)
        self.t, self.score = np.full(shape, np.nan), np.full(shape, np.nan)
        self.has[row, col], self.t[row, col], self.score[row, col] = True, truth, scores
        self.ids, self.rows = ids, np.arange(len(ids))

    def column(self, picks: list[str]) -> np.ndarray:
        """Each scenario's pick (in `ids` order) as a column of the table; KeyError where a pick
        is not one of its scenario's candidates."""
        col = self.schedules.get_indexer(picks)
        if (col < 0).any() or not self.has[self.rows, col].all():
            bad = int(np.flatnonzero((col < 0) | ~self.has[self.rows, np.maximum(col, 0)])[0])
            raise KeyError(f"{picks[bad]!r} is not a candidate of scenario {self.ids[bad]} of the validation side")
        return col

    def time(self, col: np.ndarray) -> np.ndarray:
        return self.t[self.rows, col]

    def fixed_rule(self, fallback: str, baseline: np.ndarray) -> np.ndarray:
        """``fixed_rule_pick`` for every scenario at once: the rule's schedule where the scenario
        has it (gated: and the model scores it below the baseline), else the baseline."""
        name = fallback.removeprefix(GATED)
        if name not in self.schedules:
            return baseline
        j = self.schedules.get_loc(name)
        runs = self.has[:, j]
        if name != fallback:  # ties go to the baseline
            runs = runs & (self.score[:, j] < self.score[self.rows, baseline])
        return np.where(runs, j, baseline)


FIXED_PREFIX = "t_fixed:"
"""Validation outcome columns holding a fixed rule's true time (``FIXED_PREFIX`` + schedule name)."""
MIN_FIXED_SHARE = 0.5
"""A schedule is tried as a fixed-rule fallback if at least this share of validation scenarios has it."""


def fixed_rule_schedules(ok: pd.DataFrame) -> list[str]:
    """The schedules (not baselines) that at least ``MIN_FIXED_SHARE`` of `ok`'s scenarios have:
    the fixed rules a fitted abstention rule may fall back to."""
    share = ok.groupby("schedule")["scenario_id"].nunique() / ok["scenario_id"].nunique()
    return sorted(name for name, v in share.items() if v >= MIN_FIXED_SHARE and not name.startswith("none."))


class ShippedPolicy(BaseSelector):
    """What a framework hook runs: the runtime ``ficco_select.runtime.selector.Selector`` around a
    learned model fitted on the training side, with its abstention rules fitted on
    validation folds of that side (``fit_abstention``, ``fit_unseen_hardware``), as
    ``ficco export`` ships it. The tables score the decisions users get beside the bare
    argmin of each model. ``decisions_``: the runtime's decision (with its source: model,
    heuristic, fallback) for each scenario of the last ``predict``.

    `inner`: the learned selector (unfitted; default ``XGBTimeRegressor()``). Passed the same
    instance as a bare row of the same evaluation, its fit on the same training frame is
    reused rather than repeated (``evaluate`` fits selectors in list order).
    """

    name = "shipped"
    decides_unseen_machines = True

    def __init__(self, inner: BaseSelector | None = None) -> None:
        self.inner = inner

    def _fresh(self) -> BaseSelector:
        return clone(self.inner or XGBTimeRegressor())

    def fit(self, df, *, unseen_machines: Iterable[str] = ()):
        """Fit the model and its rules on `df`. `unseen_machines`: machines it will be asked
        to decide that `df` lacks (an evaluation's hold-out side); only then is the rule for
        machines the model never saw fitted (``fit_unseen_hardware``: a model per half of each
        kind's machines, so it is not paid where every machine was trained on). Without it, a
        machine not in `df` is the runtime's ``unseen_machine`` abstention, to the heuristic;
        decisions on trained machines do not depend on it."""
        self.abstention_ = fit_abstention(self._fresh, df)
        inner = self.inner if self.inner is not None else self._fresh()
        if getattr(inner, "fitted_on_", lambda: None)() is not df:
            inner.fit(df)
        self.model_ = TreeEnsemble.from_json(json.loads(inner.model_.get_booster().save_raw("json")),
                                             expected_features=len(FEATURE_NAMES))
        self.meta_ = {**runtime_meta(inner.name, df), "abstention": self.abstention_}
        self.unseen_hardware_ = None
        if unseen := set(unseen_machines) - set(usable_rows(df)["hardware"]):
            self.unseen_hardware_ = fit_unseen_hardware(self._fresh, df, self.abstention_,
                                                        kinds={load_hardware(h).kind for h in unseen})
            self.meta_ = {**self.meta_, "unseen_hardware": self.unseen_hardware_,
                          "abstention": with_machine_fallbacks(self.abstention_, self.unseen_hardware_)}
        self._runtimes()
        self.fitted_on_ = weakref.ref(df)  # lets UnguardedShipped reuse this fit
        return self

    def _runtimes(self) -> None:
        """The runtime selector on ``meta_``, and the same without the GPU do-no-harm rule."""
        self.runtime_ = RuntimeSelector(self.model_, self.meta_, layer_tables=False)
        self.unguarded_ = RuntimeSelector(self.model_, {k: v for k, v in self.meta_.items() if k != "gpu_no_harm"},
                                          layer_tables=False)

    def predict(self, df, *, guarded: bool = True):
        """The runtime's decisions; `guarded` False: without the GPU do-no-harm rule (the
        ``shipped-unguarded`` row), leaving ``decisions_`` (the last guarded prediction's, for
        the abstention table) to the policy as it ships. Changes nothing the decisions read."""
        ok = usable_rows(df)
        legal = legal_schedules(ok)
        runtime = self.runtime_ if guarded else self.unguarded_
        out, decisions = {}, {}
        for rec in scenario_records(ok):
            sid = rec.pop("scenario_id")
            decision = decisions[sid] = runtime.select(rec)
            out[sid] = decision.schedule.name if decision.schedule.name in legal[sid] else BASELINE.name
        if guarded:
            self.decisions_ = decisions
        return out


class UnguardedShipped(BaseSelector):
    """The shipped policy without its GPU do-no-harm rule (``gpu_no_harm``): what it would run
    if the simulator's gains were taken as they come. A row of the tables, never exported:
    beside ``shipped`` it shows what the rule costs on simulated truth. `shipped`: the
    ``ShippedPolicy`` of the same evaluation, fitted first (its fit is reused); None: its own."""

    name = "shipped-unguarded"
    decides_unseen_machines = True

    def __init__(self, shipped: ShippedPolicy | None = None) -> None:
        self.shipped = shipped

    def fit(self, df, *, unseen_machines: Iterable[str] = ()):
        if self.shipped is None:
            self.shipped = ShippedPolicy()
        if getattr(self.shipped, "fitted_on_", lambda: None)() is not df:
            self.shipped.fit(df, unseen_machines=unseen_machines)
        return self

    def predict(self, df):
        return self.shipped.predict(df, guarded=False)
