"""NeMo's hand-written TP-overlap presets beside ficco's advice for the same model, GPU, TP
size and sequence length, both as TransformerEngine runs them, scored on the calibrated
simulator (noise-free).

    python benchmarks/nemo_presets.py --selector DIR [--json]

The presets (``benchmarks/data/nemo_tp_overlap_presets.json``) are NeMo 2's whose hidden size
is a catalog model's and whose GPU is a shipped machine. Per preset:
- per layer: the time of the six GEMMs ficco decides (qkv, proj, fc1, fc2 forward; proj and
  fc2 input gradients, each with its collective); the bulk GEMMs (qkv and fc1 gradients) run
  the preset's settings in both and are left out;
- per step: that, times the model's layers;
- against the baseline (no overlap) and the ceiling: on each GEMM the best schedule TE can
  run (``train.advise.te_entry``'s targets) by the same simulator.
Where the two disagree, each GEMM's schedules and simulated times are in ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ficco_select.data.simulate import simulate_rows
from ficco_select.hardware import load_hardware
from ficco_select.runtime.selector import Selector
from ficco_select.train import advise as A

PRESETS = Path(__file__).with_name("data") / "nemo_tp_overlap_presets.json"


def te_runnable(op: str, names: set[str]) -> set[str]:
    """The candidate schedules TE can run (the targets of ``te_entry``), among `names`."""
    return {n for n in names if n.startswith(("none.", "shard.ring."))
            or (op == "gemm_rs" and n.startswith("ficco.") and ".a2a.gemm_per_step.m.sm" in n)}


def preset_advice(preset: dict) -> dict:
    """A preset in ``te_advice``'s form: its entries, overlap on, no switch off."""
    return {"ub_cfgs": preset["gemms"], "overlap": True, "megatron_flags": [], "model_parallel_config": {}}


def compare(preset: dict, select) -> dict:
    model = A.Model.from_catalog(preset["model"])
    layout = A.Layout(tp=preset["tp"], seq=preset["seq"], micro_batch=preset["micro_batch"], dtype=preset["dtype"],
                      context_parallel=preset["cp"])
    spec = load_hardware(preset["hardware"])
    advice = A.te_advice(A.decide(select, model, layout, preset["hardware"]), model)
    theirs = preset_advice(preset)
    per_gemm, total = {}, {"preset": 0.0, "ficco": 0.0, "baseline": 0.0, "ceiling": 0.0}
    for gemm in A.layer_gemms(model):
        rows = simulate_rows([A.scenario_of(gemm, model, layout, preset["hardware"])], spec)
        time_of = dict(zip(rows["schedule"], rows["time_s"]))
        runnable = te_runnable(gemm.op, set(time_of))
        picks = {"preset": A.te_runs(theirs, gemm).name, "ficco": A.te_runs(advice, gemm).name,
                 "baseline": "none.sm", "ceiling": min(runnable, key=time_of.get)}
        per_gemm[gemm.name] = {who: {"schedule": name, "us": round(time_of[name] * 1e6, 1)} for who, name in picks.items()}
        for who, name in picks.items():
            total[who] += time_of[name]
    return {"preset": preset["name"], "model": preset["model"], "hardware": preset["hardware"],
            "dtype": preset["dtype"], "tp": preset["tp"], "tokens": layout.tokens, "layers": model.layers,
            "layer_ms": {who: round(t * 1e3, 3) for who, t in total.items()},
            "step_s": {who: round(t * model.layers, 3) for who, t in total.items()},
            "preset_over_ficco": round(total["preset"] / total["ficco"], 4),
            "per_gemm": per_gemm, "source": preset["source"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selector", default=None, help="An exported selector (default: Selector.load()'s).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    select = Selector.load(args.selector).select
    rows = [compare(p, select) for p in json.loads(PRESETS.read_text())["presets"]]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'preset':<52} {'tokens':>6}  ms/layer: {'preset':>7} {'ficco':>7} {'none':>7} {'ceiling':>7}  preset/ficco")
    for r in rows:
        t = r["layer_ms"]
        print(f"{r['preset']:<52} {r['tokens']:>6}            {t['preset']:7.3f} {t['ficco']:7.3f} {t['baseline']:7.3f} "
              f"{t['ceiling']:7.3f}  {r['preset_over_ficco']:.3f}")
    faster = sum(r["preset_over_ficco"] > 1.005 for r in rows)
    slower = sum(r["preset_over_ficco"] < 1 / 1.005 for r in rows)
    print(f"ficco faster at {faster}, equal (within 0.5%) at {len(rows) - faster - slower}, slower at {slower} "
          f"of {len(rows)} presets")


if __name__ == "__main__":
    main()
