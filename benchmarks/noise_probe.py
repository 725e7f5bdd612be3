"""Where does the cpu backend's timing noise come from? One scenario on P gloo ranks, a few
schedules timed many times under each setting, and the spread of the per-run times.

    python benchmarks/noise_probe.py                          # the settings below
    python benchmarks/noise_probe.py --setting 'runs5={"runs": 5, "reps": 30}'
    python benchmarks/noise_probe.py --gemm-alone             # the machine's own floor

A setting is NAME=JSON with any of: ``runs`` (back-to-back runs per repetition, timed as
one span), ``reps``, ``barrier`` (a barrier before each repetition, as the harness does),
``gloo_threads`` (gloo's transport threads per rank), ``shared_clock`` (a repetition is
last end - first start on the host's monotonic clock instead of the slowest rank's own
span), ``pin_main_thread`` (after the process group is up, pin only the rank's own thread,
which runs its GEMMs, to core rank % cores; gloo's threads, already started, stay free:
the P=2 suspect, a rank's GEMM sharing a core with its peer's transport thread). Each line: median per-run time, IQR / median, min / median, p90 / median (the
``ficco_select.data.labels.summarize`` spread is the IQR / median). Run nothing else beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ficco_select.executor import ranks
from ficco_select.executor.comm import P2PComm
from ficco_select.executor.operators import build_operator
from ficco_select.scenario import Scenario
from ficco_select.schedule import parse

SETTINGS = {
    "harness": {},                                   # one run per repetition after a barrier
    "runs5": {"runs": 5, "reps": 30},                # five back-to-back runs per repetition
    "no-barrier": {"barrier": False},
    "gloo-1-thread": {"gloo_threads": 1},
    "shared-clock": {"shared_clock": True},
    "pin-main-thread": {"pin_main_thread": True},
}
SCHEDULES = ("none.sm", "shard.ring.sm", "ficco.d4.ring.gemm_per_piece.m.sm")


def rank_main(rank: int, world: int, scenario: dict, setting: dict) -> dict[str, list[float]]:
    """One rank of the probe, in a gloo group of its own options; the times per schedule."""
    options = None
    if "gloo_threads" in setting:
        options = dist.ProcessGroupGloo._Options()
        options._threads = setting["gloo_threads"]
        options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
    dist.init_process_group("gloo", store=ranks.rendezvous(), rank=rank, world_size=world, pg_options=options,
                            timeout=datetime.timedelta(seconds=120))
    if setting.get("pin_main_thread"):
        # Linux: pid 0 is the calling thread only; threads gloo started before keep their mask.
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    op = build_operator(Scenario(**scenario), P2PComm())
    runs, out = setting.get("runs", 1), {}
    for name in SCHEDULES:
        schedule = parse(name)
        for _ in range(3):
            op.run(schedule)
        starts, ends = [], []
        for _ in range(setting.get("reps", 60)):
            if setting.get("barrier", True):
                dist.barrier()
            starts.append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for the host's processes
            for _ in range(runs):
                op.run(schedule)
            ends.append(time.perf_counter())
        s, e = torch.tensor(starts, dtype=torch.float64), torch.tensor(ends, dtype=torch.float64)
        if setting.get("shared_clock"):
            dist.all_reduce(s, op=dist.ReduceOp.MIN)
            dist.all_reduce(e, op=dist.ReduceOp.MAX)
            span = e - s
        else:
            span = e - s
            dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the harness's slowest rank
        out[name] = (span / runs).tolist()
    dist.barrier()
    dist.destroy_process_group()
    return out


def probe(scenario: dict, setting: dict) -> dict[str, list[float]]:
    """The probe on fresh ranks (``ficco_select.executor.ranks``); rank 0's times."""
    return ranks.run_ranks(rank_main, scenario["world_size"], (scenario, setting), group=None, timeout_s=600)[0]


def gemm_alone(m: int, n: int, k: int, reps: int = 60) -> dict[str, list[float]]:
    """The floor: one single-threaded GEMM in this process, no ranks, 1 and 5 runs per rep."""
    torch.set_num_threads(1)
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    out = {}
    for runs in (1, 5):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(runs):
                torch.mm(a, b, out=c)
            times.append((time.perf_counter() - t0) / runs)
        out[f"gemm x{runs}"] = times
    return out


def line(setting: str, name: str, times: list[float]) -> str:
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4)
    p90 = statistics.quantiles(times, n=10)[8]
    return (f"{setting:<14} {name:<36} median {1e3 * med:7.2f} ms  IQR/med {(q[2] - q[0]) / med:.3f}  "
            f"min/med {min(times) / med:.2f}  p90/med {p90 / med:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", default=None, help="NAME=JSON (repeatable)")
    ap.add_argument("--op", default="ag_gemm")
    ap.add_argument("--shape", default="1024,512,512", help="m,n,k (global)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--gemm-alone", action="store_true", help="only the single-process GEMM floor")
    args = ap.parse_args()
    m, n, k = (int(x) for x in args.shape.split(","))
    if args.gemm_alone:
        for name, times in gemm_alone(m, n // args.world_size, k).items():
            print(line("gemm-alone", name, times))
        return
    settings = dict(SETTINGS) if not args.setting else \
        {name: json.loads(text) for name, _, text in (s.partition("=") for s in args.setting)}
    scenario = dict(group="probe", op=args.op, m=m, n=n, k=k, dtype="float32", world_size=args.world_size,
                    hardware="cpu")
    for setting, knobs in settings.items():
        for name, times in probe(scenario, knobs).items():
            print(line(setting, name, times), flush=True)


if __name__ == "__main__":
    main()
