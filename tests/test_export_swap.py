"""Exports swapped while jobs load them: every load sees one export, whole.

``ficco_select.train.export.publish`` writes each export to a version folder and switches the export's
link to it in one ``os.replace``; ``Selector.load`` resolves the link once. A process
loading in a loop while another publishes two different exports in turn must never find
the folder missing (a heuristic-only selector) nor combine one export's selector.json
with the other's layers.json (tables refused for their digest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


from ficco_select.train.export import write_tables
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.train.export import KEEP_VERSIONS, publish
from helpers.exports import write_selector

EXPORTS = int(os.environ.get("FICCO_SWAP_EXPORTS", "30"))
"""How many exports at least swap under the loading loop; counts, not seconds, so that a loaded
machine runs the same test, only slower."""
LOADS = 60
"""How many loads at least the loading loop makes while exports swap."""
LAYERS = [Scenario(group="g", op="ag_gemm", m=8, n=4096, k=4096, dtype="bfloat16", world_size=8,
                   hardware="h100-nvswitch")]

LOADER = """
import json, sys, logging
logging.disable(logging.WARNING)
from ficco_select.runtime.selector import Selector
from pathlib import Path
out, enough, stop = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
counts = {"loads": 0, "missing": 0, "mixed": 0, "seen": []}
while not stop.exists():
    sel = Selector.load(out)
    counts["loads"] += 1
    if sel.model is None:
        counts["missing"] += 1
    elif not sel._tables:
        counts["mixed"] += 1  # layers.json of another export: refused for its digest
    else:
        counts["seen"].append(sel.rules.run_id)
    if counts["loads"] == enough:
        print("enough", flush=True)
counts["seen"] = sorted(set(counts["seen"]))
print(json.dumps(counts))
"""


def writer(tag: str, margin: float):
    def write(folder):
        write_selector(folder, mlflow_run_id=tag, abstention={"min_margin": margin, "fallback": "heuristic"})
        write_tables(Selector.load(folder), LAYERS, folder)
    return write


def test_loads_never_see_a_missing_or_mixed_export_while_exports_swap(tmp_path):
    out = tmp_path / "selector"
    publish(out, writer("A", 0.0))
    stop = tmp_path / "stop"
    loader = subprocess.Popen([sys.executable, "-c", LOADER, str(out), str(LOADS), str(stop)],
                              stdout=subprocess.PIPE, text=True, cwd=str(tmp_path.parent))
    os.set_blocking(loader.stdout.fileno(), False)
    exports, loaded_enough, deadline = 0, "", time.monotonic() + 600
    while (exports < EXPORTS or not loaded_enough) and time.monotonic() < deadline and loader.poll() is None:
        publish(out, writer("B" if exports % 2 == 0 else "A", 0.001 * (exports % 7)))
        exports += 1
        loaded_enough += loader.stdout.readline() or ""
    stop.touch()
    os.set_blocking(loader.stdout.fileno(), True)
    report = loaded_enough + loader.communicate(timeout=120)[0]
    counts = json.loads(report.splitlines()[-1])
    print(f"exports {exports}, loads {counts['loads']}, missing {counts['missing']}, mixed {counts['mixed']}")
    assert exports >= EXPORTS and counts["loads"] >= LOADS, (exports, counts)
    assert counts["missing"] == 0 and counts["mixed"] == 0, counts
    assert counts["seen"] == ["A", "B"]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".selector.v")]) == KEEP_VERSIONS + 1
