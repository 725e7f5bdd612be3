"""Layer tables: a selector's decisions for one layer over the token count ``m``.

In serving (continuous batching, decode) and in training with variable sequence lengths,
``m`` changes from call to call while the rest of the scenario stays: the layer (op, n, k,
dtype, world size, hardware, imbalance). A layer's table is the selector's one cache: m to
the decision the direct path gives there (``policy.decide``), so a table and the direct path
agree at every m by construction.

- On a layer's second distinct ``m`` (a one-off scenario costs one decision, not a table),
  its decisions are computed on a grid of ``m`` in one batch (the grid's feature rows, built
  for all m at once by ``features.grid_features``, and one tree walk):
  ``GRID_STEPS_PER_OCTAVE`` points per doubling of ``m``, rounded up to valid values
  (multiples of P for ``ag_gemm``, ``gemm_rs`` and ``gemm_ar``), from the smallest valid
  ``m`` to the largest inside the model's trained range (``DEFAULT_M_RANGE`` without a
  model). Where two neighbours disagree, the interval is bisected (all such intervals in one
  batch per step) down to adjacent valid ``m``, so the grid holds every breakpoint it can see.
- Any other ``m`` is decided directly on its first ask and kept (``LayerTable.decide``): the
  model's picks and the GPU do-no-harm rule's verdicts move with ``m`` between points that
  agree (wave quantization, fixed costs), so no point's answer stands in for another's.
  From then on that ``m`` is one dict lookup.
- The grid is what a table says about the whole layer: ``ficco export --layers`` writes it,
  and the compile pass leaves PyTorch's pattern where every grid point is the baseline.

The selector builds a table (``Selector.layer_table``: it resolves the machine, the m range
the model may decide, and passes the policy for the points); ``build_table`` here lays the
grid and bisects, knowing nothing of the selector. Precompiled tables: ``ficco export
--layers FILE`` (``ficco_select.train.export.write_tables``) writes the tables of a scenario
table's layers into the export folder (``layers.json``, generated, deterministic, with the
digest of the model and selector.json they came from); ``Selector.load`` reads them, so
known layers never walk trees at their grid points. A file whose digest is not the folder's
is ignored with a warning, and so is one that holds anything the direct path could not give
(``read_tables``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ficco_select.hardware_spec import HardwareSpec
from ficco_select.runtime.caches import BoundedCache
from ficco_select.runtime.decision import Decision
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
TABLES_FILE = "layers.json"
"""Precompiled tables in an export folder (``ficco export --layers``)."""


MEMO_LIMIT = 1 << 16
"""The m beyond its grid points a table keeps decided before it starts over (its grid stays)."""


class LayerTable:
    """One layer's decisions over ``m``: at its grid points, decided in one batch; at any other
    valid ``m``, the direct decision, made on that m's first ask (``decide_points``) and kept
    (the ``MEMO_LIMIT`` most recently used). ``scenario``: the layer at one of its m;
    ``step``: valid m are its multiples."""

    __slots__ = ("scenario", "grid", "decisions", "step", "decide_points", "neighbours", "_at_grid", "_kept",
                 "grid_get", "kept_get")

    def __init__(self, scenario: Scenario, grid: tuple[int, ...], decisions: tuple[Decision, ...], step: int,
                 decide_points: Callable[[Sequence[int]], list[Decision]] | None,
                 known: Mapping[int, Decision] | None = None) -> None:
        self.scenario, self.grid, self.decisions, self.step = scenario, grid, decisions, step
        self.decide_points = decide_points
        """The direct decisions at a batch of m (the selector's policy for this layer)."""
        self.neighbours = 1
        """How many valid m of its grid interval an m off the grid is decided with, nearest
        first (the selector's choice: a model scores a batch in one tree walk, about the cost of
        one point; the heuristic decides point by point)."""
        self._at_grid: dict[int, Decision] = dict(zip(grid, decisions))
        self._kept: BoundedCache[int, Decision] = BoundedCache(MEMO_LIMIT)
        # The selector's hot path (an int m, checked by the Scenario): two C calls, no frame.
        self.grid_get, self.kept_get = self._at_grid.get, self._kept.peek
        for m, decision in (known or {}).items():
            if m not in self._at_grid:
                self._kept.put(m, decision)

    @property
    def layer(self) -> tuple:
        return self.scenario.layer

    # Sent to a group's other ranks (``runtime/dispatch.py``) as its grid alone: there a table
    # answers the grid's m, the same on every rank, and decides nothing.
    def __getstate__(self):
        return self.scenario, self.grid, self.decisions, self.step

    def __setstate__(self, state) -> None:
        self.__init__(*state, decide_points=None)

    def on_grid(self, m: int) -> Decision | None:
        """The grid's decision at `m`, None off the grid: what every rank holding this table
        (or a copy sent to it) answers alike."""
        return self._at_grid.get(m) if type(m) is int else None

    def known(self, m: int) -> Decision | None:
        """The decision kept for `m`, None if it has none yet."""
        if type(m) is not int:  # 8.0 and True find 8 and 1: not row counts
            return None
        return self._at_grid.get(m) or self._kept.get(m)

    def decide(self, m: int) -> Decision | None:
        """The decision for token count `m`: the direct path's, kept. None for an m the layer
        cannot have or for anything but an int (the caller then decides directly). Never raises."""
        try:
            decision = self.known(m)
            if decision is not None:
                return decision
            if not self._valid(m) or self.decide_points is None:
                return None
            # Another thread may have decided m meanwhile: the same decision.
            return self.decide_many(self._near(m)).get(m) or self.known(m) or self.decide_points([m])[0]
        except Exception:  # noqa: BLE001 - the caller decides directly, and says why
            return None

    def decide_many(self, ms: Iterable[int]) -> dict[int, Decision]:
        """Decide the valid m of `ms` not decided yet, in one batch; returns them by m."""
        new = [m for m in dict.fromkeys(ms) if self._valid(m) and self.known(m) is None]
        if not new:
            return {}
        made = dict(zip(new, self.decide_points(new)))
        for m, decision in made.items():
            self._kept.put(m, decision)
        return made

    def forget(self) -> None:
        """Keep the grid's decisions only."""
        self._kept.clear()

    def decided(self) -> dict[int, Decision]:
        """Every decision kept, by m (grid points too)."""
        return {**dict(self._kept.items()), **self._at_grid}

    def _near(self, m: int) -> list[int]:
        """`m` and up to ``neighbours - 1`` more valid m of its grid interval, nearest first:
        continuous batching and variable sequence lengths ask the m around one they asked."""
        at = bisect_right(self.grid, m)
        if self.neighbours <= 1 or not 0 < at < len(self.grid):
            return [m]
        lo, hi, step = self.grid[at - 1], self.grid[at], self.step
        near = [m]
        for k in range(1, self.neighbours):  # below, then above, one step further each time
            near += [other for other in (m - k * step, m + k * step) if lo < other < hi]
            if len(near) >= self.neighbours or (m - k * step <= lo and m + k * step >= hi):
                break
        return near[:self.neighbours]

    def _valid(self, m) -> bool:
        return type(m) is int and 1 <= m <= MAX_EXTENT and m % self.step == 0


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
                also: Iterable[int] = (), known: Mapping[int, Decision] | None = None) -> LayerTable:
    """`scenario`'s layer decided on its grid of m in [`lo`, `hi`] (and at the valid m of
    `also` inside it); `decide(ms)` gives the direct decisions at the token counts `ms`, in
    one batch (``Selector.layer_table`` passes the policy's); `known`: decisions made before,
    by m, kept and not made again. An empty grid where the range holds no valid m: every m is
    then decided on its first ask.

    Where neighbours on the grid disagree, every open interval is bisected at once, down to
    adjacent valid m: the grid then holds the breakpoint."""
    step = layer_step(scenario.op, scenario.world_size)
    known = dict(known or {})
    grid = m_grid(int(lo), min(int(hi), MAX_EXTENT), step)  # no scenario takes a larger m
    if not grid:
        return LayerTable(scenario, (), (), step, decide, known)
    grid = sorted({*grid, *(m for m in also if m % step == 0 and grid[0] <= m <= grid[-1])})
    decided = {m: known[m] for m in grid if m in known}

    def decide_at(ms: list[int]) -> None:
        new = [m for m in ms if m not in decided]
        decided.update(zip(new, (known.pop(m) if m in known else None for m in new)))
        todo = [m for m in new if decided[m] is None]
        if todo:
            decided.update(zip(todo, decide(todo)))

    decide_at(grid)
    same = lambda a, b: (decided[a].schedule, decided[a].source) == (decided[b].schedule, decided[b].source)  # noqa: E731
    open_ = [(a, b) for a, b in zip(grid, grid[1:]) if b - a > step and not same(a, b)]
    while open_:
        mids = [step * ((a + b) // (2 * step)) for a, b in open_]
        decide_at(mids)
        open_ = [(lo, hi) for (a, b), mid in zip(open_, mids) for lo, hi in ((a, mid), (mid, b))
                 if hi - lo > step and not same(lo, hi)]
    points = tuple(sorted(decided))
    return LayerTable(scenario, points, tuple(decided[m] for m in points), step, decide, known)


# -- precompiled tables ------------------------------------------------------------------
def export_digest(folder: str | Path) -> str:
    """The digest of an export's model.json and selector.json: what its tables were built from."""
    h = hashlib.sha256()
    for name in ("model.json", "selector.json"):
        h.update(Path(folder, name).read_bytes())
    return h.hexdigest()[:16]


SOURCES = ("model", "heuristic", "cost_model", "fallback")
"""Who may have made a table's decision (``Decision.source``)."""


@dataclasses.dataclass(frozen=True)
class LayerDecider:
    """What a precompiled table needs from its selector (``read_tables``): the backend its
    machine decides on, the direct decisions at a batch of m (each m between the points is
    decided that way on its first ask), and the decisions given at a batch of m under the GPU
    do-no-harm rule (``policy.no_harm``)."""

    backend: str
    decide_points: Callable[[Sequence[int]], list[Decision]]
    judge: Callable[[Sequence[int], Sequence[Decision]], list[Decision]]
    spec: HardwareSpec | None = None
    """The machine: its engines bound the legal decisions (a switch schedule where the fabric reduces in the switch)."""


def read_tables(folder: str | Path,
                decider_of: Callable[[Scenario], LayerDecider | None] = lambda layer: None) -> dict[tuple, LayerTable]:
    """The precompiled tables of an export folder ({} without ``layers.json``); ValueError
    naming the file, the layer and the field for anything the direct path could not have
    given: a malformed field, a table built from another model (a matching digest says which
    model the file came from, not that its contents were left as written), a grid step other
    than the layer's, a layer given twice, a layer whose machine the selector does not know
    (``decider_of(layer)`` None), a decision illegal for its layer at its m, or an overlap
    pick that the GPU do-no-harm rule refuses at its m."""
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
        decider = decider_of(layer)
        if decider is None:
            raise ValueError(f"{at}: hardware {layer.hardware!r} is not a machine this export knows (a shipped "
                             "machine or one of its hardware_specs)")
        _check_legal(layer, grid, decisions, decider.backend, at, decider.spec)
        for m, given, judged in zip(grid, decisions, decider.judge(grid, decisions)):
            if judged is not given:
                raise ValueError(f"{at}: m={m}: the GPU do-no-harm rule refuses this pick ({judged.reason})")
        tables[layer.layer] = LayerTable(layer, grid, decisions, step, decider.decide_points)
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


def _check_legal(layer: Scenario, grid: tuple[int, ...], decisions: tuple[Decision, ...], backend: str,
                 at: str, spec: HardwareSpec | None = None) -> None:
    """ValueError naming `at` and the point whose decision the layer cannot run."""
    for m, decision in zip(grid, decisions):
        try:
            scenario = dataclasses.replace(layer, m=m)
        except Exception as e:  # noqa: BLE001 - a layer no scenario can have
            raise ValueError(f"{at}: m={m}: not a valid scenario of the layer ({e})") from None
        if decision.schedule not in legal_candidates(scenario, backend, spec):
            raise ValueError(f"{at}: m={m}: {decision.schedule.name} is not a legal schedule of this layer")
