"""One training: evaluate every selector, track it in MLflow, register the learned model
the shipped-policy row scored (same settings, refitted on all the data, with its runtime
rules), and move the ``champion`` alias only when it wins.

MLflow layout: experiment ``ficco-select``; a parent run per training with the dataset
(digest), parameters and the comparison tables; a nested run per selector with its metrics
per split (``<split>_<metric>``); the chosen model logged in XGBoost's native UBJ format
with ``selector.json`` (the rules the runtime reads) and ``evidence.json`` (their validation
figures and provenance: ``export_files``) and registered as ``ficco-selector``. Promotion
rule: the new version gets ``champion`` only if, on every grouped hold-out split evaluated,
the oracle capture of what ships (the ``shipped`` row: model, abstention and fallback) beats
the heuristic's and is at least the current champion's. Both are read before the GPU
do-no-harm rule (``shipped-unguarded`` where evaluated): the rule filters whatever runs on a
GPU, and on simulated truth it costs by design what it saves on real GPUs, so a gate scored
with it would compare the rule with the simulator, not the model with the heuristic. mlflow
is imported here only, never by the runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select import __version__
from ficco_select.features import FEATURE_NAMES, FEATURE_SCHEMA_HASH, FEATURE_SCHEMA_VERSION
from ficco_select.runtime.scope import Scope
from ficco_select.train.config import TrainConfig
from ficco_select.train.evaluate import abstention_table, choices_table, evaluate, tables
from ficco_select.train.measured_holdout import holdout_tables, holdout_text
from ficco_select.train.metrics import format_table
from ficco_select.train.report import write_report
from ficco_select.train.selectors import BaseSelector, XGBRanker, XGBTimeRegressor, clone, with_features, with_reference_picks
from ficco_select.train.shipped import (ShippedPolicy, fit_abstention, fit_unseen_hardware, rules_and_evidence,
                                       runtime_meta, with_machine_fallbacks)

EXPERIMENT = "ficco-select"
REGISTERED_MODEL = "ficco-selector"
ALIAS = "champion"
GROUPED_SPLITS = ("family", "hardware")
LEARNED = {"xgb-regressor": XGBTimeRegressor, "xgb-ranker": XGBRanker}
"""Selectors that can be exported (XGBoost native format)."""


def dataset_digest(df: pd.DataFrame) -> str:
    cols = ["scenario_id", "schedule", "time_s", "verified", "backend"]
    return hashlib.sha1(pd.util.hash_pandas_object(df[cols], index=False).values.tobytes()).hexdigest()[:16]


def train(df: pd.DataFrame, config: TrainConfig | None = None, *, extra: pd.DataFrame | None = None) -> dict:
    """Evaluate, log, register, maybe promote. Returns a summary (tables, run id, version, promoted).

    `config`: the splits, the selector set, where to write (``ficco_select.train.config.TrainConfig``,
    checked when made; default: every split, every selector, ``out/train``).

    `extra`: labeled rows added only to the registered model's training data, never
    scored (e.g. telemetry, whose scenarios lack most candidates:
    ``ficco_select.train.training_data.telemetry_training_rows``). The evaluation, and so the choice of
    selector and its promotion, is on `df` alone.
    """
    import mlflow

    config = config or TrainConfig()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    mlflow.set_experiment(EXPERIMENT)
    data = _training_data(df, extra)
    seconds: dict[str, float] = {}  # each stage's wall time, in the summary ("seconds")
    with mlflow.start_run(run_name=f"train-{data.digest[:8]}") as parent:
        run_id = parent.info.run_id
        with _timed(seconds, "record_inputs"):
            _record_inputs(data, config.splits)
        with _timed(seconds, "evaluate"):
            scores = _evaluate(data.df, config)
        with _timed(seconds, "record_scores"):
            _record_scores(data.df, scores, config.out_dir)
        with _timed(seconds, "register"):
            registered = _register(data, scores, config, run_id)
        with _timed(seconds, "promote"):
            promoted = _promote(registered, scores)
        with _timed(seconds, "report"):
            summary = _report(config.out_dir, run_id, data, scores, registered, promoted)
        return {**summary, "seconds": seconds}


@contextlib.contextmanager
def _timed(seconds: dict[str, float], stage: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = round(time.perf_counter() - started, 2)


# -- what flows between the stages ---------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingData:
    """The rows of one training: what is scored, and what the registered model is fitted on."""

    df: pd.DataFrame
    """The evaluated rows: every score, and so the choice and promotion, is on these alone."""
    fit_df: pd.DataFrame
    """`df` plus the extra rows (``train``'s `extra`): the registered model's training data."""
    digest: str
    """``dataset_digest`` of `fit_df`, what the registered model was fitted on."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scores:
    """The evaluation of every selector (``ficco_select.train.evaluate``)."""

    results: dict
    """``ficco_select.train.evaluate.evaluate``'s results (per split, and the choices)."""
    by_split: dict[str, pd.DataFrame]
    """A comparison table per split: a row per selector, a column per metric."""
    grouped: list[str]
    """The grouped hold-out splits evaluated (else every split): registration tags and the
    promotion rule read these."""
    text: str
    """The tables as ``comparison.txt`` holds them."""
    abstentions: pd.DataFrame
    """``ficco_select.train.evaluate.abstention_table``: where the shipped policy's model did not decide."""
    holdout: dict[str, pd.DataFrame]
    """``ficco_select.train.measured_holdout.holdout_tables``: each measured machine held out, on its second sweep."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registered:
    """The model registered by this training."""

    chosen: str
    """The learned selector it is (``_candidate``)."""
    row: str
    """The table row that gates what ships: ``shipped-unguarded`` (the shipped policy before the
    GPU do-no-harm rule) or ``shipped`` if evaluated, else `chosen`."""
    model: BaseSelector
    """`chosen` fitted on ``TrainingData.fit_df``."""
    version: str
    """Its version of ``REGISTERED_MODEL``."""


# -- the stages, in order ------------------------------------------------------------------
def _training_data(df: pd.DataFrame, extra: pd.DataFrame | None) -> TrainingData:
    """`df` scored; `df` and `extra` (if any rows) fitted."""
    fit_df = df if extra is None or extra.empty else pd.concat([df, extra], ignore_index=True)
    return TrainingData(df=df, fit_df=fit_df, digest=dataset_digest(fit_df))


def _record_inputs(data: TrainingData, splits: Sequence[str]) -> None:
    """The parent run's parameters and its dataset input (one row per scenario)."""
    import mlflow

    df, digest = data.df, data.digest
    mlflow.log_params({"dataset_digest": digest, "rows": len(df), "scenarios": df["scenario_id"].nunique(),
                       "hardware": ",".join(sorted(df["hardware"].unique())), "splits": ",".join(splits),
                       "feature_schema_version": FEATURE_SCHEMA_VERSION,
                       "feature_schema_hash": FEATURE_SCHEMA_HASH, "ficco_version": __version__,
                       "extra_rows": len(data.fit_df) - len(df)})
    scen = df.groupby("scenario_id", sort=False).first().reset_index()[
        ["scenario_id", "group", "op", "m", "n", "k", "dtype", "world_size", "hardware", "backend"]]
    mlflow.log_input(mlflow.data.from_pandas(scen, name=f"ficco-dataset-{digest}"), context="training")


def _evaluate(df: pd.DataFrame, config: TrainConfig) -> Scores:
    """Every selector of `config` fitted and scored on every split of `df`."""
    results = evaluate(df, splits=config.splits, make_selectors=config.make_selectors, progress=config.progress,
                       workers=config.workers)
    by_split = tables(results)
    text = "\n\n".join(f"== {split} ==\n{format_table(t)}" for split, t in by_split.items())
    abstentions = abstention_table(df, results)
    if not abstentions.empty:  # where the shipped policy's model stepped aside, and what that scored
        text += "\n\n== abstention (shipped: why the model did not decide, what ran) ==\n" + \
            abstentions.set_index(["split", "setting", "reason", "ran"]).to_string(float_format=lambda x: f"{x:.3f}")
    holdout = holdout_tables(df, results)
    if holdout:
        text += "\n\n" + holdout_text(holdout)
    grouped = [s for s in GROUPED_SPLITS if s in by_split] or list(by_split)
    return Scores(results=results, by_split=by_split, grouped=grouped, text=text, abstentions=abstentions,
                  holdout=holdout)


def _record_scores(df: pd.DataFrame, scores: Scores, out_dir: Path) -> None:
    """A nested run per selector with its metrics per split (``<split>_<metric>``), and the
    comparison files in `out_dir` (logged as artifacts with the report)."""
    import mlflow

    by_split, results = scores.by_split, scores.results
    for name in next(iter(by_split.values())).index:
        with mlflow.start_run(run_name=name, nested=True):
            mlflow.log_param("selector", name)
            for split, table in by_split.items():
                mlflow.log_metrics({f"{split}_{metric}": float(value)
                                    for metric, value in table.loc[name].items() if np.isfinite(value)})
    (out_dir / "comparison.txt").write_text(scores.text + "\n")
    (out_dir / "evaluation.json").write_text(json.dumps({k: v for k, v in results.items()
                                                         if k not in ("choices", "decisions")},
                                                        indent=2, default=float))
    scores.abstentions.to_csv(out_dir / "abstention.csv", index=False)
    choices_table(df, results).to_parquet(out_dir / "choices.parquet", index=False)
    for split, table in by_split.items():
        table.to_csv(out_dir / f"comparison_{split}.csv")
    if scores.holdout:
        pd.concat(scores.holdout, names=["machine"]).to_csv(out_dir / "measured_holdout.csv")


def _register(data: TrainingData, scores: Scores, config: TrainConfig, run_id: str) -> Registered:
    """Fit the candidate on all the data and register it (``_log_model``).

    The candidate: what the shipped row scored (its inner model, same settings), else the
    exportable learned selector with the best grouped hold-out capture."""
    by_split, grouped = scores.by_split, scores.grouped
    candidate = _candidate(config.make_selectors(), by_split, grouped)
    index = by_split[grouped[0]].index
    row = next((r for r in ("shipped-unguarded", "shipped") if r in index), candidate.name)
    chosen = candidate.name
    features = with_reference_picks(with_features(data.fit_df))
    model = clone(candidate).fit(features)
    version = _log_model(model, candidate, features, data.digest, by_split, grouped, row, run_id)
    return Registered(chosen=chosen, row=row, model=model, version=version)


def _promote(registered: Registered, scores: Scores) -> bool:
    """The champion decision for the registered version (``_maybe_promote``)."""
    from mlflow import MlflowClient

    return _maybe_promote(MlflowClient(), registered.version, scores.by_split, scores.grouped, registered.row)


def _report(out_dir: Path, run_id: str, data: TrainingData, scores: Scores, registered: Registered,
            promoted: bool) -> dict:
    """The outcome: tags on the parent run; feature importance, ``summary.json`` and the
    report in `out_dir`, all of it logged as the run's ``evaluation`` artifacts. Returns
    ``train``'s summary."""
    import mlflow

    chosen, version = registered.chosen, registered.version
    mlflow.set_tags({"chosen_selector": chosen, "registered_version": version, "promoted": str(promoted)})
    gain = registered.model.model_.get_booster().get_score(importance_type="gain")
    importance = {FEATURE_NAMES[int(k[1:])] if k.startswith("f") and k[1:].isdigit() else k: float(v)
                  for k, v in gain.items()}
    (out_dir / "importance.json").write_text(json.dumps(importance, indent=2))
    (out_dir / "summary.json").write_text(json.dumps(
        {"mlflow_run_id": run_id, "dataset_digest": data.digest, "rows": len(data.df),
         "extra_rows": len(data.fit_df) - len(data.df), "chosen": chosen,
         "registered_version": version, "promoted": promoted, "feature_schema_hash": FEATURE_SCHEMA_HASH},
        indent=2))
    report = write_report(out_dir)
    mlflow.log_artifacts(str(out_dir), artifact_path="evaluation")
    return {"run_id": run_id, "chosen": chosen, "version": version, "promoted": promoted,
            "report": str(report),
            "tables": {s: t.to_dict("index") for s, t in scores.by_split.items()},
            "measured_holdout": {m: t.to_dict("index") for m, t in scores.holdout.items()}, "text": scores.text}


# -- helpers of the stages -----------------------------------------------------------------
def _candidate(selectors: list[BaseSelector], by_split: dict, grouped: Sequence[str]) -> BaseSelector:
    """The learned selector to register (unfitted): the shipped policy's inner model if the
    evaluation scored one, else the exportable one with the best grouped hold-out capture."""
    for selector in selectors:
        if isinstance(selector, ShippedPolicy) and selector.inner is not None:
            return selector.inner
    learned = [s for s in selectors if s.name in LEARNED and s.name in by_split[grouped[0]].index]
    return max(learned or [LEARNED["xgb-regressor"]()],
               key=lambda s: np.mean([by_split[g].loc[s.name, "oracle_capture"] for g in grouped]))


def _log_model(model: BaseSelector, candidate: BaseSelector, df: pd.DataFrame, digest: str, by_split: dict,
               grouped: Sequence[str], row: str, run_id: str) -> str:
    """Log `model` (fitted `candidate`) with its runtime rules; tags carry the hold-out
    captures of `row`, the table row that scored what ships."""
    import mlflow

    rules, evidence = export_files(fitted_rules(candidate, df, digest, run_id))
    mlflow.log_dict(evidence, "evidence.json")
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / "selector.json", Path(tmp) / "evidence.json"]
        files[0].write_text(json.dumps(rules, indent=1))
        files[1].write_text(json.dumps(evidence, indent=1))
        info = mlflow.xgboost.log_model(model.model_, name="selector", registered_model_name=REGISTERED_MODEL,
                                        model_format="ubj", extra_files=[str(f) for f in files],
                                        pip_requirements=_model_requirements())
    version = str(info.registered_model_version)
    client = mlflow.MlflowClient()
    for split in grouped:
        table = by_split[split]
        client.set_model_version_tag(REGISTERED_MODEL, version, f"{split}_oracle_capture",
                                     f"{table.loc[row, 'oracle_capture']:.6f}")
        client.set_model_version_tag(REGISTERED_MODEL, version, f"{split}_heuristic_capture",
                                     f"{table.loc['heuristic', 'oracle_capture']:.6f}")
    client.set_model_version_tag(REGISTERED_MODEL, version, "feature_schema_hash", FEATURE_SCHEMA_HASH)
    return version


