"""Measure every legal schedule of every scenario on a real backend -> a Parquet dataset
(columns: data/dataset.py). Crash-safe and resumable; a scenario that fails (timeout,
dead rank) is recorded as failed with its reason and the sweep goes on.

Two row sources feed the same sweep (parts, resume, failed rows, progress, summary):
- the cpu backend's gloo ranks (``ficco_select.data.measure.gloo``), spawned here or under
  torchrun;
- the loopback executor (``ficco_select.data.measure.loopback``): P virtual ranks on one
  device, one scenario at a time (``loopback_rows``). It is the cuda backend's single-GPU
  mode; on ``device='cpu'`` it runs the cpu backend's candidates on CPU threads, which
  tests the plumbing (its times are not labels);
- the cuda backend's node mode (``ficco_select.data.measure.node``): a gloo-launched process per
  GPU, spawned like the cpu backend's ranks (``ranks="node"``).

What a sweep refuses before it starts, and which scenarios fit in memory:
``ficco_select.data.measure.preflight``; what it keeps of `out` and of an interrupted run's
committed parts: ``ficco_select.data.measure.resume``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from tqdm import tqdm

from ficco_select.data.dataset import provenance, write_parquet_atomic
from ficco_select.data.locks import output_lock
from ficco_select.data.measure.config import MeasureConfig, MeasureError
from ficco_select.data.measure.fabric import Fabric, inside
from ficco_select.data.measure.fabric_profile import on_fabric, profile_path
from ficco_select.data.measure.gloo import init_from_env, measure_in_group, measure_spawned, under_torchrun
from ficco_select.data.measure.harness import failed_rows
from ficco_select.data.measure.loopback import LoopbackError
from ficco_select.data.measure.loopback_scenario import loopback_rows
from ficco_select.data.measure.node import NodeOptions
from ficco_select.data.measure.preflight import check_machines, check_memory, describe, loopback_device, node_options
from ficco_select.data.measure.resume import check_parts_timing, earlier_rows, merge_parts, parts_dir
from ficco_select.data.scenarios import read_scenarios, table_machines
from ficco_select.hardware import HardwareSpec, machines
from ficco_select.scenario import Scenario
from ficco_select.schedule import candidates


def measure(scenarios: Sequence[Scenario], *, backend: str = "cpu", config: MeasureConfig,
            out: str | Path | None = None, progress: bool = True,
            device: str | None = None, ranks: str = "loopback", fabric: Fabric | None = None) -> pd.DataFrame | None:
    """Measure `scenarios`; write `out` if given; return the rows (None on non-zero ranks).

    backend ``cpu``: spawns the gloo ranks itself, one job per world size, unless running
    under torchrun, where this process is one rank and every scenario must match the
    torchrun world size. backend ``cuda``: the loopback executor on one GPU (`device`,
    default ``cuda``), every scenario's P ranks virtual on that device; each scenario's
    hardware column must name the GPU (a preset or spec file), never ``cpu``.
    With ``ranks="node"`` the cuda backend spawns a process per GPU instead
    (``data/measure/node.py``: NCCL for ``sm``, copy engines through symmetric memory for
    ``dma``); a scenario of world size P needs P visible GPUs.

    device: None for the backend's own executor; ``cpu`` with backend ``cpu`` runs the
    loopback executor on CPU threads instead of gloo ranks (tests of the cuda path).

    fabric: the cpu backend's ranks on a shaped loopback (``fabric.py``; this process must
    run inside it). The scenarios' ``cpu`` becomes the fabric's machine (``cpu-500mbit``),
    profiled once per `out` (``fabric_profile.on_fabric``), and the fingerprint ends with
    ``-fabric-<rate>``.

    Crash-safe with `out`: each finished scenario is committed atomically to
    ``<out>.parts/<scenario_id>.parquet`` before the next one starts; rerunning the same
    command after a kill skips the committed ones, so every scenario ends up exactly once.

    Nothing measured is lost: an existing `out` (the same backend, machine and timing
    settings, else it is refused; so are committed parts timed otherwise) keeps its
    scenarios, which count as done; `out` is rewritten (atomically) as those plus this
    run's, only when this run added any. Only the parts of `scenarios`
    are removed once in `out`; parts of other scenarios (an interrupted sweep of another
    table into the same `out`) stay where they are.
    Two runs into one `out` at once: the second refuses at once, naming the first
    (``ficco_select.data.locks``), and the first goes on untouched.
    """
    writes = out is not None and not (under_torchrun() and int(os.environ.get("RANK", "0")) != 0)  # only rank 0 writes
    with output_lock(out, "ficco measure") if writes else contextlib.nullcontext():
        known = []
        if fabric is not None:
            scenarios, spec = _on_fabric(scenarios, fabric, backend=backend, out=out, device=device)
            known = [(spec, str(profile_path(out)) if out is not None else "the fabric's profile")]
        with machines(known, replace=True):  # the fabric's rows are its profile's, whatever a caller believes
            plan = _plan(scenarios, backend=backend, config=config, out=out, device=device, ranks=ranks,
                         fabric=fabric)
            rows, failed = _run(plan, config, progress)
            return _assemble(plan, rows, failed) if plan.is_rank0 else None


# -- what flows between the stages ---------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """What a sweep measures and how: the scenarios left, the executor, and where the rows go."""

    scenarios: Sequence[Scenario]
    """The whole table, done scenarios included."""
    todo: list[Scenario]
    """The scenarios neither in `out` nor committed to its parts, in table order."""
    backend: str
    mode: str | None
    """The cuda backend's ranks mode, or ``fabric-<rate>`` on a shaped fabric, else None (the
    fingerprint ends with it: each labels differently)."""
    device: str | None
    """The loopback executor's device; None: gloo ranks, or a process per GPU (`node`)."""
    node: NodeOptions | None
    """The cuda backend's node mode, else None."""
    distributed: bool
    """This process is one rank of a torchrun job (its process group initialized)."""
    is_rank0: bool
    """This process writes and returns the rows."""
    out: str | Path | None
    parts: Path | None
    """``parts_dir(out)``, or None without `out`."""
    earlier: pd.DataFrame | None
    """The rows already in `out` (rank 0 only), or None."""
    timing: dict
    """The timing settings the rows are taken with (``TimingPolicy.timing``), recorded in
    every file written."""


