"""Layer tables: a selector's decisions for one layer over the token count ``m``.

In serving (continuous batching, decode) and in training with variable sequence lengths,
``m`` changes from call to call while the rest of the scenario stays: the layer (op, n, k,
dtype, world size, hardware, imbalance). Each new ``m`` would be a cache miss, a walk of
every tree for every candidate. Instead, the first time a layer is seen its decisions are
computed on a grid of ``m`` in one batch (the grid's feature rows, built for all m at once by
``features.grid_features``, and one tree walk); from then on any ``m`` of the layer is
two indexings (``LayerTable.decide``: an index over every m up to the table's end).

- The grid: ``GRID_STEPS_PER_OCTAVE`` points per doubling of ``m``, rounded up to valid
  values (multiples of P for ``ag_gemm``, ``gemm_rs`` and ``gemm_ar``), from the smallest valid ``m`` to
  the largest inside the model's trained range (``DEFAULT_M_RANGE`` without a model).
- Where two neighbouring grid points disagree, the interval is bisected (all such intervals
  in one batch per step) down to adjacent valid ``m``, so the breakpoint is exact; where
  they agree, the decision is taken to hold in between (a flip and back inside one interval
  is missed: measured).
- Between the points decided, an ``m`` gets the decision of the point below it. Its schedule
  is legal at ``m`` too: legality asks only for enough rows per shard, and ``m`` has more.
  Where the GPU do-no-harm rule applies (``runtime/no_harm.py``), an overlap pick is judged
  again at the ``m`` asked (``no_harm.TableGuard``), once per ``m``: the rule's verdict moves
  with ``m`` between points that agree, and a table never ships an overlap the direct path's
  rule refuses.
- At grid points a table's decision is the selector's direct one (tested); between them it
  is measured against the direct decision (``benchmarks/selector_speed.py``).
- Outside the grid, or for an ``m`` that is not valid for the layer, ``decide`` answers None
  and the caller decides that call directly (``Selector.select``).

The selector builds a table (``Selector.layer_table``: it resolves the machine, the m range
the model may decide, and decides the points); ``build_table`` here lays the grid and
bisects, knowing nothing of the selector. Precompiled tables: ``ficco export --layers FILE``
(``ficco_select.train.export.write_tables``) writes the tables of a scenario table's layers into the
export folder (``layers.json``, generated, deterministic, with the digest
of the model and selector.json they came from); ``Selector.load`` reads them, so known
layers never walk trees. A file whose digest is not the folder's is ignored with a warning,
and so is one that holds anything the direct path could not give (``read_tables``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from ficco_select.runtime.decision import Decision
from ficco_select.runtime.no_harm import TableGuard
from ficco_select.runtime.trees import read_json
from ficco_select.scenario import LAYER_COLUMNS, MAX_EXTENT, Scenario
from ficco_select.schedule import legal_candidates, parse

GRID_STEPS_PER_OCTAVE = 16
"""Grid points per doubling of m (neighbours about 4.4% apart). With the bisection of
disagreeing neighbours, 2000 random m (multiples of 8 up to 4096, 8 layers of llama3-70b and
mixtral on mi300x-8, the pipeline's 100-tree champion) got the direct decision every time at
16, 98.1% at 4 and 97.8% at 2; the table's first build took about the same time at 8 and 16."""
DEFAULT_M_RANGE = (1, 1 << 20)
"""The m range of a table without a model's trained range (a heuristic-only selector)."""
DENSE_M_LIMIT = 1 << 17
"""Up to this m a table answers from an index over every m (2 bytes each); beyond, by bisection."""
TABLES_FILE = "layers.json"
"""Precompiled tables in an export folder (``ficco export --layers``)."""


class _Judged:
    """A guarded interval's place in a table's choices: its pick, judged by the guard at each
    m asked (``LayerTable.decide``); the m refused, with the baseline's decision there."""

    __slots__ = ("point", "refused")

    def __init__(self, point: int):
        self.point = point  # the grid point below the interval
        self.refused: dict[int, Decision] = {}

    def __getstate__(self):
        return self.point, self.refused

    def __setstate__(self, state):
        self.point, self.refused = state


@dataclasses.dataclass(frozen=True, slots=True)
class LayerTable:
    """One layer's decisions at the grid points of ``m`` (ascending); ``step``: valid ``m``
    are its multiples; ``guard``: the GPU do-no-harm rule over the m between the points, where
    it applies."""

    layer: tuple
    grid: tuple[int, ...]
    decisions: tuple[Decision, ...]
    step: int
    guard: TableGuard | None = dataclasses.field(default=None, compare=False)
    # The lookup's own layout, so that `decide` is two indexings: for every m up to the grid's
    # end (at most DENSE_M_LIMIT), the position in _choices of its answer: 0 (None) for an m
    # the layer cannot have or below the grid, else 1 + the index of the grid point at or
    # below m; for an m inside a guarded interval (an overlap pick between two points, under
    # a guard) the interval's _Judged, until the guard lets the pick stand there.
    # 2 bytes per m: 128 KiB for a table up to m = 65536. Larger m are bisected.
    _index: array = dataclasses.field(init=False, repr=False, compare=False)
    _choices: tuple[Decision | _Judged | None, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.grid)
        guarded = np.array([self.guard is not None and not d.schedule.is_baseline for d in self.decisions])
        if 1 + n + int(guarded.sum()) >= 1 << 16:
            raise ValueError(f"a layer table holds at most {(1 << 15) - 1} points, got {n}")
        judged = {i: _Judged(i) for i in np.flatnonzero(guarded).tolist()}
        slot = np.zeros(n, np.int64)  # each guarded point's _Judged, after the decisions
        slot[list(judged)] = 1 + n + np.arange(len(judged))
        grid = np.asarray(self.grid)
        ms = np.arange(min(self.grid[-1], DENSE_M_LIMIT) + 1)
        at = np.searchsorted(grid, ms, side="right")  # 1 + the grid point at or below m
        between = (at > 0) & (grid[np.maximum(at - 1, 0)] != ms) & guarded[np.maximum(at - 1, 0)]
        at = np.where(between, slot[np.maximum(at - 1, 0)], at)
        at[(ms % self.step != 0) | (ms < self.grid[0])] = 0
        object.__setattr__(self, "_index", array("H", at.astype(np.uint16).tobytes()))
        object.__setattr__(self, "_choices", (None, *self.decisions, *judged.values()))

    def decide(self, m: int) -> Decision | None:
        """The decision for token count `m`, or None outside the table, for an m the layer
        cannot have, or for anything but an int (the caller then decides directly). Never raises."""
        try:
            if m >= 0:  # a negative index would count from the end
                choice = self._choices[self._index[m]]
                return self._judge(m, choice) if type(choice) is _Judged else choice
            return None
        except IndexError:  # beyond the dense index
            if type(m) is not int or m % self.step or m > self.grid[-1]:
                return None
            at = bisect_right(self.grid, m) - 1
            decision = self.decisions[at]
            if self.guard is None or decision.schedule.is_baseline or self.grid[at] == m:
                return decision
            return self.guard.at(m, decision)
        except Exception:  # noqa: BLE001 - a float, a string, None: not a row count
            return None

    def _judge(self, m: int, judged: _Judged) -> Decision:
        """The pick of `judged`'s interval at `m`, under the guard; remembered, so that the guard
        judges each m once: a pick that stands is looked up directly from then on."""
        refused = judged.refused.get(m)
        if refused is not None:
            return refused
        pick = self.decisions[judged.point]
        decision = self.guard.at(m, pick)
        if decision is pick:
            self._index[m] = 1 + judged.point
        else:
            judged.refused[m] = decision
        return decision


def m_grid(lo: int, hi: int, step: int) -> tuple[int, ...]:
    """Valid m (multiples of `step`) in [lo, hi], GRID_STEPS_PER_OCTAVE per doubling, the
    smallest and the largest included."""
    first, last = step * math.ceil(max(lo, 1) / step), step * (hi // step)
    if first > last:
        return ()
    octaves = math.log2(last / first)
    points = {first, last}
    for i in range(1, int(octaves * GRID_STEPS_PER_OCTAVE) + 1):
        points.add(min(last, step * math.ceil(first * 2 ** (i / GRID_STEPS_PER_OCTAVE) / step)))
    return tuple(sorted(points))


def layer_step(op: str, world_size: int) -> int:
    """The step of a layer's valid m: P where the op shards m over the ranks, else 1."""
    return world_size if op in ("ag_gemm", "gemm_rs", "gemm_ar") else 1


def build_table(scenario: Scenario, lo: int, hi: int, decide: Callable[[Sequence[int]], list[Decision]],
                also: Iterable[int] = (), guard: TableGuard | None = None) -> LayerTable | None:
    """`scenario`'s layer decided on its grid of m in [`lo`, `hi`] (and at the valid m of
    `also` inside it); `decide(ms)` gives the decisions at the token counts `ms`, in one
    batch (``Selector.layer_table`` passes its own), under the GPU do-no-harm rule; `guard`:
    that rule, to judge each overlap pick again at the m between the points. None where the
    range holds no valid m.

    Where neighbours on the grid disagree, every open interval is bisected at once, down to
    adjacent valid m: the breakpoint is then exact. Neighbours that agree are taken to agree
    in between."""
    step = layer_step(scenario.op, scenario.world_size)
    grid = m_grid(int(lo), min(int(hi), MAX_EXTENT), step)  # no scenario takes a larger m
    if not grid:
        return None
    grid = tuple(sorted({*grid, *(m for m in also if m % step == 0 and grid[0] <= m <= grid[-1])}))
    decided = dict(zip(grid, decide(grid)))
    same = lambda a, b: (decided[a].schedule, decided[a].source) == (decided[b].schedule, decided[b].source)  # noqa: E731
    open_ = [(a, b) for a, b in zip(grid, grid[1:]) if b - a > step and not same(a, b)]
    while open_:
        mids = [step * ((a + b) // (2 * step)) for a, b in open_]
        decided.update(zip(mids, decide(mids)))
        open_ = [(lo, hi) for (a, b), mid in zip(open_, mids) for lo, hi in ((a, mid), (mid, b))
                 if hi - lo > step and not same(lo, hi)]
    points = tuple(sorted(decided))
    return LayerTable(scenario.layer, points, tuple(decided[m] for m in points), step, guard)


# -- precompiled tables ------------------------------------------------------------------
def export_digest(folder: str | Path) -> str:
    """The digest of an export's model.json and selector.json: what its tables were built from."""
    h = hashlib.sha256()
    for name in ("model.json", "selector.json"):
        h.update(Path(folder, name).read_bytes())
    return h.hexdigest()[:16]


SOURCES = ("model", "heuristic", "cost_model", "fallback")
"""Who may have made a table's decision (``Decision.source``)."""


def read_tables(folder: str | Path, backend_of: Callable[[str], str | None] = lambda hardware: None,
                guard_of: Callable[[Scenario], TableGuard | None] = lambda layer: None) -> dict[tuple, LayerTable]:
    """The precompiled tables of an export folder ({} without ``layers.json``); ValueError
    naming the file, the layer and the field for anything the direct path could not have
    given: a malformed field, a table built from another model (a matching digest says which
    model the file came from, not that its contents were left as written), a grid step other
    than the layer's, a layer given twice, a decision illegal for its layer at its m (on the
    backend ``backend_of(hardware)`` gives; a layer whose machine is unknown there is refused
    too), or an overlap pick that the GPU do-no-harm rule refuses at its m (``guard_of(layer)``:
    the rule over the layer's table, None where it does not apply; the same guard then judges
    the m between the points)."""
    path = Path(folder, TABLES_FILE)
    if not path.exists():
        return {}
    doc = read_json(path, "layer tables")
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("model_digest") != export_digest(folder):
        raise ValueError(f"{path}: field 'model_digest' is {doc.get('model_digest')!r}, not this export's "
                         f"{export_digest(folder)}: built from another model; re-run ficco export --layers")
    entries = doc.get("layers", [])
    if not isinstance(entries, list):
        raise ValueError(f"{path}: field 'layers' must be a list, got {type(entries).__name__}")
    tables, first_at = {}, {}
    for i, entry in enumerate(entries):
        at = f"{path}: layers[{i}]"
        layer, grid, decisions, step = _read_entry(entry, at)
        if layer.layer in first_at:
            raise ValueError(f"{at}: the layer of layers[{first_at[layer.layer]}] again (a layer has one table)")
        first_at[layer.layer] = i
        _check_legal(layer, grid, decisions, backend_of(layer.hardware), at)
        guard = guard_of(layer)
        if guard is not None and (refusals := guard.refusals(grid, decisions)):
            m, why = refusals[0]
            raise ValueError(f"{at}: m={m}: the GPU do-no-harm rule refuses this pick ({why})")
        try:
            tables[layer.layer] = LayerTable(layer.layer, grid, decisions, step, guard)
        except ValueError as e:
            raise ValueError(f"{at}: field 'grid': {e}") from None
    return tables


def _read_entry(entry, at: str) -> tuple[Scenario, tuple[int, ...], tuple[Decision, ...], int]:
    """One ``layers`` entry, every field checked: (the layer at its first grid point, the grid,
    its decisions, the step); ValueError naming `at` and the field."""
    if not isinstance(entry, dict):
        raise ValueError(f"{at}: expected an object, got {type(entry).__name__}")
    missing = [f for f in (*LAYER_COLUMNS, "step", "grid", "decisions") if f not in entry]
    if missing:
        raise ValueError(f"{at}: field '{missing[0]}' is missing")
    grid = entry["grid"]
    if not isinstance(grid, list) or not grid:
        raise ValueError(f"{at}: field 'grid' must be a non-empty list of token counts, got {grid!r:.60}")
    for j, m in enumerate(grid):
        if type(m) is not int or not 1 <= m <= MAX_EXTENT:
            raise ValueError(f"{at}: field 'grid[{j}]' must be an integer in [1, {MAX_EXTENT}], got {m!r}")
        if j and m <= grid[j - 1]:
            raise ValueError(f"{at}: field 'grid[{j}]' is {m}, not above grid[{j - 1}] = {grid[j - 1]} (ascending)")
    try:
        layer = Scenario(group="layers.json", m=grid[0], **{c: entry[c] for c in LAYER_COLUMNS})
    except Exception as e:  # noqa: BLE001 - a layer no scenario can have
        raise ValueError(f"{at}: not a valid layer at m={grid[0]} ({e})") from None
    step = entry["step"]
    if type(step) is not int or step != layer_step(layer.op, layer.world_size):
        raise ValueError(f"{at}: field 'step' is {step!r}; a {layer.op} layer on {layer.world_size} ranks takes "
                         f"m in multiples of {layer_step(layer.op, layer.world_size)}")
    off = next((j for j, m in enumerate(grid) if m % step), None)
    if off is not None:
        raise ValueError(f"{at}: field 'grid[{off}]' is {grid[off]}, not a multiple of the step {step}")
    rows = entry["decisions"]
    if not isinstance(rows, list) or len(rows) != len(grid):
        raise ValueError(f"{at}: field 'decisions' must be a list of one decision per grid point "
                         f"({len(grid)}), got {len(rows) if isinstance(rows, list) else type(rows).__name__}")
    decisions = tuple(_read_decision(row, f"{at}: field 'decisions[{j}]") for j, row in enumerate(rows))
    return layer, tuple(grid), decisions, step


def _read_decision(row, at: str) -> Decision:
    """[schedule name, source, confidence, reason]; ValueError naming `at` (the field, opened)."""
    if not isinstance(row, list) or len(row) != 4:
        raise ValueError(f"{at}' must be [schedule, source, confidence, reason], got {row!r:.80}")
    name, source, confidence, reason = row
    try:
        schedule = parse(name if isinstance(name, str) else "")
    except ValueError:
        raise ValueError(f"{at}[0]' is {name!r:.60}, not a schedule name") from None
    if source not in SOURCES:
        raise ValueError(f"{at}[1]' is {source!r:.60}; a table's source is one of {', '.join(SOURCES)}")
    if type(confidence) not in (int, float) or not 0 <= confidence <= 1:  # NaN fails the comparison too
        raise ValueError(f"{at}[2]' (confidence) must be a number in [0, 1], got {confidence!r}")
    if not isinstance(reason, str):
        raise ValueError(f"{at}[3]' (reason) must be a string, got {reason!r:.60}")
    return Decision(schedule, source, float(confidence), reason)


def _check_legal(layer: Scenario, grid: tuple[int, ...], decisions: tuple[Decision, ...], backend: str | None,
                 at: str) -> None:
    """ValueError naming `at` and the point whose decision the layer cannot run."""
    if backend is None:
        raise ValueError(f"{at}: hardware {layer.hardware!r} is not a machine this export knows (a shipped "
                         "machine or one of its hardware_specs)")
    for m, decision in zip(grid, decisions):
        try:
            scenario = dataclasses.replace(layer, m=m)
        except Exception as e:  # noqa: BLE001 - a layer no scenario can have
            raise ValueError(f"{at}: m={m}: not a valid scenario of the layer ({e})") from None
        if decision.schedule not in legal_candidates(scenario, backend):
            raise ValueError(f"{at}: m={m}: {decision.schedule.name} is not a legal schedule of this layer")
