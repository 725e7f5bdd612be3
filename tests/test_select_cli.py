"""`ficco select`: one decision per scenario-table row, from a real exported model or the
heuristic; malformed rows get the baseline (source fallback) instead of stopping the command;
`--truth` scores the decisions, and refuses a dataset that lacks most schedules."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from ficco_select.data.catalog import catalog
from ficco_select.data.dataset import write_parquet_atomic
from ficco_select.data.simulate import simulate
from ficco_select.cli.main import main
from ficco_select import Scenario
from ficco_select.features import FEATURE_SCHEMA_HASH
from ficco_select.hardware import load_hardware
from ficco_select.runtime.selector import Selector
from ficco_select.runtime.loading import RULES_VERSION
from ficco_select.schedule import BASELINE
from ficco_select.train.selectors import XGBTimeRegressor
from ficco_select.train.shipped import training_ranges
from helpers.datasets import catalog_slice as _catalog_slice, thinned as _thinned

HEADER = "group,op,m,n,k,dtype,world_size,hardware,imbalance"
MALFORMED = [  # (line, what is wrong)
    ("llama3,ag_gemm,abc,4096,4096,bfloat16,8,h100-nvswitch,", "column 'm'"),
    ("llama3,conv2d,8192,4096,4096,bfloat16,8,h100-nvswitch,", "column 'op'"),
    ("llama3,ag_gemm,8192,4096,4096,,8,h100-nvswitch,", "column 'dtype'"),
    ("llama3,ag_gemm,8191,4096,4096,bfloat16,8,h100-nvswitch,", "not divisible"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A real model: XGBoost fitted on simulated h100-nvswitch rows, written the way
    `ficco export` writes it (XGBoost JSON + selector.json)."""
    recs = catalog("full", world_sizes=(2, 4, 8), hardware="h100-nvswitch", models=["llama3-8b"])
    df = simulate([Scenario.from_record(r) for r in recs], load_hardware("h100-nvswitch"), noise=0.03, seed=4)
    model = XGBTimeRegressor(n_estimators=30).fit(df)
    folder = tmp_path_factory.mktemp("selector")
    model.model_.get_booster().save_model(str(folder / "model.json"))
    (folder / "selector.json").write_text(json.dumps({
        "rules_version": RULES_VERSION, "selector": "xgb-regressor", "feature_schema_hash": FEATURE_SCHEMA_HASH,
        "training_ranges": training_ranges(df),
        # Trust every margin: with the whole-schedule features this small model often scores
        # its two best candidates alike, and the default rule (0.01) would abstain there.
        "abstention": {"min_margin": 0.0, "fallback": "heuristic"}}))
    return folder, recs


def table(tmp_path, records, malformed=True) -> tuple:
    """A CSV of `records` then the malformed lines; returns (path, lines without header)."""
    lines = [",".join("" if r.get(c) is None else str(r[c]) for c in HEADER.split(",")) for r in records]
    if malformed:
        lines += [line for line, _ in MALFORMED]
    path = tmp_path / "scenarios.csv"
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    return path, lines


def select(*args):
    res = CliRunner().invoke(main, ["select", *map(str, args)])
    return res


def test_heuristic_only_decides_every_valid_row_and_falls_back_on_malformed_ones(tmp_path):
    recs = catalog("full", world_sizes=(8,), hardware="h100-nvswitch", models=["llama3-8b"])[:3]
    path, lines = table(tmp_path, recs)
    res = select("--scenarios", path, "--heuristic-only", "--json")
    assert res.exit_code == 0, res.output
    decisions = json.loads(res.stdout)
    assert [d["row"] for d in decisions] == list(range(1, len(lines) + 1))
    for d, rec in zip(decisions, recs):
        assert d["scenario_id"] == Scenario.from_record(rec).scenario_id
        assert d["source"] == "heuristic" and d["reason"] == "no model" and d["confidence"] == 0.0
        assert d["schedule"] == Selector().select(rec).schedule.name
    for d, (_, why) in zip(decisions[len(recs):], MALFORMED):
        assert d["scenario_id"] is None and d["source"] == "fallback"
        assert d["schedule"] == BASELINE.name and why in d["reason"]


def test_a_real_model_decides_inside_its_training_ranges(model_dir, tmp_path):
    folder, recs = model_dir
    unseen = {**recs[0], "hardware": "mi300x-8"}
    unknown = {**recs[0], "hardware": "tpu-v9"}
    rows = [*recs, unseen, unknown]
    path, _ = table(tmp_path, rows)
    res = select("--scenarios", path, "--model", folder, "--json")
    assert res.exit_code == 0, res.output
    decisions = json.loads(res.stdout)
    reference = Selector.load(folder)
    for d, rec in zip(decisions, rows):  # the command says what the runtime would do
        expected = reference.select(rec)
        assert (d["schedule"], d["source"], d["reason"]) == (expected.schedule.name, expected.source, expected.reason)
        assert d["confidence"] == pytest.approx(expected.confidence)
    assert [d["source"] for d in decisions[:len(recs)]] == ["model"] * len(recs)  # all inside the ranges
    assert all(0 <= d["confidence"] <= 1 for d in decisions[:len(recs)])
    assert any(d["confidence"] > 0 for d in decisions[:len(recs)])
    assert decisions[len(recs)]["source"] == "heuristic" and "not seen" in decisions[len(recs)]["reason"]
    assert decisions[len(recs) + 1]["source"] == "fallback" and decisions[len(recs) + 1]["scenario_id"]
    assert [d["source"] for d in decisions[len(rows):]] == ["fallback"] * len(MALFORMED)


