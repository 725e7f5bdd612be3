"""A real training tracked in a real MLflow SQLite store: runs, registry, promotion rules;
`ficco train` and `ficco pipeline` refuse a dataset they cannot use before any work."""

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from ficco_select.data.catalog import catalog
from ficco_select.data.simulate import simulate
from ficco_select.cli.main import main
from ficco_select import Scenario
from ficco_select.features import FEATURE_SCHEMA_HASH
from ficco_select.hardware import load_hardware
from ficco_select.train.config import TrainConfig
from ficco_select.train.run import ALIAS, EXPERIMENT, REGISTERED_MODEL, _maybe_promote, train
from ficco_select.train.selectors import AlwaysBaseline, Heuristic, Oracle, XGBRanker, XGBTimeRegressor
from ficco_select.train.shipped import ShippedPolicy
from helpers.datasets import catalog_slice as _catalog_slice, thinned as _thinned

# Tier: end to end (training, MLflow, evaluation); deselect with -m "not slow"
pytestmark = pytest.mark.slow


def fast_selectors():
    ranker = XGBRanker(n_estimators=40)
    return [XGBTimeRegressor(n_estimators=40), ranker, ShippedPolicy(ranker), Heuristic(tune=False),
            AlwaysBaseline(), Oracle()]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    frames = []
    for hw in ("mi300x-8", "h100-nvswitch"):
        recs = catalog("full", world_sizes=(2, 4, 8), hardware=hw, models=["llama3-8b", "mixtral-8x7b"])
        frames.append(simulate([Scenario.from_record(r) for r in recs], load_hardware(hw), noise=0.03, seed=4))
    df = pd.concat(frames, ignore_index=True)
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    first = train(df, TrainConfig(splits=("family", "hardware"), selectors=fast_selectors, out_dir=root / "out1",
                                  progress=False))
    second = train(df, TrainConfig(splits=("family", "hardware"), selectors=fast_selectors, out_dir=root / "out2",
                                   progress=False))
    yield root, first, second
    mp.undo()


def test_training_is_tracked_with_nested_runs_and_a_registered_model(store):
    import mlflow

    root, first, second = store
    exp = mlflow.get_experiment_by_name(EXPERIMENT)
    runs = mlflow.search_runs([exp.experiment_id])
    parent = runs[runs["run_id"] == first["run_id"]].iloc[0]
    assert parent["params.feature_schema_hash"] == FEATURE_SCHEMA_HASH
    children = runs[runs["tags.mlflow.parentRunId"] == first["run_id"]]
    assert set(children["params.selector"]) == {"xgb-regressor", "xgb-ranker", "shipped", "heuristic",
                                                "always-baseline", "ceiling"}
    assert "metrics.family_oracle_capture" in runs.columns
    client = mlflow.MlflowClient()
    versions = client.search_model_versions(f"name='{REGISTERED_MODEL}'")
    assert {str(v.version) for v in versions} == {first["version"], second["version"]}
    local = mlflow.artifacts.download_artifacts(f"models:/{REGISTERED_MODEL}/{first['version']}")
    meta = json.loads(next(Path(local).rglob("selector.json")).read_text())
    assert meta["feature_schema_hash"] == FEATURE_SCHEMA_HASH and meta["selector"] == first["chosen"]
    # What registers is what the shipped row scored: its inner model (the ranker, with its
    # settings), tagged with the shipped row's hold-out capture, not the bare model's.
    assert first["chosen"] == "xgb-ranker"
    assert meta["abstention"]["min_margin"] is None or meta["abstention"]["min_margin"] >= 0
    assert "validation" not in json.dumps(meta) and "by_reason" not in meta.get("unseen_hardware", {})  # rules only
    # The validation evidence beside the rules, in the model's artifacts and in the run.
    evidence = json.loads(next(Path(local).rglob("evidence.json")).read_text())
    assert evidence["abstention"]["validation_scenarios"] > 0 and evidence["mlflow_run_id"] == meta["mlflow_run_id"]
    assert "dataset_digest" in evidence and "dataset_digest" not in meta  # provenance: the evidence's
    logged = mlflow.artifacts.download_artifacts(run_id=meta["mlflow_run_id"], artifact_path="evidence.json")
    assert json.loads(Path(logged).read_text()) == evidence
    version = client.get_model_version(REGISTERED_MODEL, first["version"])
    shipped = first["tables"]["family"]["shipped"]["oracle_capture"]
    assert float(version.tags["family_oracle_capture"]) == pytest.approx(shipped, abs=1e-6)
    assert (root / "out1" / "comparison.txt").exists()


