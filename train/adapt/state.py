"""What a ``ficco adapt`` folder keeps between rounds, and how a restarted run reads it back
(``ficco adapt``'s state stage).

``options.json``: what the folder was made with, the machine's numbers included
(``verify_state`` refuses other options, another machine under the same name, or a folder
``ficco adapt`` did not write; ``check_state`` records them). ``measured.parquet`` (every
measured row, carrying the adapted spec) and ``rounds.json`` (each finished ``Round``): both
replaced atomically after each round (``save``). ``pending.json``: the scenarios of the round under way, written
before it measures (``write_pending``) and read back by ``pending``. ``resume`` reads a
folder back, refusing another machine's or a damaged one; ``last_spec`` is the spec its
last finished round adapted to.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ficco_select.data.dataset import read_dataset, write_parquet_atomic
from ficco_select.data.locks import write_json_atomic as write_json
from ficco_select.hardware import HardwareSpec, spec_as_dict, spec_from_dict

log = logging.getLogger("ficco_select.train.adapt")

OPTIONS_FILE = "options.json"
"""What an adapt folder was made with: the machine and every option that shapes its rounds."""


@dataclasses.dataclass
class Round:
    measured: int
    fraction: float
    chosen: list[str]
    spec: dict
    scores: dict


def read_json(path: Path):
    """A state file's contents; ValueError naming the file if it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e}); a state file of this folder, damaged: "
                         "choose another --out") from None


def verify_state(out: Path, options: dict) -> None:
    """Refuse a folder that ``ficco adapt`` did not write, or wrote for another machine or
    other options (resuming it would mix two experiments), writing nothing: the run checks
    this before any work, and records its options (``check_state``) once nothing else refuses.

    `options` may hold ``specs``: for ``hardware`` and ``start``, where the spec came from (a
    file or a name) and its numbers. A machine is its numbers, not its name: another spec
    file under the same ``name:`` is another machine."""
    path = out / OPTIONS_FILE
    if path.exists():
        recorded = read_json(path)
        if not isinstance(recorded, dict):
            raise ValueError(f"{path}: expected an object of options, got {str(recorded)[:80]}; a state file of "
                             "this folder, damaged: choose another --out")
        changed = [k for k in options if k != "specs" and recorded.get(k) != options[k]]
        if changed:
            k = changed[0]
            raise ValueError(f"--out {out} was made with --{k.replace('_', '-')} {recorded.get(k)!r}, not "
                             f"{options[k]!r}: resuming would mix two runs; choose another --out "
                             f"(or the same options)")
        _same_specs(out, recorded.get("specs"), options.get("specs", {}))
        return
    if out.exists() and any(out.iterdir()):
        found = sorted(p.name for p in out.iterdir())[:4]
        raise ValueError(f"--out {out} holds {', '.join(found)} but no {OPTIONS_FILE}: not a ficco adapt "
                         "folder; choose another --out (nothing was changed)")


def _same_specs(out: Path, recorded, specs: dict) -> None:
    """Refuse a resume whose --hardware or --start spec has other numbers than the folder's."""
    path = out / OPTIONS_FILE
    for option, given in specs.items():
        mine = recorded.get(option) if isinstance(recorded, dict) else None
        if not isinstance(mine, dict) or not isinstance(mine.get("numbers"), dict):
            raise ValueError(f"{path}: field 'specs' does not record the numbers of --{option}'s spec (a folder of "
                             "an older ficco adapt): resuming could mix two machines; choose another --out")
        fields = [*given["numbers"], *(f for f in mine["numbers"] if f not in given["numbers"])]
        differ = [f for f in fields if mine["numbers"].get(f) != given["numbers"].get(f)]
        if differ:
            raise ValueError(f"--{option} {given['from']}: machine {given['numbers'].get('name')!r} has other numbers "
                             f"({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}) than the one --out {out} "
                             f"was made with (from {mine.get('from')}): resuming would mix two machines; choose "
                             "another --out (or that spec)")


def spec_record(spec: HardwareSpec, source: str) -> dict:
    """A spec as ``options.json`` records it: where it came from and its numbers (as JSON reads them back)."""
    return {"from": str(source), "numbers": json.loads(json.dumps(spec_as_dict(spec)))}


