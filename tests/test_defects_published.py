"""The simulator's inputs against hostile input: a published-measurements table too long to
be hand-curated or holding magnitudes no GPU measures, `ficco sim calibrate` aimed at a file
that exists, and telemetry lines of a rank outside the job or with a field of the wrong type.
Each refusal is one line naming the file and the row, column, line or field."""

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers.cli import FICCO, refused
from test_published import AG_POINT, BUSBW, COLLECTIVE, GEMM, write
from test_telemetry import SCENARIO, write_job

import ficco_select.data.published as published
from ficco_select.data.published import read_published
from ficco_select.data.telemetry import TelemetryError, read_telemetry

REPO = Path(__file__).parents[1]
PUBLISHED = REPO / "data" / "published"
MEASURED = REPO / "data" / "measured" / "cpu_catalog_ar_a2a.parquet"


# -- published tables --------------------------------------------------------------------
@pytest.fixture
def million_rows(tmp_path):
    """A published table of a million rows: the shortest committed row, repeated (~240 MB)."""
    header, *rows = (PUBLISHED / "gpu-calibration.csv").read_text().splitlines(keepends=True)
    row = min(rows, key=len)
    path = tmp_path / "million.csv"
    with path.open("w") as f:
        f.write(header)
        for _ in range(100):
            f.write(row * 10_000)
    yield path
    path.unlink()