def test_promotion_rules(store):
    import mlflow

    _, first, second = store
    client = mlflow.MlflowClient()
    v1, v2 = first["version"], second["version"]
    client.set_registered_model_alias(REGISTERED_MODEL, ALIAS, v1)
    client.set_model_version_tag(REGISTERED_MODEL, v1, "family_oracle_capture", "0.95")

    def tables(model, heuristic):
        return {"family": pd.DataFrame({"oracle_capture": {"xgb-ranker": model, "heuristic": heuristic}})}

    # not better than the heuristic: no promotion
    assert not _maybe_promote(client, v2, tables(0.90, 0.92), ["family"], "xgb-ranker")
    # better than the heuristic but below the champion: no promotion
    assert not _maybe_promote(client, v2, tables(0.93, 0.90), ["family"], "xgb-ranker")
    assert str(client.get_model_version_by_alias(REGISTERED_MODEL, ALIAS).version) == v1
    # better than both: the alias moves
    assert _maybe_promote(client, v2, tables(0.97, 0.90), ["family"], "xgb-ranker")
    assert str(client.get_model_version_by_alias(REGISTERED_MODEL, ALIAS).version) == v2
    # A champion of another feature schema (the runtime refuses it) is no rival, whatever it scored.
    client.set_model_version_tag(REGISTERED_MODEL, v2, "family_oracle_capture", "0.99")
    client.set_model_version_tag(REGISTERED_MODEL, v2, "feature_schema_hash", "another-schema")
    assert _maybe_promote(client, v1, tables(0.93, 0.90), ["family"], "xgb-ranker")
    assert str(client.get_model_version_by_alias(REGISTERED_MODEL, ALIAS).version) == v1


def test_the_report_is_one_html_file_with_tables_and_plots(store):
    root, first, _ = store
    page = (root / "out1" / "report.html").read_text()
    assert page.count("<table") >= 2 and page.count("data:image/png;base64,") >= 4
    assert first["chosen"] in page
    assert {p.name for p in (root / "out1").glob("*.png")} >= {"confusion.png", "best_schedule_map.png", "feature_importance.png"}
    from click.testing import CliRunner

    from ficco_select.cli.main import main

    res = CliRunner().invoke(main, ["report", "--dir", str(root / "out1")])
    assert res.exit_code == 0 and res.output.strip().endswith("report.html")
    bad = CliRunner().invoke(main, ["report", "--dir", str(root / "nothing")])
    assert bad.exit_code != 0


