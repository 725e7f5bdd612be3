"""The runtime's fallbacks on the scenarios of a frame: for each scenario, what
``ficco_select.runtime.fallbacks.run_fallback`` (the one dispatch the runtime runs where its
model abstains) picks, so that training scores the fallbacks that ship, not copies of them.

    view = runtime_view(ok)                       # each scenario as the runtime sees it
    picks(view, "heuristic")                      # {scenario_id: schedule name}
    picks(view, "gated:shard.ring.sm", scores)    # gated rules read the model's scores

A scenario is decided on its machine's spec (``load_hardware``, or the one given), among its
legal candidates (``schedule.legal_candidates``), as the runtime decides it. A frame may lack
rows of some candidates (unusable measurements): the runtime's pick can then be a schedule
the frame cannot time, which its consumers score as the baseline, as the tables score any
pick outside the frame (``ShippedPolicy.predict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ficco_select.hardware import HardwareSpec, load_hardware
from ficco_select.heuristic import backend_for
from ficco_select.runtime.fallbacks import run_fallback
from ficco_select.scenario import SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import Schedule, legal_candidates

WHY = "scored at training"
"""The reason text the picks carry (never read: only the schedule is)."""


@dataclasses.dataclass(frozen=True)
class RuntimeView:
    """Each scenario of a frame as the runtime decides it, in sorted scenario-id order."""

    ids: list[str]
    scenarios: list[Scenario]
    specs: list[HardwareSpec]
    candidates: list[tuple[Schedule, ...]]
    """The runtime's legal candidates of each scenario, in the runtime's order."""
    records: list[dict]
    """Each scenario's ``SCENARIO_COLUMNS``, as the features read them."""


def runtime_view(ok: pd.DataFrame, specs: Mapping[str, HardwareSpec] | None = None) -> RuntimeView:
    """The scenarios of the usable rows `ok`, each on its machine's spec: `specs` (by machine
    name, e.g. a calibrated one) where given, else ``load_hardware``."""
    first = ok.drop_duplicates("scenario_id").sort_values("scenario_id", kind="stable")
    records = first[[c for c in SCENARIO_COLUMNS if c in first.columns]].to_dict("records")
    of = {name: (specs or {}).get(name) or load_hardware(name) for name in first["hardware"].unique()}
    scenarios = [Scenario.from_record(r) for r in records]
    hws = [of[s.hardware] for s in scenarios]
    return RuntimeView(ids=first["scenario_id"].tolist(), scenarios=scenarios, specs=hws,
                       candidates=[legal_candidates(s, backend_for(hw), hw) for s, hw in zip(scenarios, hws)],
                       records=records)


def picks(view: RuntimeView, fallback: str, scores: Sequence[np.ndarray] | None = None) -> dict[str, str]:
    """{scenario_id: the schedule `fallback` runs there}, by ``run_fallback``, one call per
    scenario. `scores`: per scenario, the model's scores of its candidates in their order
    (lower is better; ``candidate_scores``), which a gated rule needs."""
    out = {}  # (the reason key, low_margin, only names the abstention in a decision's text)
    for i, (sid, s, hw, cands) in enumerate(zip(view.ids, view.scenarios, view.specs, view.candidates)):
        decision = run_fallback(fallback, "low_margin", s, hw, WHY, cands, None if scores is None else scores[i])
        out[sid] = decision.schedule.name
    return out


def candidate_scores(view: RuntimeView, ok: pd.DataFrame, scores: np.ndarray,
                     score_pairs: Callable[[list[dict], list[str]], np.ndarray]) -> list[np.ndarray]:
    """Per scenario of `view`, the model's scores of its candidates in the runtime's order:
    each row of `ok` carries its score (`scores`, lower is better); a candidate without a
    row is scored by `score_pairs(records, schedule names)`, as the runtime would score it."""
    known = dict(zip(zip(ok["scenario_id"].tolist(), ok["schedule"].tolist()), np.asarray(scores, float).tolist()))
    missing = [(i, j) for i, (sid, cands) in enumerate(zip(view.ids, view.candidates))
               for j, c in enumerate(cands) if (sid, c.name) not in known]
    extra = dict(zip(missing, score_pairs([view.records[i] for i, _ in missing],
                                          [view.candidates[i][j].name for i, j in missing]))) if missing else {}
    return [np.array([known[(sid, c.name)] if (sid, c.name) in known else extra[(i, j)] for j, c in enumerate(cands)])
            for i, (sid, cands) in enumerate(zip(view.ids, view.candidates))]
