"""Do the cpu backend's labels repeat? Two independent sweeps of the same scenarios (fresh
ranks each), compared by ``ficco dataset compare`` (``ficco_select.data.compare``), per harness setting.

    python benchmarks/repeatability.py                       # the harness's defaults
    python benchmarks/repeatability.py --setting before:min_rep_s=0 --setting after
    python benchmarks/repeatability.py --n 40 --out out/repeat --json

A setting is ``NAME[:field=value,...]`` over ``MeasureConfig`` fields (``min_rep_s``,
``reps``, ``threads_per_rank``, ...); without fields it is the defaults.
The scenarios: ``--scenarios FILE``, else ``--n`` of the cpu catalog, the same for every
setting, spread over world sizes and operators. Aims on this 2-core machine: median spread
<= 10% at P=2 and <= 15% at P=3,4; best agreement >= 90%; median tau >= 0.8; speedup
above the ideal in <= 2% of scenarios. Run nothing else beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import zlib
from pathlib import Path

from ficco_select.data.compare import compare
from ficco_select.data.measure.gloo import MeasureConfig
from ficco_select.data.measure.sweep import measure
from ficco_select.data.scenarios import packaged, read_scenarios

AIMS = {"median_spread": {2: 0.10, 3: 0.15, 4: 0.15}, "best_agreement": 0.90, "median_tau": 0.8, "above_ideal": 0.02}


def parse_setting(text: str) -> tuple[str, MeasureConfig]:
    name, _, assignments = text.partition(":")
    fields = {f.name: f for f in dataclasses.fields(MeasureConfig)}
    values = {}
    for item in filter(None, assignments.split(",")):
        key, _, raw = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--setting {text}: unknown field {key!r}; MeasureConfig has {', '.join(fields)}")
        values[key] = raw.lower() in ("1", "true", "yes") if fields[key].type in ("bool", bool) else \
            (int(raw) if fields[key].type in ("int", "int | None") else float(raw))
    return name, MeasureConfig(**values)


def pick(scenarios, n: int):
    """n scenarios spread over (world size, op), deterministic (by id hash)."""
    by_key: dict = {}
    for s in sorted(scenarios, key=lambda s: zlib.crc32(s.scenario_id.encode())):
        by_key.setdefault((s.world_size, s.op), []).append(s)
    chosen, keys = [], sorted(by_key)
    while len(chosen) < n and any(by_key.values()):
        for key in keys:
            if by_key[key] and len(chosen) < n:
                chosen.append(by_key[key].pop(0))
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=None, help="scenario table (default: --n of the cpu catalog)")
    ap.add_argument("--n", type=int, default=30, help="scenarios taken from the cpu catalog")
    ap.add_argument("--setting", action="append", default=None, help="NAME[:field=value,...] (repeatable)")
    ap.add_argument("--out", default="out/repeatability", help="folder for the sweeps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    scenarios = read_scenarios(args.scenarios or packaged("catalog_cpu.csv"), backend="cpu")
    if not args.scenarios:
        scenarios = pick(scenarios, args.n)
    settings = [parse_setting(s) for s in (args.setting or ["defaults"])]
    results = {}
    for name, config in settings:
        sweeps, seconds = [], []
        for sweep in ("a", "b"):
            out = Path(args.out) / f"{name}-{sweep}.parquet"
            out.unlink(missing_ok=True)  # a fresh sweep, never a resumed one
            t0 = time.perf_counter()
            sweeps.append(measure(scenarios, config=config, out=out, progress=not args.json))
            seconds.append(time.perf_counter() - t0)
        summary, _ = compare(*sweeps)
        results[name] = {**summary, "sweep_seconds": [round(s, 1) for s in seconds],
                         "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "fault"}}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{len(scenarios)} scenarios, two fresh sweeps per setting; aims: spread <= 10% (P=2) / 15% (P=3,4), "
          "best agreement >= 90%, median tau >= 0.8, above ideal <= 2%")
    header = f"{'setting':<14} {'P':>3} {'n':>4} {'spread':>7} {'best agr':>8} {'tau':>6} {'above id':>8} " \
             f"{'rep capt':>8} {'sweep s':>8}"
    print(header)
    for name, r in results.items():
        blocks = [("all", r)] + list(r["by_world_size"].items())
        for P, b in blocks:
            print(f"{name:<14} {P!s:>3} {b['scenarios']:>4} {b['median_spread']:>7.3f} {b['best_agreement']:>8.3f} "
                  f"{b['median_tau']:>6.3f} {b['above_ideal']:>8.3f} {b['repeat_capture']:>8.4f} "
                  f"{sum(r['sweep_seconds']) / 2 if P == 'all' else float('nan'):>8.1f}")


if __name__ == "__main__":
    main()
