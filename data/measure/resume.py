"""What a sweep finds in its `out` and keeps: the rows already there, the scenarios an
interrupted run committed to ``<out>.parts/``, and the dataset they join into.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ficco_select.data.dataset import DatasetError, provenance, read_dataset, read_timing, unlike_timing, write_parquet_atomic


def parts_dir(out: str | Path) -> Path:
    """Where finished scenarios are committed, one file each, until the dataset is complete:
    beside `out`'s real path (symlinks resolved), as its lock is, so that a rerun through
    another name for it resumes."""
    out = Path(out).resolve()
    return out.with_name(out.name + ".parts")


def earlier_rows(out: str | Path, backend: str, mode: str | None, timing: dict) -> pd.DataFrame | None:
    """The rows already in `out`, or None if there is no `out` yet. Refuses an `out` that
    is not a dataset, or was measured by another backend, on another machine or with other
    timing settings (``unlike_timing``): appending would mix labels, replacing would destroy
    them."""
    out = Path(out)
    if not out.exists():
        return None
    try:
        df = read_dataset(out)
    except DatasetError as e:
        raise ValueError(f"--out {out}: exists and is not a dataset this run can add to ({e}); "
                         "choose another --out") from None
    here = provenance(backend, mode)
    for col in ("backend", "hardware_fingerprint"):
        theirs = sorted(set(df[col].astype(str))) if col in df.columns else ["?"]
        if theirs != [str(here[col])]:
            raise ValueError(f"--out {out}: holds rows with {col} {', '.join(theirs)}, this run measures "
                             f"{here[col]}; one dataset holds one machine's measurements: choose another --out")
    why = unlike_timing(read_timing(out), timing, "this run")
    if why:
        raise ValueError(f"--out {out}: {why}; one dataset is timed alike: rerun with its settings, or choose "
                         "another --out")
    return df


def check_parts_timing(committed: list[Path], timing: dict) -> None:
    """Refuse committed parts (an interrupted run's) timed with other settings than this run's:
    counted as done, they would join this run's rows in one dataset."""
    for part in committed:
        why = unlike_timing(read_timing(part), timing, "this run")
        if why:
            raise ValueError(f"{part}: a committed part of an earlier run, {why}; rerun with its settings, or "
                             f"remove {part.parent} to measure those scenarios again")


def merge_parts(out: str | Path, parts: Path, earlier: pd.DataFrame | None,
                ids: list[str], timing: dict) -> tuple[pd.DataFrame, int]:
    """`out` = its earlier rows + this table's committed parts, written atomically only if
    there are new parts; then those parts (only) are removed. Returns (rows, parts of other
    scenarios left in `parts`)."""
    have = set(earlier["scenario_id"]) if earlier is not None else set()
    by_id = {p.stem: p for p in parts.glob("*.parquet")} if parts.is_dir() else {}
    new = [sid for sid in dict.fromkeys(ids) if sid in by_id and sid not in have]
    frames = ([earlier] if earlier is not None else []) + [pd.read_parquet(by_id[sid]) for sid in new]
    df = pd.concat(frames, ignore_index=True)
    if new or earlier is None:
        write_parquet_atomic(df, out, timing=timing)
    for sid in ids:  # ours only, and only once `out` holds them
        if sid in by_id:
            by_id[sid].unlink()
    others = len(list(parts.glob("*.parquet"))) if parts.is_dir() else 0
    if parts.is_dir() and not any(parts.iterdir()):
        parts.rmdir()
    return df, others