def test_pipeline_adds_new_hardware_rows_and_refuses_what_it_cannot_do(tmp_path):
    from ficco_select.train.pipeline import new_hardware_rows

    rows = new_hardware_rows("sim", "l40s-pcie-8", tmp_path, progress=False)
    assert set(rows["hardware"]) == {"l40s-pcie-8"} and (rows["backend"] == "sim").all()
    with pytest.raises(ValueError, match="needs --hardware"):
        new_hardware_rows("sim", None, tmp_path, progress=False)
    # A GPU is measured on its machine (ficco measure --backend cuda) and joins as a dataset.
    with pytest.raises(ValueError, match="add it with --dataset"):
        new_hardware_rows("cuda", None, tmp_path, progress=False)
    result = CliRunner().invoke(main, ["pipeline", "--backend", "cuda"])
    assert result.exit_code == 2 and "'cuda' is not one of 'cpu', 'sim'" in result.output
    result = CliRunner().invoke(main, ["pipeline", "--dataset", str(tmp_path / "missing.parquet")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_export_then_the_runtime_selector_decides_without_raising(store, tmp_path, caplog):
    from ficco_select.runtime.selector import Selector
    from ficco_select.train.export import export

    root, first, second = store
    folder = export(tmp_path / "sel", f"models:/{REGISTERED_MODEL}/{second['version']}")
    assert {p.name for p in folder.iterdir()} == {"model.json", "selector.json", "evidence.json"}
    sel = Selector.load(folder)
    assert sel.model is not None
    recs = catalog("full", world_sizes=(4, 8), hardware="mi300x-8", models=["llama3-8b"])
    sources = set()
    for rec in recs:
        d = sel.select(rec)
        assert d.schedule in __import__("ficco_select").candidates(Scenario.from_record(rec), "sim")
        assert sel.select(rec) is d  # cached
        sources.add(d.source)
    assert "model" in sources
    # outside what it was trained on: the fallback fitted for that reason decides, and says so
    d = sel.select({**recs[0], "hardware": "a100-nvswitch"})
    fallbacks = sel.rules.fallback_by_reason
    assert d.abstained == "unseen_machine" and "not seen" in d.reason
    fitted = fallbacks.get((d.abstained, "gpu"), fallbacks.get((d.abstained, "any"), "heuristic"))
    assert d.source == (fitted if fitted in ("heuristic", "cost_model") else "fallback")
    # broken input never raises: the baseline, with one warning per key
    bad = {**recs[0], "m": -1}
    assert sel.select(bad).source == "fallback" and sel.select(bad).schedule.is_baseline
    # a corrupt model file: heuristic-only selector, one clear warning
    (folder / "model.json").write_text("{not json")
    caplog.clear()
    broken = Selector.load(folder)
    assert broken.model is None and "using the heuristic" in caplog.text
    assert broken.select(recs[0]).source == "heuristic"


def test_export_with_layers_precompiles_tables_that_the_runtime_reads(store, tmp_path, caplog):
    from ficco_select.runtime.layers import TABLES_FILE
    from ficco_select.runtime.selector import Selector
    from ficco_select.train.export import export

    root, first, second = store
    uri = f"models:/{REGISTERED_MODEL}/{second['version']}"
    recs = catalog("full", world_sizes=(4, 8), hardware="mi300x-8", models=["llama3-8b", "mixtral-8x7b"])
    layers = list({s.layer: s for s in map(Scenario.from_record, recs)}.values())
    folder = export(tmp_path / "sel", uri, layers)
    text = (folder / TABLES_FILE).read_text()
    assert "do not edit" in text and export(tmp_path / "again", uri, layers).joinpath(TABLES_FILE).read_text() == text
    sel = Selector.load(folder)
    lazy = Selector(sel.model, sel.rules.to_meta())
    assert {key for key, _ in sel._tables.items()} == {s.layer for s in layers}  # loaded, not built
    for layer in layers:
        pre, built = sel._tables.get(layer.layer), lazy.layer_table(layer)
        assert pre.grid == built.grid and [(d.schedule, d.source) for d in pre.decisions] == \
            [(d.schedule, d.source) for d in built.decisions]
    # Tables built from another model are not used: a warning, and they are built on first sight.
    (folder / "selector.json").write_text((folder / "selector.json").read_text() + " ")
    caplog.clear()
    stale = Selector.load(folder)
    assert stale.model is not None and not stale._tables and "layer tables" in caplog.text
    assert stale.layer_table(layers[0]) is not None


def test_a_new_champion_reaches_the_runtime_folder_without_a_manual_step(store, tmp_path):
    from ficco_select.runtime.selector import Selector
    from ficco_select.train.pipeline import export_if_promoted

    root, first, second = store
    first = {**first, "promoted": True}  # as a pipeline's summary is when its version became the champion
    done = export_if_promoted(first, tmp_path / "runtime")
    assert done["exported"] == str(tmp_path / "runtime") and Selector.load(done["exported"]).model is not None
    assert "exported" not in export_if_promoted({**second, "promoted": False}, tmp_path / "runtime2")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not an export")
    refused = export_if_promoted(first, tmp_path / "mine")
    assert "notes.txt" in refused["export_error"] and (tmp_path / "mine" / "notes.txt").exists()


def test_the_readme_retrain_flow_with_a_spec_file(tmp_path):
    """docs/new-hardware.md "Retrain on new hardware" with a machine described only by a file: every
    stage, each in a fresh process, finds it by the name the file declares."""
    import subprocess
    import sys

    import yaml

    from ficco_select.hardware import presets_dir

    spec = yaml.safe_load((presets_dir() / "h100-nvswitch.yaml").read_text())  # step 1: copy, rename, edit
    spec.update(name="my-node", link_bw_gbps=2 * spec["link_bw_gbps"])
    spec_path = tmp_path / "my-node.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    recs = catalog("full", world_sizes=(2, 4, 8), hardware=str(spec_path), models=["llama3-8b", "mixtral-8x7b"])
    table = tmp_path / "mine.csv"
    pd.DataFrame(recs)[["group", "op", "m", "n", "k", "dtype", "world_size", "hardware", "imbalance"]].to_csv(
        table, index=False)
    env = {**__import__("os").environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}

    def run(*args: str) -> str:
        res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        return res.stdout

    run("-m", "ficco_select.cli.main", "simulate", "--scenarios", str(table), "--out", "mine.parquet", "--noise", "0.03")
    run("-m", "ficco_select.cli.main", "dataset", "validate", "mine.parquet")
    simulated_ids = set(pd.read_parquet(tmp_path / "mine.parquet")["scenario_id"])
    assert set(pd.read_parquet(tmp_path / "mine.parquet")["hardware"]) == {"my-node"}
    # step 3: train beside a preset's rows, register, export (a fresh process reads the file's spec)
    run("-c", """
import pandas as pd
from ficco_select.data.catalog import catalog
from ficco_select.data.dataset import dataset_machines, read_dataset
from ficco_select.data.simulate import simulate
from ficco_select import Scenario
from ficco_select.hardware import load_hardware, machines
from ficco_select.train.export import export
from ficco_select.train.config import TrainConfig
from ficco_select.train.run import train
from ficco_select.train.selectors import AlwaysBaseline, Heuristic, Oracle, XGBRanker, XGBTimeRegressor
from ficco_select.train.shipped import ShippedPolicy
recs = catalog("full", world_sizes=(2, 4, 8), hardware="mi300x-8", models=["llama3-8b", "mixtral-8x7b"])
preset = simulate([Scenario.from_record(r) for r in recs], load_hardware("mi300x-8"), noise=0.03, seed=4)
df = pd.concat([read_dataset("mine.parquet"), preset], ignore_index=True)
fast = lambda: [XGBTimeRegressor(n_estimators=40), XGBRanker(n_estimators=40), Heuristic(tune=False),
                AlwaysBaseline(), Oracle()]
with machines(dataset_machines("mine.parquet")):  # the machine its rows name
    summary = train(df, TrainConfig(splits=("family", "hardware"), selectors=fast, out_dir="out", progress=False))
export("sel", f"models:/ficco-selector/{summary['version']}")
""")
    # the runtime, from the exported folder: the machine by name and by its file
    named = tmp_path / "named.csv"
    pd.read_csv(table).assign(hardware="my-node").to_csv(named, index=False)
    for path in (table, named):
        decisions = json.loads(run("-m", "ficco_select.cli.main", "select", "--model", "sel", "--scenarios", str(path),
                                   "--json"))
        assert {d["scenario_id"] for d in decisions} == simulated_ids  # one id per scenario, file or name
        # Known by its spec: no decision calls the machine unseen; a fallback is only the
        # fitted margin rule's (per operator it may abstain) or the GPU do-no-harm rule's,
        # never a machine it cannot place.
        assert not [d for d in decisions if "not seen" in d["reason"] or (
            d["source"] == "fallback" and "model margin" not in d["reason"] and "never trusts" not in d["reason"]
            and "the baseline does no harm" not in d["reason"])]
        assert any(d["source"] == "model" for d in decisions)


def test_export_never_empties_a_folder_it_did_not_write(store, tmp_path):
    from ficco_select.train.export import export

    root, first, second = store
    uri = f"models:/{REGISTERED_MODEL}/{second['version']}"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    sibling = tmp_path / "sel.tmp"  # the old export's scratch name: not ours either
    sibling.mkdir()
    (sibling / "x").write_text("keep")
    with pytest.raises(ValueError, match="notes.txt"):
        export(mine, uri)
    assert (mine / "notes.txt").read_text() == "keep"
    folder = tmp_path / "sel"
    export(folder, uri)
    export(folder, uri)  # an earlier export is replaced: the link now points at a newer version
    assert folder.is_symlink() and {p.name for p in folder.iterdir()} == {"model.json", "selector.json", "evidence.json"}
    assert (sibling / "x").read_text() == "keep"
    names = {p.name for p in tmp_path.iterdir()}
    assert {n for n in names if not n.startswith(".sel.")} == {"mine", "sel", "sel.tmp"}  # no scratch left behind
    assert {n for n in names if n.startswith(".sel.") and not n.startswith(".sel.v")} == {".sel.lock"}
    with pytest.raises(ValueError, match="not to one of its exports"):
        (tmp_path / "elsewhere").symlink_to(mine)
        export(tmp_path / "elsewhere", uri)


def test_a_train_config_is_checked_before_any_work_and_names_the_field():
    from ficco_select.train.config import TrainConfig

    with pytest.raises(ValueError, match=r"TrainConfig.splits: unknown split 'families'"):
        TrainConfig(splits=("families",))
    with pytest.raises(ValueError, match=r"TrainConfig.splits: a sequence of split names"):
        TrainConfig(splits="family")
    with pytest.raises(ValueError, match=r"TrainConfig.selectors: unknown set 'quick'"):
        TrainConfig(selectors="quick")
    assert TrainConfig(splits=["family"]).splits == ("family",) and TrainConfig().out_dir == Path("out/train")
    result = CliRunner().invoke(main, ["train", "--splits", "family,nope", "--dataset", "missing.parquet"])
    assert result.exit_code == 1 and "unknown split 'nope'" in result.output  # before the dataset is read


def test_train_refuses_a_dataset_lacking_most_schedules(tmp_path, monkeypatch):
    from helpers.cli import refused

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "train"
    refused(["train", "--dataset", _thinned(tmp_path), "--selectors", "debug", "--splits", "random",
             "--out", out, "--no-progress"], "thin.parquet", "36 of 40 scenarios lack", written=out)
    assert not (tmp_path / "mlflow.db").exists(), "a training run was started"


def test_pipeline_validates_its_datasets_before_any_work(tmp_path, monkeypatch):
    from ficco_select.data.dataset import write_parquet_atomic
    from helpers.cli import refused

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    df = _catalog_slice(tmp_path, scenarios=8)
    negative = df.copy()
    negative.loc[5, "time_s"] = -negative.loc[5, "time_s"]
    write_parquet_atomic(negative, tmp_path / "negative.parquet")
    write_parquet_atomic(df.drop(columns=["near_best"]), tmp_path / "nocol.parquet")
    out = tmp_path / "pipeline"
    for name, needles in {"negative.parquet": ("row 5", "column 'time_s'"),
                          "nocol.parquet": ("column 'near_best' is missing",)}.items():
        refused(["pipeline", "--dataset", tmp_path / name, "--debug", "--no-export", "--no-progress", "--out", out],
                name, *needles, written=out)
    assert not (tmp_path / "mlflow.db").exists(), "a training run was started"
