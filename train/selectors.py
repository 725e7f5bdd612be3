"""Selectors with one API: ``fit(df)`` on a labeled dataset, ``predict(df)`` -> {scenario_id: schedule}.

``df`` is a dataset (``ficco_select.data.dataset`` schema); ``predict`` uses only the scenario
columns and the schedule names of each scenario's rows (its legal candidates), never
the times, except ``Oracle`` which is the upper bound by definition. Learned state ends
in ``_``; constructors only store arguments (scikit-learn style).
"""

from __future__ import annotations

import inspect
import itertools
import weakref
import zlib

import numpy as np
import pandas as pd

from ficco_select.data.calibrate import calibrate
from ficco_select.data.simulate import simulate_rows
from ficco_select.features import FEATURE_NAMES, pair_features
from ficco_select.hardware import HardwareSpec, load_hardware
from ficco_select.heuristic import HeuristicParams, choose, estimates
from ficco_select.runtime.decision import pick_with_margin
from ficco_select.runtime.scope import COST_MODEL
from ficco_select.scenario import SCENARIO_COLUMNS, Scenario
from ficco_select.schedule import BASELINE, SHARD
from ficco_select.train.fallback_picks import picks, runtime_view
from ficco_select.train.metrics import capture_scorer, ceiling_choices, oracle_choices, usable_rows

SEED = 0
FIT_THREADS = 2
"""Threads per model fit (XGBoost, the forest). An evaluation's fold processes set it to
their share of the cores: the trees do not depend on it (XGBoost's hist method sums in a
fixed order), and threads beyond a core's share only wait on each other."""


def hardware_of(df: pd.DataFrame) -> dict[str, HardwareSpec]:
    return {name: load_hardware(name) for name in sorted(df["hardware"].unique())}


def scenario_records(df: pd.DataFrame) -> list[dict]:
    """One record per scenario (its id and ``SCENARIO_COLUMNS``), in order of first row."""
    return df.drop_duplicates("scenario_id")[["scenario_id", *SCENARIO_COLUMNS]].to_dict("records")


def legal_schedules(ok: pd.DataFrame) -> dict[str, set[str]]:
    """Each scenario's schedules among the rows `ok` (its legal candidates), by scenario id in
    sorted order. Plain lists: indexing Arrow-backed columns row by row is slow."""
    out: dict[str, set[str]] = {}
    for sid, name in zip(ok["scenario_id"].tolist(), ok["schedule"].tolist()):
        out.setdefault(sid, set()).add(name)
    return dict(sorted(out.items()))


class BaseSelector:
    name = "selector"
    decides_unseen_machines = False
    """Whether `fit` takes ``unseen_machines``: the machines it will be asked to decide that its
    training frame lacks (``evaluate`` passes its hold-out side's); the runtime policy fits its
    rule for them only then."""

    def fit(self, df: pd.DataFrame) -> "BaseSelector":
        return self

    def __getstate__(self) -> dict:
        # A fitted selector pickles without the frame it was fitted on (``fitted_on_``: a weak
        # reference, only for reusing a fit within one evaluation).
        return {k: v for k, v in vars(self).items() if k != "fitted_on_"}

    def predict(self, df: pd.DataFrame) -> dict[str, str]:  # pragma: no cover - abstract
        raise NotImplementedError


class AlwaysBaseline(BaseSelector):
    name = "always-baseline"

    def predict(self, df):
        # none.sm where the scenario has it, else the first none.* by name
        nones = usable_rows(df)[["scenario_id", "schedule"]]
        nones = nones[nones["schedule"].str.startswith("none.")]
        nones = nones.assign(rank=nones["schedule"] != BASELINE.name).sort_values(["scenario_id", "rank", "schedule"])
        return dict(nones.drop_duplicates("scenario_id")[["scenario_id", "schedule"]].itertuples(index=False))


class AlwaysShard(BaseSelector):
    name = "always-shard"

    def predict(self, df):
        out = {}
        for sid, g in usable_rows(df).groupby("scenario_id"):
            names = set(g["schedule"])
            out[sid] = SHARD.name if SHARD.name in names else BASELINE.name
        return out


