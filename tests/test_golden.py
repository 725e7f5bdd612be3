"""Saved reference outputs of the deterministic stages: a change to the simulator, the cost
model, the heuristic or the features shows up here as a diff of a small committed file.

    python tests/test_golden.py   # regenerate tests/golden/ after a deliberate change

The reference: two catalog scenarios per (op, P = 2, 4, 8) on three presets of different
topologies: the simulated time of every legal schedule (``times.csv``), each scenario's
signatures (``signatures.csv``), the heuristic's choice and the feature schema hash, which
covers the features' formulas (``decisions.json``).
"""

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select.hardware import load_hardware
from ficco_select.hardware_spec import TOPOLOGIES

GOLDEN = Path(__file__).with_name("golden")
PRESETS = ("mi300x-8", "h100-nvswitch", "l40s-pcie-8")
KEYS = ["scenario_id", "op", "world_size", "hardware"]
SIGNATURES = ["t_comp_s", "t_comm_s", "ideal_speedup", "dil_d2", "dil_d4", "chunk_loss_d2", "cil_gemm_sm",
              "cil_overlap_sm"]


def reference() -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    from ficco_select.data.catalog import catalog
    from ficco_select.data.simulate import simulate_rows
    from ficco_select.features import FEATURE_SCHEMA_HASH
    from ficco_select.hardware import load_hardware
    from ficco_select.heuristic import choose
    from ficco_select.scenario import Scenario

    by_kind: dict[tuple, list] = {}
    for r in catalog("full", models=["llama3-8b", "mixtral-8x7b", "gpt3-175b"], dtype="float32"):
        by_kind.setdefault((r["op"], r["world_size"]), []).append(r)
    scenarios = [Scenario.from_record(r) for kind in sorted(by_kind) for r in by_kind[kind][::5][:2]]
    frames, choices = [], {}
    for name in PRESETS:
        hw = load_hardware(name)
        on = [Scenario.from_record({**s.as_record(), "hardware": name}) for s in scenarios]
        frames.append(simulate_rows(on, hw))
        choices.update({f"{name}/{s.scenario_id}": choose(s, hw).name for s in on})
    rows = pd.concat(frames, ignore_index=True)
    times = rows[["scenario_id", "hardware", "schedule", "time_s"]]
    signatures = rows.groupby(["scenario_id", "hardware"], sort=False).first().reset_index()[KEYS + SIGNATURES]
    return times, signatures, {"feature_schema_hash": FEATURE_SCHEMA_HASH, "heuristic": choices}


@functools.cache
def built() -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    return reference()


def test_simulator_heuristic_and_features_match_the_saved_reference():
    times, signatures, decisions = built()
    saved_times = pd.read_csv(GOLDEN / "times.csv")
    saved_signatures = pd.read_csv(GOLDEN / "signatures.csv")
    again = "python tests/test_golden.py regenerates the reference after a deliberate change"
    assert list(times["schedule"]) == list(saved_times["schedule"]), f"the legal schedules changed; {again}"
    np.testing.assert_allclose(times["time_s"], saved_times["time_s"], rtol=1e-10, err_msg=again)
    for col in SIGNATURES:
        np.testing.assert_allclose(signatures[col], saved_signatures[col], rtol=1e-10, err_msg=f"{col}: {again}")
    assert decisions == json.loads((GOLDEN / "decisions.json").read_text()), again


def test_the_reference_covers_every_op_world_size_and_topology():
    # On the reference the code builds now: a catalog or preset change that drops a kind fails here.
    _, signatures, decisions = built()
    hardware = [load_hardware(name) for name in set(signatures["hardware"])]
    assert {hw.topology for hw in hardware} == set(TOPOLOGIES)
    assert set(signatures["op"]) == {"ag_gemm", "gemm_rs", "a2a_gemm", "gemm_ar", "gemm_a2a"} and set(signatures["world_size"]) == {2, 4, 8}
    assert len(set(decisions["heuristic"].values())) > 3  # the heuristic picks more than one kind of schedule


if __name__ == "__main__":
    GOLDEN.mkdir(exist_ok=True)
    for old in ("times.csv", "signatures.csv", "decisions.json"):  # this script's files only: others share the folder
        (GOLDEN / old).unlink(missing_ok=True)
    times, signatures, decisions = reference()
    times.to_csv(GOLDEN / "times.csv", index=False, float_format="%.13g")
    signatures.to_csv(GOLDEN / "signatures.csv", index=False, float_format="%.13g")
    (GOLDEN / "decisions.json").write_text(json.dumps(decisions, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(times)} times, {len(signatures)} signatures, {len(decisions['heuristic'])} decisions to {GOLDEN}")
