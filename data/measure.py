"""Measure every legal schedule of every scenario on a real backend -> a Parquet dataset.

One row per (scenario, schedule): the scenario columns, ``scenario_id``, ``schedule``,
``time_s`` (median over repetitions of the slowest rank's time), ``time_spread``
(interquartile range / median), ``times_s`` (every repetition), ``verified`` (output
equals the reference on every rank within dtype tolerance), ``rel_error``, compute and
communication timed alone (``t_comp_s``, ``t_comm_s``) and provenance columns.
The file is written atomically: a failed or interrupted run leaves no partial file.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from tqdm import tqdm

from ficco_select import __version__
from ficco_select.executor.cpu import (MeasureConfig, init_from_env, measure_in_group,
                                       measure_spawned, under_torchrun)
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates

SCHEMA_VERSION = 1
"""Version of the dataset columns; readers refuse other versions."""


def provenance(backend: str) -> dict:
    return {
        "backend": backend,
        "hardware_fingerprint": f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}cores",
        "host": platform.node(),
        "torch_version": torch.__version__,
        "ficco_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_parquet_atomic(df: pd.DataFrame, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(df, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           b"ficco_schema_version": str(SCHEMA_VERSION).encode()})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def parts_dir(out: str | Path) -> Path:
    """Where finished scenarios are committed, one file each, until the dataset is complete."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def measure(scenarios: Sequence[Scenario], *, backend: str = "cpu", config: MeasureConfig,
            out: str | Path | None = None, progress: bool = True) -> pd.DataFrame | None:
    """Measure `scenarios`; write `out` if given; return the rows (None on non-zero ranks).

    Spawns the ranks itself, one job per world size, unless running under torchrun, where
    this process is one rank and every scenario must match the torchrun world size.

    Crash-safe with `out`: each finished scenario is committed atomically to
    ``<out>.parts/<scenario_id>.parquet`` before the next one starts; rerunning the same
    command after a kill skips the committed ones, so every scenario ends up exactly once.
    `out` is assembled (atomically) when all are done, and the parts are then removed.
    """
    if backend != "cpu":
        raise ValueError(f"backend {backend!r}: only the cpu backend measures so far")
    distributed = under_torchrun()
    is_rank0 = not distributed or int(os.environ.get("RANK", "0")) == 0
    parts = parts_dir(out) if out is not None else None
    done = {p.stem for p in parts.glob("*.parquet")} if parts is not None and parts.is_dir() else set()
    todo = [s for s in scenarios if s.scenario_id not in done]
    rows: list[dict] = []

    def on_scenario(scenario_rows: list[dict]) -> None:
        if parts is not None:
            part = pd.DataFrame(scenario_rows).assign(**provenance(backend))
            write_parquet_atomic(part, parts / f"{scenario_rows[0]['scenario_id']}.parquet")
        rows.extend(scenario_rows)

    total = sum(len(candidates(s, backend)) for s in todo)
    bar = tqdm(total=total, unit="schedule", desc="measure", disable=not (progress and is_rank0))
    try:
        if distributed:
            init_from_env(config.timeout_s * 2)
            try:
                measure_in_group(todo, config, lambda kind, payload: on_scenario(payload)
                                 if kind == "scenario" else bar.update(payload))
            finally:
                dist.destroy_process_group()
        else:
            by_world: dict[int, list[Scenario]] = {}
            for s in todo:
                by_world.setdefault(s.world_size, []).append(s)
            for P in sorted(by_world):
                measure_spawned(by_world[P], config, on_scenario=on_scenario, on_progress=bar.update)
    finally:
        bar.close()
    if not is_rank0:
        return None
    if parts is None:
        return pd.DataFrame(rows).assign(**provenance(backend))
    by_id = {p.stem: p for p in parts.glob("*.parquet")}
    df = pd.concat([pd.read_parquet(by_id[s.scenario_id]) for s in scenarios], ignore_index=True)
    write_parquet_atomic(df, out)
    shutil.rmtree(parts)
    return df


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per scenario: baseline time, best verified schedule, its time and the speedup."""
    out = []
    for sid, g in df.groupby("scenario_id", sort=False):
        ok = g[g["verified"]]
        base = g[g["schedule"].str.startswith("none.")]
        best = ok.loc[ok["time_s"].idxmin()] if len(ok) else None
        first = g.iloc[0]
        t_base = float(base["time_s"].iloc[0]) if len(base) else float("nan")
        ideal = (first["t_comp_s"] + first["t_comm_s"]) / max(first["t_comp_s"], first["t_comm_s"])
        out.append({
            "op": first["op"], "P": first["world_size"], "m": first["m"], "n": first["n"], "k": first["k"],
            "dtype": first["dtype"], "schedules": len(g), "verified": int(g["verified"].sum()),
            "baseline_ms": 1e3 * t_base,
            "best": best["schedule"] if best is not None else "-",
            "best_ms": 1e3 * best["time_s"] if best is not None else float("nan"),
            "speedup": t_base / best["time_s"] if best is not None else float("nan"),
            "ideal": ideal,
        })
        row = out[-1]
        # Realized fraction of the ideal overlap gain: (realized - 1) / (ideal - 1).
        row["realized_frac"] = (row["speedup"] - 1) / (ideal - 1) if ideal > 1 else float("nan")
    return pd.DataFrame(out)
