"""One writer per output: a lock held for the whole run of a command that writes a file or
folder (``ficco measure``, ``ficco adapt``, ``ficco export``).

The lock is ``flock`` on a hidden file beside the output (``.<name>.lock``), keyed by the
output's real path (symlinks resolved, the output's or a folder's above it): one output
named two ways has one lock. The kernel releases it when its holder exits, however it
exits (``kill -9`` included): no stale lock to clear by hand. The file holds who took it
(command, process, host, time), and a second writer refuses at once with one line that
names the holder; nothing of the first writer's is touched."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class OutputLocked(ValueError):
    """Another process is writing the same output; names it (a ValueError: the commands
    report it as one line, as they do a bad option)."""


def lock_path(out: str | Path, *, follow: bool = True) -> Path:
    """`follow`: a symlink at `out` is resolved too (a file written through it); False for an
    output that is the link itself (an export swaps the link to a new folder)."""
    out = Path(out)
    real = out.resolve() if follow else out.parent.resolve() / out.name  # what does not exist yet stays as named
    return real.parent / f".{real.name}.lock"


@contextlib.contextmanager
def output_lock(out: str | Path, command: str, *, follow: bool = True) -> Iterator[None]:
    """Hold `out`'s lock for the block; OutputLocked naming the holder if another process has it."""
    path = lock_path(out, follow=follow)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLocked(f"{out}: {_holder(path)} is writing it; wait for it to finish (or stop it), "
                               "or choose another output") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"command": command, "pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text())
        return f"{who['command']} (pid {who['pid']} on {who['host']}, since {who['since']})"
    except Exception:  # noqa: BLE001 - written a moment ago, or by hand: still held by someone
        return "another process"


def write_json_atomic(path: str | Path, doc: Any) -> None:
    """Write `doc` as JSON through ``<path>.tmp`` and a rename: a reader, or a rerun after a
    kill, sees the old file or the new, never part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)