def test_a_published_table_of_a_million_rows_is_refused_at_once(million_rows):
    for command in (["sim", "validate", "--published", million_rows],
                    ["sim", "fit", "--published", million_rows, "--hardware", "a100-nvswitch"]):
        start = time.monotonic()
        res = subprocess.run([*FICCO, *map(str, command)], cwd=REPO, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
        errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
        assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr
        assert str(million_rows) in errors[0] and f"more than {published.MAX_ROWS} rows" in errors[0]
        assert took < 60, f"{command[:2]} took {took:.0f} s to refuse"


def test_every_committed_row_is_within_the_physical_bounds():
    for name in ("gpu-calibration.csv", "validation.csv"):
        assert read_published(PUBLISHED / name)


@pytest.mark.parametrize("point, change, column", [
    (GEMM, {"m": "1e300"}, "m"),
    (GEMM, {"n": str(2**31 + 1)}, "n"),
    (AG_POINT, {"k": "1e20"}, "k"),
    (AG_POINT, {"world_size": "1e300"}, "world_size"),
    ({**BUSBW, "gpus": "1e300 (inferred)"}, {}, "gpus"),
    (AG_POINT, {"baseline_time_us": "1e308"}, "baseline_time_us"),
    (AG_POINT, {"method_time_us": "3.6e12"}, "method_time_us"),
    (COLLECTIVE, {"notes": "[grade A] message = full gathered buffer 99999999999999 GiB"}, "notes"),
    (BUSBW, {"notes": "[grade C] all_reduce busbw ~9999999999 GB/s"}, "notes"),
])
def test_magnitudes_no_gpu_measures_are_refused_naming_file_row_and_column(tmp_path, point, change, column):
    path = write(tmp_path, [AG_POINT, {**point, **change}])
    for command in (["sim", "validate", "--published", path],
                    ["sim", "fit", "--published", path, "--hardware", "h100-nvswitch"]):
        refused(command, str(path), "row 2", f"column '{column}'")


# -- sim calibrate's --out -----------------------------------------------------------------
def test_sim_calibrate_refuses_an_existing_out_and_its_own_input(tmp_path):
    dataset = tmp_path / "measured.parquet"
    shutil.copy(MEASURED, dataset)
    kept = tmp_path / "spec.yaml"
    kept.write_text("# a spec fitted last week\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (dataset, kept)}

    calibrate = ["sim", "calibrate", "--dataset", dataset, "--name", "mine", "--out"]
    refused([*calibrate, kept], f"--out {kept}: exists", "nothing is overwritten")
    # The input itself, spelled another way: compared as resolved paths.
    (tmp_path / "sub").mkdir()
    other_spelling = tmp_path / "sub" / ".." / "measured.parquet"
    refused([*calibrate, other_spelling], f"--out {other_spelling}: is the --dataset input")
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (dataset, kept)} == before

    res = subprocess.run([*FICCO, *map(str, calibrate), tmp_path / "new.yaml"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and (tmp_path / "new.yaml").read_text().startswith("# Calibrated"), res.stderr


def test_hardware_from_profile_refuses_an_existing_out_its_profile_and_its_base(tmp_path):
    from test_gpu_profile import EXAMPLE

    from ficco_select.hardware import presets_dir

    profile = tmp_path / "profile.yaml"  # JSON is YAML: a profile may carry either name
    profile.write_text(json.dumps(EXAMPLE))
    base = tmp_path / "base.yaml"
    shutil.copy(presets_dir() / "h200-nvswitch.yaml", base)
    kept = tmp_path / "spec.yaml"
    kept.write_text("# a spec fitted last week\n")
    before = {p: p.read_bytes() for p in (profile, base, kept)}

    command = ["hardware", "from-profile", profile, "--base", base, "--out"]
    refused([*command, kept], f"--out {kept}: exists", "nothing is overwritten")
    refused([*command, profile], f"--out {profile}: is the PROFILE input")
    refused([*command, base], f"--out {base}: is the --base input")
    assert {p: p.read_bytes() for p in (profile, base, kept)} == before


# -- telemetry -----------------------------------------------------------------------------
@pytest.fixture
def telemetry(tmp_path):
    """A finished two-rank job's lines, and the rows they give."""
    path = tmp_path / "telemetry.jsonl"
    write_job(path, killed=False)
    return path, read_telemetry(path)


def with_line(path: Path, name: str, **changes) -> tuple[Path, int]:
    """A copy of `path` with its first line appended again, changed; returns it and that line's number."""
    lines = path.read_text().splitlines()
    out = path.with_name(name)
    out.write_text("\n".join([*lines, json.dumps({**json.loads(lines[0]), **changes})]) + "\n")
    return out, len(lines) + 1


@pytest.mark.parametrize("rank", [7, SCENARIO.world_size, -1])
def test_a_telemetry_line_of_a_rank_outside_the_job_is_skipped_naming_file_line_and_field(telemetry, rank,
                                                                                         caplog):
    path, rows = telemetry
    first = json.loads(path.read_text().splitlines()[0])
    bad, number = with_line(path, "rank.jsonl", rank=rank, time_s=4 * first["time_s"])
    with caplog.at_level(logging.WARNING, logger="ficco_select.data.telemetry"):
        again = read_telemetry(bad)
    assert again["times_s"].tolist() == rows["times_s"].tolist()  # the 4x time is no rank's
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "ficco_select.data.telemetry"]
    assert str(bad) in warning and f"line {number}: field 'rank'" in warning
    # A file of such lines alone is refused, naming the file, the line and the field.
    alone = bad.with_name("alone.jsonl")
    alone.write_text(bad.read_text().splitlines()[-1] + "\n")
    with pytest.raises(TelemetryError, match=r"alone.jsonl: no usable telemetry line; line 1: field 'rank'"):
        read_telemetry(alone)


WRONG_TYPES = {
    "backend": ["cpu"], "op": ["ag_gemm"], "dtype": {"float32": 4}, "group": ["tele"], "hardware": ["cpu"],
    "m": "64", "n": 32.5, "k": True, "world_size": 2.0, "imbalance": "1.0", "scenario_id": 12,
    "schedule": ["none.sm"], "source": 5, "rank": 0.0, "call": "0", "time_s": "0.01", "verified": 1,
    "rel_error": "1e-7", "ts": 1700000000,
}
"""One wrong-typed value per field of a telemetry line (``ficco_select.data.telemetry.LINE_FIELDS``)."""


def test_every_telemetry_field_is_checked_for_its_type():
    from ficco_select.data.telemetry import LINE_FIELDS

    assert set(WRONG_TYPES) == {*LINE_FIELDS, "imbalance"}


@pytest.mark.parametrize("field", sorted(WRONG_TYPES))
def test_a_telemetry_field_of_the_wrong_type_is_named_by_file_line_and_field(telemetry, field, caplog):
    path, rows = telemetry
    bad, number = with_line(path, "typed.jsonl", **{field: WRONG_TYPES[field]})
    with caplog.at_level(logging.WARNING, logger="ficco_select.data.telemetry"):
        again = read_telemetry(bad)
    assert again["times_s"].tolist() == rows["times_s"].tolist()
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "ficco_select.data.telemetry"]
    assert f"line {number}: field '{field}'" in warning
    alone = bad.with_name("alone.jsonl")
    alone.write_text(bad.read_text().splitlines()[-1] + "\n")
    with pytest.raises(TelemetryError, match=rf"alone.jsonl: no usable telemetry line; line 1: field '{field}'"):
        read_telemetry(alone)


def test_ficco_train_refuses_a_telemetry_file_of_a_list_valued_backend_in_one_line(telemetry, tmp_path,
                                                                                  monkeypatch):
    path, _ = telemetry
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps({**json.loads(path.read_text().splitlines()[0]), "backend": ["cpu"]}) + "\n")
    monkeypatch.chdir(tmp_path)  # an MLflow store, were one opened, stays here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    refused(["train", "--dataset", MEASURED, "--telemetry", alone, "--out", tmp_path / "train"],
            str(alone), "line 1", "field 'backend'", written=tmp_path / "train")
