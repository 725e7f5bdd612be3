"""The training report opened in a real browser (headless Chromium via Playwright,
``scripts/check_report.py``): it renders, its images load, its page logs no error; and the
check fails on a broken page."""

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("playwright", reason="Playwright for Python not installed (pip install -e '.[browser]')")
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="no Chromium at /usr/bin/chromium (apt-get install chromium)")

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_report", REPO / "scripts" / "check_report.py")
check_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_report)

SCHEDULES = ["none.sm", "shard.ring.dma", "ficco.d2.ring.gemm_per_step.m.dma", "ficco.d4.a2a.gemm_per_piece.m.sm"]


def small_training_output(folder: Path) -> Path:
    """What ``ficco_select.train.run.train`` writes for the report, tiny and made up: two grouped splits,
    three selectors, twelve scenarios."""
    selectors = ["xgb-regressor", "heuristic", "ceiling"]
    metrics = {"n": 12, "top1": 0.5, "near_opt_2": 0.75, "near_opt_5": 0.8, "oracle_capture": 0.97,
               "worst_regret": 1.4, "mean_regret": 0.03, "slower_than_baseline": 0.1, "speedup": 1.05,
               "oracle_speedup": 1.08, "invalid": 0.0}
    scores = {s: metrics for s in selectors}
    block = {"folds": {"a": {}, "b": {}}, "mean": scores, "by_backend": {"sim": scores}}
    (folder / "evaluation.json").write_text(json.dumps({"splits": {"family": block, "hardware": block}}))
    rows = [{"split": split, "selector": sel, "scenario_id": f"s{i}", "chosen": SCHEDULES[(i + j) % 4],
             "best": SCHEDULES[i % 4], "m": 2 ** (4 + i), "comp_comm_ratio": 0.1 * (i + 1),
             "regret": 1 + 0.05 * j * (i % 3)}
            for split in ("family", "hardware") for j, sel in enumerate(selectors) for i in range(12)]
    pd.DataFrame(rows).to_parquet(folder / "choices.parquet")
    (folder / "importance.json").write_text(json.dumps({"log2_m": 3.0, "world_size": 1.5, "degree": 0.5}))
    (folder / "summary.json").write_text(json.dumps({"chosen": "xgb-regressor", "rows": 288}))
    return folder


def test_the_report_renders_in_chromium_with_every_image_and_no_error(tmp_path):
    from ficco_select.train.report import write_report

    report = write_report(small_training_output(tmp_path), adapt_curve_csv=tmp_path / "no-curve.csv")
    result = check_report.check_report(report, screenshot=tmp_path / "report.png")
    assert result["ok"], result["failures"]
    # regret CDF per split, confusion, best-schedule map, feature importance
    assert result["images"] == result["images_loaded"] == 5
    assert result["tables"] >= 4 and result["width"] <= check_report.WIDTH
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_check_fails_on_a_broken_page(tmp_path, capsys):
    page = tmp_path / "report.html"
    page.write_text("<!doctype html><html><head><title>something else</title></head><body>"
                    "<h2>family hold-out</h2><img src='missing.png'>"
                    "<script>console.error('logged'); undefinedFunction();</script></body></html>")
    result = check_report.check_report(page)
    assert not result["ok"] and result["images_loaded"] == 0
    failures = "\n".join(result["failures"])
    for expected in ("title:", "no <h1>", "Where each schedule family wins", "<img> #0 did not load",
                     "console error: logged", "page error:", "undefinedFunction"):
        assert expected in failures, expected
    assert check_report.main([str(page), "--screenshot", str(tmp_path / "shot.png")]) == 1
    assert "FAILED" in capsys.readouterr().out
