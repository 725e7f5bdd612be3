"""The `ficco` command as tests run it: in a subprocess (``FICCO``) or in-process
(``refused``), and the scenario tables they feed it."""

import sys
from pathlib import Path

from click.testing import CliRunner

from ficco_select.cli.main import main

FICCO = [sys.executable, "-m", "ficco_select.cli.main"]
"""The ficco command of this interpreter, for a subprocess."""
HEADER = "group,op,m,n,k,dtype,world_size,hardware,imbalance\n"
DECOY = "decoy"
"""What a decoy module says when imported: a run's output must never hold it."""


def decoy_folder(folder: Path) -> Path:
    """`folder` (made if missing) holding what a user's ML repository often has at its top:
    ``data/`` (with ``data/dataset.py``), ``features/``, ``features.py`` and ``train.py``, each
    failing loudly if imported. ficco-select's own modules live under ``ficco_select`` only,
    so a command run from here, and every process it starts by module name, never loads them."""
    folder.mkdir(parents=True, exist_ok=True)
    boom = "raise SystemExit('" + DECOY + " {} was imported')\n"
    for package in ("data", "features"):
        (folder / package).mkdir(exist_ok=True)
        (folder / package / "__init__.py").write_text(boom.format(package))
    (folder / "data" / "dataset.py").write_text(boom.format("data/dataset.py"))
    (folder / "features.py").write_text(boom.format("features.py"))
    (folder / "train.py").write_text(boom.format("train.py"))
    return folder


def table(tmp_path: Path, *rows: str, name: str = "scenarios.csv") -> Path:
    """A scenario table of `rows` (CSV lines under ``HEADER``)."""
    path = tmp_path / name
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


def refused(args: list, *needles: str, written: Path | None = None) -> str:
    """Run `ficco args` in-process; assert a one-line error holding every needle, exit != 0,
    no traceback, and (with `written`) that nothing was written there. Returns the error line."""
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code != 0, res.output
    assert isinstance(res.exception, SystemExit), f"traceback: {res.exception!r}\n{res.output}"
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    if written is not None:
        assert not written.exists(), f"{written} was written"
    return errors[0]
