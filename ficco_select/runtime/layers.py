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
layers never walk trees. A file whose digest is not the folder's is ignored with a warning.
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
from ficco_select.runtime.trees import read_json
from ficco_select.scenario import LAYER_COLUMNS, Scenario
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


@dataclasses.dataclass(frozen=True, slots=True)
class LayerTable:
    """One layer's decisions at the grid points of ``m`` (ascending); ``step``: valid ``m``
    are its multiples."""

    layer: tuple
    grid: tuple[int, ...]
    decisions: tuple[Decision, ...]
    step: int
    # The lookup's own layout, so that `decide` is two indexings: for every m up to the grid's
    # end (at most DENSE_M_LIMIT), the position in _choices of its answer: 0 (None) for an m
    # the layer cannot have or below the grid, else 1 + the index of the grid point below m.
    # 2 bytes per m: 128 KiB for a table up to m = 65536. Larger m are bisected.
    _index: array = dataclasses.field(init=False, repr=False, compare=False)
    _choices: tuple[Decision | None, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.grid) >= 1 << 16:
            raise ValueError(f"a layer table holds at most {(1 << 16) - 1} points, got {len(self.grid)}")
        ms = np.arange(min(self.grid[-1], DENSE_M_LIMIT) + 1)
        at = np.searchsorted(self.grid, ms, side="right")  # 1 + the grid point at or below m
        at[(ms % self.step != 0) | (ms < self.grid[0])] = 0
        object.__setattr__(self, "_index", array("H", at.astype(np.uint16).tobytes()))
        object.__setattr__(self, "_choices", (None, *self.decisions))

    def decide(self, m: int) -> Decision | None:
        """The decision for token count `m`, or None outside the table, for an m the layer
        cannot have, or for anything but an int (the caller then decides directly). Never raises."""
        try:
            if m >= 0:  # a negative index would count from the end
                return self._choices[self._index[m]]
            return None
        except IndexError:  # beyond the dense index
            if type(m) is not int or m % self.step or m > self.grid[-1]:
                return None
            return self.decisions[bisect_right(self.grid, m) - 1]
        except Exception:  # noqa: BLE001 - a float, a string, None: not a row count
            return None


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


def build_table(scenario: Scenario, lo: int, hi: int, decide: Callable[[Sequence[int]], list[Decision]],
                also: Iterable[int] = ()) -> LayerTable | None:
    """`scenario`'s layer decided on its grid of m in [`lo`, `hi`] (and at the valid m of
    `also` inside it); `decide(ms)` gives the decisions at the token counts `ms`, in one
    batch (``Selector.layer_table`` passes its own). None where the range holds no valid m.

    Where neighbours on the grid disagree, every open interval is bisected at once, down to
    adjacent valid m: the breakpoint is then exact. Neighbours that agree are taken to agree
    in between."""
    step = scenario.world_size if scenario.op in ("ag_gemm", "gemm_rs", "gemm_ar") else 1
    grid = m_grid(int(lo), int(hi), step)
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
    return LayerTable(scenario.layer, points, tuple(decided[m] for m in points), step)


def _check_legal(key: tuple, grid: tuple[int, ...], decisions: tuple[Decision, ...], backend: str | None,
                 at: str) -> None:
    """ValueError naming `at` and the point whose decision the layer cannot run."""
    if backend is None:
        raise ValueError(f"{at}: hardware {key[LAYER_COLUMNS.index('hardware')]!r} is not a machine this export knows")
    for m, decision in zip(grid, decisions):
        try:
            scenario = Scenario(group="layers.json", m=m, **dict(zip(LAYER_COLUMNS, key)))
        except Exception as e:  # noqa: BLE001 - a layer no scenario can have
            raise ValueError(f"{at}: m={m}: not a valid scenario of the layer ({e})") from None
        if decision.schedule not in legal_candidates(scenario, backend):
            raise ValueError(f"{at}: m={m}: {decision.schedule.name} is not a legal schedule of this layer")


# -- precompiled tables ------------------------------------------------------------------
def export_digest(folder: str | Path) -> str:
    """The digest of an export's model.json and selector.json: what its tables were built from."""
    h = hashlib.sha256()
    for name in ("model.json", "selector.json"):
        h.update(Path(folder, name).read_bytes())
    return h.hexdigest()[:16]


def read_tables(folder: str | Path, backend_of: Callable[[str], str | None] = lambda hardware: None
                ) -> dict[tuple, LayerTable]:
    """The precompiled tables of an export folder ({} without ``layers.json``); ValueError
    naming the file and field if they are malformed, were built from another model, or hold
    a decision that is illegal for its layer at its m (on the backend ``backend_of(hardware)``
    gives; a layer whose machine is unknown there is refused too): a matching digest says
    which model the file came from, not that its contents were left as written."""
    path = Path(folder, TABLES_FILE)
    if not path.exists():
        return {}
    doc = read_json(path, "layer tables")
    if doc.get("model_digest") != export_digest(folder):
        raise ValueError(f"{path}: field 'model_digest' is {doc.get('model_digest')!r}, not this export's "
                         f"{export_digest(folder)}: built from another model; re-run ficco export --layers")
    tables = {}
    for i, entry in enumerate(doc.get("layers", [])):
        at = f"{path}: layers[{i}]"
        try:
            key = tuple(entry[c] for c in LAYER_COLUMNS)
            grid = tuple(int(m) for m in entry["grid"])
            decisions = tuple(Decision(parse(name), str(source), float(confidence), str(reason))
                              for name, source, confidence, reason in entry["decisions"])
            step = int(entry["step"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{at}: {type(e).__name__}: {e}") from None
        if not grid or len(grid) != len(decisions) or list(grid) != sorted(set(grid)) or step < 1:
            raise ValueError(f"{at}: 'grid' must be ascending, one decision per point")
        _check_legal(key, grid, decisions, backend_of(str(key[LAYER_COLUMNS.index("hardware")])), at)
        tables[key] = LayerTable(key, grid, decisions, step)
    return tables
