"""This machine's record of what online learning measured: the next job on the machine
starts from it, and ``ficco train --telemetry RECORD.json`` turns it into training rows
(``ficco_select.data.learned``).

One JSON file per machine and hardware name, ``<folder>/<hardware>-<machine>.json`` (folder:
``$FICCO_LEARN_DIR``, else ``~/.cache/ficco-select/learned``)::

    {"v": 1, "kind": "ficco-learned",
     "key": {"machine": "<16 hex>", "hardware": "h100-nvswitch", "versions": {"torch": ..., "ficco": ...}},
     "shapes": {"<scenario_id>": {"record": {<Scenario.as_record()>}, "schedule": "<settled>",
                                  "arms": {"<schedule>": [round time_s, ...]}, "verified": {"<schedule>": bool},
                                  "backend": "cpu"|"cuda", "rounds": int, "explored_calls": int,
                                  "cost_s": float, "settled_at": "<iso time>", ...}}}

The machine fingerprint names the file; the versions are checked inside it: a record of
another torch, ficco-select, CUDA runtime or driver is not read (what was fastest may have
changed with the stack), and the next ``put`` replaces it.

``put`` merges under an exclusive ``flock`` of ``<file>.lock`` and replaces the file whole
(temporary file in the same folder, fsync, ``os.replace``): two jobs writing at once both
keep their shapes, and a writer killed at any point leaves the old or the new file, never a
part. Nothing here raises into a job: a failure warns once and reads as "no record".

Runtime path: standard library (torch only inside ``record_key``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ficco_select.runtime.learned")

RECORD_VERSION = 1
KIND = "ficco-learned"
ENV = "FICCO_LEARN_DIR"
DEFAULT_FOLDER = Path("~/.cache/ficco-select/learned")


@dataclasses.dataclass(frozen=True)
class RecordKey:
    """Which record a job reads and writes. ``versions`` is kept as sorted (name, version)
    pairs so that the key hashes; pass a dict or pairs, read it back with ``as_dict()``."""

    machine: str
    """Hex fingerprint of the machine (``record_key``): names the file."""
    hardware: str
    """The hardware name the job decides for (``cpu``, ``h100-nvswitch``...)."""
    versions: tuple[tuple[str, str], ...] = ()
    """torch, ficco and, where there is one, cuda (runtime) and cuda_driver: checked inside the file."""

    def __post_init__(self) -> None:
        pairs = self.versions.items() if isinstance(self.versions, dict) else self.versions
        object.__setattr__(self, "versions", tuple(sorted((str(k), str(v)) for k, v in pairs)))

    def as_dict(self) -> dict[str, Any]:
        """The key as the file holds it."""
        return {"machine": self.machine, "hardware": self.hardware, "versions": dict(self.versions)}


def record_key(hardware: str, device: torch.device | str) -> RecordKey:
    """The key of this machine's record for `hardware` on `device`'s kind. The fingerprint
    is the first 16 hex of a sha256 over the hardware name, its spec's numbers where the
    name resolves (a spec file known only inside a ``machines`` block resolves only there),
    the CPU (architecture, model, count) and, on a cuda device, every visible GPU's name."""
    import torch

    import ficco_select

    device = torch.device(device)
    machine: dict[str, Any] = {"hardware": hardware, "arch": platform.machine(), "cpu": _cpu_model(),
                               "cpus": os.cpu_count()}
    try:
        from ficco_select.hardware import load_hardware, spec_as_dict

        machine["spec"] = spec_as_dict(load_hardware(hardware))
    except Exception:  # noqa: BLE001 - an unknown name has no numbers: the name alone
        pass
    versions = {"torch": torch.__version__, "ficco": ficco_select.__version__}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if device.type == "cuda":
        try:
            count = torch.cuda.device_count()
            machine["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
        except Exception:  # noqa: BLE001 - no GPU to name: the host alone
            pass
        driver = _cuda_driver()
        if driver:
            versions["cuda_driver"] = driver
    text = json.dumps(machine, sort_keys=True, separators=(",", ":"), default=str)
    return RecordKey(hashlib.sha256(text.encode()).hexdigest()[:16], hardware, versions)


def _cpu_model() -> str:
    """The first "model name" of /proc/cpuinfo (Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cuda_driver() -> str:
    """The CUDA version the driver supports (cuDriverGetVersion, e.g. 12.8) and, on Linux,
    the NVIDIA kernel module's release: "12.8/570.124.06"; "" where neither is known."""
    parts = []
    try:
        import torch

        v = int(torch._C._cuda_getDriverVersion())  # CUDA builds only; 0 without a driver
        if v > 0:
            parts.append(f"{v // 1000}.{v % 1000 // 10}")
    except Exception:  # noqa: BLE001 - a build without the binding
        pass
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", f.readline())
        if found:
            parts.append(found.group(1))
    except OSError:
        pass
    return "/".join(parts)


class LearnedRecord:
    """The record file of one key (``record_key``) in `folder`."""

    def __init__(self, key: RecordKey, folder: str | Path | None = None) -> None:
        self.key = key
        folder = folder if folder is not None else os.environ.get(ENV) or DEFAULT_FOLDER
        self.folder = Path(folder).expanduser()
        self.path = self.folder / f"{_safe(key.hardware)}-{_safe(key.machine)}.json"

    def load(self) -> dict[str, dict]:
        """scenario_id -> entry, the shapes recorded under this key; {} where there is none
        (no file, unreadable, corrupt, another format, another key)."""
        try:
            return self._read()
        except Exception as e:  # noqa: BLE001 - never into the job
            _once(logging.WARNING, self.path, "io", "ficco-select: learned record %s not read: %s", self.path, e)
            return {}

    def put(self, entries: dict[str, dict]) -> bool:
        """Merge `entries` (scenario_id -> entry) into the file; False (warned once) where it
        could not be written. A file of another key is replaced."""
        temp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(f"{self.path}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when the process dies
                # Under the lock no other writer has a temporary file open: any left is a killed one's.
                for stale in self.folder.glob(f".{self.path.name}.*.tmp"):
                    stale.unlink(missing_ok=True)
                shapes = {**self._read(), **entries}
                text = json.dumps({"v": RECORD_VERSION, "kind": KIND, "key": self.key.as_dict(), "shapes": shapes})
                fd, temp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.folder)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temp, self.path)
                temp = None
                _sync_folder(self.folder)
            return True
        except Exception as e:  # noqa: BLE001 - an OS error or an entry JSON cannot hold: the job goes on
            _once(logging.WARNING, self.path, "io", "ficco-select: learned record %s not written: %s", self.path, e)
            return False
        finally:
            if temp is not None:
                Path(temp).unlink(missing_ok=True)

    def _read(self) -> dict[str, dict]:
        """The file's shapes for this key; {} (said once, why) where it holds none. Raises
        only what reading the disk raises."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            return self._corrupt(f"not JSON ({e.msg} at line {e.lineno})")
        if not isinstance(data, dict) or data.get("kind") != KIND:
            return self._corrupt(f"not a learned record (no \"kind\": \"{KIND}\")")
        if data.get("v") != RECORD_VERSION:
            _once(logging.INFO, self.path, "version", "ficco-select: learned record %s is format version %r; this "
                  "ficco-select reads version %d: not used", self.path, data.get("v"), RECORD_VERSION)
            return {}
        key, shapes = data.get("key"), data.get("shapes")
        if not isinstance(key, dict) or not isinstance(key.get("versions"), dict):
            return self._corrupt("field 'key': must be an object with 'versions'")
        if not isinstance(shapes, dict):
            return self._corrupt("field 'shapes': must be an object")
        changed = _changed(key, self.key.as_dict())
        if changed:
            _once(logging.INFO, self.path, f"key {changed}", "ficco-select: learned record %s invalidated: %s "
                  "changed (%s); it is not used, and the next record replaces it", self.path, changed.split(":")[0],
                  changed)
            return {}
        kept = {}
        for sid, entry in shapes.items():
            why = _entry_problem(entry)
            if why:
                _once(logging.WARNING, self.path, f"entry {sid}", "ficco-select: learned record %s: shape %s "
                      "skipped: %s", self.path, sid, why)
            else:
                kept[sid] = entry
        return kept

    def _corrupt(self, why: str) -> dict:
        _once(logging.WARNING, self.path, "corrupt", "ficco-select: learned record %s is corrupt (%s): not used; the "
              "next record replaces it", self.path, why)
        return {}


def _changed(theirs: dict, ours: dict) -> str:
    """The first key field that differs ('versions.torch: 2.12.0 -> 2.13.0'), "" if none."""
    for field in ("machine", "hardware"):
        if theirs.get(field) != ours[field]:
            return f"{field}: {theirs.get(field)!r} -> {ours[field]!r}"
    for name in sorted(set(theirs["versions"]) | set(ours["versions"])):
        old, new = theirs["versions"].get(name), ours["versions"].get(name)
        if old != new:
            return f"versions.{name}: {old or 'none'} -> {new or 'none'}"
    return ""


def _entry_problem(entry: Any) -> str:
    """Why a shape's entry cannot be used (the field), "" if it can: what the learner reads."""
    if not isinstance(entry, dict):
        return "not an object"
    for field, kind in (("record", dict), ("schedule", str), ("arms", dict)):
        if not isinstance(entry.get(field), kind):
            return f"field '{field}': must be {'a string' if kind is str else 'an object'}"
    return ""


def _safe(name: str) -> str:
    """A file-name part of `name`: letters, digits, '.', '_' and '-' kept, the rest '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:100] or "_"


def _sync_folder(folder: Path) -> None:
    """The rename itself reaches the disk (a power loss, not only a kill)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


_SAID: set[tuple[str, str]] = set()
_SAID_LOCK = threading.Lock()


def _once(level: int, path: Path, what: str, message: str, *args: Any) -> None:
    """Log `message` the first time the process has `what` to say about `path`."""
    with _SAID_LOCK:
        if (str(path), what) in _SAID:
            return
        _SAID.add((str(path), what))
    log.log(level, message, *args)