class Oracle(BaseSelector):
    """The ceiling: what a perfect selector picks from the labels (``metrics.ceiling_choices``):
    1 on simulated rows, the repeat oracle on measured rows a second sweep timed."""

    name = "ceiling"

    def predict(self, df):
        return ceiling_choices(df)


_ESTIMATES: dict[tuple[str, int], tuple] = {}
"""(scenario_id, id(spec)) -> (spec, scenario, its heuristic estimates): every fold's
heuristic, tuned or not, decides the same scenarios again."""


_CHOICES: dict[tuple, str] = {}
"""(rules, scenario_id, id(spec), params) -> the schedule those rules pick (``_ESTIMATES``
holds the spec, so that its id is not reused while the entry is)."""


class Heuristic(BaseSelector):
    """The hand heuristic (``ficco_select.heuristic.choose``, the runtime's fallback);
    ``fit`` tunes its parameters on the training data only (a grid search on capture)."""

    name = "heuristic"
    GRID = {"min_gain": (0.0, 0.01, 0.02, 0.05), "fill": (0.5, 0.75, 1.0, 1.5)}
    PARAMS = HeuristicParams

    def __init__(self, params=None, tune: bool = True, tune_scenarios: int = 800) -> None:
        self.params = params
        self.tune = tune
        self.tune_scenarios = tune_scenarios

    def fit(self, df):
        self.params_ = self.params or self.PARAMS()
        if self.tune:
            ok = usable_rows(df)
            ids = sorted(set(ok["scenario_id"]), key=lambda s: zlib.crc32(s.encode()))[: self.tune_scenarios]
            sample = ok[ok["scenario_id"].isin(ids)]
            capture, prepared = capture_scorer(sample), self._prepare(sample)
            best = -1.0
            for values in itertools.product(*self.GRID.values()):
                params = self.PARAMS(**dict(zip(self.GRID, values)))
                value = capture(self._choose(prepared, params))
                if value > best:
                    best, self.params_ = value, params
        return self

    def predict(self, df):
        return self._choose(self._prepare(df), getattr(self, "params_", self.params or self.PARAMS()))

    @staticmethod
    def _prepare(df: pd.DataFrame) -> list[tuple]:
        """(scenario_id, scenario, spec, estimates, legal schedule names) per usable scenario.
        The estimates depend on neither the thresholds nor the fold: made once per
        (scenario, spec) for every heuristic of the process (``_ESTIMATES``)."""
        hw = hardware_of(df)
        ok = usable_rows(df)
        legal = legal_schedules(ok)
        if len(_ESTIMATES) > 1 << 17:
            _ESTIMATES.clear()
        out = []
        for rec in scenario_records(ok):
            sid = rec.pop("scenario_id")
            spec = hw[rec["hardware"]]
            cached = _ESTIMATES.get((sid, id(spec)))
            if cached is None or cached[0] is not spec:  # (an id is only reused once its spec is gone)
                scenario = Scenario.from_record(rec)
                cached = _ESTIMATES[(sid, id(spec))] = (spec, scenario, estimates(scenario, spec))
            out.append((sid, cached[1], spec, cached[2], legal[sid]))
        return out

    @classmethod
    def _choose(cls, prepared: list[tuple], params) -> dict[str, str]:
        if len(_CHOICES) > 1 << 18:
            _CHOICES.clear()
        out = {}
        for sid, scenario, spec, est, legal in prepared:
            # Every fold's validation decides the same scenarios again with the same parameters.
            key = (cls._rules, sid, id(spec), params)
            name = _CHOICES.get(key)
            if name is None or _ESTIMATES.get((sid, id(spec)), (None,))[0] is not spec:
                name = _CHOICES[key] = cls._rules(scenario, spec, params, est=est).name
            out[sid] = name if name in legal else BASELINE.name
        return out

    _rules = staticmethod(choose)


_CALIBRATIONS: dict[tuple[str, int, int], HardwareSpec] = {}
"""(machine, devices, digest of its rows) -> the spec calibrated on those rows."""


