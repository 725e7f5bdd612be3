"""The selector's calls on published GPU points: right, wrong or unverifiable.

The simulator's check (``ficco_select.data.published.compare``) asks whether the cost model's times match
real GPUs. This asks what a user of the runtime selector cares about: on the collective +
GEMM points others measured, would the schedule it picks have paid?

A *point* is one measured setting: the rows of a table (``overlap`` and ``baseline`` kinds,
``docs/published.md``) with the same source, device, op, m, n, k, dtype and world size. Its
*measured methods* are every overlapped method timed there, ours (PyTorch async-TP's fused
ops are ``shard.ring.dma``: ``ficco_select.data.published.METHOD_SCHEDULES``) and fused kernels alike,
each with its speedup over the serial baseline (baseline time / method time; the ``speedup``
cell where a row gives no method time). The selector decides the point's scenario on the
point's preset, once per point, and the call is:

- **right**: it picks an overlap schedule and some measured method pays
  (speedup >= ``PAYS``, 1.05), unless the pick's twin loses (below); or it picks the
  baseline (``none.*``) and every measured method loses (speedup < ``LOSES``, 1).
- **wrong**: it picks the baseline and some measured method pays (>= 1.05); or it picks an
  overlap schedule whose *twin*, the same schedule measured at the point, loses (< 1; with
  several twins, the best). The twin is the direct evidence, so it outweighs another
  method's win. A twin below ``FAR`` (0.9) also counts as "twin loses by more than 10%".
- **unverifiable**: anything else: a point with no measured method, the best measured
  speedup in [1, 1.05) (neither pays nor loses), an overlap pick whose twin wins by less
  than 5% while no method pays, and an overlap pick without a twin where no measured method
  pays. The last includes points where every measured method loses: a fused kernel's or
  another schedule's loss does not say that the picked schedule loses, so it is counted
  apart (``unverifiable_all_lose``) instead of as wrong.

A *switch pick* (``none.switch``, or a schedule on the ``switch`` engine: the collective
reduced or multicast in the NVSwitch) is judged by its twin alone: right where the twin pays
(>= 1.05), wrong where it loses (< 1), else unverifiable. Another method's win or loss says
nothing of the switch, and the library's serial baseline is not its twin: without a twin the
call is unverifiable. ``none.switch`` *is* the measured baseline where the point's baseline runs
its collective in the switch (``Point.baseline_schedule``: NCCL's LDMC all-reduce, say), and is
judged as the baseline there; at such a point the library's ``none.*`` is the switch pick's
counterpart: no measured twin, unverifiable.

Points on a device no preset describes are not decided: their rows are listed as not
compared, as ``compare`` lists them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from ficco_select.data.published import MAX_ROWS, Point, PublishedError, _number, read_published
from ficco_select.data.published_kinds import LIBRARY_BASELINE, is_switch

PAYS = 1.05
"""A measured speedup at or above this pays: overlap is worth running there."""
LOSES = 1.0
"""A measured speedup below this loses: the serial baseline is faster."""
FAR = 0.9
"""A twin below this loses by more than 10%: a costly wrong call."""
VERDICTS = ("right", "wrong", "unverifiable")


@dataclasses.dataclass(frozen=True)
class Measured:
    """One overlapped method timed at a point."""
    row: int
    method: str
    """The table's ``method`` cell."""
    schedule: str
    """The project's schedule the method is; "" for a fused kernel."""
    speedup: float

    @property
    def label(self) -> str:
        """The schedule's name, or a fused kernel's row: its method cell is a sentence."""
        return self.schedule or f"fused@row{self.row}"


def judge_calls(path: str | Path, selector=None, *, fallback: str | None = None) -> dict:
    """Each collective + GEMM point of the published table `path` decided by `selector`
    (default ``Selector.load()``: the exported model, or the heuristic alone), and its call
    judged against the measured methods (the module's docstring gives the rule). With
    `fallback` (``heuristic``, ``cost_model``, ...), what that fallback alone decides in the
    model's place, under the selector's GPU do-no-harm rule (``Selector.decide_as``).

    Returns ``file``, ``selector`` (``model`` where the selector holds a model, else
    ``heuristic``; ``<fallback> fallback`` with one), ``points`` (one per point: its rows, the pick, who decided it, the
    measured methods, the twin's speedup, the verdict and why), ``summary`` (the counts)
    and ``not_compared`` (rows on a device without a preset)."""
    if selector is None:
        from ficco_select.runtime.selector import Selector

        selector = Selector.load()
    points = [p for p in read_published(path) if p.kind in ("overlap", "baseline")]
    table = _cells(path)
    methods = _measured_methods(path, table, points)
    devices = {p.row: table[p.row - 1]["hardware"] for p in points}  # two devices without a preset: two points
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        key = (p.source, devices[p.row], p.hardware, p.op, p.m, p.n, p.k, p.dtype, p.world_size)
        groups.setdefault(key, []).append(p)

    calls, not_compared = [], []
    for group in groups.values():
        first = group[0]
        if not first.hardware:
            not_compared += [p.row for p in group]
            continue
        scenario = first.scenario(first.hardware)
        decision = selector.select(scenario) if fallback is None else selector.decide_as(scenario, fallback)
        measured = [methods[p.row] for p in group if p.row in methods]
        verdict, why, twin = judge(decision.schedule.name, decision.schedule.is_baseline, measured,
                                   measured_baseline=first.baseline_schedule)
        calls.append({
            "rows": [p.row for p in group], "url": first.source, "device": devices[first.row],
            "hardware": first.hardware, "op": first.op, "m": first.m, "n": first.n, "k": first.k,
            "dtype": first.dtype, "world_size": first.world_size,
            "pick": decision.schedule.name, "decided_by": decision.source, "reason": decision.reason,
            "measured": [dataclasses.asdict(m) | {"label": m.label, "speedup": round(m.speedup, 3)} for m in measured],
            "twin_speedup": None if twin is None else round(twin, 3),
            "verdict": verdict, "why": why, "twin_loses_over_10pct": twin is not None and twin < FAR,
            "every_method_loses": bool(measured) and max(m.speedup for m in measured) < LOSES})
    who = "heuristic" if getattr(selector, "model", None) is None else "model"
    return {"file": str(path), "selector": who if fallback is None else f"{fallback} fallback",
            "points": calls, "summary": _summary(calls), "not_compared": not_compared}


