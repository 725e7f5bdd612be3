"""Datasets cut from the committed cpu sweep (``CPU_SWEEP``): two shards of it (``two_shards``),
its first scenarios with every schedule (``catalog_slice``) and those scenarios with most
schedules missing (``thinned``)."""

from pathlib import Path

import pandas as pd

from ficco_select.data.dataset import read_dataset, write_parquet_atomic

CPU_SWEEP = Path(__file__).parents[2] / "data" / "measured" / "cpu_catalog.parquet"
"""The committed sweep of the cpu catalog, measured on gloo ranks."""


def two_shards(tmp_path: Path, df: pd.DataFrame) -> tuple[Path, Path]:
    """Two valid datasets of five scenarios each, cut from `df`."""
    ids = list(dict.fromkeys(df["scenario_id"]))
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_parquet_atomic(df[df["scenario_id"].isin(ids[:5])], a)
    write_parquet_atomic(df[df["scenario_id"].isin(ids[5:10])], b)
    return a, b


def catalog_slice(tmp_path: Path, scenarios: int = 40) -> pd.DataFrame:
    """The committed sweep's first `scenarios` scenarios, every schedule of each."""
    df = read_dataset(CPU_SWEEP)
    keep = list(dict.fromkeys(df["scenario_id"]))[:scenarios]
    return df[df["scenario_id"].isin(keep)].reset_index(drop=True)


def thinned(tmp_path: Path) -> Path:
    """The slice with every schedule but the baseline and shard.ring.sm dropped from all but 4 scenarios."""
    df = catalog_slice(tmp_path)
    whole = set(list(dict.fromkeys(df["scenario_id"]))[:4])
    kept = df[df["scenario_id"].isin(whole) | df["schedule"].isin(["none.sm", "shard.ring.sm"])]
    path = tmp_path / "thin.parquet"
    write_parquet_atomic(kept.reset_index(drop=True), path)
    return path
