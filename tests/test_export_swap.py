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

SECONDS = float(os.environ.get("FICCO_SWAP_SECONDS", "4"))
"""How long exports swap under the loading loop (the unit tier: a few seconds)."""
LAYERS = [Scenario(group="g", op="ag_gemm", m=8, n=4096, k=4096, dtype="bfloat16", world_size=8,
                   hardware="h100-nvswitch")]

LOADER = """
import json, sys, time, logging
logging.disable(logging.WARNING)
from ficco_select.runtime.selector import Selector
out, seconds = sys.argv[1], float(sys.argv[2])
counts = {"loads": 0, "missing": 0, "mixed": 0, "seen": []}
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    sel = Selector.load(out)
    counts["loads"] += 1
    if sel.model is None:
        counts["missing"] += 1
    elif not sel._tables:
        counts["mixed"] += 1  # layers.json of another export: refused for its digest
    else:
        counts["seen"].append(sel.rules.run_id)
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
    loader = subprocess.Popen([sys.executable, "-c", LOADER, str(out), str(SECONDS)], stdout=subprocess.PIPE,
                              text=True, cwd=str(tmp_path.parent))
    exports, stop = 0, time.monotonic() + SECONDS
    while time.monotonic() < stop:
        publish(out, writer("B" if exports % 2 == 0 else "A", 0.001 * (exports % 7)))
        exports += 1
    counts = json.loads(loader.communicate(timeout=60 + SECONDS)[0])
    print(f"exports {exports}, loads {counts['loads']}, missing {counts['missing']}, mixed {counts['mixed']}")
    assert exports > 20 and counts["loads"] > 50, (exports, counts)
    assert counts["missing"] == 0 and counts["mixed"] == 0, counts
    assert counts["seen"] == ["A", "B"]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".selector.v")]) == KEEP_VERSIONS + 1
