"""Hardware specs by name or path: the shipped machines, spec files, and the machines a job names.

A spec is a YAML file; presets ship in ``ficco_select/presets/``. Its fields and their
check: ``ficco_select.hardware_spec`` (``HardwareSpec``, ``spec_from_dict``, read from here
as well). Plain Python + PyYAML: the runtime may read specs.

Rows (scenario tables after reading, datasets, models) carry a machine's *name*. The
shipped machines (presets, data-sheet machines) are known everywhere; any other is known
where a job says so: ``with machines(specs, where):`` names them for the work inside the
block. Datasets carry the specs of their non-preset machines in their Parquet metadata
(``ficco_select.data.dataset.dataset_machines``) and models in ``selector.json``, so the
job that reads them can name them again. Reading a file never changes what a name means.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path

import yaml

# The spec's own names are read from here by most of the package: one import for both.
from ficco_select.hardware_spec import (HardwareError, HardwareSpec, fields_of, is_spec_path, spec_as_dict,
                                        spec_field, spec_from_dict)

log = logging.getLogger("ficco_select.hardware")


GPU_PRESETS = (("H200", "h200-nvswitch"), ("H100", "h100-nvswitch"), ("H800", "h800-nvswitch"),
               ("A100", "a100-nvswitch"), ("A800", "a800-nvswitch"), ("L40S", "l40s-pcie-8"),
               ("MI300", "mi300x-8"), ("MI250", "mi250x-8"),
               ("GB200", "gb200-nvl72"), ("B200", "b200-nvswitch"), ("B300", "b300-nvswitch"))
"""(device-name substring, preset), first match wins: the preset of a GPU by its name (a
data-sheet machine's too: ``datasheet_names``)."""


def preset_for_device(device_name: str) -> str | None:
    """The shipped preset of a GPU, by its device name (``NVIDIA H200`` -> h200-nvswitch)."""
    upper = device_name.upper()
    return next((preset for key, preset in GPU_PRESETS if key in upper), None)


def presets_dir() -> Path:
    return Path(str(resources.files("ficco_select") / "presets"))


def preset_names() -> list[str]:
    """The presets the training data simulates, and every hold-out scores."""
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def datasheet_names() -> list[str]:
    """Data-sheet machines (``presets/datasheet/``): GPUs with published rows (H800, A800,
    Blackwell), loaded by name like a preset but never trained on: the simulator's zero-shot
    check. Their terms are the data sheet's except where their own rows fit them (each
    field's comment says which)."""
    return sorted(p.stem for p in (presets_dir() / "datasheet").glob("*.yaml"))


def shipped_names() -> set[str]:
    """Every machine shipped with the package (presets and data-sheet machines): names that
    mean one spec everywhere."""
    return set(preset_names()) | set(datasheet_names())


def _preset_path(name: str) -> Path | None:
    for path in (presets_dir() / f"{name}.yaml", presets_dir() / "datasheet" / f"{name}.yaml"):
        if name and path.is_file():
            return path
    return None




# The machines a job knows by name beyond the shipped ones (spec files, datasets' specs,
# machines sampled around the presets, a fabric's profile), with where each came from.
# Rows carry a machine's name, never a path (a path differs between machines and would
# change the scenario id); this is where a name that is not a preset is found again. Known
# only while a ``machines`` block is open: reading a file changes nothing, and nothing a job
# names outlives it. A context finds its own innermost open block first (a context
# variable: each thread's or task's own job); a context in no open block of its own (a
# thread the job started) finds the machines of the blocks open in the process, where they
# agree on what the name means.
class _Job:
    """One open ``machines`` block: the machines it knows (its parent's, and its own)."""

    __slots__ = ("table", "parent", "open")

    def __init__(self, table: dict[str, tuple["HardwareSpec", str]], parent: "_Job | None"):
        self.table, self.parent, self.open = table, parent, True


_KNOWN: contextvars.ContextVar["_Job | None"] = contextvars.ContextVar("ficco_known_machines", default=None)
_OPEN: tuple[_Job, ...] = ()
"""Every block open in the process, in the order opened (replaced whole, under _OPEN_LOCK)."""
_OPEN_LOCK = threading.Lock()
_WHEN_A_JOB_ENDS: list[Callable[[frozenset[str]], None]] = []
"""Called with the names a block introduced, as it ends (``when_a_job_ends``)."""


def when_a_job_ends(forget: Callable[[frozenset[str]], None]) -> None:
    """Call `forget(names)` as each ``machines`` block ends, with the names it introduced:
    what a cache outside this module decided for those machines goes with the job (the
    runtime's plans and layer tables)."""
    _WHEN_A_JOB_ENDS.append(forget)


def _job() -> _Job | None:
    """The current context's innermost open block, None if none: a context copied inside a
    block that has since ended sees the block around it, not the ended one."""
    job = _KNOWN.get()
    while job is not None and not job.open:
        job = job.parent
    return job


def _known(name: str) -> tuple["HardwareSpec", str] | None:
    """What the current context knows `name` as (the spec and where it came from), None if
    nothing; HardwareError where the context is in no block that names it and the blocks open
    in the process mean different machines by it."""
    job = _job()
    if job is not None and (found := job.table.get(name)) is not None:
        return found
    found = []
    for other in _OPEN:
        entry = other.table.get(name)
        if entry is not None and all(entry[0] != seen[0] for seen in found):
            found.append(entry)
    if len(found) > 1:
        raise HardwareError(
            f"machine {name!r} means different machines in the jobs open in this process "
            f"({'; '.join(source for _, source in found)}), and this thread is in none of them: start its work "
            "in its job's context, threading.Thread(target=contextvars.copy_context().run, args=(work,)), or "
            "name the machine in it (with machines(...))")
    return found[0] if found else None


Known = Iterable["HardwareSpec | tuple[HardwareSpec, str]"]
"""Specs, each alone or with where it came from (``known_machines``' values)."""


class Scope:
    """The machines a ``machines`` block knows; its owner may refine the spec of one of the
    block's own names (``ficco adapt``, round by round) with ``refine``."""

    def __init__(self, table: dict[str, tuple[HardwareSpec, str]], own: set[str]):
        self._table, self._own = table, own

    def refine(self, spec: HardwareSpec) -> None:
        """From now on the block (not blocks already opened inside it) means `spec` by its name."""
        if spec.name not in self._own:
            raise HardwareError(f"machine {spec.name!r} is not one this block introduced; it cannot refine it")
        self._table[spec.name] = (spec, self._table[spec.name][1])


@contextlib.contextmanager
def machines(specs: Known, where: str = "", *, replace: bool = False) -> Iterator[Scope]:
    """Know `specs` by their names for the work inside the block (and the blocks it opens),
    while it is open: threads started inside it find them too (``known_machine``).

    A name means one machine: a preset's name is refused for a spec with other numbers, and
    so is a name the job already knows with other numbers, naming where each came from.
    `replace`: inside the block `specs` win over what the job knew by their names (the
    measurement of a machine by its own profile; a run that refines its belief of one).
    """
    global _OPEN
    parent = _job()
    table = dict(parent.table) if parent is not None else {}
    own = set()
    for item in specs:
        spec, source = item if isinstance(item, tuple) else (item, where or "a spec")
        if _known_as(spec, source, table, replace) is None:
            table[spec.name] = (spec, source)
            own.add(spec.name)
    job = _Job(table, parent)
    token = _KNOWN.set(job)
    with _OPEN_LOCK:
        _OPEN = (*_OPEN, job)
    try:
        yield Scope(table, own)
    finally:
        job.open = False  # before it leaves _OPEN: no context finds it from here on
        with _OPEN_LOCK:
            _OPEN = tuple(other for other in _OPEN if other is not job)
        _KNOWN.reset(token)
        if own:
            for forget in _WHEN_A_JOB_ENDS:
                forget(frozenset(own))


def _known_as(spec: HardwareSpec, where: str, table: Mapping[str, tuple[HardwareSpec, str]],
              replace: bool) -> HardwareSpec | None:
    """The machine `spec`'s name already means (a preset, or one in `table`, equal to
    `spec`); None if the name is free (or `replace`); HardwareError if it means another."""
    if _preset_path(spec.name) is not None:
        if _preset(spec.name) != spec:
            raise HardwareError(f"{where}: name {spec.name!r} is a preset's, with other numbers; "
                                "give this machine its own name (field 'name')")
        return spec
    known = table.get(spec.name)
    if known is None or replace:
        return None
    if known[0] != spec:
        differ = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != getattr(known[0], f.name)]
        raise HardwareError(f"{where}: machine {spec.name!r} is already known in this job from {known[1]}, "
                            f"with other numbers ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}); "
                            "a name means one machine: give this one its own name (field 'name')")
    return known[0]


