"""Export a registered selector for the runtime: XGBoost JSON + selector.json in one folder.

The runtime (``ficco_select.selector``) never talks to MLflow: this explicit step copies
the model out of the registry once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from train.run import ALIAS, REGISTERED_MODEL


def export(out: str | Path, model_uri: str = f"models:/{REGISTERED_MODEL}@{ALIAS}") -> Path:
    import mlflow
    import xgboost as xgb

    out = Path(out)
    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    model_files = [p for p in local.rglob("model.ubj")] or [p for p in local.rglob("model.json")]
    metas = list(local.rglob("selector.json"))
    if not model_files or not metas:
        raise ValueError(f"{model_uri}: no XGBoost model file or selector.json in the artifacts")
    booster = xgb.Booster()
    booster.load_model(str(model_files[0]))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    booster.save_model(str(tmp / "model.json"))
    shutil.copy(metas[0], tmp / "selector.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # readers see the old folder or the new one, never half of one
    return out