# -- the stages, in order ------------------------------------------------------------------
def _on_fabric(scenarios: Sequence[Scenario], fabric: Fabric, *, backend: str, out: str | Path | None,
               device: str | None) -> tuple[list[Scenario], HardwareSpec]:
    if backend != "cpu" or device is not None or under_torchrun():
        raise ValueError(f"--fabric {fabric.rate}: a shaped fabric carries the cpu backend's spawned gloo ranks "
                         "(not the cuda backend, the loopback executor or a torchrun job)")
    if inside() != fabric:
        raise ValueError(f"--fabric {fabric.rate}: this process is not inside that fabric's network namespace "
                         "(`ficco measure --fabric` makes one)")
    return on_fabric(scenarios, fabric, out)


def _plan(scenarios: Sequence[Scenario], *, backend: str, config: MeasureConfig, out: str | Path | None,
          device: str | None, ranks: str, fabric: Fabric | None = None) -> SweepPlan:
    """Refuse, before any work starts, what cannot run here (ranks mode, machines, device,
    memory); then what is left to measure: `scenarios` less those already in `out` or
    committed to its parts. Under torchrun rank 0 decides, the process group initialized."""
    if ranks not in ("loopback", "node"):
        raise ValueError(f"ranks {ranks!r}: 'loopback' (virtual ranks on one device) or 'node' (a process per GPU)")
    if ranks == "node" and backend != "cuda":
        raise ValueError(f"ranks 'node': a process per GPU is the cuda backend's mode, not {backend!r}'s")
    check_machines(scenarios, backend)
    node = node_options(scenarios, backend, device) if ranks == "node" else None
    # In the fingerprint: the cuda modes label differently, and a fabric is another network.
    mode = ranks if backend == "cuda" else (f"fabric-{fabric.rate}" if fabric is not None else None)
    device = None if node else loopback_device(scenarios, backend, device)
    distributed = device is None and under_torchrun()
    is_rank0 = not distributed or int(os.environ.get("RANK", "0")) == 0
    check_memory(scenarios, backend, device, node,
                 local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else None)
    parts = parts_dir(out) if out is not None else None
    wanted = {s.scenario_id for s in scenarios}
    timing = config.timing()
    earlier = earlier_rows(out, backend, mode, timing) if out is not None and is_rank0 else None
    done = set(earlier["scenario_id"]) if earlier is not None else set()
    if parts is not None and parts.is_dir() and is_rank0:
        committed = [p for p in sorted(parts.glob("*.parquet")) if p.stem in wanted]
        check_parts_timing(committed, timing)
        done |= {p.stem for p in committed}
    if distributed:
        init_from_env(config.timeout_s * 2)
        # Only rank 0's disk holds the parts (ranks may be on other nodes): it decides what is left.
        box = [sorted(done)]
        dist.broadcast_object_list(box, src=0)
        done = set(box[0])
    return SweepPlan(scenarios=scenarios, todo=[s for s in scenarios if s.scenario_id not in done], backend=backend,
                     mode=mode, device=device, node=node, distributed=distributed, is_rank0=is_rank0, out=out,
                     parts=parts, earlier=earlier, timing=timing)


