"""How every `ficco` command reports: a result as text or JSON, an error as one line.

- `reported(*errors)`: inside the block, an expected stage error ends the command with
  click's one-line ``Error: <message>`` and exit status 1, with no traceback; any other
  error propagates (a bug should show its traceback).
- `finishing(what)`: around a long command's work: an exit with status 0 from inside it
  (before the command wrote `what`) becomes ``Error: ...`` and exit status 1.
- `show(as_json, obj, text)`: print `obj` as indented JSON (``--json``), or the lines of
  `text()`; then exit with `exit_code` (1: the result records a failure a script must see).

Light on purpose (click and the standard library): every command module imports it, and
`ficco --help` must not pay for pandas or torch.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

Message = Callable[[Exception], str]


@contextmanager
def reported(*errors: type[Exception], message: Message = str) -> Iterator[None]:
    """Turn any of `errors` raised in the block into ``Error: message(e)``, exit 1."""
    try:
        yield
    except errors as e:
        raise click.ClickException(message(e)) from None


@contextmanager
def finishing(what: str | Path) -> Iterator[None]:
    """A long command exits 0 only once its work returned: a ``SystemExit`` with status 0 raised
    inside the block (by a library, a handler, a stray ``sys.exit()``) ends it with exit 1 naming
    `what` was not written, so a script or a bring-up never takes an unfinished run for done."""
    try:
        yield
    except SystemExit as e:
        if e.code not in (0, None):
            raise
        raise click.ClickException(f"the run ended before {what} was written (an exit with status 0 from inside "
                                   "it); rerun the same command: it resumes from what was kept") from None


def naming(path: str | Path) -> Message:
    """Errors that do not begin with `path` get it in front (``data.parquet: column ...``)."""
    def message(e: Exception) -> str:
        return str(e) if str(e).startswith(str(path)) else f"{path}: {e}"
    return message


def naming_rows_of(path: str | Path) -> Message:
    """Errors about one row of the table `path` (``row 3, column 'm': ...``) get it in front;
    the others (an option, the file itself) already say what they are about."""
    def message(e: Exception) -> str:
        return f"{path}: {e}" if str(e).startswith("row ") else str(e)
    return message


def refuse_input_as_out(out, inputs: dict[str, list]) -> None:
    """Refuse, before any work, an --out that is one of the command's inputs (`inputs`: the
    option or argument -> its paths), however either is spelled (resolved: symlinks, ``./``)."""
    real = Path(out).resolve()
    for name, paths in inputs.items():
        if any(p is not None and Path(p).resolve() == real for p in paths):
            raise click.ClickException(f"--out {out}: is the {name} input; writing it would replace what it "
                                       "reads: choose another --out")


def refuse_existing_out(out, inputs: dict[str, list]) -> None:
    """Refuse, before any work, an --out that is an input or exists already: a command that
    cannot resume writes a new file and replaces nothing that is there."""
    refuse_input_as_out(out, inputs)
    if os.path.lexists(out):
        raise click.ClickException(f"--out {out}: exists; nothing is overwritten: choose another --out (or "
                                   "delete it first)")


def json_option(help: str | None = None):
    """The ``--json`` flag; the command receives it as `as_json`."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def show(as_json: bool, obj: Any, text: Callable[[], str | Iterable[str]], *, exit_code: int = 0) -> None:
    """Print `obj` as JSON or `text()` (one string, or lines), then exit with `exit_code`."""
    if as_json:
        echo_json(obj)
    else:
        lines = text()
        for line in [lines] if isinstance(lines, str) else lines:
            click.echo(line)
    if exit_code:
        sys.exit(exit_code)


def echo_json(obj: Any) -> None:
    """Indented JSON on stdout; values JSON lacks (paths, timestamps) as their str()."""
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