def judge(pick: str, baseline: bool, measured: list[Measured], *,
          measured_baseline: str = LIBRARY_BASELINE) -> tuple[str, str, float | None]:
    """The verdict on picking `pick` (`baseline`: a ``none.*`` schedule) where `measured`
    were timed over the serial `measured_baseline` (``none.sm``, or ``none.switch`` where the
    point's baseline reduces in the switch): (verdict, why, the twin's speedup or None)."""
    twins = [m.speedup for m in measured if m.schedule == pick]
    twin = max(twins) if twins else None
    if baseline and is_switch(pick) != is_switch(measured_baseline):
        return _by_twin(pick, twin, f"the baseline measured here is {measured_baseline}")
    if is_switch(pick) and not baseline:
        return _by_twin(pick, twin, "a switch schedule")
    if not measured:
        return "unverifiable", "no overlapped method was timed here", twin
    best = max(measured, key=lambda m: m.speedup)
    if baseline:
        if best.speedup >= PAYS:
            return "wrong", f"the baseline, where {best.label} pays {best.speedup:.3f}", twin
        if best.speedup < LOSES:
            return "right", f"the baseline, where every measured method loses (best {best.speedup:.3f})", twin
        return "unverifiable", f"the baseline; the best measured, {best.label} {best.speedup:.3f}, wins by < 5%", twin
    if twin is not None and twin < LOSES:
        return "wrong", f"its twin loses: {twin:.3f}", twin
    if best.speedup >= PAYS:
        return "right", f"overlap, where {best.label} pays {best.speedup:.3f}", twin
    if twin is not None:
        return "unverifiable", f"its twin wins by less than 5% ({twin:.3f}) and nothing pays", twin
    if best.speedup < LOSES:
        return "unverifiable", f"no measured twin; every measured method loses (best {best.speedup:.3f})", twin
    return "unverifiable", f"no measured twin; the best measured, {best.label} {best.speedup:.3f}, wins by < 5%", twin


def _by_twin(pick: str, twin: float | None, what: str) -> tuple[str, str, float | None]:
    """A pick judged by its twin alone: another method's time says nothing of it."""
    if twin is None:
        return "unverifiable", f"{pick}: no measured twin ({what})", None
    if twin >= PAYS:
        return "right", f"{pick}: its twin pays {twin:.3f}", twin
    if twin < LOSES:
        return "wrong", f"{pick}: its twin loses: {twin:.3f}", twin
    return "unverifiable", f"{pick}: its twin wins by less than 5% ({twin:.3f})", twin


def _summary(calls: list[dict]) -> dict:
    verdicts = [c["verdict"] for c in calls]
    decided_by: dict[str, int] = {}
    for c in calls:
        decided_by[c["decided_by"]] = decided_by.get(c["decided_by"], 0) + 1
    return {"points": len(calls), **{v: verdicts.count(v) for v in VERDICTS},
            "twin_loses_over_10pct": sum(c["twin_loses_over_10pct"] for c in calls),
            "unverifiable_all_lose": sum(c["verdict"] == "unverifiable" and c["every_method_loses"] for c in calls),
            "decided_by": decided_by}


def _cells(path: str | Path) -> list[dict[str, str]]:
    """The table's cells as text, rows in order: what a point does not keep (its device's
    own name, a fused kernel's time). ``read_published`` has checked the file already."""
    table = pd.read_csv(path, dtype=str, keep_default_na=False, nrows=MAX_ROWS + 1)
    return [{k: str(v).strip() for k, v in r.items()} for r in table.to_dict("records")]


def _measured_methods(path: str | Path, table: list[dict[str, str]], points: list[Point]) -> dict[int, Measured]:
    """The method timed on each collective + GEMM row, by row. ``read_published`` keeps an
    overlap row's method time only; a fused kernel's comes from its row's ``method_time_us``,
    else its ``speedup`` cell. A row with neither times its baseline alone."""
    out = {}
    for p in points:
        r = table[p.row - 1]
        if p.kind == "overlap":
            out[p.row] = Measured(p.row, r["method"], p.schedule, p.speedup)
            continue
        try:
            if r["method_time_us"]:
                speedup = p.baseline_us / _number(r, "method_time_us")
            elif r["speedup"]:
                speedup = _number(r, "speedup")
            else:
                continue
        except PublishedError as e:
            raise PublishedError(f"{path}: row {p.row}, {e}") from None
        out[p.row] = Measured(p.row, r["method"], "", speedup)
    return out