def _calibrated(rows: pd.DataFrame, hw: str, devices: int) -> HardwareSpec:
    """``calibrate`` on a machine's training rows, once per distinct rows: the folds of the
    hardware and topology hold-outs train on the same rows of each machine they keep."""
    lists = [c for c in rows.columns if rows[c].dtype == object]  # per-repetition times, which it never reads
    key = (hw, devices, int(pd.util.hash_pandas_object(rows.drop(columns=lists), index=False).sum()))
    if key not in _CALIBRATIONS:
        if len(_CALIBRATIONS) > 256:
            _CALIBRATIONS.clear()
        _CALIBRATIONS[key] = calibrate(rows, name=hw, devices=devices, description="calibrated on the training fold")
    return _CALIBRATIONS[key]


class SimulatorSelector(BaseSelector):
    """The physics alone: the argmin of the analytic model (``ficco_select.data.simulate``) on each
    scenario's machine, picked by the runtime's rule for a model's scores
    (``decision.pick_with_margin``: ties by name). Does learning add anything over it? (The
    runtime's ``cost_model`` fallback, ``no_harm.cost_model_pick``, reads the same model but
    breaks its ties, baselines of two engines, say, by candidate order.)

    ``fit`` calibrates the model (``ficco_select.data.calibrate``) on the training rows a machine
    *measured* (>= 4 scenarios of it), never on the test fold. A machine without measured
    training rows is modelled by its spec as given; for a simulated machine that spec is
    the one its rows were simulated with, so on sim rows this selector is the noise-free
    ceiling by construction, and only measured rows can answer the question.
    """

    name = "simulator"

    def fit(self, df):
        ok = usable_rows(df)
        self.specs_ = {}
        for hw, rows in ok[ok["backend"] != "sim"].groupby("hardware"):
            if rows["scenario_id"].nunique() >= 4:
                self.specs_[hw] = _calibrated(rows, hw, load_hardware(hw).devices)
        return self

    def predict(self, df):
        ok = usable_rows(df)
        legal = legal_schedules(ok)
        out = {}
        specs = getattr(self, "specs_", {})
        for hw, rows in ok.groupby("hardware"):
            if hw not in specs and (given := reference_picks(rows, "simulator")) is not None:
                out.update(given)  # the spec as given: decided once per scenario (with_reference_picks)
                continue
            records = scenario_records(rows)
            ids = [r.pop("scenario_id") for r in records]
            scenarios = [Scenario.from_record(r) for r in records]
            model = simulate_rows(scenarios, specs.get(hw) or load_hardware(hw))
            sid_of = {s.scenario_id: sid for s, sid in zip(scenarios, ids)}
            sids = [sid_of[s] for s in model["scenario_id"].tolist()]
            model = model.assign(scenario_id=sids)[[name in legal[sid] for sid, name in
                                                    zip(sids, model["schedule"].tolist())]]
            out.update(_argmin_choice(model, model["time_s"].to_numpy()))
        return {sid: out.get(sid, BASELINE.name) for sid in legal}  # (no candidate the model knows)


FEATURE_COLUMNS = tuple(f"x.{name}" for name in FEATURE_NAMES)
"""Where ``with_features`` keeps each row's features in a frame."""


def with_features(df: pd.DataFrame) -> pd.DataFrame:
    """`df`'s usable rows with their pair features as columns (``FEATURE_COLUMNS``).

    An evaluation fits every selector on every fold; computed once here, each fit and
    prediction slices them instead of computing them again.
    """
    ok = usable_rows(df).reset_index(drop=True)
    if set(FEATURE_COLUMNS) <= set(ok.columns):
        return ok
    X = _feature_matrix(ok)
    return pd.concat([ok.drop(columns=[c for c in FEATURE_COLUMNS if c in ok.columns]),
                      pd.DataFrame(X, columns=list(FEATURE_COLUMNS))], axis=1)


REFERENCE_PICKS = {"heuristic": "pick.heuristic", COST_MODEL: "pick.cost_model", "simulator": "pick.simulator"}
"""Where ``with_reference_picks`` keeps each scenario's pick by the runtime's ``heuristic`` and
``cost_model`` fallbacks, and by the ``simulator`` row, on its machine's spec as given (in
every row of it)."""


