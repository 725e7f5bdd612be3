"""Joining datasets (``ficco dataset merge``): the shards of one sweep, each measured on its
own node or process (``ficco measure --shard i/N``), as the one dataset a whole run would make.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ficco_select.data.dataset import DatasetError, read_timing, read_valid_dataset, unlike_timing

MERGE_KEYS = ("backend", "hardware_fingerprint")
"""What every input of a merge must share: one backend, one kind of machine."""


def merge(paths: Sequence[str | Path]) -> pd.DataFrame:
    """The datasets `paths` as one (``ficco dataset merge``): the shards of one sweep, each
    measured on its own node or process (``ficco measure --shard i/N``).

    Refuses an input that is not a valid dataset (``read_valid_dataset``: what training
    needs), and inputs of different backends or machines (``MERGE_KEYS``) or timed with
    different settings (``unlike_timing``; inputs that all record none merge as before, and
    their merge records none), naming the files. A
    scenario in two inputs is kept once if both hold the same measurement (the same
    schedules, statuses and times), and refused otherwise, naming it and both files: two
    different measurements of one scenario are not one sweep's. Rows keep the inputs' order.
    The inputs' common timing settings are ``read_timing(paths[0])``.
    """
    if not paths:
        raise DatasetError("nothing to merge: give the datasets")
    frames = [read_valid_dataset(p) for p in paths]
    first = frames[0]
    for key in MERGE_KEYS:
        values = [sorted(set(f[key].astype(str))) for f in frames]
        for path, got in zip(paths, values):
            if len(got) != 1 or got != values[0]:
                raise DatasetError(f"{path}: {key} {', '.join(got)}, {paths[0]} has {', '.join(values[0])}; "
                                   "a merge joins the shards of one machine's sweep")
    timings = [read_timing(p) for p in paths]
    for path, timing in zip(paths[1:], timings[1:]):
        why = unlike_timing(timing, timings[0], str(paths[0]))
        if why:
            raise DatasetError(f"{path}: {why}; a merge joins the shards of one sweep, timed alike: measure them "
                               "with the same settings")
    kept: list[pd.DataFrame] = [first]
    owner = {sid: paths[0] for sid in first["scenario_id"].unique()}
    measured = {sid: _measurement(g) for sid, g in first.groupby("scenario_id", sort=False)}
    for path, frame in zip(paths[1:], frames[1:]):
        drop = []
        for sid, g in frame.groupby("scenario_id", sort=False):
            if sid not in owner:
                owner[sid], measured[sid] = path, _measurement(g)
            elif _measurement(g) == measured[sid]:
                drop.append(sid)
            else:
                raise DatasetError(f"{path}: scenario {sid} is also in {owner[sid]} with other rows (schedules, "
                                   "statuses or times); two measurements of one scenario are not one sweep's: "
                                   "keep one file's")
        kept.append(frame[~frame["scenario_id"].isin(drop)])
    return pd.concat(kept, ignore_index=True)


def _measurement(rows: pd.DataFrame) -> tuple:
    """A scenario's rows as what a duplicate must repeat exactly."""
    return tuple(sorted(zip(rows["schedule"].astype(str), rows["status"].astype(str),
                            rows["time_s"].astype(float).round(12).fillna(-1.0))))
