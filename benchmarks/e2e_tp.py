"""A real training step on gloo ranks: a Llama-style block, sequence-parallel tensor-parallel,
forward + backward + optimizer step, timed under each way of running its collectives.

The block (per rank, Megatron-style sequence parallelism): RMSNorm -> fused q/k/v projection
(column-parallel: all-gather the sequence) -> causal attention over this rank's heads ->
output projection (row-parallel: reduce-scatter the sequence) -> residual; RMSNorm -> fused
gate/up projection (column-parallel) -> SiLU(gate) * up -> down projection (row-parallel)
-> residual. Eight GEMMs with a collective each per step (four forward, four for the inputs'
gradients).

Ways, interleaved in one run (each repeat runs every way once, in rotated order; after a
switch one untimed step absorbs its first decisions, then one step is timed, the slowest
rank's time):
- ``pytorch``: unhooked (PyTorch's differentiable all-gather / reduce-scatter, then the GEMM);
- ``async-tp``: PyTorch's async-TP fallback ops (``torch.distributed._symmetric_memory``'s
  ``_fused_all_gather_matmul_fallback`` / ``_fused_matmul_reduce_scatter_fallback``, what
  ``fused_all_gather_matmul`` runs without symmetric memory), with their mirror op as the
  input's gradient;
- ``ficco``: ``tp.install`` with the selector (the exported champion, or ``--model``);
- ``baseline``, ``shard.ring.sm``, and each ``--ficco`` schedule: every layer pinned to it;
- ``oracle``: the per-layer oracle, each call shape (four GEMMs forward, four for the inputs'
  gradients) pinned to the schedule that measured fastest for it in this job. Before the
  timed repeats, ``--explore-steps`` steps run with ``configure(explore_every=1)``, so that
  every shape cycles through its candidates, with telemetry on; the lines, read back as
  dataset rows (``data.telemetry``: each call the slowest rank's time, the median over
  calls), give each shape's fastest verified schedule.

Prints, per configuration, each way's median step time, its ratio to ``pytorch`` (median of
the per-repeat ratios) and that ratio's spread (interquartile range), the best fixed rule,
and the oracle's schedule per shape.

    python benchmarks/e2e_tp.py [--world-sizes 2,3,4] [--sizes 384,768] [--seq 1536] [--reps 8]
                                [--explore-steps 36] [--model DIR] [--json] [--plot docs/e2e_tp.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

FIXED = ("none.sm", "shard.ring.sm")
FICCO = ("ficco.d2.ring.gemm_per_piece.m.sm",)


class Block(nn.Module):
    """The full (unsharded) Llama-style block; ``parallelize`` shards it."""

    def __init__(self, hidden: int, heads: int, ffn: int, P: int) -> None:
        super().__init__()
        self.heads, self.P = heads, P
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        with torch.no_grad():  # rank r's rows of the fused weights: its heads' q, k, v; its gate and up
            q, k, v = self.qkv.weight.chunk(3)
            self.qkv.weight.copy_(torch.cat([torch.cat([w.chunk(P)[r] for w in (q, k, v)]) for r in range(P)]))
            g, u = self.gate_up.weight.chunk(2)
            self.gate_up.weight.copy_(torch.cat([torch.cat([g.chunk(P)[r], u.chunk(P)[r]]) for r in range(P)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (seq / P, batch, hidden), this rank's shard
        qkv = self.qkv(self.norm1(x))  # (seq, batch, 3 * hidden / P)
        seq, batch, width = qkv.shape
        heads = self.heads // self.P
        q, k, v = (t.reshape(seq, batch, heads, -1).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(seq, batch, -1)
        h = x + self.o(attn)
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


# -- PyTorch's async-TP fallback ops, differentiable -------------------------------------------
class _FallbackAG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_name):  # all_gather(x) @ w^T
        A, (y,) = symm_mem._fused_all_gather_matmul_fallback(x, [w.t()], 0, group_name, return_A=True)
        ctx.save_for_backward(A, w)
        ctx.group_name = group_name
        return y

    @staticmethod
    def backward(ctx, dy):
        A, w = ctx.saved_tensors
        dx = symm_mem._fused_matmul_reduce_scatter_fallback(dy.contiguous(), w, "sum", 0, ctx.group_name)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ A.reshape(-1, A.shape[-1])
        return dx, dw, None


class _FallbackRS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_name):  # reduce_scatter(x @ w^T)
        ctx.save_for_backward(x, w)
        ctx.group_name = group_name
        return symm_mem._fused_matmul_reduce_scatter_fallback(x, w.t(), "sum", 0, group_name)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy_full, (dx,) = symm_mem._fused_all_gather_matmul_fallback(dy.contiguous(), [w], 0, ctx.group_name,
                                                                     return_A=True)
        dw = dy_full.reshape(-1, dy_full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw, None


def _async_tp(layer) -> None:
    from ficco_select.runtime.tp import ColumnParallelLinear

    op = _FallbackAG if isinstance(layer, ColumnParallelLinear) else _FallbackRS
    layer.forward = lambda x: op.apply(x, layer.weight, layer.group.group_name)


# -- the per-layer oracle ------------------------------------------------------------------------
def oracle_selector(telemetry: list[str]):
    """A selector that answers each call shape (scenario) with the schedule that measured
    fastest for it in `telemetry` (every rank's file of the exploration), else the baseline."""
    from data.telemetry import read_telemetry
    from ficco_select.runtime.decision import Decision
    from ficco_select.runtime.selector import Selector
    from ficco_select.schedule import BASELINE, parse

    rows = read_telemetry(telemetry)
    ok = rows[rows["status"].eq("ok") & rows["verified"].eq(True)]
    best = {sid: parse(g.loc[g["time_s"].idxmin(), "schedule"]) for sid, g in ok.groupby("scenario_id")}

    class Oracle(Selector):
        def layer_table(self, scenario):  # per shape, never a table
            return None

        def select(self, scenario):
            pick = best.get(scenario.scenario_id)
            if pick is None:
                return Decision(BASELINE, "fallback", 0.0, "not explored")
            return Decision(pick, "model", 1.0, "fastest in this job's exploration")

    return Oracle(), {sid: s.name for sid, s in best.items()}


# -- one rank ----------------------------------------------------------------------------------
def rank_main(rank: int, P: int, config: dict, tmp: str, results) -> None:
    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import TP_LAYERS, install, parallelize

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // P))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=P)
    group = dist.group.WORLD
    selector = Selector.load(config["model"]) if config["model"] else Selector.load()
    torch.manual_seed(0)
    hidden = config["hidden"]
    model = parallelize(Block(hidden, config["heads"], 3 * hidden, P),
                        {"qkv": "colwise", "o": "rowwise", "gate_up": "colwise", "down": "rowwise"}, group)
    layers = [m for m in model.modules() if isinstance(m, TP_LAYERS)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(config["seq"], config["batch"], hidden).chunk(P)[rank].clone()
    handle = None

    oracle = None

    def use(way: str) -> None:
        nonlocal handle
        if handle is not None:
            handle.remove()
            handle = None
        for layer in layers:
            layer.__dict__.pop("forward", None)
        if way == "async-tp":
            for layer in layers:
                _async_tp(layer)
        elif way != "pytorch":
            chosen = oracle if way == "oracle" else selector
            torch_ops.configure(selector=chosen, hardware="cpu", schedule="" if way in ("ficco", "oracle") else way)
            handle = install(model)  # the tables of every layer, before any step

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        return float(elapsed)

    ways = config["ways"]
    picks = {}
    if "oracle" in ways:  # every shape through its candidates, timed, before the timed repeats
        explored = f"{tmp}/explore.{{rank}}.jsonl"
        torch_ops.configure(selector=selector, hardware="cpu", schedule="", explore_every=1, telemetry=explored)
        handle = install(model)
        for _ in range(config["explore_steps"]):
            step()
        torch_ops.configure(explore_every=0, telemetry="")
        dist.barrier()
        if rank == 0:  # only rank 0 decides (the group runs its decisions)
            oracle, picks = oracle_selector([explored.format(rank=r) for r in range(P)])
    times = {w: [] for w in ways}
    for way in ways:  # warm every way once
        use(way)
        step()
    for r in range(config["reps"]):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            use(way)
            step()  # the way's first decisions, if any
            times[way].append(step())
    if rank == 0:
        results.put((times, picks))
    use("pytorch")
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads can abort the process
    # (as the tests' ranks do).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_config(P: int, config: dict) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(P, config, tmp, results), nprocs=P, join=True)
    times, picks = results.get()
    base = times["pytorch"]
    out = {"world_size": P, "hidden": config["hidden"], "seq": config["seq"], "ways": {}, "oracle_picks": picks}
    for way, ts in times.items():
        ratios = sorted(b / t for b, t in zip(base, ts))  # speedup over the same repeat's unhooked step
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else (ratios[0],) * 3
        out["ways"][way] = {"step_ms": round(1e3 * statistics.median(ts), 2),
                            "speedup": round(statistics.median(ratios), 3), "spread": round(q3 - q1, 3)}
    fixed = [w for w in times if w not in ("pytorch", "async-tp", "ficco", "oracle")]
    out["best_fixed"] = max(fixed, key=lambda w: out["ways"][w]["speedup"]) if fixed else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2,3,4")
    ap.add_argument("--sizes", default="384,768", help="Hidden sizes (12 heads; ffn 3x hidden).")
    ap.add_argument("--seq", type=int, default=1536, help="Tokens per sequence (divisible by every world size).")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--explore-steps", type=int, default=36,
                    help="Steps of exploration behind the per-layer oracle (0: no oracle).")
    ap.add_argument("--model", default=None, help="An exported selector folder (default: the exported champion).")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="Write a bar chart of the speedups here (PNG).")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ways = ["pytorch", "async-tp", "ficco", *FIXED, *FICCO, *(["oracle"] if args.explore_steps else [])]
    rows = []
    for P in (int(p) for p in args.world_sizes.split(",")):
        for hidden in (int(h) for h in args.sizes.split(",")):
            config = {"hidden": hidden, "heads": 12, "seq": args.seq, "batch": args.batch, "reps": args.reps,
                      "model": args.model, "ways": ways, "explore_steps": args.explore_steps}
            rows.append(run_config(P, config))
            if not args.json:
                r = rows[-1]
                print(f"P={P} hidden={hidden} seq={args.seq}: " + ", ".join(
                    f"{w} {v['step_ms']:.0f} ms x{v['speedup']:.3f}±{v['spread']:.3f}" for w, v in r["ways"].items())
                    + f"; best fixed {r['best_fixed']}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.plot:
        _plot(rows, args.plot)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = list(rows[0]["ways"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(ways)
    for i, way in enumerate(ways):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["ways"][way]["speedup"] for r in rows], width,
               yerr=[r["ways"][way]["spread"] / 2 for r in rows], label=way)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"P={r['world_size']}\nhidden {r['hidden']}" for r in rows])
    ax.set_ylabel("step speedup over unhooked PyTorch")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
