"""A real training step on gloo ranks: a Llama-style block, sequence-parallel tensor-parallel,
forward + backward + optimizer step, timed under each way of running its collectives, and
the telemetry loop closed on it.

The block (``e2e_block.Block``; per rank, Megatron-style sequence parallelism): RMSNorm ->
fused q/k/v projection (column-parallel: all-gather the sequence) -> causal attention over
this rank's heads -> output projection (row-parallel: reduce-scatter the sequence) ->
residual; RMSNorm -> fused gate/up projection (column-parallel) -> SiLU(gate) * up -> down
projection (row-parallel) -> residual. Eight GEMMs with a collective each per step (four
forward, four for the inputs' gradients).

Three phases:
1. **Explore** (per configuration, fresh ranks): ``--explore-steps`` steps with
   ``configure(explore_every=1)`` and telemetry on, so that every call shape cycles through
   its candidates; each rank writes its lines under ``--workdir``.
2. **Retrain** (``--retrain``): ``ficco train --telemetry <every file>`` (``RETRAIN``; a private MLflow
   store under ``--workdir``), then ``ficco export`` of the version it registered: the
   exported champion retrained on this job's telemetry.
3. **Time** (per configuration, fresh ranks): the ways, interleaved; each repeat runs every
   way once, in rotated order; after a switch a garbage collection and one untimed step, then ``--steps`` timed steps
   (each the slowest rank's), their mean.

Ways:
- ``pytorch``: unhooked (PyTorch's differentiable all-gather / reduce-scatter, then the GEMM);
- ``async-tp``: PyTorch's async-TP fallback ops (``torch.distributed._symmetric_memory``'s
  ``_fused_all_gather_matmul_fallback`` / ``_fused_matmul_reduce_scatter_fallback``, what
  ``fused_all_gather_matmul`` runs without symmetric memory), with their mirror op as the
  input's gradient;
- ``ficco``: ``tp.install`` with the selector (the exported champion, or ``--model``);
- ``ficco-checked``: the same in the debug mode, each call first checking that every rank
  passes the same shapes (``configure(check_calls=True)``): what that check costs;
- ``ficco+telemetry``: the same with the selector retrained on the job's telemetry (phase 2);
- ``none.sm``, ``shard.ring.sm``, and each ``--ficco`` schedule: every layer pinned to it;
- ``oracle``: the per-layer oracle, each call shape pinned to the schedule that measured
  fastest for it in phase 1 (read back as dataset rows, ``ficco_select.data.telemetry``: each call the
  slowest rank's time, the median over calls);
- ``compute-only``: not a way to run a job, the step's compute alone: every collective
  replaced by a local copy of the same shape. ``comm / compute`` = (pytorch - compute-only)
  / compute-only says whether communication or compute dominates a configuration.

With ``--dtensor``, the ways a DTensor user has (``e2e_dtensor.py``), on the same block in
torchtitan's form (unfused ``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``, input (batch,
seq / P, hidden)) and torchtitan's plan (``SequenceParallel`` norms, ``PrepareModuleInput``,
``ColwiseParallel`` / ``RowwiseParallel``), each from the same full weights; speedups still
over ``pytorch`` (so ``dtensor``'s says what DTensor itself costs against the plain
tensor-parallel step):
- ``dtensor``: the plan, eager;
- ``dtensor-compiled``: the plan under ``torch.compile`` (Inductor);
- ``dtensor-compiled+micro-pipeline``: the same with Inductor's async-TP pass
  (``torch._inductor.config._micro_pipeline_tp``); it fuses only on NCCL with symmetric
  memory, so where it fuses nothing (gloo: always) the way is reported "not on this backend"
  instead of a number;
- ``ficco-styles``: the plan in ficco's drop-in styles (``runtime/dtensor.py``:
  ``FiccoColwiseParallel``, ``FiccoRowwiseParallel``, ``FiccoPrepareModuleInput``), eager,
  the tables built first (``prepare_tables``); like PyTorch's styles, they trust DTensor's
  shapes and skip the per-call check (with the default ``configure``);
- ``dtensor-compiled+ficco``: the plan compiled with ficco's Inductor pass
  (``runtime/compile.py``, ``install_pass``); rank 0 prints what the pass rewrote.
Each compiled way compiles (forward and backward) in its warm-up step, before any timing;
after the warm-ups a recompilation raises (``torch._dynamo.config.error_on_recompile``).

Prints, per configuration, each way's median step time and its speedup over ``pytorch``:
the median of the per-repeat ratios with its 95% confidence interval (distribution-free,
from order statistics), the best fixed rule, and the oracle's and the retrained
selector's schedule per shape.

    python benchmarks/e2e_tp.py [--configs 2:512:512,...] [--reps 20] [--steps 2]
                                [--explore-steps 36] [--retrain] [--model DIR] [--workdir DIR] [--fabric RATE]
                                [--dtensor] [--json] [--plot docs/e2e_tp.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
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
from e2e_dtensor import DTENSOR, compiling, dtensor_ways  # noqa: E402 - the ways of --dtensor

RETRAIN = ("--splits", "family,hardware", "--selectors", "fast")
"""What the retraining evaluates before it registers: the pipeline's selectors, its two grouped hold-outs."""
FIXED = ("none.sm", "shard.ring.sm")
FICCO = ("ficco.d2.a2a.gemm_per_step.m.sm",)
"""The best single ficco schedule as a fixed rule (where legal, else the baseline) among those
that at least half the cpu catalog's scenarios have: capture 0.811 on its second sweep
(data/measured/cpu_catalog_repeat.parquet), against 0.851 for the baseline everywhere."""


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


