"""The runtime selector under threads: wrong and illegal decisions, counted.

N threads call ``Selector.select`` for S seconds on fresh Scenario objects (ids are reused
as objects die, as in a job) of three layers with m varying, against the answers one
thread gets for the same scenarios, with the selector's default cache bounds. Prints the
calls, the decisions that differ from the one-thread answer, and those illegal for their
scenario (target: 0 and 0).

    python benchmarks/selector_threads.py [--threads 8] [--seconds 10] [--model DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

LAYERS = [
    dict(group="g", op="ag_gemm", n=4096, k=4096, dtype="bfloat16", world_size=8, hardware="h100-nvswitch"),
    dict(group="g", op="gemm_rs", n=8192, k=28672, dtype="bfloat16", world_size=2, hardware="mi300x-8"),
    dict(group="g", op="a2a_gemm", n=2048, k=4096, dtype="float16", world_size=4, hardware="a100-nvswitch",
         imbalance=1.5),
]
MS = [8 * i for i in range(1, 513)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--model", default=None, help="An exported selector folder (default: the heuristic alone).")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from ficco_select.runtime.selector import Selector
    from ficco_select.scenario import Scenario
    from ficco_select.schedule import is_legal

    def fresh() -> Selector:
        return Selector.load(args.model) if args.model else Selector()

    one = fresh()
    expected = {(i, m): one.select(Scenario(**layer, m=m)).schedule for i, layer in enumerate(LAYERS) for m in MS}
    shared = fresh()
    for i, layer in enumerate(LAYERS):  # the same tables as the one-thread selector, where it has them
        for m in MS[:2]:
            shared.select(Scenario(**layer, m=m))
    counts = {"calls": 0, "wrong": 0, "illegal": 0}
    lock = threading.Lock()
    stop = time.monotonic() + args.seconds

    def work(seed: int) -> None:
        rng, mine = random.Random(seed), {"calls": 0, "wrong": 0, "illegal": 0}
        while time.monotonic() < stop:
            i, m = rng.randrange(len(LAYERS)), rng.choice(MS)
            scenario = Scenario(**LAYERS[i], m=m)
            schedule = shared.select(scenario).schedule
            mine["calls"] += 1
            if schedule != expected[i, m]:
                mine["wrong"] += 1
                mine["illegal"] += not is_legal(schedule, scenario, "sim")
        with lock:
            for k, v in mine.items():
                counts[k] += v

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"threads": args.threads, "seconds": args.seconds, **counts}
    print(json.dumps(out) if args.json else "  ".join(f"{k} {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
