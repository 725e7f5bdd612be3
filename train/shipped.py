"""The policy that ships: a learned selector inside the runtime ``Selector``, with the rules
that tell it when to abstain, fitted on validation folds of the training side, scored in the
tables as users get it (``ShippedPolicy``; ``UnguardedShipped``: the same without its GPU
do-no-harm rule).

The rules' fits and the file they ship in each live in a module of their own:

- ``abstention_fit.fit_abstention``: the margin threshold and fallback with the most expected
  speed on validation scenarios whose slowdowns stay within a tail guard (one rule, one per
  kind of machine, one per operator on a kind), and the rules outside the training ranges;
- ``unseen_fit.fit_unseen_hardware``: how far outside the trained machines' specs the model may decide;
- ``validation_outcomes``: what the runtime would run on each validation scenario, its
  fallbacks by the runtime's own dispatch (``runtime.fallbacks.run_fallback``);
- ``runtime_meta``: what ``selector.json`` holds beside them (``runtime_meta``,
  ``training_ranges``, ``rules_and_evidence``).

Their names are imported here too, where their callers have always found them.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable

from ficco_select.features import FEATURE_NAMES
from ficco_select.hardware import load_hardware
from ficco_select.runtime.selector import Selector as RuntimeSelector
from ficco_select.runtime.trees import TreeEnsemble
from ficco_select.schedule import BASELINE
from ficco_select.train.abstention_fit import SLOWDOWN_CAP, fit_abstention, with_machine_fallbacks
from ficco_select.train.metrics import usable_rows
from ficco_select.train.runtime_meta import measured_gpus, rules_and_evidence, runtime_meta, training_ranges
from ficco_select.train.selectors import BaseSelector, XGBTimeRegressor, clone, legal_schedules, scenario_records
from ficco_select.train.unseen_fit import fit_unseen_hardware
from ficco_select.train.validation_outcomes import fixed_rule_schedules

__all__ = [  # with the names their callers have always imported from here
    "ShippedPolicy", "UnguardedShipped", "SLOWDOWN_CAP", "fit_abstention", "fit_unseen_hardware",
    "fixed_rule_schedules", "measured_gpus", "rules_and_evidence", "runtime_meta", "training_ranges",
    "with_machine_fallbacks",
]


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

    def __getstate__(self) -> dict:
        # The runtime selectors are made from model_ and meta_ (and hold locks): made again on load.
        return {k: v for k, v in super().__getstate__().items() if k not in ("runtime_", "unguarded_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "model_" in state:
            self._runtimes()

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