def refuse_shipped_name(spec: HardwareSpec, where: str) -> None:
    """HardwareError if `spec` takes a shipped machine's name with other numbers."""
    _known_as(spec, where, {}, replace=False)


def known_machines() -> dict[str, tuple[HardwareSpec, str]]:
    """The machines the current job knows beyond the shipped ones, by name, with where each
    came from: what a worker process is handed to know them as this one does
    (``with machines(known.values()):``). In a thread of no block of its own: those of the
    blocks open in the process, but for a name they mean differently."""
    job, known = _job(), {}
    for other in _OPEN:
        for name in other.table:
            if name not in known:
                try:
                    if (found := _known(name)) is not None:
                        known[name] = found
                except HardwareError:
                    pass  # the open jobs disagree: no machine by that name for this context
    return {**known, **(job.table if job is not None else {})}


def known_machine(name: str) -> HardwareSpec | None:
    """The machine the current job knows by `name` (not a shipped one), None if none;
    HardwareError where the jobs open in the process mean different machines by it and this
    context is in none of them."""
    found = _known(name)
    return None if found is None else found[0]


def refuse_known_name(spec: HardwareSpec, where: str) -> None:
    """HardwareError naming `where` if `spec`'s name means another machine here: a shipped
    one's, or one the current job knows."""
    found = _known(spec.name)
    _known_as(spec, where, {spec.name: found} if found is not None else {}, replace=False)


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    """A machine by name (a shipped one, or one the job knows: ``machines``), or a spec file
    by path (read, never remembered: a job that names the machine later says so with
    ``machines``)."""
    if not is_spec_path(name_or_path):
        name = str(name_or_path)
        known = _known(name)
        if known is not None:
            return known[0]
        if _preset_path(name) is None:
            raise HardwareError(f"unknown hardware {name!r}; presets: {', '.join(preset_names())}; data-sheet "
                                f"machines: {', '.join(datasheet_names())} (or pass a spec file: ./my-node.yaml)")
        return _preset(name)
    path = Path(name_or_path)
    spec = _read_spec(path)
    refuse_known_name(spec, str(path))  # a preset's or a known machine's name: refused
    return spec


@functools.cache  # the package's files: read once per process, not once per table row
def _preset(name: str) -> HardwareSpec:
    return _read_spec(_preset_path(name))


def hardware_name(value: str) -> str:
    """The name rows carry for a hardware value: a spec file's ``name``, else the value."""
    return load_hardware(value).name if is_spec_path(value) else value


def _read_spec(path: Path) -> HardwareSpec:
    try:
        exists, is_file = path.exists(), path.is_file()
    except OSError as e:  # a path the OS refuses to look up (too long, a component not a directory...)
        raise HardwareError(f"{path}: cannot be read ({e.strerror})") from None
    if not exists:
        raise HardwareError(f"{path}: no such hardware spec file")
    if not is_file:
        raise HardwareError(f"{path}: not a file (a hardware spec is a YAML file)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise HardwareError(f"{path}: not a text file (a hardware spec is a YAML file)") from None
    except OSError as e:
        raise HardwareError(f"{path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        # Position and problem only: the file's lines are not echoed (it may not be a spec at all).
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise HardwareError(f"{path}: not valid YAML{at} ({getattr(e, 'problem', None) or type(e).__name__})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: a hardware spec is a mapping of fields")
    return spec_from_dict(data, str(path))
