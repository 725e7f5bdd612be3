"""The default training data: the committed cpu measurements plus the catalog simulated
on every GPU preset (with measurement-like noise), one dataset schema for all, and, as
training data only, part of the catalog simulated on machines sampled around the presets
(``ficco_select.data.machines``: evaluation never scores them).

The cpu rows that an independent second sweep re-timed (``MEASURED_REPEAT``, when there is
one for the committed labels) carry its times as ``time_repeat_s``: metrics judge choices
on them, and the ceiling there is the repeat oracle (``ficco_select.train.metrics``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select.data.catalog import catalog
from ficco_select.data.dataset import COLUMNS, DatasetError, attach_repeat, dataset_machines, read_dataset, refuse_invalid
from ficco_select.data.machines import sampled_machines
from ficco_select.data.simulate import simulate
from ficco_select.hardware import HardwareSpec, Known, load_hardware, machines, preset_names
from ficco_select.scenario import Scenario
from ficco_select.train.metrics import BASELINE_PREFIX, require_every_candidate, usable_rows

log = logging.getLogger("ficco_select.train.training_data")

MEASURED = "cpu_catalog.parquet"
"""The committed measured dataset in data/measured/."""
MEASURED_REPEAT: str | None = "cpu_catalog_repeat.parquet"
"""An independent second sweep of every one of its scenarios (data/scenarios/catalog_cpu_repeat.csv),
measured with the same harness in fresh ranks (None: no repeat, every row judged on its own
labels). A repeat taken with another harness would judge the labels on other labels' noise."""
FABRICS = ("2gbit", "1gbit", "500mbit")
"""The shaped fabrics of this host with a committed sweep and second sweep (``fabric_<rate>[_repeat].parquet``)."""
MEASURED_SWEEPS: tuple[tuple[str, str | None], ...] = (
    (MEASURED, MEASURED_REPEAT),
    ("cpu_catalog_ar_a2a.parquet", "cpu_catalog_ar_a2a_repeat.parquet"),
    *((f"fabric_{rate}.parquet", f"fabric_{rate}_repeat.parquet") for rate in FABRICS),
)
"""Every committed cpu sweep in data/measured/ with its independent second sweep: the
catalog of the first three operators, the sweep of gemm_ar and gemm_a2a
(data/scenarios/catalog_cpu_ar_a2a.csv, re-timed from catalog_cpu_ar_a2a_repeat.csv), and
data/scenarios/catalog_fabric.csv on each shaped fabric (``ficco measure --fabric RATE``,
``scripts/fabric_sweeps.sh``): machines ``cpu-<rate>`` for each of ``FABRICS``."""
SIM_NOISE = 0.03
"""Log-normal sigma of the simulated repetitions: a few percent, like a quiet GPU."""
SAMPLED_PER_PRESET = 3
"""Machines sampled around each GPU preset (``ficco_select.data.machines``), training data only."""
SAMPLED_SPREAD = 3.0
"""Each of a sampled machine's numbers is its preset's times a factor in [1/3, 3]."""
SAMPLED_SHARE = 0.2
"""Share of the catalog simulated on each sampled machine (a different share on each)."""


def measured_path(name: str = MEASURED) -> Path:
    return Path(str(resources.files("ficco_select.data") / "measured" / name))


def simulated(hardware: str | HardwareSpec, *, world_sizes=(2, 4, 8), noise: float = SIM_NOISE, seed: int = 0,
              share: float = 1.0) -> pd.DataFrame:
    """The full-scale catalog simulated on one machine (a preset's or a spec file's name, or
    a spec) (`share` < 1: that share of its scenarios, drawn with `seed`)."""
    spec = hardware if isinstance(hardware, HardwareSpec) else load_hardware(hardware)
    records = catalog("full", world_sizes=world_sizes, hardware=spec)
    if share < 1:
        keep = np.random.default_rng(seed).random(len(records)) < share
        records = [r for r, k in zip(records, keep) if k]
    scenarios = [Scenario.from_record({**r, "hardware": spec.name}) for r in records]
    return simulate(scenarios, spec, noise=noise, seed=seed)


def sampled_specs(*, per_preset: int = SAMPLED_PER_PRESET, spread: float = SAMPLED_SPREAD,
                  seed: int = 0) -> list[HardwareSpec]:
    """The machines sampled around every GPU preset that the training data simulates.

    Fewer than ``SAMPLED_PER_PRESET`` machines (the debug slice) are the first of the default
    draw, so that ``<preset>~<i>`` is one machine however many a run keeps."""
    gpus = [load_hardware(name) for name in preset_names() if name != "cpu"]
    drawn = max(per_preset, SAMPLED_PER_PRESET)
    return [hw for i, hw in enumerate(sampled_machines(gpus, per_preset=drawn, spread=spread, seed=seed))
            if i % drawn < per_preset]


def sampled(*, per_preset: int = SAMPLED_PER_PRESET, spread: float = SAMPLED_SPREAD, share: float = SAMPLED_SHARE,
            noise: float = SIM_NOISE, seed: int = 0) -> list[pd.DataFrame]:
    """Part of the catalog simulated on each machine of ``sampled_specs``; the job that
    trains on the rows knows the machines by name with ``training_machines``."""
    return [simulated(hw, noise=noise, seed=seed + 1 + i, share=share)
            for i, hw in enumerate(sampled_specs(per_preset=per_preset, spread=spread, seed=seed))]


