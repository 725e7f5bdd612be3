"""NeMo's hand-written TP-overlap presets beside ficco's advice for the same model, GPU, TP
size and sequence length, both as TransformerEngine runs them, scored on the calibrated
simulator (noise-free).

    python benchmarks/nemo_presets.py --selector DIR [--nearest] [--json]

The presets (``benchmarks/data/nemo_tp_overlap_presets.json``) are NeMo 2's whose hidden size
is a catalog model's and whose GPU is a shipped machine. Per preset:
- per layer: the time of the six GEMMs ficco decides (qkv, proj, fc1, fc2 forward; proj and
  fc2 input gradients, each with its collective); the bulk GEMMs (qkv and fc1 gradients) run
  the preset's settings in both and are left out;
- per step: that, times the model's layers;
- ficco's advice as ``ficco advise`` writes it: where TE cannot run a decision as made, the
  calibrated cost model's fastest of what TE runs, which this simulator then scores (its
  own choice: favourable by construction), or with ``--nearest`` TE's nearest method;
- against the baseline (no overlap) and the ceiling: on each GEMM the best schedule TE can
  run (``train.advise.te_entry``'s targets) by the same simulator.
Where the two disagree, each GEMM's schedules and simulated times are in ``--json``.
A GEMM whose shape, world size, dtype and GPU a published measurement has
(``data/published/``) is also judged there, each side's call by ``data.published_calls``'
rule: right, wrong or unverifiable.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ficco_select.data.published_calls import judge_calls
from ficco_select.data.simulate import simulate_rows
from ficco_select.hardware import load_hardware
from ficco_select.runtime.decision import Decision
from ficco_select.runtime.selector import Selector
from ficco_select.schedule import BASELINE, parse
from ficco_select.train import advise as A

PRESETS = Path(__file__).with_name("data") / "nemo_tp_overlap_presets.json"


def te_runnable(op: str, names: set[str], P: int) -> set[str]:
    """The candidate schedules TE can run (the targets of ``te_entry``), among `names`."""
    return {n for n in names if n.startswith(("none.", "shard.ring."))
            or (op == "gemm_rs" and n.startswith("ficco.") and ".gemm_per_step.m.sm" in n
                and (".a2a." in n or P == 2))}


def as_simulated(name: str, time_of: dict) -> str:
    """`name`, or where the simulator has no such candidate (a pipeline of more chunks than
    the shape's legal degrees), the legal pipeline of the nearest degree."""
    if name in time_of:
        return name
    schedule = parse(name)
    pipelines = [parse(n) for n in time_of if n.startswith("ficco.") and ".gemm_per_step.m.sm" in n
                 and parse(n).pattern == schedule.pattern]
    return min(pipelines, key=lambda p: abs(p.degree - schedule.degree)).name


def preset_advice(preset: dict) -> dict:
    """A preset in ``te_advice``'s form: its entries, overlap on, no switch off."""
    return {"ub_cfgs": preset["gemms"], "overlap": True, "megatron_flags": [], "model_parallel_config": {},
            "tp": preset["tp"]}


PUBLISHED = [Path(__file__).parents[1] / "data" / "published" / name for name in ("gpu-calibration.csv", "validation.csv")]


class Runs:
    """A ``select()`` that decides the scenarios of a config's GEMMs as TE runs them (the
    baseline elsewhere): how ``judge_calls`` judges a config on published points."""

    model = None

    def __init__(self, picks: dict[tuple, str]):
        self.picks = picks

    def select(self, s) -> Decision:
        name = self.picks.get(key(s))
        return Decision(parse(name) if name else BASELINE, "config", 0.0)


def key(s) -> tuple:
    return (s.op, s.m, s.n, s.k, s.world_size, s.dtype, s.hardware)


def published_calls(picks: dict[str, dict[tuple, str]]) -> list[dict]:
    """Each published point one of the GEMMs is, with each config's call there judged."""
    out = []
    for path in PUBLISHED:
        judged = {who: judge_calls(path, Runs(p))["points"] for who, p in picks.items()}
        first = next(iter(picks.values()))
        for i, point in enumerate(next(iter(judged.values()))):
            if (point["op"], point["m"], point["n"], point["k"], point["world_size"], point["dtype"],
                    point["hardware"]) in first:
                out.append({"file": path.name, "rows": point["rows"], "gemm": (point["op"], point["m"], point["n"], point["k"]),
                            **{who: {"pick": calls[i]["pick"], "verdict": calls[i]["verdict"], "why": calls[i]["why"]}
                               for who, calls in judged.items()}})
    return out


def compare(preset: dict, select, nearest: bool = False) -> dict:
    model = A.Model.from_catalog(preset["model"])
    layout = A.Layout(tp=preset["tp"], seq=preset["seq"], micro_batch=preset["micro_batch"], dtype=preset["dtype"],
                      context_parallel=preset["cp"])
    spec = load_hardware(preset["hardware"])
    advice = A.te_advice(A.decide(select, model, layout, preset["hardware"]), model, layout, preset["hardware"],
                         pick=None if nearest else A.cost_model_pick(spec))
    theirs = preset_advice(preset)
    per_gemm, total = {}, {"preset": 0.0, "ficco": 0.0, "baseline": 0.0, "ceiling": 0.0}
    picks: dict[str, dict[tuple, str]] = {"preset": {}, "ficco": {}}
    for gemm in A.layer_gemms(model):
        scenario = A.scenario_of(gemm, model, layout, preset["hardware"])
        picks["preset"][key(scenario)] = A.te_runs(theirs, gemm).name
        picks["ficco"][key(scenario)] = A.te_runs(advice, gemm).name
        rows = simulate_rows([scenario], spec)
        time_of = dict(zip(rows["schedule"], rows["time_s"]))
        runnable = te_runnable(gemm.op, set(time_of), layout.tp)
        chosen = {"preset": as_simulated(picks["preset"][key(scenario)], time_of),
                  "ficco": as_simulated(picks["ficco"][key(scenario)], time_of),
                  "baseline": "none.sm", "ceiling": min(runnable, key=time_of.get)}
        per_gemm[gemm.name] = {who: {"schedule": name, "us": round(time_of[name] * 1e6, 1)} for who, name in chosen.items()}
        for who, name in chosen.items():
            total[who] += time_of[name]
    return {"preset": preset["name"], "model": preset["model"], "hardware": preset["hardware"],
            "dtype": preset["dtype"], "tp": preset["tp"], "tokens": layout.tokens, "layers": model.layers,
            "layer_ms": {who: round(t * 1e3, 3) for who, t in total.items()},
            "step_s": {who: round(t * model.layers, 3) for who, t in total.items()},
            "preset_over_ficco": round(total["preset"] / total["ficco"], 4),
            "per_gemm": per_gemm, "advice_notes": advice["notes"], "published": published_calls(picks),
            "source": preset["source"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selector", default=None, help="An exported selector (default: Selector.load()'s).")
    parser.add_argument("--nearest", action="store_true",
                        help="Run TE's nearest method where it cannot run a decision as made (no cost model).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    select = Selector.load(args.selector).select
    rows = [compare(p, select, args.nearest) for p in json.loads(PRESETS.read_text())["presets"]]
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
    by_cost = sum("the cost model's fastest" in n for r in rows for n in r["advice_notes"])
    unlike = sum(bool(r["advice_notes"]) and len(r["advice_notes"]) for r in rows)
    print(f"GEMMs TE cannot run as decided: {unlike} of {sum(len(r['per_gemm']) for r in rows)}"
          + (f", each run as the cost model's fastest of what TE runs ({by_cost})" if by_cost else
             ", each run as TE's nearest method"))
    for r in rows:
        for p in r["published"]:
            print(f"published {p['file']} rows {p['rows']}: {r['preset']} {p['gemm']}: preset {p['preset']['pick']} "
                  f"{p['preset']['verdict']}, ficco {p['ficco']['pick']} {p['ficco']['verdict']} ({p['ficco']['why']})")


if __name__ == "__main__":
    main()