PROVENANCE = ("dataset_digest", "ficco_version", "feature_schema_version", "feature_names", "target")
"""What training records about a model that the runtime never reads: evidence.json's, not
selector.json's (``export_files``)."""


def fitted_rules(candidate: BaseSelector, df: pd.DataFrame, digest: str, run_id: str) -> dict:
    """The runtime rules for `candidate` (unfitted) trained on `df` (its ``dataset_digest``)
    in the MLflow run `run_id`, fitted on validation folds of `df` (``fit_abstention``,
    ``fit_unseen_hardware``), with their validation figures and provenance: what
    ``export_files`` splits into an export's two files."""
    abstention = fit_abstention(lambda: clone(candidate), df)
    unseen = fit_unseen_hardware(lambda: clone(candidate), df, abstention)
    # unseen's by_reason is a copy: with_machine_fallbacks moves its choice into abstention.by_reason.
    return {**runtime_meta(candidate.name, df), "abstention": with_machine_fallbacks(abstention, unseen),
            "unseen_hardware": {k: v for k, v in unseen.items() if k != "by_reason"},
            "dataset_digest": digest, "mlflow_run_id": run_id, "ficco_version": __version__}


def export_files(meta: dict) -> tuple[dict, dict]:
    """An export's ``selector.json`` and ``evidence.json`` from ``fitted_rules``' `meta`.

    The rules are written as the runtime parses them (``Scope.from_meta``, then
    ``Scope.to_meta``): a file the runtime would refuse is never written, and it holds only
    what the runtime reads. The evidence holds the validation figures, the sampled machines
    (``rules_and_evidence``; their names leave ``training_ranges`` too) and the provenance
    (``PROVENANCE``; the GPU rule's fit)."""
    rules, evidence = rules_and_evidence(meta)
    # The sampled machines' names too: their specs are the evidence's, so no job can name one.
    seen = rules["training_ranges"].get("hardware", [])
    if kept := [h for h in seen if h not in evidence.get("sampled_machines", {})]:
        rules = {**rules, "training_ranges": {**rules["training_ranges"], "hardware": kept}}
    selector = Scope.from_meta(rules, "selector.json to export").to_meta()
    gpu_fit = {k: v for k, v in rules.get("gpu_no_harm", {}).items() if k not in selector.get("gpu_no_harm", {})
               and k != "measured"}
    provenance = {k: rules[k] for k in PROVENANCE if k in rules}
    return selector, {**evidence, **provenance, **({"gpu_no_harm": gpu_fit} if gpu_fit else {})}


