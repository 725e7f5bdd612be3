"""An inference step on gloo ranks: a Llama-style block, tensor-parallel without sequence
parallelism (what inference engines run), forward only, timed under each way of running its
all-reduces.

The block is ``e2e_block.Block``, sharded by ``tp.parallelize(..., sequence_parallel=False)``
(activations replicated): RMSNorm -> fused q/k/v projection (column-parallel, this rank's
heads; no communication) -> causal attention -> output projection (row-parallel: GEMM, then
all-reduce) -> residual; RMSNorm -> fused gate/up projection (column-parallel) -> SiLU(gate)
* up -> down projection (row-parallel: GEMM, then all-reduce) -> residual. Two GEMM +
all-reduce pairs per step. Prefill: ``seq`` tokens of one sequence; decode: ``batch``
sequences of one new token each (attention over that token only: no KV cache, so the step's
attention is cheaper than a real decode step's; the GEMM + all-reduce pairs are the real ones).

First, per configuration, ``--explore-steps`` steps with every call shape cycling through its
candidates (``configure(explore_every=1)``, telemetry on): the per-layer oracle's picks.
Then the ways, interleaved (each repeat runs every way once, in rotated order; after a switch a
garbage collection and one untimed step, then ``--steps`` timed steps, each the slowest rank's, their mean):
- ``pytorch``: unhooked (``F.linear``, then ``dist.all_reduce``);
- ``ficco``: ``tp.install`` with the selector (the exported champion, or ``--model``): every
  row-parallel layer through ``matmul_all_reduce``;
- each of ``FIXED``: every all-reduce pinned to that schedule where it is legal, else the
  baseline (``none.sm``: PyTorch's own ``mm`` then ``all_reduce``, through the hook);
- ``oracle``: each call shape pinned to the schedule that measured fastest for it in the
  exploration (``e2e_ranks.oracle_selector``);
- ``compute-only``: not a way to run a job: the all-reduces left out; ``comm / compute`` =
  (pytorch - compute-only) / compute-only.

Prints, per configuration, each way's median step time and its speedup over ``pytorch``: the
median of the per-repeat ratios with its 95% confidence interval (distribution-free, from
order statistics, ``e2e_ranks.median_ci``), and the schedules ficco ran.

With ``--fabric RATE`` every rank runs on a shaped fabric of this host (``e2e_tp.py``'s):
the selector decides for the fabric's profiled spec.

    python benchmarks/e2e_infer.py [--configs P:seq:batch:hidden,...] [--reps 20] [--steps 3]
                                   [--explore-steps 6] [--model DIR] [--fabric RATE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_ranks import (  # noqa: E402 - what the end-to-end benchmarks share
    LEARNED,
    explore,
    explored,
    hardware_of,
    learn_run,
    learning_figures,
    learning_line,
    oracle_selector,
    plot_learning,
    restore,
    run_ranks,
    slowest_rank_seconds,
    speedups,
    timed,
    use_learned,
    warm,
)
from e2e_block import HEAD_DIM, Block  # noqa: E402 - the block the end-to-end benchmarks time
from e2e_tp import _fabric_spec  # noqa: E402 - the training step's shaped fabric

FIXED = ("none.sm", "shard.ring.sm", "ficco.d2.ring.gemm_per_step.m.sm", "ficco.d2.a2a.gemm_per_step.m.sm")
"""Fixed rules: the baseline through ficco's executor, the reduce-scatter + all-gather form at
shard level and at d = 2, and the piece-wise all-reduce in two pieces (P >= 3)."""
DEFAULT_CONFIGS = "2:512:1:512,2:1:16:512,4:512:1:512,4:1:16:512"
"""P:seq:batch:hidden: prefill (512 tokens of one sequence) and decode (16 sequences, one new
token each) at P = 2 and 4."""
PLAN = {"qkv": "colwise", "o": "rowwise", "gate_up": "colwise", "down": "rowwise"}


def _compute_only(layer) -> None:
    """The layer's GEMM alone: the row-parallel layer's all-reduce left out."""
    layer.forward = lambda x: F.linear(x, layer.weight)


def rank_phase(rank: int, P: int, config: dict) -> dict | None:
    """One rank's phase (``config["phase"]``): explore, or time every way; rank 0's figures."""
    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import TP_LAYERS, install, parallelize

    hardware = hardware_of(config)
    torch.manual_seed(0)
    hidden = config["hidden"]
    model = parallelize(Block(hidden, hidden // HEAD_DIM, 3 * hidden, P), PLAN, dist.group.WORLD,
                        sequence_parallel=False).requires_grad_(False)
    layers = [m for m in model.modules() if isinstance(m, TP_LAYERS)]
    x = torch.randn(config["seq"], config["batch"], hidden)  # replicated

    @torch.inference_mode()
    def step() -> float:
        return slowest_rank_seconds(lambda: model(x))

    champion = Selector.load(config["model"]) if config["model"] else Selector.load()
    if config["phase"] == "explore":
        explore(model, step, champion, hardware, config)
        return None
    selectors = {"ficco": champion, "oracle": oracle_selector(config["oracle"])}
    baseline = oracle_selector({})  # answers every shape with the baseline
    handle = None

    def use(way: str) -> None:
        nonlocal handle
        restore(layers, handle)
        handle = None
        if way == "compute-only":
            for layer in layers:
                _compute_only(layer)
        elif way == LEARNED:
            use_learned(champion, hardware, config)
            handle = install(model)
        elif way != "pytorch":
            torch_ops.configure(selector=selectors.get(way, baseline), hardware=hardware,
                                schedule="" if way in selectors else way)
            handle = install(model)

    learned = learn_run(model, step, champion, hardware, config) if config.get("learn_steps") else None
    ran = warm(config["ways"], use, step)
    return {"times": timed(config["ways"], use, step, config), "ficco_ran": ran, "learned": learned}


def summarize(P: int, config: dict, times: dict) -> dict:
    return {"world_size": P, "seq": config["seq"], "batch": config["batch"], "hidden": config["hidden"],
            "reps": len(times["pytorch"])} | speedups(times, FIXED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="P:seq:batch:hidden, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--explore-steps", type=int, default=6, help="steps of the oracle's exploration")
    parser.add_argument("--model", default="", help="exported selector folder (default: the packaged champion)")
    parser.add_argument("--fabric", default=None, metavar="RATE",
                        help="run every rank on a shaped fabric of this host (tc's rate, e.g. 1gbit)")
    parser.add_argument("--learn-steps", type=int, default=0,
                        help="Before the timing, run this many steps with the hook learning (configure(learn=True)) "
                             f"from an empty record, then time what it settled on as the way {LEARNED!r}.")
    parser.add_argument("--learn-plot", default=None, help="Write the learning runs' step times here (PNG).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    fabric = _fabric_spec(args.fabric) if args.fabric else None
    from ficco_select.hardware import machines, spec_from_dict

    # The fabric's machine, as its profile describes it: what the exploration's telemetry names.
    with machines([spec_from_dict(fabric, "the fabric's profile")] if fabric else [], "the fabric's profile"):
        rows = _explore_and_time(args, fabric, parser)
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.learn_plot and args.learn_steps:
        plot_learning(rows, args.learn_plot, "inference step (forward), gloo ranks")


def _explore_and_time(args, fabric: dict | None, parser) -> list[dict]:
    """Each configuration explored (the per-layer oracle), then every way timed; each row
    printed as it comes unless --json."""
    rows = []
    for spec in args.configs.split(","):
        P, seq, batch, hidden = (int(v) for v in spec.split(":"))
        if hidden % HEAD_DIM or (hidden // HEAD_DIM) % P:
            parser.error(f"--configs {spec}: hidden must be a multiple of {HEAD_DIM} with hidden/{HEAD_DIM} heads "
                         "divisible by P")
        config = {"seq": seq, "batch": batch, "hidden": hidden, "reps": args.reps, "steps": args.steps,
                  "model": args.model, "spec": fabric, "learn_steps": args.learn_steps,
                  "ways": ["pytorch", "ficco", *([LEARNED] if args.learn_steps else []), *FIXED, "oracle", "compute-only"]}
        with tempfile.TemporaryDirectory() as tmp:
            telemetry = f"{tmp}/explore.{{rank}}.jsonl"
            run_ranks(P, {**config, "phase": "explore", "explore_steps": args.explore_steps, "telemetry": telemetry},
                      rank_phase)
            best, _ = explored([telemetry.format(rank=r) for r in range(P)])
            got = run_ranks(P, {**config, "phase": "time", "oracle": best, "learn_dir": f"{tmp}/learned"}, rank_phase)
        row = summarize(P, config, got["times"]) | {"ficco_ran": got["ficco_ran"], "oracle_picks": best,
                                                     "fabric": args.fabric}
        if got["learned"]:
            row["learning"] = learning_figures(got["learned"], row)
            row["label"] = f"{fabric['name'] if fabric else 'cpu'} P={P} seq={seq} batch={batch} hidden={hidden}"
        rows.append(row)
        if not args.json:
            ways = "  ".join(f"{w} {v['speedup']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]"
                             for w, v in row["ways"].items() if w != "pytorch")
            print(f"P={P} seq={seq} batch={batch} hidden={hidden} comm/compute={row['comm_per_compute']:.2f} "
                  f"pytorch {row['ways']['pytorch']['step_ms']:.3f} ms | {ways} | best fixed {row['best_fixed']} "
                  f"| gap captured {row['gap_captured']} | ficco ran {row['ficco_ran']}", flush=True)
            if "learning" in row:
                print(learning_line(row["learning"]), flush=True)
    return rows


if __name__ == "__main__":
    main()
