"""The reference site (``mkdocs.yml``, pages in ``docs/``) builds, strict: every page in the
navigation, no broken link between pages, and the CLI page generated from the command's
own definitions, every command on it."""

import subprocess
import sys
from pathlib import Path

from ficco_select.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strict_with_every_command(tmp_path):
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    for name, command in main.commands.items():
        assert f"ficco {name}" in cli, name
        for sub in getattr(command, "commands", {}):
            assert f"ficco {name} {sub}" in cli, (name, sub)
    pages = {p.stem for p in (REPO / "docs").glob("*.md")}
    assert {"index", "design", "cli", "published", "runtime"} <= pages