def _compute_only(layer, P: int, rank: int) -> None:
    """The layer's GEMM with its collective replaced by a local copy of the same shape: P
    copies of the shard for the all-gather, this rank's slice of the sum for the reduce-scatter."""
    from ficco_select.runtime.tp import ColumnParallelLinear

    if isinstance(layer, ColumnParallelLinear):
        layer.forward = lambda x: F.linear(torch.cat([x] * P), layer.weight)
    else:
        layer.forward = lambda x: F.linear(x, layer.weight).chunk(P)[rank].contiguous()


# -- one rank ----------------------------------------------------------------------------------
def rank_phase(rank: int, P: int, config: dict) -> dict | None:
    """One rank's phase (``config["phase"]``): explore, or time every way; rank 0's figures."""
    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import TP_LAYERS, install, parallelize

    hardware = hardware_of(config)
    group = dist.group.WORLD
    torch.manual_seed(0)
    hidden = config["hidden"]
    model = parallelize(Block(hidden, config["heads"], 3 * hidden, P),
                        {"qkv": "colwise", "o": "rowwise", "gate_up": "colwise", "down": "rowwise"}, group)
    layers = [m for m in model.modules() if isinstance(m, TP_LAYERS)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(config["seq"], config["batch"], hidden).chunk(P)[rank].clone()

    run = {"model": model, "x": x, "opt": opt}  # what step() runs: the block's, or a DTensor way's

    def train_step() -> None:
        run["opt"].zero_grad(set_to_none=True)
        run["model"](run["x"]).square().mean().backward()
        run["opt"].step()

    def step() -> float:
        return slowest_rank_seconds(train_step)

    champion = Selector.load(config["model"]) if config["model"] else Selector.load()
    if config["phase"] == "explore":
        explore(model, step, champion, hardware, config)
        return None

    # Only rank 0 decides (the group runs its decisions): the others need no selector's answers.
    selectors = {"ficco": champion, "ficco-checked": champion, "oracle": oracle_selector(config["oracle"]),
                 "ficco+telemetry": Selector.load(config["retrained"]) if config["retrained"] else None}
    handle = None
    dtensor = dtensor_ways(config, P, rank) if any(w in DTENSOR for w in config["ways"]) else {}

    def use(way: str) -> None:
        nonlocal handle
        restore(layers, handle)
        handle = None
        run.update(model=model, x=x, opt=opt)
        if way in dtensor:
            run.update({k: dtensor[way][k] for k in ("model", "x", "opt")})
            if way in ("ficco-styles", "dtensor-compiled+ficco"):  # ficco's ops decide with the selector
                torch_ops.configure(selector=champion, hardware=hardware, schedule="", check_calls=False)
            if way == "ficco-styles":
                from ficco_select.runtime.dtensor import prepare_tables

                prepare_tables(dtensor[way]["parallel"])  # the tables of every layer, before any step
        elif way == "async-tp":
            for layer in layers:
                _async_tp(layer)
        elif way == "compute-only":
            for layer in layers:
                _compute_only(layer, P, rank)
        elif way == LEARNED:
            use_learned(champion, hardware, config)
            handle = install(model)
        elif way != "pytorch":
            selected = way in selectors
            torch_ops.configure(selector=selectors[way] if selected else champion, hardware=hardware,
                                schedule="" if selected else way, check_calls=way == "ficco-checked")
            handle = install(model)  # the tables of every layer, before any step

    learned = learn_run(model, step, champion, hardware, config) if config.get("learn_steps") else None
    ways = config["ways"]
    notes = {}
    ran = warm(ways, use, step, lambda way: compiling(way, group, notes) if way in dtensor
               else contextlib.nullcontext())
    not_run = {}
    if dtensor:
        torch._dynamo.config.error_on_recompile = True  # no compilation inside the timed steps
        if rank == 0:
            for way, note in notes.items():
                print(f"{way}: {note}", file=sys.stderr, flush=True)  # stdout: the --json
        not_run = {way: note for way, note in notes.items() if note.startswith("not on this backend")}
    times = timed([w for w in ways if w not in not_run], use, step, config)
    # a way that cannot run here: why, not a number
    return {"times": {w: not_run[w] if w in not_run else times[w] for w in ways}, "ficco_ran": ran,
            "learned": learned}


# -- the figures ---------------------------------------------------------------------------------
def summarize(P: int, config: dict, times: dict) -> dict:
    out = {"world_size": P, "seq": config["seq"], "hidden": config["hidden"], "reps": len(times["pytorch"]),
           "hardware": hardware_of(config)}
    if config["spec"]:
        out["link_bw_gbps"] = round(config["spec"]["link_bw_gbps"], 4)
    return out | speedups(times, FIXED + FICCO)


def retrain(telemetry: list[str], workdir: str) -> tuple[str, dict]:
    """``ficco train --telemetry`` on the exploration's files, in a private MLflow store, and
    ``ficco export`` of the version it registered; returns (the export folder, train's summary)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db"}
    ficco = [sys.executable, "-m", "ficco_select.cli.main"]  # the ficco command of this interpreter
    args = [f"--telemetry={f}" for f in telemetry]
    done = subprocess.run([*ficco, "train", *args, *RETRAIN, "--out", f"{workdir}/train", "--json", "--no-progress"],
                          env=env, check=True, capture_output=True, text=True)
    summary = json.loads(done.stdout)
    out = f"{workdir}/retrained"
    subprocess.run([*ficco, "export", "--model-uri", f"models:/ficco-selector/{summary['version']}", "--out", out],
                   env=env, check=True, capture_output=True, text=True)
    return out, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="2:512:512,2:1024:128,3:1536:192,4:1024:256,4:1024:128",
                    help=f"Comma-separated P:seq:hidden (heads of {HEAD_DIM}; ffn 3x hidden).")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2, help="Timed steps per way and repeat (their mean).")
    ap.add_argument("--explore-steps", type=int, default=36,
                    help="Steps of exploration behind the per-layer oracle and the retraining (at least 1).")
    ap.add_argument("--retrain", action="store_true",
                    help="Close the telemetry loop: ficco train --telemetry on the exploration, then time "
                         "the retrained selector beside the rest (minutes of training).")
    ap.add_argument("--model", default=None, help="An exported selector folder (default: the exported champion).")
    ap.add_argument("--workdir", default=None, help="Keep the telemetry, MLflow store and retrained export here.")
    ap.add_argument("--fabric", default=None, metavar="RATE",
                    help="Run every rank on a shaped fabric of this host (tc's rate, e.g. 1gbit; `ficco measure "
                         "--fabric`): the script re-runs itself inside one, profiles it, and the selector decides "
                         "for its machine, cpu-RATE.")
    ap.add_argument("--dtensor", action="store_true",
                    help="Also time the ways a DTensor user has (torchtitan's plan eager, compiled, compiled with "
                         "Inductor's micro-pipeline pass, in ficco's styles, compiled with ficco's pass).")
    ap.add_argument("--learn-steps", type=int, default=0,
                    help="Before the timing, run this many steps with the hook learning (configure(learn=True)) "
                         f"from an empty record, then time what it settled on as the way {LEARNED!r}.")
    ap.add_argument("--learn-plot", default=None, help="Write the learning runs' step times here (PNG).")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="Write a bar chart of the speedups here (PNG).")
    args = ap.parse_args()
    spec = _fabric_spec(args.fabric) if args.fabric else None
    if args.explore_steps < 1:
        ap.error("--explore-steps must be at least 1 (the per-layer oracle comes from the exploration)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    configs = []
    for item in args.configs.split(","):
        P, seq, hidden = (int(v) for v in item.split(":"))
        heads = hidden // HEAD_DIM
        if hidden % HEAD_DIM or heads % P or seq % P:
            ap.error(f"--configs {item}: hidden must be a multiple of {HEAD_DIM} with hidden/{HEAD_DIM} heads "
                     "divisible by P, and seq divisible by P")
        configs.append((P, {"seq": seq, "hidden": hidden, "heads": heads, "batch": args.batch, "model": args.model,
                            "spec": spec}))
    from ficco_select.hardware import machines, spec_from_dict

    # The fabric's machine, as its profile describes it: what the telemetry's rows name.
    with machines([spec_from_dict(spec, "the fabric's profile")] if spec else [], "the fabric's profile"):
        rows, summary = _explore_and_time(args, configs)
    if summary and not args.json:
        print(f"retrained: {summary['chosen']} version {summary['version']} on the exploration's telemetry")
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.plot:
        _plot(rows, args.plot)
    if args.learn_plot and args.learn_steps:
        plot_learning(rows, args.learn_plot, "training step (forward + backward + optimizer), gloo ranks")


def _explore_and_time(args, configs: list) -> tuple[list[dict], dict | None]:
    """Explore each config's layers, retrain on the telemetry if asked, and time every way
    (each row printed as it comes unless --json). Returns the rows and the retraining's
    summary (None without)."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        explorations = []
        for i, (P, config) in enumerate(configs):  # 1. explore
            config["telemetry"] = f"{workdir}/explore{i}.{{rank}}.jsonl"
            run_ranks(P, {**config, "phase": "explore", "explore_steps": args.explore_steps}, rank_phase)
            explorations.append([config["telemetry"].format(rank=r) for r in range(P)])
        retrained, summary = retrain([f for files in explorations for f in files], workdir) if args.retrain else (None, None)
        ways = ["pytorch", "async-tp", "ficco", "ficco-checked", *(["ficco+telemetry"] if retrained else []),
                *([LEARNED] if args.learn_steps else []), *FIXED, *FICCO,
                "oracle", *(DTENSOR if args.dtensor else ()), "compute-only"]
        rows = []
        for files, (P, config) in zip(explorations, configs):  # 3. time
            best, shapes = explored(files)
            got = run_ranks(P, {**config, "phase": "time", "ways": ways, "reps": args.reps, "steps": args.steps,
                                "oracle": best, "retrained": retrained, "learn_steps": args.learn_steps,
                                "learn_dir": f"{workdir}/learned{len(rows)}"}, rank_phase)
            rows.append(summarize(P, config, got["times"]) | {"ficco_ran": got["ficco_ran"], "oracle_picks": best})
            if got["learned"]:
                rows[-1]["learning"] = learning_figures(got["learned"], rows[-1])
                rows[-1]["label"] = f"{rows[-1]['hardware']} P={P} seq={config['seq']} hidden={config['hidden']}"
            if retrained:
                rows[-1]["retrained_picks"] = _decisions(retrained, shapes)
            if not args.json:
                _print_row(rows[-1])
    return rows, summary


def _fabric_spec(rate: str) -> dict:
    """Outside the fabric: become this same command inside it (never returns). Inside: the
    fabric's spec from a quick profile (``ficco_select.data.measure.fabric_profile``), as a dict for the ranks."""
    from ficco_select.data.measure.fabric import exec_inside, inside, parse_fabric
    from ficco_select.data.measure.fabric_profile import fabric_spec, profile_fabric
    from ficco_select.hardware import spec_as_dict

    fabric = parse_fabric(rate)
    if inside() != fabric:
        exec_inside(fabric, [sys.executable, *sys.argv])
    return spec_as_dict(fabric_spec(fabric, profile_fabric(fabric)))


def _decisions(folder: str, shapes: dict) -> dict:
    """The retrained selector's decision (schedule and source) for each explored shape."""
    from ficco_select.runtime.selector import Selector

    sel = Selector.load(folder)
    return {sid: f"{(d := sel.select(s)).schedule.name} ({d.source})" for sid, s in shapes.items()}


def _print_row(r: dict) -> None:
    print(f"{r['hardware']} P={r['world_size']} seq={r['seq']} hidden={r['hidden']} (comm/compute {r['comm_per_compute']:.2f}): "
          + ", ".join(f"{w} {v['not_run']}" if "not_run" in v else
                      f"{w} {v['step_ms']:.0f} ms x{v['speedup']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]"
                      for w, v in r["ways"].items()) + f"; best fixed {r['best_fixed']}; gap captured "
          f"{r['gap_captured']}", flush=True)
    if "learning" in r:
        print(learning_line(r["learning"]), flush=True)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = [w for w in rows[0]["ways"] if w not in ("pytorch", "compute-only")
            and all("speedup" in r["ways"][w] for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(ways)
    for i, way in enumerate(ways):
        xs = [j + i * width for j in range(len(rows))]
        mid = [r["ways"][way]["speedup"] for r in rows]
        err = [[m - r["ways"][way]["ci"][0] for m, r in zip(mid, rows)],
               [r["ways"][way]["ci"][1] - m for m, r in zip(mid, rows)]]
        ax.bar(xs, mid, width, yerr=err, capsize=2, label=way, color=plt.cm.tab20(i % 20))  # a color per way
    ax.axhline(1.0, color="black", linewidth=0.8)
    low = min(r["ways"][w]["ci"][0] for r in rows for w in ways)
    ax.set_ylim(min(0.9, low - 0.05), None)  # ratios around 1: the differences, not the bars' length
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"P={r['world_size']} seq {r['seq']}\nhidden {r['hidden']}\ncomm/compute {r['comm_per_compute']:.2f}"
                   for r in rows])
    ax.set_ylabel("step speedup over unhooked PyTorch\n(median, 95% CI)")
    ax.legend(fontsize=7, ncol=min(len(ways), 6), loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend below the axes, whole


if __name__ == "__main__":
    main()
