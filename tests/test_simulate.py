"""The sim backend: the paper's qualitative claims on the MI300X preset, physical bounds,
and a dataset in the same schema as measured ones; `ficco simulate` refuses a noise that is not
a finite sigma, and neither it nor `ficco catalog` replaces what is at `--out`."""

import os

import numpy as np
import pytest
from click.testing import CliRunner

from ficco_select.data.dataset import read_dataset, validate
from ficco_select.data.simulate import simulate, simulate_rows
from ficco_select.costs import contended as _contended
from ficco_select.cli.main import main
from ficco_select import Scenario
from ficco_select.hardware import load_hardware
from helpers.cli import refused, table
from helpers.datasets import CPU_SWEEP, two_shards

MI300X = load_hardware("mi300x-8")
A_ROW = "t,ag_gemm,64,64,64,float32,2,cpu,"


@pytest.fixture(scope="module")
def shipped():
    return read_dataset(CPU_SWEEP)


def sc(op="ag_gemm", m=8192, n=8192, k=8192, P=8, dtype="bfloat16", **kw):
    return Scenario(group="t", op=op, m=m, n=n, k=k, dtype=dtype, world_size=P, hardware="mi300x-8", **kw)


def times(scenario, hw=MI300X):
    df = simulate_rows([scenario], hw)
    return dict(zip(df["schedule"], df["time_s"])), df


def test_comm_bound_finer_a2a_beats_shard_ring_on_a_fully_connected_node():
    t, _ = times(sc(m=65536, n=1024, k=8192))
    best_a2a = min(v for name, v in t.items() if ".a2a." in name)
    assert best_a2a < t["shard.ring.sm"]
    assert best_a2a < t["none.sm"]


def test_dma_contends_less_than_sm():
    g, c = np.array([1e-3]), np.array([1e-3])
    assert _contended(MI300X, g, c, np.array([True]))[0] < _contended(MI300X, g, c, np.array([False]))[0]
    # compute and ring transfers balanced, so they overlap fully: copy engines leave
    # every CU to the GEMM and win despite their higher per-transfer cost
    t, _ = times(sc(m=16384, n=131072, k=8192))
    assert t["shard.ring.dma"] < t["shard.ring.sm"]
    _, df = times(sc(m=16384, n=131072, k=8192))
    assert (df["cil_gemm_sm"] > MI300X.dma_mem_contention).all()


@pytest.mark.parametrize("scenario", [sc(), sc(m=65536, n=1024), sc(op="gemm_rs", m=16384, k=8192),
                                      sc(m=512, n=8192, k=8192)])
def test_no_schedule_beats_the_physical_bound(scenario):
    _, df = times(scenario)
    P = scenario.world_size
    peak = MI300X.peak_tflops["bfloat16"] * 1e12
    flops = 2 * scenario.m * scenario.n * scenario.k / P
    recv_bytes = (P - 1) * scenario.m // P * (scenario.k if scenario.op == "ag_gemm" else scenario.n) * 2
    links = (P - 1) * MI300X.link_bw_gbps * 1e9
    bound = max(flops / peak, recv_bytes / links)
    assert (df["time_s"] >= bound).all()


def test_tiny_transfers_make_finer_decomposition_lose():
    t, _ = times(sc(m=64, n=4096, k=4096))  # decode: 8 tokens per rank
    finest = min(v for name, v in t.items() if name.startswith("ficco.d8"))
    assert finest > min(t["shard.ring.sm"], t["none.sm"])


def test_simulated_dataset_has_the_measured_schema_and_validates(tmp_path):
    scenarios = [sc(), sc(op="gemm_rs", m=16384, k=8192), sc(op="a2a_gemm", m=4096, imbalance=2.0),
                 sc(m=1024, P=4)]
    df = simulate(scenarios, MI300X, noise=0.05, seed=1)
    assert validate(df) == []
    assert (df["backend"] == "sim").all() and df["noisy"].any()
    assert {"dil_d2", "chunk_loss_d4", "cil_gemm_sm"} <= set(df.columns)
    exact = simulate(scenarios, MI300X)
    assert validate(exact) == [] and not exact["noisy"].any()


def test_cli_simulate(tmp_path):
    table = tmp_path / "s.csv"
    table.write_text("group,op,m,n,k,dtype,world_size,hardware,imbalance\n"
                     "llama,ag_gemm,8192,8192,4096,bfloat16,8,h100-nvswitch,\n"
                     "llama,gemm_rs,8192,4096,8192,bfloat16,8,h100-nvswitch,\n")
    out = tmp_path / "sim.parquet"
    res = CliRunner().invoke(main, ["simulate", "--scenarios", str(table), "--hardware", "mi300x-8",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = read_dataset(out)
    assert (df["hardware"] == "mi300x-8").all() and validate(df) == []


# -- simulate: a noise it cannot draw ----------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_simulate_refuses_a_noise_that_is_not_a_finite_sigma(tmp_path, value):
    out = tmp_path / "sim.parquet"
    refused(["simulate", "--scenarios", table(tmp_path, A_ROW), "--out", out, "--noise", value], "--noise", value,
            written=out)


# -- writers never replace what is at --out ----------------------------------------------------
def test_simulate_and_catalog_refuse_an_existing_out_and_their_input(tmp_path, shipped):
    path = table(tmp_path, A_ROW)
    scenarios = path.read_bytes()
    a, _ = two_shards(tmp_path, shipped)
    measured = a.read_bytes()
    refused(["simulate", "--scenarios", path, "--out", a], "--out", "a.parquet", "exists")
    assert a.read_bytes() == measured, "a measured dataset was replaced by simulated rows"
    refused(["simulate", "--scenarios", path, "--out", path], "--out", "scenarios.csv", "--scenarios")
    os.symlink(path, tmp_path / "link.csv")
    refused(["simulate", "--scenarios", tmp_path / "link.csv", "--out", tmp_path / "." / "scenarios.csv"],
            "--out", "--scenarios")
    assert path.read_bytes() == scenarios, "the scenario table was replaced by Parquet bytes"
    refused(["catalog", "--scale", "cpu", "--out", path], "--out", "scenarios.csv", "exists")
    assert path.read_bytes() == scenarios
