"""Measure every legal schedule of every scenario on a real backend -> a Parquet dataset
(columns: data/dataset.py). Crash-safe and resumable; a scenario that fails (timeout,
dead rank) is recorded as failed with its reason and the sweep goes on.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch.distributed as dist
from tqdm import tqdm

from data.dataset import provenance, write_parquet_atomic
from ficco_select.executor.cpu import (MeasureConfig, MeasureError, init_from_env,
                                       measure_in_group, measure_spawned, under_torchrun)
from ficco_select.executor.harness import failed_rows
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates


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
    if distributed:
        init_from_env(config.timeout_s * 2)
        # Only rank 0's disk holds the parts (ranks may be on other nodes): it decides what is left.
        box = [sorted(done)]
        dist.broadcast_object_list(box, src=0)
        done = set(box[0])
    todo = [s for s in scenarios if s.scenario_id not in done]
    rows: list[dict] = []

    def on_scenario(scenario_rows: list[dict]) -> None:
        if parts is not None:
            part = pd.DataFrame(scenario_rows).assign(**provenance(backend))
            write_parquet_atomic(part, parts / f"{scenario_rows[0]['scenario_id']}.parquet")
        rows.extend(scenario_rows)

    failed: list[str] = []
    total = sum(len(candidates(s, backend)) for s in todo)
    bar = tqdm(total=total, unit="schedule", desc="measure", disable=not (progress and is_rank0))
    try:
        if distributed:
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
                failed += _measure_surviving_failures(by_world[P], config, backend, on_scenario, bar)
    finally:
        bar.close()
    if not is_rank0:
        return None
    if parts is None:
        df = pd.DataFrame(rows).assign(**provenance(backend))
    else:
        by_id = {p.stem: p for p in parts.glob("*.parquet")}
        df = pd.concat([pd.read_parquet(by_id[s.scenario_id]) for s in scenarios], ignore_index=True)
        write_parquet_atomic(df, out)
        shutil.rmtree(parts)
    ok = df[df["status"] == "ok"]
    df.attrs["sweep"] = {
        "scenarios": len(scenarios),
        "measured": len(todo) - len(failed),
        "skipped": len(scenarios) - len(todo),
        "failed": len(failed),
        "failures": failed,
        "noisy_rows": int(ok["noisy"].sum()),
        "rows": len(df),
    }
    return df


def _measure_surviving_failures(scenarios: list[Scenario], config: MeasureConfig, backend: str,
                                on_scenario, bar) -> list[str]:
    """Measure scenarios of one world size; a scenario whose job fails (timeout, dead rank)
    is recorded as failed with the reason and the sweep goes on with fresh ranks."""
    failures: list[str] = []
    remaining = list(scenarios)
    while remaining:
        finished: set[str] = set()

        def record(rows: list[dict]) -> None:
            finished.add(rows[0]["scenario_id"])
            on_scenario(rows)

        try:
            measure_spawned(remaining, config, on_scenario=record, on_progress=bar.update)
            return failures
        except MeasureError as e:
            rest = [s for s in remaining if s.scenario_id not in finished]
            culprit, remaining = rest[0], rest[1:]
            reason = str(e).splitlines()[0]
            on_scenario(failed_rows(culprit, reason, backend))
            bar.update(len(candidates(culprit, backend)))
            failures.append(f"{culprit.scenario_id} ({culprit.group} {culprit.op} m={culprit.m} "
                            f"n={culprit.n} k={culprit.k} P={culprit.world_size}): {reason}")
    return failures


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per scenario: baseline time, best verified schedule, its time, speedup and the share
    of the ideal overlap gain it realizes, (speedup - 1) / (ideal - 1)."""
    out = []
    for _, g in df[df["status"] == "ok"].groupby("scenario_id", sort=False):
        ok = g[g["verified"]]
        first = g.iloc[0]
        t_base = float(g.loc[g["schedule"].str.startswith("none."), "time_s"].iloc[0])
        best = ok.loc[ok["time_s"].idxmin()] if len(ok) else None
        speedup = t_base / best["time_s"] if best is not None else float("nan")
        ideal = first["ideal_speedup"]
        out.append({
            "op": first["op"], "P": first["world_size"], "m": first["m"], "n": first["n"], "k": first["k"],
            "dtype": first["dtype"], "schedules": len(g), "verified": int(g["verified"].sum()),
            "noisy": int(g["noisy"].sum()), "baseline_ms": 1e3 * t_base,
            "best": best["schedule"] if best is not None else "-",
            "best_ms": 1e3 * best["time_s"] if best is not None else float("nan"),
            "speedup": speedup, "ideal": ideal,
            "realized_frac": (speedup - 1) / (ideal - 1) if ideal > 1 else float("nan"),
        })
    return pd.DataFrame(out)
