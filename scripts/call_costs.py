"""What the fixed cost of a call does to the simulator's error on published GPU points.

    python scripts/call_costs.py data/published/validation.csv [--json]

Every point is predicted twice on its preset: as committed, and with every fixed cost of a
call taken out (the spec fields whose role is ``latency``: a GEMM's launch, a collective
library's per-call latency, per-transfer and per-step costs, an overlapped call's setup,
each set to 0.001 us, which keeps the collective library's model in place). Printed: the
rows where the two differ by more than 1% (the small calls), each preset's median APE both
ways, then at each collective + GEMM point the simulator's best overlap gain both ways beside
the best gain measured there (what decides whether overlap is picked).
"""

import dataclasses
import json
import statistics
import sys

from ficco_select.data.no_harm import residuals
from ficco_select.data.published import compare, read_published
from ficco_select.hardware import HardwareSpec, load_hardware

NONE_US = 0.001
"""A fixed cost taken out: positive (the spec requires it), too small to show."""


def without_call_costs(spec: HardwareSpec) -> HardwareSpec:
    latency = [f.name for f in dataclasses.fields(spec) if f.metadata.get("role") == "latency"]
    return dataclasses.replace(spec, **{name: NONE_US for name in latency if getattr(spec, name) > 0})


def effect(path: str) -> dict:
    points = read_published(path)
    presets = sorted({p.hardware for p in points if p.hardware})
    bare_specs = {name: without_call_costs(load_hardware(name)) for name in presets}
    committed = compare(points)["points"]
    bare = compare(points, bare_specs)["points"]
    rows, medians = [], {}
    for full, cut in zip(committed, bare):
        if full.get("ape") is None:
            continue
        value = "predicted_gbps" if full["kind"] == "bandwidth" else "predicted_us"
        rows.append({"row": full["row"], "kind": full["kind"], "hardware": full["hardware"], "op": full["op"],
                     "m": full["m"], "n": full["n"], "k": full["k"], "world_size": full["world_size"],
                     "measured": full.get("measured_gbps", full.get("measured_us")),
                     "with_call_costs": full[value], "without": cut[value],
                     "ape": full["ape"], "ape_without": cut["ape"]})
    for name in presets:
        mine = [r for r in rows if r["hardware"] == name]
        medians[name] = {"points": len(mine), "ape": round(statistics.median(r["ape"] for r in mine), 4),
                         "ape_without": round(statistics.median(r["ape_without"] for r in mine), 4)}
    gains = [{"rows": full["rows"], "hardware": full["hardware"], "op": full["op"],
              "with_call_costs": round(full["simulated_gain"], 3), "without": round(cut["simulated_gain"], 3),
              "measured": round(full["measured_gain"], 3)}
             for full, cut in zip(residuals(path), residuals(path, bare_specs))]
    return {"rows": rows, "presets": medians, "best_gains": gains}


def main(path: str, as_json: bool) -> None:
    result = effect(path)
    if as_json:
        print(json.dumps(result, indent=1))
        return
    print(f"{'row':>4} {'kind':13} {'preset':14} {'point':28} {'measured':>9} {'with':>9} {'without':>9}"
          f" {'APE':>6} {'without':>7}")
    for r in result["rows"]:
        if abs(r["with_call_costs"] - r["without"]) <= 0.01 * abs(r["with_call_costs"]):
            continue
        point = f"{r['op']} {r['m'] or ''}x{r['n'] or ''}x{r['k'] or ''} P={r['world_size']}"
        print(f"{r['row']:>4} {r['kind']:13} {r['hardware']:14} {point:28} {r['measured']:>9.1f}"
              f" {r['with_call_costs']:>9.1f} {r['without']:>9.1f} {r['ape']:>6.1%} {r['ape_without']:>7.1%}")
    print("\nmedian APE per preset, with the committed fixed costs / without them (points):")
    for name, m in result["presets"].items():
        print(f"  {name:14} {m['ape']:6.1%} / {m['ape_without']:6.1%}  ({m['points']})")
    print("\nthe simulator's best overlap gain with the fixed costs / without them, and the best measured:")
    for g in result["best_gains"]:
        rows = ",".join(map(str, g["rows"]))
        print(f"  rows {rows:<10} {g['hardware']:14} {g['op']:8} x{g['with_call_costs']:.3f} / x{g['without']:.3f}"
              f"   measured x{g['measured']:.3f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--json"]
    if len(args) != 1:
        sys.exit("usage: python scripts/call_costs.py TABLE.csv [--json]")
    main(args[0], "--json" in sys.argv[1:])
