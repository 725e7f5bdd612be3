"""The GPU policy's evidence on simulated rows: the hand heuristic and the cost model, bare
and under an export's GPU do-no-harm rule, on every bfloat16 scenario of the catalog
simulated on the GPU presets (the family hold-out's rows, all of them).

    python scripts/gpu_policy.py DIR        # DIR: an export (ficco pipeline's, ficco export's)

The model under the rule is the pipeline's ``shipped`` row on the same rows (comparison.txt,
``family.sim.bfloat16``); the calls of all three on published GPU points come from
``ficco sim validate --published FILE --model DIR [--fallback heuristic|cost_model]``. On
simulated rows the cost model's pick is the truth's own argmin: its score there is a bound,
not evidence.
"""

import json
import sys
from pathlib import Path

import pandas as pd

from ficco_select.hardware import load_hardware, preset_names
from ficco_select.runtime.fallbacks import run_fallback
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.train.metrics import score, usable_rows
from ficco_select.train.selectors import scenario_records
from ficco_select.train.training_data import simulated


def main(export: Path) -> None:
    rule = json.loads((export / "selector.json").read_text())["gpu_no_harm"]
    ruled = Selector(meta={"selector": "xgb-regressor", "training_ranges": {}, "gpu_no_harm": rule})
    rows = pd.concat([simulated(name) for name in preset_names() if name != "cpu"], ignore_index=True)
    rows = usable_rows(rows[rows["dtype"] == "bfloat16"])
    print(f"{rows['scenario_id'].nunique()} bfloat16 scenarios on {rows['hardware'].nunique()} GPU presets")
    for fallback in ("heuristic", "cost_model"):
        bare, guarded = {}, {}
        for record in scenario_records(rows):
            sid = record.pop("scenario_id")
            s = Scenario.from_record(record)
            bare[sid] = run_fallback(fallback, "other", s, load_hardware(s.hardware), "").schedule.name
            guarded[sid] = ruled.decide_as(s, fallback).schedule.name
        for how, chosen in (("bare", bare), ("under the rule", guarded)):
            m = score(rows, chosen)
            print(f"{fallback:10s} {how:15s} near-opt@2% {m['near_opt_2']:.3f}  capture {m['oracle_capture']:.3f}  "
                  f"slower than the baseline {m['slower_than_baseline']:.1%}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