def _run(plan: SweepPlan, config: MeasureConfig, progress: bool) -> tuple[list[dict], list[str]]:
    """Measure `plan.todo` on its executor, each finished scenario committed (``_commit``) as
    it comes. Returns (this run's rows, its failures: a scenario whose run failed is recorded
    as failed with its reason and the sweep goes on)."""
    rows: list[dict] = []

    def on_scenario(scenario_rows: list[dict]) -> None:
        _commit(plan, scenario_rows)
        rows.extend(scenario_rows)

    failed: list[str] = []
    total = sum(len(candidates(s, plan.backend)) for s in plan.todo)
    bar = tqdm(total=total, unit="schedule", desc="measure", disable=not (progress and plan.is_rank0))
    try:
        if plan.device is not None:
            failed += _measure_loopback(plan.todo, config, plan.backend, plan.device, on_scenario, bar)
        elif plan.distributed:
            try:
                def emit(kind: str, payload) -> None:
                    if kind == "scenario":
                        on_scenario(payload)
                    elif kind == "progress":
                        bar.update(payload)

                measure_in_group(plan.todo, config, emit)
            finally:
                dist.destroy_process_group()
        else:
            by_world: dict[int, list[Scenario]] = {}
            for s in plan.todo:
                by_world.setdefault(s.world_size, []).append(s)
            for P in sorted(by_world):
                failed += _measure_surviving_failures(by_world[P], config, plan.backend, on_scenario, bar, plan.node)
    finally:
        bar.close()
    return rows, failed


def _commit(plan: SweepPlan, scenario_rows: list[dict]) -> None:
    """Crash safety: one finished scenario's rows to ``<out>.parts/<scenario_id>.parquet``,
    atomically, before the next one starts (no `out`: nothing to write)."""
    if plan.parts is not None:
        part = pd.DataFrame(scenario_rows).assign(**provenance(plan.backend, plan.mode))
        write_parquet_atomic(part, plan.parts / f"{scenario_rows[0]['scenario_id']}.parquet", timing=plan.timing)


def _assemble(plan: SweepPlan, rows: list[dict], failed: list[str]) -> pd.DataFrame:
    """The dataset: with `out`, its earlier rows plus the committed parts, written
    (``merge_parts``); else this run's `rows`. Its ``attrs["sweep"]`` counts what the sweep did."""
    kept_parts = 0
    if plan.parts is None:
        df = pd.DataFrame(rows).assign(**provenance(plan.backend, plan.mode))
    else:
        df, kept_parts = merge_parts(plan.out, plan.parts, plan.earlier, [s.scenario_id for s in plan.scenarios],
                                     plan.timing)
    ok = df[df["status"] == "ok"]
    df.attrs["sweep"] = {
        "scenarios": len(plan.scenarios),
        "measured": len(plan.todo) - len(failed),
        "skipped": len(plan.scenarios) - len(plan.todo),
        "failed": len(failed),
        "failures": failed,
        "noisy_rows": int(ok["noisy"].sum()),
        "rows": len(df),
        "kept_from_out": 0 if plan.earlier is None else int(plan.earlier["scenario_id"].nunique()),
        "other_parts_kept": kept_parts,
    }
    return df


