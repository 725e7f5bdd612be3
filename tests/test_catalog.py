"""The model-shape scenario catalog: real configs, valid scenarios, affordable cpu scale."""

import math
from collections import Counter

import pandas as pd
import pytest

from ficco_select.data.catalog import (
    CPU_MAX_GFLOP_PER_RANK,
    MODELS,
    catalog,
    write_catalog,
)
from ficco_select.data.scenarios import read_scenarios
from ficco_select.scenario import OPS, Scenario
from ficco_select.schedule import candidates


@pytest.fixture(scope="module")
def cpu_records():
    return catalog()


@pytest.fixture(scope="module")
def full_records():
    return catalog(scale="full")


def test_families_dense_and_moe():
    dense = {m.family for m in MODELS.values() if not m.is_moe}
    moe = {m.family for m in MODELS.values() if m.is_moe}
    assert len(dense) >= 8
    assert len(moe) >= 2
    assert not dense & moe
    for m in MODELS.values():
        assert m.source
        if m.is_moe:
            assert m.top_k >= 1 and m.expert_intermediate > 0 and m.experts >= m.top_k
        else:
            assert m.intermediate > 0 and m.top_k == 0 and m.expert_intermediate == 0


def test_published_numbers_spot_checks():
    llama = MODELS["llama3-70b"]
    assert (llama.hidden, llama.intermediate, llama.heads, llama.kv_heads, llama.head_dim) == (
        8192, 28672, 64, 8, 128)
    ds = MODELS["deepseek-v3"]
    assert (ds.hidden, ds.experts, ds.top_k, ds.expert_intermediate) == (7168, 256, 8, 2048)


@pytest.mark.parametrize("scale", ["cpu", "full"])
def test_every_record_is_a_valid_unique_scenario(scale, cpu_records, full_records):
    records = cpu_records if scale == "cpu" else full_records
    ids = [Scenario.from_record(r).scenario_id for r in records]
    assert len(ids) == len(set(ids))
    groups = {r["group"] for r in records}
    assert groups == {m.family for m in MODELS.values()}
    for r in records:
        assert r["group"] == MODELS[r["model"]].family
        assert r["tokens"] % r["world_size"] == 0  # padded to a multiple of P


def test_deterministic():
    assert catalog() == catalog()
    assert catalog(scale="full", world_sizes=(2, 8)) == catalog(scale="full", world_sizes=(2, 8))


def test_cpu_scale_size_ops_world_sizes_and_flop_cap(cpu_records):
    assert 600 <= len(cpu_records) <= 1000
    by = Counter((r["op"], r["world_size"]) for r in cpu_records)
    assert set(by) == {(op, P) for op in OPS for P in (2, 3, 4)}
    # The row-parallel projections come twice, with reduce-scatter and with all-reduce.
    assert by[("gemm_ar", 4)] == by[("gemm_rs", 4)]
    for r in cpu_records:
        s = Scenario.from_record(r)
        assert r["hardware"] == "cpu" and r["dtype"] == "float32"
        assert s.busiest_rank_gflop() <= CPU_MAX_GFLOP_PER_RANK
        assert len(candidates(s, "cpu")) >= 2
        assert s.n % 8 == 0 and s.k % 8 == 0
        if s.op in ("a2a_gemm", "gemm_a2a"):
            assert 1.0 <= s.imbalance <= s.world_size


