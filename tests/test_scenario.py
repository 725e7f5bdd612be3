"""Scenario validation, ids, a2a routing, and scenario tables with bad rows."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ficco_select.data.scenarios import read_scenarios
from ficco_select.cli.main import main
from ficco_select import Scenario, ScenarioError

GOOD = dict(group="llama", op="ag_gemm", m=64, n=32, k=16, dtype="float32", world_size=2, hardware="cpu")


def test_scenario_id_is_a_pure_function_of_the_columns():
    a = Scenario(**GOOD)
    assert a.scenario_id == Scenario(**GOOD).scenario_id
    assert a.scenario_id != Scenario(**{**GOOD, "m": 128}).scenario_id
    assert a.scenario_id != Scenario(**{**GOOD, "group": "gpt"}).scenario_id
    # the same in another interpreter with another hash seed
    code = ("from ficco_select import Scenario; print(Scenario(group='llama', op='ag_gemm', m=64, n=32, k=16, "
            "dtype='float32', world_size=2, hardware='cpu').scenario_id)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert other == a.scenario_id == "de3ead589021b263"  # golden: ids must never drift


@pytest.mark.parametrize("field,value,needle", [
    ("m", -4, "column 'm'"), ("n", 0, "column 'n'"), ("k", 2.5, "column 'k'"),
    ("op", "gemm_ag", "column 'op'"), ("dtype", "int8", "column 'dtype'"),
    ("world_size", 1, "column 'world_size'"), ("m", 63, "not divisible"),
    ("imbalance", 2.0, "column 'imbalance'"),
])
def test_invalid_fields_are_named(field, value, needle):
    with pytest.raises(ScenarioError, match=needle):
        Scenario.from_record({**GOOD, field: value}, row=7)
    with pytest.raises(ScenarioError, match="row 7"):
        Scenario.from_record({**GOOD, field: value}, row=7)


@pytest.mark.parametrize("P,m,imb", [(2, 100, 1.0), (3, 77, 1.7), (4, 64, 4.0), (8, 1000, 2.5)])
def test_token_counts_match_the_imbalance(P, m, imb):
    s = Scenario(**{**GOOD, "op": "a2a_gemm", "m": m, "world_size": P, "imbalance": imb})
    counts = s.token_counts()
    loads = [sum(counts[src][dst] for src in range(P)) for dst in range(P)]
    assert sum(loads) == P * m
    assert loads[0] == round(imb * m)
    assert max(loads) - min(loads[1:]) >= 0 and max(loads[1:]) - min(loads[1:]) <= 1
    assert all(c >= 0 for row in counts for c in row)


def write(tmp_path, rows, header="group,op,m,n,k,dtype,world_size,hardware,imbalance"):
    p = tmp_path / "s.csv"
    p.write_text(header + "\n" + "\n".join(rows) + "\n")
    return p


@pytest.mark.parametrize("row,needle", [
    ("g,ag_gemm,-64,32,16,float32,2,cpu,", "row 2, column 'm'"),
    ("g,ag_gemm,64,32,16,float64,2,cpu,", "row 2, column 'dtype'"),
    ("g,conv,64,32,16,float32,2,cpu,", "row 2, column 'op'"),
    ("g,ag_gemm,64,32,,float32,2,cpu,", "row 2, column 'k': missing"),
    ("g,ag_gemm,64,32,16,float32,16,cpu,", "row 2, column 'world_size'"),
    ("g,ag_gemm,64,32,16,float16,2,cpu,", "row 2, column 'dtype'"),  # no legal schedule on cpu
    ("g,ag_gemm,64,32,16,float32,2,cpu,", "row 2 repeats row 1"),
])
def test_bad_rows_name_row_and_column(tmp_path, row, needle):
    path = write(tmp_path, ["g,ag_gemm,64,32,16,float32,2,cpu,", row])
    with pytest.raises(ScenarioError, match=needle):
        read_scenarios(path, backend="cpu")


def test_missing_column(tmp_path):
    path = write(tmp_path, ["g,ag_gemm,64,32,16,2,cpu"], header="group,op,m,n,k,world_size,hardware")
    with pytest.raises(ScenarioError, match="column 'dtype' is missing"):
        read_scenarios(path)


def test_cli_bad_input_writes_nothing(tmp_path):
    path = write(tmp_path, ["g,ag_gemm,64,32,16,float32,2,cpu,", "g,ag_gemm,64,0,16,float32,2,cpu,"])
    out = tmp_path / "out.parquet"
    result = CliRunner().invoke(main, ["measure", "--scenarios", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code != 0
    assert "row 2, column 'n'" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def test_rank_gemms_are_the_executor_s_shapes_and_the_cost_model_s_busiest_rank():
    from ficco_select.data.catalog import catalog
    from ficco_select.costs import OP_CODES, rank_work

    for r in catalog("full")[::5]:
        s = Scenario.from_record(r)
        gemms = s.rank_gemms()
        assert len(gemms) == s.world_size and all(min(g) >= 0 for g in gemms)
        M, N, K, shard_rows, shard_cols = (float(x) for x in rank_work(OP_CODES[s.op], s.m, s.n, s.k, s.world_size,
                                                                        s.imbalance))
        busiest = max(gemms, key=lambda g: g[0] * g[1] * g[2])
        if s.op in ("a2a_gemm", "gemm_a2a"):
            assert sum(g[0] for g in gemms) == s.world_size * s.m  # every token reaches one expert
            assert abs(busiest[0] - M) <= 0.5 and busiest[1:] == (N, K)  # the hot expert, rounded
            # The dispatch moves tokens (k wide); the combine moves the expert's outputs (n wide).
            assert shard_cols == (s.n if s.op == "gemm_a2a" else s.k)
        else:
            assert set(gemms) == {(M, N, K)}
            assert shard_rows * s.world_size == s.m and shard_cols == (s.k if s.op == "ag_gemm" else s.n)
        assert s.busiest_rank_gflop() == 2 * busiest[0] * busiest[1] * busiest[2] / 1e9


# -- every numeric cell a user may get wrong --------------------------------------------------
NUMERIC_COLUMNS = ("m", "n", "k", "world_size", "imbalance")
BAD_NUMBERS = ("0", "-1", "nan", "inf", "1e308", "1e400", "2.5", "abc")
"""Zero, negative, NaN, infinite, past any machine, overflowing a float, fractional, not a number."""


def _a2a_row(column: str, value: str) -> str:
    """An all-to-all row (the op that takes every numeric column) with `column` set to `value`."""
    cells = dict(group="g", op="a2a_gemm", m="64", n="32", k="16", dtype="float32", world_size="2", hardware="cpu",
                 imbalance="1.5")
    cells[column] = value
    return ",".join(cells.values())


@pytest.mark.parametrize("column", NUMERIC_COLUMNS)
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_a_bad_number_in_any_numeric_column_is_refused_naming_file_row_and_column(tmp_path, column, value):
    if column == "imbalance" and value == "2.5":
        value = "3"  # 2.5 is a fine imbalance; 3 is past world_size 2
    path = write(tmp_path, ["g,ag_gemm,64,32,16,float32,2,cpu,", _a2a_row(column, value)])
    with pytest.raises(ScenarioError) as refused:
        read_scenarios(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and f"row 2, column '{column}'" in message, message
    assert len(message) < 300, message  # not a 300-digit integer


@pytest.mark.parametrize("column", ["m", "world_size"])
def test_ficco_select_gives_a_bad_row_the_baseline_naming_the_column(tmp_path, column):
    # `ficco select` decides as the runtime does (documented in its --scenarios help): an
    # invalid row gets the baseline, source fallback, and a reason naming the column.
    path = write(tmp_path, [_a2a_row(column, "1e308")])
    result = CliRunner().invoke(main, ["select", "--scenarios", str(path), "--json"])
    assert result.exit_code == 0, result.output
    (decision,) = json.loads(result.output)
    assert decision["source"] == "fallback" and decision["schedule"].startswith("none."), decision
    assert decision["scenario_id"] is None and f"column '{column}'" in decision["reason"], decision
    assert len(decision["reason"]) < 200, decision
