"""Export a registered selector for the runtime: XGBoost JSON + selector.json in one folder.

The runtime (``ficco_select.runtime.selector``) never talks to MLflow: this explicit step copies
the model out of the registry once, with the precompiled layer tables of a scenario table
if asked (``--layers``). The folder is written beside its destination and
swapped in, so a reader sees the old export or the new one; a destination holding
anything an export does not write is refused, never emptied.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ficco_select.runtime.layers import write_tables
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from train.run import ALIAS, REGISTERED_MODEL

EXPORT_FILES = ("model.json", "selector.json", "layers.json")
"""What an exported folder holds; a destination with anything else is not ours to replace."""


def export(out: str | Path, model_uri: str = f"models:/{REGISTERED_MODEL}@{ALIAS}",
           layers: Sequence[Scenario] = ()) -> Path:
    """Write the registered model `model_uri` to the folder `out`, with the precompiled
    tables of `layers` (``ficco_select.runtime.layers``; their m is ignored) if given."""
    import mlflow
    import xgboost as xgb

    out = Path(out)
    _check_destination(out)
    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    model_files = [p for p in local.rglob("model.ubj")] or [p for p in local.rglob("model.json")]
    metas = list(local.rglob("selector.json"))
    if not model_files or not metas:
        raise ValueError(f"{model_uri}: no XGBoost model file or selector.json in the artifacts")
    booster = xgb.Booster()
    booster.load_model(str(model_files[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        booster.save_model(str(new / "model.json"))
        shutil.copy(metas[0], new / "selector.json")
        if layers:
            write_tables(Selector.load(new), layers, new)
        if out.exists():  # an earlier export: moved aside, then removed once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / out.name)
            new.rename(out)
            shutil.rmtree(old)
        else:
            new.rename(out)
    finally:
        if new.exists():
            shutil.rmtree(new)
    return out


def _check_destination(out: Path) -> None:
    """`out` may be replaced only if it is absent, an empty folder, or an earlier export."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder; choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
    if foreign:
        raise ValueError(f"--out {out}: holds {', '.join(foreign[:5])}, which an export does not write; "
                         "choose another --out (nothing was changed)")