def with_reference_picks(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the picks of ``REFERENCE_PICKS`` as columns: the fallbacks' are what the
    runtime's dispatch (``runtime.fallbacks.run_fallback``, through ``fallback_picks``) runs for
    each scenario. All depend on the scenario and its machine only, not on a fold: the
    validation folds of every shipped-policy fit, and the simulator's row on machines it does
    not calibrate, read them instead of deciding each scenario again. A fallback's pick may
    lie outside the frame's rows (a candidate without a usable row); its readers score it
    as the baseline."""
    view = runtime_view(usable_rows(df))
    chosen = {"heuristic": picks(view, "heuristic"), COST_MODEL: picks(view, COST_MODEL),
              "simulator": SimulatorSelector().predict(df)}
    sids = df["scenario_id"]
    return df.assign(**{column: sids.map(chosen[who]).to_numpy(object) for who, column in REFERENCE_PICKS.items()})


def reference_picks(df: pd.DataFrame, who: str) -> dict[str, str] | None:
    """{scenario_id: schedule} from ``with_reference_picks``'s column of `who`, or None
    where `df` lacks it."""
    column = REFERENCE_PICKS[who]
    if column not in df.columns:
        return None
    first = df.drop_duplicates("scenario_id")
    return dict(zip(first["scenario_id"].tolist(), first[column].tolist()))


def _feature_matrix(ok: pd.DataFrame) -> np.ndarray:
    recs = ok[list(SCENARIO_COLUMNS)].to_dict("records")
    return pair_features(recs, ok["schedule"].tolist(), hardware_of(ok))


def feature_pairs(df: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """The usable rows and their feature matrix (precomputed by ``with_features`` if it ran)."""
    ok = usable_rows(df).reset_index(drop=True)
    if set(FEATURE_COLUMNS) <= set(ok.columns):
        # Row-major float32, what XGBoost holds: it copies any other layout, slowly.
        return ok, np.ascontiguousarray(ok[list(FEATURE_COLUMNS)].to_numpy(np.float32))
    return ok, _feature_matrix(ok)


def _relative_log_time(ok: pd.DataFrame) -> np.ndarray:
    """log(time / baseline time) per row: comparable across scenarios of any scale."""
    base = ok.loc[ok["schedule"].str.startswith("none.")].groupby("scenario_id")["time_s"].min()
    return np.log(ok["time_s"].to_numpy() / ok["scenario_id"].map(base).to_numpy())


def _argmin_choice(ok: pd.DataFrame, predicted: np.ndarray) -> dict[str, str]:
    """Each scenario's pick by the runtime's rule (``pick_with_margin``): {scenario_id: schedule}."""
    names, sids = ok["schedule"].to_numpy(str), ok["scenario_id"].to_numpy()
    at, _ = pick_with_margin(predicted, names, sids)
    return dict(zip(sids[at], names[at]))


class XGBTimeRegressor(BaseSelector):
    """XGBoost regression of each schedule's log time relative to the baseline; choose the argmin."""

    name = "xgb-regressor"

    def __init__(self, n_estimators: int = 300, max_depth: int = 6, learning_rate: float = 0.08) -> None:
        self.n_estimators, self.max_depth, self.learning_rate = n_estimators, max_depth, learning_rate

    def _model(self):
        import xgboost as xgb

        return xgb.XGBRegressor(n_estimators=self.n_estimators, max_depth=self.max_depth,
                                learning_rate=self.learning_rate, tree_method="hist", random_state=SEED,
                                n_jobs=FIT_THREADS, subsample=0.9, colsample_bytree=0.9)

    def fit(self, df):
        ok, X = feature_pairs(df)
        self.model_ = self._model().fit(X, _relative_log_time(ok))
        self.fitted_on_ = weakref.ref(df)  # lets ShippedPolicy reuse this fit
        return self

    def predict(self, df):
        ok, X = feature_pairs(df)
        return _argmin_choice(ok, self.model_.predict(X))


class XGBRanker(BaseSelector):
    """XGBoost learning-to-rank, one query group per scenario; choose the top-ranked."""

    name = "xgb-ranker"

    def __init__(self, n_estimators: int = 300, max_depth: int = 6, learning_rate: float = 0.08) -> None:
        self.n_estimators, self.max_depth, self.learning_rate = n_estimators, max_depth, learning_rate

    def fit(self, df):
        import xgboost as xgb

        ok, X = feature_pairs(df)
        order = np.argsort(ok["scenario_id"].to_numpy(), kind="stable")
        ok, X = ok.iloc[order].reset_index(drop=True), X[order]
        # Relevance: graded by how close to the scenario's best (ties within noise rank alike).
        rel = _relative_log_time(ok)
        best = pd.Series(rel).groupby(ok["scenario_id"]).transform("min").to_numpy()
        gap = np.exp(rel - best) - 1
        grade = np.select([gap <= 0.02, gap <= 0.05, gap <= 0.15, gap <= 0.4], [4, 3, 2, 1], 0)
        qid = pd.factorize(ok["scenario_id"])[0]
        self.model_ = xgb.XGBRanker(objective="rank:ndcg", n_estimators=self.n_estimators,
                                    max_depth=self.max_depth, learning_rate=self.learning_rate,
                                    tree_method="hist", random_state=SEED, n_jobs=FIT_THREADS)
        self.model_.fit(X, grade, qid=qid)
        self.fitted_on_ = weakref.ref(df)  # lets ShippedPolicy reuse this fit
        return self

    def predict(self, df):
        ok, X = feature_pairs(df)
        return _argmin_choice(ok, -self.model_.predict(X))


class RandomForestTime(BaseSelector):
    """scikit-learn random forest on the same regression target."""

    name = "random-forest"

    def __init__(self, n_estimators: int = 60, min_samples_leaf: int = 3, max_samples: float | None = None) -> None:
        self.n_estimators, self.min_samples_leaf, self.max_samples = n_estimators, min_samples_leaf, max_samples

    def fit(self, df):
        from sklearn.ensemble import RandomForestRegressor

        ok, X = feature_pairs(df)
        self.model_ = RandomForestRegressor(n_estimators=self.n_estimators, min_samples_leaf=self.min_samples_leaf,
                                            max_features=0.5, max_samples=self.max_samples, n_jobs=FIT_THREADS,
                                            random_state=SEED)
        self.model_.fit(np.nan_to_num(X, nan=-1.0), _relative_log_time(ok))
        return self

    def predict(self, df):
        ok, X = feature_pairs(df)
        return _argmin_choice(ok, self.model_.predict(np.nan_to_num(X, nan=-1.0)))


class HGBClassifier(BaseSelector):
    """HistGradientBoosting classifier of the best schedule (scenario features only);
    choose the most probable class that is legal for the scenario."""

    name = "hgb-classifier"

    def __init__(self, max_iter: int = 200) -> None:
        self.max_iter = max_iter

    def fit(self, df):
        from sklearn.ensemble import HistGradientBoostingClassifier

        ok, X = feature_pairs(df)
        best = oracle_choices(df)
        first = ~ok["scenario_id"].duplicated()
        Xs = X[first.to_numpy()][:, : self._n_scenario_features()]
        y = ok.loc[first, "scenario_id"].map(best).to_numpy()
        # No early stopping: above 10,000 scenarios it would hold out a stratified split, which
        # fails on a best schedule that only one scenario has.
        self.model_ = HistGradientBoostingClassifier(max_iter=self.max_iter, early_stopping=False,
                                                     random_state=SEED).fit(Xs, y)
        return self

    @staticmethod
    def _n_scenario_features() -> int:
        from ficco_select.features import SCENARIO_FEATURES

        return len(SCENARIO_FEATURES)

    def predict(self, df):
        ok, X = feature_pairs(df)
        first = (~ok["scenario_id"].duplicated()).to_numpy()
        proba = self.model_.predict_proba(X[first][:, : self._n_scenario_features()])
        classes = self.model_.classes_
        legal = legal_schedules(ok)
        out = {}
        for sid, p in zip(ok.loc[first, "scenario_id"].tolist(), proba):
            for idx in np.argsort(-p):
                if classes[idx] in legal[sid]:
                    out[sid] = classes[idx]
                    break
            else:
                out[sid] = BASELINE.name
        return out


def clone(selector: BaseSelector) -> BaseSelector:
    """An unfitted copy of `selector` (its constructor arguments are its attributes)."""
    params = inspect.signature(type(selector).__init__).parameters
    return type(selector)(**{k: getattr(selector, k) for k in params if k != "self"})
