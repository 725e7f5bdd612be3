"""What one training run is told: a typed, checked config instead of loose arguments.

``TrainConfig`` is checked when it is made (``__post_init__``), so a wrong split or
selector set fails before any data is built or any MLflow run opens, with an error that
names the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ficco_select.train.evaluate import SPLITS
from ficco_select.train.selector_sets import all_selectors, debug_selectors, fast_selectors, shipping_selectors
from ficco_select.train.selectors import BaseSelector

SELECTOR_SETS: dict[str, Callable[[], list[BaseSelector]]] = {
    "shipping": shipping_selectors, "all": all_selectors, "fast": fast_selectors, "debug": debug_selectors}
"""Named selector sets: ``shipping`` (the default: what ships and its references), ``all``
(with the learned selectors that do not ship, on request), ``fast`` (the pipeline's),
``debug`` (tiny models, for ``ficco pipeline --debug``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    splits: tuple[str, ...] = SPLITS
    """Hold-out splits to evaluate, from ``ficco_select.train.evaluate.SPLITS``; ``family`` and
    ``hardware`` decide the promotion when present."""
    selectors: str | Callable[[], list[BaseSelector]] = "shipping"
    """A named set (``SELECTOR_SETS``), or a factory of fresh selectors (tests, research)."""
    out_dir: Path = Path("out/train")
    """Where the tables, plots, report and summary go."""
    progress: bool = True
    """A progress bar over the evaluation's fits."""
    workers: int = 1
    """Folds fitted at once, each in a process of its own (``ficco_select.train.evaluate.evaluate``)."""

    def __post_init__(self) -> None:
        if isinstance(self.splits, str) or not all(isinstance(s, str) for s in self.splits):
            raise ValueError(f"TrainConfig.splits: a sequence of split names, got {self.splits!r}")
        unknown = [s for s in self.splits if s not in SPLITS]
        if unknown or not self.splits:
            raise ValueError(f"TrainConfig.splits: unknown split {unknown[0] if unknown else '(none given)'!r} "
                             f"(known: {', '.join(SPLITS)})")
        object.__setattr__(self, "splits", tuple(self.splits))
        if isinstance(self.selectors, str) and self.selectors not in SELECTOR_SETS:
            raise ValueError(f"TrainConfig.selectors: unknown set {self.selectors!r} (known: {', '.join(SELECTOR_SETS)})")
        if not isinstance(self.selectors, str) and not callable(self.selectors):
            raise ValueError(f"TrainConfig.selectors: a set name or a factory, got {self.selectors!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"TrainConfig.workers: a number of processes, at least 1, got {self.workers!r}")
        object.__setattr__(self, "out_dir", Path(self.out_dir))

    def make_selectors(self) -> list[BaseSelector]:
        """Fresh selectors of this config's set."""
        make = SELECTOR_SETS[self.selectors] if isinstance(self.selectors, str) else self.selectors
        return make()