def _model_requirements() -> list[str]:
    """What loading the logged model needs, pinned to this environment. Given, MLflow skips
    inferring them, which loads the model in a Python process of its own (seconds per model)."""
    import mlflow.xgboost

    pinned = [f"{dist}=={importlib.metadata.version(dist)}" for dist in ("numpy", "pandas", "scikit-learn", "scipy")]
    return mlflow.xgboost.get_default_pip_requirements() + pinned


def _maybe_promote(client, version: str, by_split: dict, grouped: Sequence[str], name: str) -> bool:
    """Move the champion alias to `version` only if it beats the heuristic and the champion.

    A champion of another feature schema is no rival: the runtime refuses to load it, and
    its scores were taken on other features (and, when the cost model changed, other labels)."""
    for split in grouped:
        if by_split[split].loc[name, "oracle_capture"] <= by_split[split].loc["heuristic", "oracle_capture"]:
            return False
    try:
        champion = client.get_model_version_by_alias(REGISTERED_MODEL, ALIAS)
    except Exception:  # noqa: BLE001 - no champion yet (MLflow raises its own error type)
        champion = None
    if champion is not None and champion.tags.get("feature_schema_hash") == FEATURE_SCHEMA_HASH:
        for split in grouped:
            theirs = champion.tags.get(f"{split}_oracle_capture")
            if theirs is not None and by_split[split].loc[name, "oracle_capture"] < float(theirs):
                return False
    client.set_registered_model_alias(REGISTERED_MODEL, ALIAS, version)
    return True


def train_from_files(config: TrainConfig, datasets: Sequence[str], telemetry: Sequence[str]):
    """``ficco train``: train on `datasets` (default: the default training data) plus the
    telemetry files' rows; returns (train's summary, the telemetry rows or None).
    Raises DatasetError, ValueError (a telemetry file that adds nothing)."""
    from ficco_select.data.telemetry import read_telemetry
    from ficco_select.hardware import machines
    from ficco_select.train.training_data import load_training_data, telemetry_training_rows, training_machines

    df = load_training_data(datasets)
    with machines(training_machines(datasets)):
        extra = None
        if telemetry:
            extra = telemetry_training_rows(read_telemetry(telemetry), df)
            if extra.empty:
                raise ValueError(f"{', '.join(telemetry)}: no telemetry scenario has a verified baseline and another "
                                 "verified schedule outside the dataset; nothing to add to the training data")
        return train(df, config, extra=extra), extra