def measured_sweep(name: str, repeat: str | None) -> pd.DataFrame:
    """The committed sweep `name` with its second sweep `repeat`'s times attached
    (``attach_repeat``; None: none). Its machine is the first sweep's spec
    (``measured_machines``), whose labels it describes: the second sweep profiled the fabric
    again (a spec a few percent off under the same name) and lends only its times."""
    sweep = read_dataset(measured_path(name))
    return sweep if repeat is None else attach_repeat(sweep, read_dataset(measured_path(repeat)))


def measured_machines() -> list[tuple[HardwareSpec, str]]:
    """The machines of the committed sweeps (``MEASURED_SWEEPS``), each first sweep's spec."""
    return [known for name, _ in MEASURED_SWEEPS for known in dataset_machines(measured_path(name))]


def measured_rows() -> pd.DataFrame:
    """Every committed cpu sweep (``MEASURED_SWEEPS``), each with its repeat's times attached."""
    return pd.concat([measured_sweep(name, repeat) for name, repeat in MEASURED_SWEEPS], ignore_index=True)


def default_training_data(*, noise: float = SIM_NOISE, seed: int = 0, extra: list[pd.DataFrame] = (),
                          sampled_per_preset: int = SAMPLED_PER_PRESET) -> pd.DataFrame:
    """Measured cpu rows + simulated rows on every GPU preset and on machines sampled
    around them (training only, ``ficco_select.data.machines``) (+ any extra datasets).
    Its machines: ``training_machines(sampled_per_preset=...)``."""
    frames = [measured_rows()]
    frames += [simulated(name, noise=noise, seed=seed) for name in preset_names() if name != "cpu"]
    if sampled_per_preset:
        frames += sampled(per_preset=sampled_per_preset, noise=noise, seed=seed)
    frames += list(extra)
    return pd.concat(frames, ignore_index=True)


def training_machines(datasets: Sequence[str | Path] = (), *, default: bool | None = None,
                      sampled_per_preset: int = SAMPLED_PER_PRESET, seed: int = 0) -> Known:
    """The machines training data names beyond the shipped ones, for ``machines``: the given
    datasets' own, and (`default`; by default when no dataset is given) those of
    ``default_training_data`` (the committed sweeps' and the sampled machines)."""
    known = [m for path in datasets for m in dataset_machines(path)]
    if default if default is not None else not datasets:
        where = f"machines sampled around the presets (spread {SAMPLED_SPREAD:g}, seed {seed})"
        known += measured_machines() + [(hw, where) for hw in sampled_specs(per_preset=sampled_per_preset, seed=seed)]
    return known


def telemetry_training_rows(telemetry: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """The telemetry rows (``ficco_select.data.telemetry.read_telemetry``) a learned selector can fit on
    beside the dataset `df`, as extra rows for the registered model only.

    Telemetry holds the one or two schedules a job ran per scenario, not every candidate,
    so it is never scored: the metrics compare a choice with the best of *all* candidates
    (``ficco_select.train.metrics``), which a partial scenario cannot give. Kept: scenarios with a
    verified baseline (``none.*``) row and at least one other verified row, since the
    learned targets are times relative to the scenario's baseline and a lone row compares
    nothing; and only scenarios not already in `df`, whose complete, controlled
    measurement is the better label (one scenario's times from two runs would be compared
    as if taken under the same conditions). Failed or unverified rows are never labels.
    """
    ok = usable_rows(telemetry)
    ok = ok[~ok["scenario_id"].isin(set(df["scenario_id"]))]
    per = ok.groupby("scenario_id")["schedule"]
    has_base = per.transform(lambda s: s.str.startswith(BASELINE_PREFIX).any())
    kept = ok[has_base & (per.transform("size") >= 2)]
    for name in sorted(set(kept["hardware"])):
        load_hardware(name)  # an unknown spec fails now, not after minutes of evaluation
    dropped = telemetry["scenario_id"].nunique() - kept["scenario_id"].nunique()
    if dropped:
        log.warning("telemetry: %d of %d scenario(s) not used for training (already in the dataset, or no "
                    "verified baseline plus another verified schedule)", dropped, telemetry["scenario_id"].nunique())
    return kept.reset_index(drop=True)


def read_training_dataset(path: str | Path) -> pd.DataFrame:
    """A dataset to train and score on: read, then refused (DatasetError naming the file) if
    a scenario lacks some of its candidates (``ficco_select.train.metrics.require_every_candidate``: how
    many, and which) or ``ficco_select.data.dataset.validate`` finds a problem (the first: its row and
    column). Both before any work is done on it."""
    df = read_dataset(path)
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:  # what validate says first; the schedules' check reads these columns
        raise DatasetError(f"{path}: column '{missing[0]}' is missing"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    try:
        require_every_candidate(df)
    except ValueError as e:
        raise DatasetError(f"{path}: {e}") from None
    with machines(dataset_machines(path)):
        refuse_invalid(df, path)
    return df


def load_training_data(datasets: Sequence[str]) -> pd.DataFrame:
    """The given datasets (each ``read_training_dataset``), or the default training data (cpu
    measured + GPU presets simulated). Raises DatasetError."""
    if not datasets:
        return default_training_data()
    return pd.concat([read_training_dataset(p) for p in datasets], ignore_index=True)
