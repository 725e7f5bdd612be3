"""Repeatability: two sweeps compared (``ficco_select.data.compare``, ``ficco dataset compare``), runs
per repetition."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from ficco_select.data.catalog import catalog
from ficco_select.data.compare import compare
from ficco_select.data.dataset import attach_repeat, write_parquet_atomic
from ficco_select.data.simulate import simulate
from ficco_select.cli.main import main
from ficco_select.hardware import load_hardware
from ficco_select.scenario import Scenario


def sweep(seed: int, noise: float = 0.03) -> pd.DataFrame:
    recs = catalog("full", world_sizes=(2, 4), hardware="h100-nvswitch", models=["llama3-8b"])
    return simulate([Scenario.from_record(r) for r in recs], load_hardware("h100-nvswitch"), noise=noise, seed=seed)


def test_identical_sweeps_agree_perfectly_and_noise_lowers_agreement():
    a = sweep(1)
    summary, per = compare(a, a)
    assert summary["median_tau"] == 1.0 and summary["best_agreement"] == 1.0 and summary["repeat_capture"] == 1.0
    assert len(per) == a["scenario_id"].nunique()
    noisy, _ = compare(sweep(1, noise=0.3), sweep(2, noise=0.3))
    assert noisy["median_tau"] < 1.0 and noisy["repeat_capture"] < 1.0
    assert set(noisy["by_world_size"]) == {2, 4}


def test_a_best_that_is_not_a_tie_in_the_other_sweep_disagrees():
    def rows(times, ties):
        return pd.DataFrame([{"scenario_id": "s", "schedule": name, "status": "ok", "verified": True, "time_s": t,
                              "time_spread": 0.01, "near_best": tie, "op": "ag_gemm", "world_size": 2, "m": 8,
                              "n": 8, "k": 8, "ideal_speedup": 1.5}
                             for (name, t), tie in zip(times.items(), ties)])
    a = rows({"none.sm": 1.0, "x": 0.7, "y": 0.8}, [False, True, False])
    b = rows({"none.sm": 1.0, "x": 0.9, "y": 0.6}, [False, False, True])
    summary, per = compare(a, b)
    assert not per["best_agrees"].iloc[0]
    assert per["repeat_capture"].iloc[0] == pytest.approx(0.6 / 0.9)
    assert summary["above_ideal"] == 0.5  # b's best speedup 1/0.6 = 1.67 > ideal 1.5 beyond 1% spread


def test_attach_repeat_and_the_cli(tmp_path):
    a, b = sweep(1), sweep(2)
    joined = attach_repeat(a, b.iloc[: len(b) // 2])
    assert joined["time_repeat_s"].notna().sum() == len(b) // 2
    write_parquet_atomic(a, tmp_path / "a.parquet")
    write_parquet_atomic(b, tmp_path / "b.parquet")
    res = CliRunner().invoke(main, ["dataset", "compare", str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"),
                                    "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["scenarios"] == a["scenario_id"].nunique() and len(out["per_scenario"]) == out["scenarios"]