def check_state(out: Path, options: dict) -> None:
    """``verify_state``, then record `options` in a new folder."""
    verify_state(out, options)
    path = out / OPTIONS_FILE
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, options)


def resume(out: Path | None, machine: str) -> tuple[pd.DataFrame, list[Round]]:
    """The rows measured so far and the finished rounds in `out` for the machine named
    `machine` (none without a ``rounds.json``); ValueError naming the file that belongs to
    another run or was damaged."""
    if out is None or not (out / "rounds.json").exists():
        return pd.DataFrame(), []
    state = read_json(out / "rounds.json")
    if not isinstance(state, dict) or state.get("machine") != machine:
        got = state.get("machine") if isinstance(state, dict) else state
        raise ValueError(f"{out / 'rounds.json'}: field 'machine' is {got!r}, not "
                         f"{machine!r}: another run's folder")
    try:
        rounds = [Round(**r) for r in state["rounds"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{out / 'rounds.json'}: field 'rounds' is malformed ({e}): not a state this version "
                         "wrote; choose another --out") from None
    # The run believes its own spec of the machine (``Machine.believe``), not the one a round wrote.
    measured = (read_dataset(out / "measured.parquet") if (out / "measured.parquet").exists()
                else pd.DataFrame())
    if len(measured):
        theirs = sorted(set(measured["hardware"]) - {machine})
        if theirs:
            raise ValueError(f"{out / 'measured.parquet'}: holds rows of {theirs[0]!r}, not of {machine!r}: "
                             "another run's measurements; choose another --out")
    missing = {sid for r in rounds for sid in r.chosen} - (set(measured["scenario_id"]) if len(measured) else set())
    if missing:
        raise ValueError(f"{out / 'measured.parquet'}: lacks {len(missing)} scenario(s) that rounds.json says were "
                         "measured: the file was replaced or removed; choose another --out")
    have = int(measured["scenario_id"].nunique()) if len(measured) else 0
    # More rows than the last finished round says: a round killed after its measurements were
    # saved. They are kept (never measured again); its redo measures only what it still lacks.
    log.info("resuming %s: %d round(s) done, %d scenario(s) measured", out, len(rounds), have)
    return measured, rounds


def last_spec(out: Path, rounds: list[Round]) -> HardwareSpec:
    """The spec the last finished round of `rounds` (read from `out`) adapted to."""
    return spec_from_dict(rounds[-1].spec, f"{out / 'rounds.json'}: last round's spec")


def pending(out: Path | None, target: float, known: Sequence[str] = ()) -> list[str]:
    """The scenarios a killed round chose for `target`, if that round was under way
    (ValueError naming the file if it holds anything but ids of `known` scenarios)."""
    path = None if out is None else out / "pending.json"
    if path is None or not path.exists():
        return []
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("chosen"), list):
        raise ValueError(f"{path}: expected an object with a 'chosen' list of scenario ids, got {str(doc)[:80]}")
    unknown = set(map(str, doc["chosen"])) - set(known)
    if known and unknown:
        raise ValueError(f"{path}: field 'chosen' names {len(unknown)} scenario(s) not on this machine's grid "
                         f"(e.g. {sorted(unknown)[0]!r}): another run's state; choose another --out")
    return list(doc["chosen"]) if doc.get("fraction") == target else []


def write_pending(out: Path | None, target: float, chosen: list[str]) -> None:
    """Before measuring: the round for `target` and its scenarios, so a killed round is redone
    on the same ones (nothing without a folder)."""
    if out is not None:
        write_json(out / "pending.json", {"fraction": target, "chosen": chosen})


def save(out: Path, measured: pd.DataFrame, rounds: list[Round]) -> None:
    """measured.parquet first, then rounds.json, each replaced atomically: a kill between
    them leaves a round's rows that rounds.json does not list yet, which a resume keeps."""
    out.mkdir(parents=True, exist_ok=True)
    if len(measured):
        write_parquet_atomic(measured, out / "measured.parquet")
    write_json(out / "rounds.json", {"machine": rounds[0].spec["name"] if rounds else "",
                                     "rounds": [dataclasses.asdict(r) for r in rounds]})