def test_cpu_scale_keeps_shape_ratios(cpu_records):
    cfg = MODELS["llama3-8b"]
    rows = [r for r in cpu_records if r["model"] == "llama3-8b"]
    for layer, expected in [
        ("mlp_up", 2 * cfg.intermediate / cfg.hidden),
        ("mlp_down", cfg.hidden / cfg.intermediate),
        ("qkv", (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim / cfg.hidden),
    ]:
        layer_rows = [r for r in rows if r["layer"] == layer]
        assert layer_rows, layer
        for r in layer_rows:
            # The sharded dim is rounded to a multiple of lcm(8, P): allow one step of error.
            step = math.lcm(8, r["world_size"])
            assert abs(r["n"] / r["k"] - expected) <= expected * step / min(r["n"], r["k"]), r
    up = [r for r in rows if r["layer"] == "mlp_up" and r["world_size"] in (2, 4)]
    assert up and all(r["n"] * cfg.hidden == r["k"] * 2 * cfg.intermediate for r in up)


def test_moe_rows(cpu_records, full_records):
    mix = MODELS["mixtral-8x7b"]
    rows = [r for r in full_records if r["model"] == "mixtral-8x7b" and r["layer"] == "moe_expert"]
    assert rows
    for r in rows:
        assert r["op"] == "a2a_gemm"
        assert (r["k"], r["n"]) == (mix.hidden, 2 * mix.expert_intermediate)
        assert r["m"] == r["tokens"] * mix.top_k // r["world_size"]
    # Mixtral has no dense MLP.
    assert not [r for r in full_records if r["model"] == "mixtral-8x7b" and r["layer"].startswith("mlp")]
    assert {r["imbalance"] for r in cpu_records if r["op"] == "a2a_gemm"} >= {1.0, 1.5, 2.0}


def test_full_scale_exact_shapes(full_records):
    rows = [r for r in full_records if r["model"] == "llama3-70b"]
    qkv = [r for r in rows if r["layer"] == "qkv"]
    assert qkv and all(r["n"] == (64 + 16) * 128 == 10240 and r["k"] == 8192 for r in qkv)
    assert all(r["op"] == "ag_gemm" for r in qkv)
    down = [r for r in rows if r["layer"] == "mlp_down"]
    assert down and all((r["op"], r["k"], r["n"]) == ("gemm_rs", 28672, 8192) for r in down)
    assert {r["world_size"] for r in full_records} == {2, 4, 8}
    assert {r["hardware"] for r in full_records} == {"h100-nvswitch"}
    # GPT-3's MLP is not gated: up projection is d_ff wide, not 2 * d_ff.
    gpt_up = [r for r in full_records if r["model"] == "gpt3-175b" and r["layer"] == "mlp_up"]
    assert gpt_up and all(r["n"] == 49152 for r in gpt_up)


def test_full_scale_skips_indivisible_layers():
    # 4096 (llama3-8b attn_out k) is not divisible by 3: that (layer, P) is skipped, not rounded.
    rows = catalog(scale="full", world_sizes=(3,), models=["llama3-8b"])
    assert not [r for r in rows if r["layer"] == "attn_out"]
    assert all(Scenario.from_record(r) for r in rows)


def test_unknown_inputs_rejected():
    with pytest.raises(ValueError):
        catalog(models=["no-such-model"])
    with pytest.raises(ValueError):
        catalog(scale="huge")
    with pytest.raises(ValueError):
        catalog(scale="cpu", dtype="float16")


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_write_catalog_round_trips(tmp_path, cpu_records, suffix):
    path = write_catalog(tmp_path / f"sub/catalog{suffix}", cpu_records)
    scenarios = read_scenarios(path, backend="cpu")
    assert [s.scenario_id for s in scenarios] == [Scenario.from_record(r).scenario_id for r in cpu_records]
    table = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    assert list(table["model"]) == [r["model"] for r in cpu_records]
    assert list(table["layer"]) == [r["layer"] for r in cpu_records]
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temp file left behind


def test_the_model_table_is_read_with_its_types_and_a_bad_cell_is_named(tmp_path):
    from ficco_select.data.catalog import MODELS_CSV, read_models

    models = read_models()
    assert [m.name for m in models] == list(MODELS) and MODELS["bloom-176b"].gated_mlp is False
    assert MODELS["mixtral-8x7b"].experts == 8 and MODELS["mixtral-8x7b"].is_moe
    lines = MODELS_CSV.read_text().splitlines()
    lines[3] = lines[3].replace(",128,", ",12B,", 1)
    bad = tmp_path / "models.csv"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"row 3, column '(heads|head_dim)': cannot read '12B' as int"):
        read_models(bad)


def test_a_sample_keeps_a_share_of_the_rows_and_a_larger_one_keeps_them_all():
    every = catalog("fabric")
    small, large = catalog("fabric", sample=0.1), catalog("fabric", sample=0.3)
    assert 0.05 * len(every) < len(small) < 0.15 * len(every)
    assert {r["model"] + str(r) for r in small} <= {r["model"] + str(r) for r in large}
    with pytest.raises(ValueError, match="--sample 0"):
        catalog("fabric", sample=0)


def test_the_fabric_scale_grows_the_dims_and_shrinks_the_tokens():
    cpu = catalog("cpu", models=["llama3-8b"])
    fabric = catalog("fabric", models=["llama3-8b"])
    assert max(r["n"] for r in fabric) / max(r["n"] for r in cpu) == pytest.approx(8, rel=0.02)  # dims /4, not /32
    assert max(r["m"] for r in fabric if r["op"] == "ag_gemm") < max(r["m"] for r in cpu if r["op"] == "ag_gemm")
    assert {r["hardware"] for r in fabric} == {"cpu"}
