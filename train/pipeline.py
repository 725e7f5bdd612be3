"""The one-command pipeline: data -> train -> evaluate -> register -> report.

With no arguments: the committed cpu dataset plus the catalog simulated on every GPU
preset (and on machines sampled around them, for training). Pointed at new hardware
(``backend``, ``hardware``), it first adds that machine's rows (simulated, or measured
resumably on the cpu backend); a machine measured elsewhere (a GPU node, with ``ficco
measure --backend cuda``) joins as a dataset (``datasets``). The grouped evaluation then
scores every selector with that hardware held out (leave-one-hardware-out) and with it
included (the family and random splits), and the champion moves only by the promotion
rules of ``ficco_select.train.run``.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ficco_select.hardware import load_hardware, machines
from ficco_select.train.config import TrainConfig
from ficco_select.train.evaluate import usable_cores
from ficco_select.train.run import train
from ficco_select.train.training_data import (
    SAMPLED_PER_PRESET,
    default_training_data,
    read_training_dataset,
    simulated,
    training_machines,
)

PIPELINE_SPLITS = ("family", "hardware", "topology")


def new_hardware_rows(backend: str, hardware: str | None, out_dir: Path, progress: bool) -> pd.DataFrame | None:
    """Rows for the machine being added: simulated on its spec, or measured here."""
    if backend == "sim":
        if not hardware:
            raise ValueError("--backend sim needs --hardware NAME|FILE (the machine to simulate)")
        return simulated(hardware)
    if backend == "cpu":
        from ficco_select.data.measure.config import MeasureConfig
        from ficco_select.data.measure.sweep import measure
        from ficco_select.data.scenarios import packaged, read_scenarios

        scenarios = read_scenarios(packaged("catalog_cpu.csv"), backend="cpu")
        return measure(scenarios, config=MeasureConfig(), out=out_dir / "measured_cpu.parquet", progress=progress)
    # A GPU is measured where it is (hours of a node: not inside a one-command pipeline),
    # and its dataset joins here with --dataset.
    raise ValueError(f"--backend {backend}: the pipeline measures the cpu backend or simulates (sim); measure a "
                     "GPU with `ficco measure --backend cuda --out gpu.parquet` and add it with --dataset gpu.parquet")


DEBUG_SCENARIOS_PER_MACHINE = 12
"""``debug``: scenarios kept of each machine (every stage still runs on every machine)."""


def run_pipeline(*, backend: str | None = None, hardware: str | None = None, datasets: Sequence[str | Path] = (),
                 out_dir: str | Path = "out/pipeline", progress: bool = True, debug: bool = False,
                 export_to: str | Path | None = None, workers: int | None = None) -> dict:
    """`datasets`: measured datasets to add to the default training data (e.g. a GPU's,
    from ``ficco measure --backend cuda``), each checked before any work
    (``ficco_select.train.training_data.read_training_dataset``: DatasetError naming the file). `debug`:
    every stage on a tiny slice (a few scenarios per machine, tiny models), to check that it
    all runs; its numbers mean nothing. `workers`: hold-out folds fitted at once (default:
    ``default_workers()``).
    `export_to`: when the champion moves, export it there (``ficco_select.train.export``), so that the
    runtime (``Selector.load()``, ``ficco select``) uses it without a manual step; never in
    `debug` (a tiny model must not reach a job). The summary says where (``exported``) or why
    not (``export_error``: a folder the export may not replace)."""
    out_dir = Path(out_dir)
    config = TrainConfig(splits=PIPELINE_SPLITS, selectors="debug" if debug else "fast", out_dir=out_dir,
                         progress=progress, workers=workers or default_workers())  # checked before any data
    started = time.perf_counter()
    extra = [read_training_dataset(p) for p in datasets]  # refused naming file, row and column, before any work
    sampled_per_preset = 1 if debug else SAMPLED_PER_PRESET
    # The job knows the machines its data names: the datasets' own, the default training
    # data's, and the machine being added (a spec file's, by its name).
    with (machines(training_machines(datasets, default=True, sampled_per_preset=sampled_per_preset)),
          machines([load_hardware(hardware)] if backend == "sim" and hardware else [], str(hardware))):
        if backend:
            extra.append(new_hardware_rows(backend, hardware, out_dir, progress))
        df = default_training_data(extra=extra, sampled_per_preset=sampled_per_preset)
        df = df.drop_duplicates(["scenario_id", "schedule"], keep="last")  # re-adding a preset replaces it
        if debug:
            df = debug_slice(df, DEBUG_SCENARIOS_PER_MACHINE)
        data_s = round(time.perf_counter() - started, 2)
        summary = train(df, config)
    summary = {**summary, "seconds": {"data": data_s, **summary["seconds"]}}
    return export_if_promoted(summary, export_to) if export_to is not None and not debug else summary


def default_workers() -> int:
    """One process per CPU core this process may use, at most 4: the pipeline's folds are ~20,
    and each process holds its own copy of the training frame."""
    return max(1, min(4, usable_cores()))


def export_if_promoted(summary: dict, export_to: str | Path) -> dict:
    """`summary` (``ficco_select.train.run.train``'s) with ``exported`` (the folder) if its version became
    the champion and was exported to `export_to`, or ``export_error`` if the folder may not
    be replaced (the model is registered either way; ``ficco export`` can still copy it)."""
    if not summary["promoted"]:
        return summary
    from ficco_select.train.export import export
    from ficco_select.train.run import REGISTERED_MODEL

    try:
        return {**summary, "exported": str(export(export_to, f"models:/{REGISTERED_MODEL}/{summary['version']}"))}
    except ValueError as e:
        return {**summary, "export_error": str(e)}


def debug_slice(df: pd.DataFrame, per_machine: int) -> pd.DataFrame:
    """The first `per_machine` scenarios of each machine in a fixed shuffled order (by id hash)."""
    ids = df.drop_duplicates("scenario_id")[["scenario_id", "hardware"]]
    ids = ids.assign(order=ids["scenario_id"].map(lambda s: zlib.crc32(s.encode()))).sort_values(["hardware", "order"])
    keep = set(ids.groupby("hardware").head(per_machine)["scenario_id"])
    return df[df["scenario_id"].isin(keep)].reset_index(drop=True)
