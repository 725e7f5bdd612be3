"""Machines sampled around the presets: more hardware to learn from than six data sheets.

A hardware hold-out with six GPU presets trains on five machines, and a model that has
seen five points of the spec space cannot be trusted anywhere else: the runtime keeps
unseen machines outside the trained spec ranges on the heuristic. Simulated machines
whose numbers are drawn around each preset (every rate, latency, unit count and
contention factor scaled by its own log-uniform factor in [1/spread, spread], the copy
engines drawn from 1 to 16; devices, tiles and topology kept) fill the space between and beyond them, so that the model
learns how the best schedule moves with the hardware rather than which of five machines
a scenario is on.

A sampled machine is named ``<preset>~<i>`` (``base_machine`` strips the mark). It is
training data only: evaluation never scores it, and a fold that holds a preset out holds
out its samples too (``ficco_select.train.evaluate.folds``), else the held-out machine would be in
training under another name.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ficco_select.hardware import HardwareSpec, fields_of, spec_field

SAMPLED_MARK = "~"

_SCALED = fields_of("rate", "latency")
"""Fields scaled by a factor of their own; peak_tflops (all dtypes together), compute units,
copy engines and the fractions are drawn with their own limits below."""


def base_machine(name: str) -> str:
    """The preset a sampled machine was drawn around; any other name unchanged."""
    return name.split(SAMPLED_MARK, 1)[0]


def is_sampled(name: str) -> bool:
    return SAMPLED_MARK in name


_FRACTIONS = fields_of("fraction")
_DRAWN = (*_SCALED, "peak_tflops", "compute_units", *_FRACTIONS, "copy_engines")


def sample_around(spec: HardwareSpec, index: int, *, spread: float, u: dict[str, float]) -> HardwareSpec:
    """One machine around `spec`, named ``<spec.name>~<index>``; `u` holds a number in
    [0, 1) per drawn field (0: the lowest factor, 1/spread; 1: the highest, spread)."""
    def factor(field: str) -> float:
        return float(spread ** (2 * u[field] - 1))

    changes = {f: getattr(spec, f) * factor(f) for f in _SCALED}
    changes["peak_tflops"] = {dtype: value * factor("peak_tflops") for dtype, value in spec.peak_tflops.items()}
    changes["compute_units"] = max(1, round(spec.compute_units * factor("compute_units")))
    for f in _FRACTIONS:  # each within its own cap (efficiencies vary less than the rates)
        exponent, cap = spec_field(f).metadata["sample"]
        changes[f] = min(cap, getattr(spec, f) * factor(f) ** exponent)
    if spec.copy_engines:  # how many a GPU exposes for peer copies is rarely published: 1 to 16
        changes["copy_engines"] = 1 + int(16 * u["copy_engines"])
    return dataclasses.replace(spec, name=f"{spec.name}{SAMPLED_MARK}{index}",
                               description=f"sampled around {spec.name} (x1/{spread:g}..x{spread:g} per field)",
                               **changes)


def sampled_machines(presets: list[HardwareSpec], *, per_preset: int, spread: float, seed: int = 0
                     ) -> list[HardwareSpec]:
    """`per_preset` machines around each preset (names ``<preset>~<i>``); nothing is
    registered: the caller that simulates them registers them (``train.training_data.sampled``),
    and datasets and models carry their specs (``ficco_select.data.dataset.user_specs``).

    Latin hypercube draws: for each preset and field, the machines fall in different
    equal slices of the range, so a few machines already reach both of its ends."""
    rng = np.random.default_rng(seed)
    out = []
    for spec in presets:
        slices = {f: rng.permutation(per_preset) for f in _DRAWN}
        for i in range(per_preset):
            u = {f: (slices[f][i] + rng.random()) / per_preset for f in _DRAWN}
            out.append(sample_around(spec, i, spread=spread, u=u))
    return out