# -- the row sources, each scenario's failure recorded ------------------------------------
def _measure_loopback(scenarios: list[Scenario], config: MeasureConfig, backend: str, device: str,
                      on_scenario, bar) -> list[str]:
    """Measure scenarios one by one in loopback on `device`; a scenario whose run fails
    (a virtual rank raised or hung, out of memory) is recorded as failed with the reason
    and the sweep goes on, unless the device itself is broken afterwards."""
    if config.fault is not None:
        raise ValueError(f"fault {config.fault!r}: fault injection is for the cpu backend's gloo ranks")
    failures: list[str] = []
    for s in scenarios:
        try:
            rows = loopback_rows(s, config, backend=backend, device=device)
        except (LoopbackError, torch.OutOfMemoryError) as e:
            reason = str(e).splitlines()[0]
            rows = failed_rows(s, reason, backend)
            failures.append(f"{s.scenario_id} ({describe(s)}): {reason}")
            _check_device(device, after=s)
        on_scenario(rows)
        bar.update(len(rows))
    return failures


def _check_device(device: str, *, after: Scenario) -> None:
    """After a failed scenario: stop the sweep if the device is unusable (a sticky CUDA error),
    rather than record every later scenario as failed. Committed scenarios are kept."""
    if torch.device(device).type != "cuda":
        return
    try:
        torch.cuda.empty_cache()
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        raise MeasureError(f"{device} is unusable after scenario {after.scenario_id} failed ({e}); "
                           "rerun the same command in a fresh process to resume") from None


def _measure_surviving_failures(scenarios: list[Scenario], config: MeasureConfig, backend: str,
                                on_scenario, bar, node: NodeOptions | None = None) -> list[str]:
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
            measure_spawned(remaining, config, on_scenario=record, on_progress=bar.update, node=node)
            return failures
        except MeasureError as e:
            rest = [s for s in remaining if s.scenario_id not in finished]
            culprit, remaining = rest[0], rest[1:]
            reason = str(e).splitlines()[0]
            on_scenario(failed_rows(culprit, reason, backend))
            bar.update(len(candidates(culprit, backend)))
            failures.append(f"{culprit.scenario_id} ({describe(culprit)}): {reason}")
    return failures


# -- `ficco measure`: the table, its shards, the summary -----------------------------------
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


def parse_shard(text: str) -> tuple[int, int]:
    """``i/N`` (0 <= i < N) -> (i, N); ValueError naming what is wrong."""
    index, sep, count = str(text).partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: expected i/N with 0 <= i < N (shard 0/3 is the first of three)")
    return i, n


def shard_of(scenarios: Sequence[Scenario], index: int, count: int) -> list[Scenario]:
    """Shard `index` of `count`: the scenarios whose id hashes (crc32) to it, in table order.
    Every scenario is in exactly one shard, whatever machine or process computes it; a table
    that gains rows moves no scenario between shards."""
    return [s for s in scenarios if zlib.crc32(s.scenario_id.encode()) % count == index]


def measure_table(path, *, backend: str, ranks: str, config: MeasureConfig, out, progress: bool,
                  shard: tuple[int, int] | None = None, fabric: Fabric | None = None) -> pd.DataFrame | None:
    """``ficco measure``: measure the scenario table `path` (only its shard ``(i, N)`` if
    given: ``shard_of``); the rows, or None on a non-zero torchrun rank. Raises
    ScenarioError, ValueError, MeasureError."""
    scenarios = read_scenarios(path, backend=backend)
    if shard is not None:
        scenarios = shard_of(scenarios, *shard)
        if not scenarios:
            raise ValueError(f"--shard {shard[0]}/{shard[1]}: no scenario of {path} falls in this shard; "
                             "use fewer shards")
    if ranks == "node" and backend != "cuda":
        raise ValueError("--ranks node: a process per GPU is the cuda backend's mode; add --backend cuda")
    with machines(table_machines(path)):  # the table's spec files, as its rows name them
        return measure(scenarios, backend=backend, config=config, out=out, progress=progress, ranks=ranks,
                       fabric=fabric)


def sweep_summary(df: pd.DataFrame, table: pd.DataFrame, out) -> dict:
    """A sweep's JSON summary: the sweep's counts, verified rows, and `table` (its
    ``summary_table``) per scenario."""
    ok = df["status"] == "ok"
    return {"out": str(out), **df.attrs.get("sweep", {}), "verified": int(df["verified"].sum()),
            "unverified": int((ok & ~df["verified"]).sum()), "per_scenario": table.to_dict("records")}
