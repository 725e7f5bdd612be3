"""The default training data: the committed cpu measurements plus the catalog simulated
on every GPU preset (with measurement-like noise), one dataset schema for all."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pandas as pd

from data.catalog import catalog
from data.dataset import read_dataset
from data.simulate import simulate
from ficco_select.hardware import load_hardware, preset_names
from ficco_select.scenario import Scenario

MEASURED = "cpu_catalog.parquet"
"""The committed measured dataset in data/measured/."""
SIM_NOISE = 0.03
"""Log-normal sigma of the simulated repetitions: a few percent, like a quiet GPU."""


def measured_path() -> Path:
    return Path(str(resources.files("data") / "measured" / MEASURED))


def simulated(hardware: str, *, world_sizes=(2, 4, 8), noise: float = SIM_NOISE, seed: int = 0) -> pd.DataFrame:
    """The full-scale catalog simulated on one preset or spec file."""
    spec = load_hardware(hardware)
    scenarios = [Scenario.from_record({**r, "hardware": spec.name})
                 for r in catalog("full", world_sizes=world_sizes, hardware=spec.name)]
    return simulate(scenarios, spec, noise=noise, seed=seed)


def default_training_data(*, noise: float = SIM_NOISE, seed: int = 0, extra: list[pd.DataFrame] = ()) -> pd.DataFrame:
    """Measured cpu rows + simulated rows on every GPU preset (+ any extra datasets)."""
    frames = [read_dataset(measured_path())]
    frames += [simulated(name, noise=noise, seed=seed) for name in preset_names() if name != "cpu"]
    frames += list(extra)
    return pd.concat(frames, ignore_index=True)
