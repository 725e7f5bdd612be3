"""A sequence-parallel MLP trained on gloo ranks with ficco's hook and telemetry on.

    python examples/tp_training.py [--world-size 2] [--steps 40] [--model DIR] [--out out/example]
    ficco train --telemetry 'out/example/telemetry-0.jsonl' --telemetry 'out/example/telemetry-1.jsonl'

Each rank holds its shard of the weights and of the sequence; ``install(model)`` makes
the forward and backward collectives + GEMMs go through ficco's selector and executor,
and every execution is appended to the rank's telemetry file, which ``ficco train``
reads back as labeled rows. Every ``--explore-every``-th call of a shape runs another
candidate (baseline first), so the job's own shapes get the alternatives training needs.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def rank_main(rank: int, args, store: str) -> None:
    from ficco_select.runtime import dispatch, torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import ColumnParallelLinear, RowParallelLinear, install

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=rank, world_size=args.world_size)
    group, P = dist.group.WORLD, args.world_size
    torch_ops.configure(selector=Selector.load(args.model) if args.model else Selector.load(),
                        hardware="cpu", telemetry=os.path.join(args.out, "telemetry-{rank}.jsonl"),
                        explore_every=args.explore_every)
    torch.manual_seed(0)  # the same full model on every rank, then each keeps its shard
    hidden = args.hidden
    full = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    model = nn.Sequential(ColumnParallelLinear.from_linear(full[0], group), nn.GELU(),
                          RowParallelLinear.from_linear(full[2], group))
    handle = install(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    target = nn.Linear(hidden, hidden)  # a fixed random map to learn
    for step in range(args.steps):
        x = torch.randn(args.seq // P, hidden)  # this rank's part of the sequence
        with torch.no_grad():
            y_true = target(x)
        loss = (model(x) - y_true).square().mean()
        opt.zero_grad()
        loss.backward()
        # The loss is the sum of the ranks' losses; the row-parallel bias is replicated,
        # so its gradient is the sum of theirs (sharded weights got theirs through ficco).
        dist.all_reduce(model[2].bias.grad)
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}")
    if rank == 0:
        for (key, _), decision in dispatch.decisions().items():
            print(f"{key[0]} {key[1:3]}: {decision.schedule.name} ({decision.source})")
    handle.remove()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--model", help="An exported selector folder (default: the exported champion, else the heuristic).")
    ap.add_argument("--out", default="out/example")
    ap.add_argument("--explore-every", type=int, default=4,
                    help="Every n-th call of a shape runs another candidate, so telemetry can train.")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as store:
        mp.spawn(rank_main, args=(args, store), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
