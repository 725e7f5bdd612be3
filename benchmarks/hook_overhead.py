"""What the tensor-parallel hook costs and gains on real gloo ranks, as ratios of one run.

A sequence-parallel MLP (ColumnParallelLinear -> GELU -> RowParallelLinear) runs its
forward unhooked (PyTorch's plain collectives, then the GEMM) and hooked (ficco's ops:
the selector's schedule, executed by the executor), interleaved; the per-call decision
bookkeeping (cache hit in ``torch_ops``) is timed on its own.

    python benchmarks/hook_overhead.py [--world-size 2] [--seq 1024] [--hidden 1024] [--schedule NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def rank_main(rank: int, args, tmp: str) -> None:
    from ficco_select.runtime import dispatch, torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import ColumnParallelLinear, RowParallelLinear, install

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=args.world_size)
    P, group = args.world_size, dist.group.WORLD
    torch_ops.configure(selector=Selector.load(args.model) if args.model else Selector(), hardware="cpu",
                        schedule=args.schedule)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, args.hidden))
    tp = nn.Sequential(ColumnParallelLinear.from_linear(full[0], group), nn.GELU(),
                       RowParallelLinear.from_linear(full[2], group))
    x = torch.randn(args.seq // P, args.hidden)

    def timed() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            tp(x)
        return time.perf_counter() - t0

    plain, hooked = [], []
    for _ in range(2):  # warm-up both paths (first hooked call decides and broadcasts)
        timed()
        with install(tp):
            timed()
    for _ in range(args.reps):
        plain.append(timed())
        with install(tp):
            hooked.append(timed())
    with torch.no_grad():
        y_plain = tp(x)
        with install(tp):
            y_hooked = tp(x)
    with install(tp):
        decisions = [d.schedule.name + f" ({d.source})" for d in dispatch.decisions().values()]
    key = next(iter(dispatch.decisions()))[0]
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        dispatch.decide(key, group, None)
    hit_us = (time.perf_counter() - t0) / n * 1e6
    if rank == 0:
        out = {"world_size": P, "seq": args.seq, "hidden": args.hidden, "reps": args.reps,
               "plain_ms": 1e3 * statistics.median(plain), "hooked_ms": 1e3 * statistics.median(hooked),
               "hooked_over_plain": statistics.median(hooked) / statistics.median(plain),
               "decision_hit_us": hit_us, "max_abs_diff_hooked_vs_plain": (y_hooked - y_plain).abs().max().item(),
               "decisions": decisions}
        out = {k: round(v, 3) if isinstance(v, float) and "diff" not in k else v for k, v in out.items()}
        print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>18}: {v}" for k, v in out.items()))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="An exported selector folder (default: the heuristic).")
    ap.add_argument("--schedule", default="", help="Pin one schedule (default: the selector decides).")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, tmp), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