def test_the_table_names_each_row_and_counts_the_sources(model_dir, tmp_path):
    folder, recs = model_dir
    path, _ = table(tmp_path, recs[:4])
    res = select("--scenarios", path, "--model", folder)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["row", "scenario_id", "op", "m,n,k", "P", "hardware", "schedule", "source",
                                "confidence", "reason"]
    assert lines[5].split()[:2] == ["5", "-"] and "fallback" in lines[5] and "column 'm'" in lines[5]
    assert lines[-1].startswith(f"{4 + len(MALFORMED)} rows: ") and f"{len(MALFORMED)} fallback" in lines[-1]
    assert "model xgb-regressor from" in lines[-1]


def test_parquet_tables_are_read_too(tmp_path):
    recs = catalog("full", world_sizes=(4,), hardware="mi300x-8", models=["mixtral-8x7b"])[:4]
    path = tmp_path / "s.parquet"
    pd.DataFrame(recs).to_parquet(path)
    res = select("--scenarios", path, "--heuristic-only", "--json")
    assert res.exit_code == 0, res.output
    decisions = json.loads(res.stdout)
    assert [d["scenario_id"] for d in decisions] == [Scenario.from_record(r).scenario_id for r in recs]
    assert {d["source"] for d in decisions} == {"heuristic"}


def test_wrong_files_and_options_are_refused_with_the_reason(tmp_path):
    path, _ = table(tmp_path, [], malformed=True)
    res = select("--scenarios", path, "--model", tmp_path / "nothing-here")
    assert res.exit_code == 1 and "no usable selector there" in res.output
    res = select("--scenarios", path, "--model", tmp_path, "--heuristic-only")
    assert res.exit_code == 2 and "exclude each other" in res.output
    no_op = tmp_path / "no_op.csv"
    no_op.write_text("group,m,n,k,dtype,world_size,hardware\nx,8,8,8,float32,2,cpu\n")
    res = select("--scenarios", no_op, "--heuristic-only")
    assert res.exit_code == 1 and "column 'op' is missing" in res.output
    res = select("--scenarios", tmp_path / "absent.csv", "--heuristic-only")
    assert res.exit_code == 1 and "no such scenario file" in res.output


def test_truth_scores_the_decisions_per_dtype_beside_the_heuristic_and_the_ceiling(model_dir, tmp_path):
    folder, _ = model_dir
    recs = catalog("full", world_sizes=(4, 8), hardware="mi300x-8", models=["mistral-7b"])
    truth = simulate([Scenario.from_record(r) for r in recs], load_hardware("mi300x-8"))  # noise-free
    write_parquet_atomic(truth, tmp_path / "truth.parquet")
    res = select("--truth", tmp_path / "truth.parquet", "--model", folder, "--json")
    assert res.exit_code == 0, res.output
    tables = json.loads(res.stdout)
    assert set(tables) == {"all", *{r["dtype"] for r in recs}, *{r["op"] for r in recs}} and "bfloat16" in tables
    assert tables["gemm_ar"]["shipped"]["n"] == sum(r["op"] == "gemm_ar" for r in recs)
    assert tables["all"]["ceiling"]["near_opt_2"] == 1.0 and tables["all"]["ceiling"]["n"] == len(recs)
    assert tables["bfloat16"]["shipped"]["n"] == sum(r["dtype"] == "bfloat16" for r in recs)
    # The shipped row scores exactly the decisions `ficco select` lists for these scenarios.
    listed = json.loads(select("--truth", tmp_path / "truth.parquet", "--model", folder, "--json").stdout)
    assert listed == tables
    from ficco_select.train.metrics import score

    decisions = Selector.load(folder)
    chosen = {Scenario.from_record(r).scenario_id: decisions.select(r).schedule.name for r in recs}
    assert tables["all"]["shipped"]["near_opt_2"] == pytest.approx(score(truth, chosen)["near_opt_2"])
    assert "give --scenarios" in select("--model", folder).output


def test_select_truth_refuses_a_dataset_lacking_most_schedules(tmp_path):
    from click.testing import CliRunner

    from ficco_select.data.dataset import write_parquet_atomic
    from ficco_select.cli.main import main
    from helpers.cli import refused

    thin = _thinned(tmp_path)
    refused(["select", "--truth", thin, "--heuristic-only"], "--truth", "thin.parquet", "36 of 40 scenarios lack",
            "ficco.d2.ring.gemm_per_piece.m.sm")
    # The same scenarios with every schedule are scored.
    whole = tmp_path / "whole.parquet"
    write_parquet_atomic(_catalog_slice(tmp_path), whole)
    res = CliRunner().invoke(main, ["select", "--truth", str(whole), "--heuristic-only"])
    assert res.exit_code == 0, res.output
    assert "== all" in res.output
