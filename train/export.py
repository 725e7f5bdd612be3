"""Export a registered selector for the runtime: XGBoost JSON, selector.json (its rules) and
evidence.json (their validation figures) in one folder.

The runtime (``ficco_select.runtime.selector``) never talks to MLflow: this explicit step copies
the model out of the registry once, with the precompiled layer tables of a scenario table
if asked (``--layers``). Each export is a version folder beside the destination, which is
a link switched to it atomically (``publish``), so a reader sees the old export or the new
one, whole; a destination holding anything an export does not write is refused, never
emptied.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ficco_select.data.locks import output_lock
from ficco_select.runtime.layers import GRID_STEPS_PER_OCTAVE, TABLES_FILE, export_digest
from ficco_select.runtime.loading import check_version
from ficco_select.runtime.scope import Scope
from ficco_select.runtime.trees import read_json
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import LAYER_COLUMNS, Scenario
from ficco_select.train.run import ALIAS, REGISTERED_MODEL

EXPORT_FILES = ("model.json", "selector.json", "evidence.json", "layers.json")
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

    evidence = metas[0].with_name("evidence.json")  # what training found; the runtime never reads it
    rules = export_rules(read_json(metas[0]), f"{model_uri}: selector.json")

    def write(folder: Path) -> None:
        booster.save_model(str(folder / "model.json"))
        (folder / "selector.json").write_text(json.dumps(rules, indent=1))
        if evidence.exists():
            shutil.copy(evidence, folder / "evidence.json")
        if layers:
            write_tables(Selector.load(folder), layers, folder)

    return publish(out, write)


def export_rules(meta: object, where: str) -> dict:
    """A registered ``selector.json`` (`meta`) as the runtime reads it: refused (ValueError
    naming `where` and the field) for another layout, feature schema or a malformed rule, as
    loading would refuse it; written with exactly what the runtime reads (``Scope.to_meta``),
    so that a model registered with provenance in its rules still ships only the rules."""
    return Scope.from_meta(check_version(meta, where), where).to_meta()


def write_tables(selector: Selector, layers: Iterable[Scenario], folder: str | Path) -> Path:
    """Build the tables of `layers` (their m ignored) with `selector` (loaded from `folder`)
    and write them to ``folder/layers.json``; deterministic: the same export and layers give
    the same bytes. Layers that cannot have a table (``Selector.layer_table``) are left out."""
    tables = {}
    for s in layers:
        table = selector.layer_table(s)
        if table is not None:
            tables[table.layer] = table
    doc = {
        "generated": "by ficco export --layers from the model in this folder; do not edit",
        "model_digest": export_digest(folder), "grid_steps_per_octave": GRID_STEPS_PER_OCTAVE,
        "layers": [{**dict(zip(LAYER_COLUMNS, key)), "step": t.step, "grid": list(t.grid),
                    "decisions": [[d.schedule.name, d.source, d.confidence, d.reason] for d in t.decisions]}
                   for key, t in sorted(tables.items(), key=lambda kv: json.dumps(kv[0]))],
    }
    head = json.dumps({k: v for k, v in doc.items() if k != "layers"}, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(entry) for entry in doc["layers"])  # a layer per line: diffs read
    path = Path(folder, TABLES_FILE)
    path.write_text(f'{head},\n "layers": [\n{body}\n ]\n}}\n')
    return path


KEEP_VERSIONS = 3
"""Export versions kept beside the live one: a job that resolved an older one a moment ago
still finds its files."""


def publish(out: str | Path, write: Callable[[Path], None]) -> Path:
    """Make `out` an export written by `write(folder)`, switched in atomically.

    The files go to a new version folder beside `out` (``.<name>.v<n>-<digest>``), and `out`
    becomes a symbolic link to it by one ``os.replace`` of the link: a job loading `out`
    resolves the link once (``Selector.load``) and reads every file of one version, the old
    or the new, whole. A real folder left at `out` by an older layout is moved aside first
    (that one switch leaves a moment without an export). The newest ``KEEP_VERSIONS``
    earlier versions are kept; older ones are removed. One exporter at a time: a second
    refuses, naming the first (``ficco_select.data.locks``)."""
    out = Path(out)
    # Two exporters at once: the second refuses. The lock is the link's own (it is what moves).
    with output_lock(out, "ficco export", follow=False):
        return _publish(out, write)


def _publish(out: Path, write: Callable[[Path], None]) -> Path:
    _check_destination(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
    new.chmod(0o755)  # mkdtemp makes it private; an export is read by jobs of other users too
    try:
        write(new)
        digest = export_digest(new)
        number = 1 + max((_version_number(p) for p in _versions(out)), default=0)
        version = out.parent / f".{out.name}.v{number}-{digest}"
        new.rename(version)
    finally:
        if new.exists():
            shutil.rmtree(new)
    link = out.parent / f".{out.name}.link-{version.name}"
    link.unlink(missing_ok=True)
    os.symlink(version.name, link)  # relative: the pair moves together
    if out.is_dir() and not out.is_symlink():  # the older layout: a real folder, moved aside
        out.rename(out.parent / f".{out.name}.v0-{export_digest(out) if (out / 'model.json').exists() else 'empty'}")
    os.replace(link, out)
    for old in sorted(_versions(out), key=_version_number)[:-(KEEP_VERSIONS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _versions(out: Path) -> list[Path]:
    return [p for p in out.parent.glob(f".{out.name}.v*-*") if p.is_dir() and not p.is_symlink()]


def _version_number(path: Path) -> int:
    head = path.name.rsplit(".v", 1)[-1].split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _check_destination(out: Path) -> None:
    """`out` may be replaced only if it is absent, an empty folder, or an earlier export
    (a link to one of its versions, or a folder of the older layout)."""
    if out.is_symlink():
        target = Path(os.readlink(out))
        if target.parent != Path(".") or not target.name.startswith(f".{out.name}.v"):
            raise ValueError(f"--out {out}: a link to {target}, not to one of its exports; choose another --out "
                             "(nothing was changed)")
        return
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder; choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
    if foreign:
        raise ValueError(f"--out {out}: holds {', '.join(foreign[:5])}, which an export does not write; "
                         "choose another --out (nothing was changed)")
