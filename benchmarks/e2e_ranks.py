"""What the end-to-end benchmarks (``e2e_tp.py``, ``e2e_infer.py``) share: one rank's entry
point, the step timed as its slowest rank, the exploration and the per-layer oracle it
gives, the interleaved timing of the ways, and the figures.

A benchmark writes its phase as ``phase(rank, P, config) -> dict | None`` (a module-level
function, so that the ranks' processes can import it) and runs it with ``run_ranks``; the
phase builds its model and a ``use(way)`` that switches the model to a way, then calls
``warm`` and ``timed``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ficco_select.executor import ranks


# -- one rank ----------------------------------------------------------------------------------
def rank_main(rank: int, P: int, config: dict, phase: Callable) -> dict | None:
    """One rank of `config`'s `phase` (its gloo group made by the launcher); rank 0's figures.
    On a shaped fabric the rank knows the fabric's machine as its profile describes it."""
    from ficco_select.hardware import machines, spec_from_dict

    known = [spec_from_dict(config["spec"], "the fabric's profile")] if config["spec"] else []
    with machines(known, "the fabric's profile"):
        return phase(rank, P, config)


def run_ranks(P: int, config: dict, phase: Callable) -> dict | None:
    """`config`'s `phase` on P fresh gloo ranks (``ficco_select.executor.ranks``), each on its
    share of the cores; rank 0's result."""
    return ranks.run_ranks(rank_main, P, (config, phase), threads=max(1, (os.cpu_count() or 2) // P),
                           timeout_s=3600)[0]


def hardware_of(config: dict) -> str:
    """The machine the ranks decide for: the shaped fabric's profiled spec, else ``cpu``."""
    return config["spec"]["name"] if config["spec"] else "cpu"


def slowest_rank_seconds(run: Callable[[], object]) -> float:
    """`run`'s time on the slowest rank: the ranks start together (a barrier) and take the max."""
    dist.barrier()
    t0 = time.perf_counter()
    run()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


# -- the ways ----------------------------------------------------------------------------------
def restore(layers, handle) -> None:
    """Every layer back to its class's forward: `handle`'s hook (if any) removed, any
    forward a way patched in dropped."""
    if handle is not None:
        handle.remove()
    for layer in layers:
        layer.__dict__.pop("forward", None)


def warm(ways: list[str], use: Callable[[str], None], step: Callable[[], float],
         warming: Callable[[str], contextlib.AbstractContextManager] = lambda way: contextlib.nullcontext()) -> dict:
    """Every way's first step, untimed (a compiled way compiles here, inside `warming(way)`);
    what the ``ficco`` way ran, by call shape (scenario id: schedule and source)."""
    from ficco_select.runtime import dispatch

    ran = {}
    for way in ways:
        use(way)
        with warming(way):
            step()
        if way == "ficco":
            ran = {plan.scenario.scenario_id: f"{plan.decision.schedule.name} ({plan.decision.source})"
                   for _, plan in dispatch.plans() if plan.scenario is not None}
    return ran


def timed(ways: list[str], use: Callable[[str], None], step: Callable[[], float], config: dict) -> dict:
    """``config["reps"]`` repeats, each running every way once in rotated order: after a switch
    a garbage collection and one untimed step, then ``config["steps"]`` timed steps, their mean.
    {way: the repeats' means}; ends unhooked (``pytorch``)."""
    times = {w: [] for w in ways}
    for r in range(config["reps"]):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            use(way)
            gc.collect()  # a switch's garbage (tables, plans) is not collected inside the next way's steps
            step()  # the way's first decisions, if any
            times[way].append(statistics.fmean(step() for _ in range(config["steps"])))
    use("pytorch")
    return times


# -- the exploration and the per-layer oracle ------------------------------------------------------
def explore(model, step, selector, hardware: str, config: dict) -> None:
    """``config["explore_steps"]`` steps of `model` hooked, every call shape cycling through its
    candidates with telemetry on (``config["telemetry"]``): the per-layer oracle's data."""
    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.tp import install

    torch_ops.configure(selector=selector, hardware=hardware, schedule="", explore_every=1,
                        telemetry=config["telemetry"])
    handle = install(model)
    for _ in range(config["explore_steps"]):
        step()
    torch_ops.configure(explore_every=0, telemetry="")
    handle.remove()


def explored(telemetry: list[str]) -> tuple[dict, dict]:
    """From `telemetry` (every rank's file of the exploration): {scenario_id: the schedule that
    measured fastest for it (verified runs only)} and {scenario_id: its Scenario}."""
    from ficco_select.data.telemetry import read_telemetry
    from ficco_select.scenario import Scenario

    rows = read_telemetry(telemetry)
    ok = rows[rows["status"].eq("ok") & rows["verified"].eq(True)]
    best = {sid: g.loc[g["time_s"].idxmin(), "schedule"] for sid, g in ok.groupby("scenario_id")}
    shapes = {r["scenario_id"]: Scenario.from_record(r) for r in rows.drop_duplicates("scenario_id").to_dict("records")}
    return best, shapes


def oracle_selector(best: dict):
    """A selector that answers each call shape (scenario) with its schedule in `best`, else the baseline."""
    from ficco_select.runtime.decision import Decision
    from ficco_select.runtime.selector import Selector
    from ficco_select.schedule import BASELINE, parse

    picks = {sid: parse(name) for sid, name in best.items()}

    class Oracle(Selector):
        def layer_table(self, scenario):  # per shape, never a table
            return None

        def select(self, scenario):
            pick = picks.get(scenario.scenario_id)
            if pick is None:
                return Decision(BASELINE, "fallback", 0.0, "not explored")
            return Decision(pick, "model", 1.0, "fastest in this job's exploration")

    return Oracle()


# -- the learning way ---------------------------------------------------------------------------------
LEARNED = "ficco-learned"
"""The way that runs what a learning job settled on, read from the machine's record (``learn_dir``)."""


def learn_run(model, step, selector, hardware: str, config: dict) -> dict:
    """``config["learn_steps"]`` steps of `model` hooked with ``configure(learn=True)`` from an
    empty record in ``config["learn_dir"]``, each followed by the same step unhooked (the
    learning run's own clock: the machine drifts over a run, and a ratio to the step beside
    it does not); each step's time (the slowest rank's), the first step after which no call
    shape learns any more, and ``dispatch.report()``."""
    from ficco_select.runtime import dispatch, torch_ops
    from ficco_select.runtime.tp import install

    torch_ops.configure(selector=selector, hardware=hardware, schedule="", learn=True, learn_dir=config["learn_dir"],
                        check_calls=False)
    handle = install(model)
    times, unhooked, settled_at = [], [], None
    for n in range(config["learn_steps"]):
        times.append(step())
        handle.remove()
        unhooked.append(step())
        handle = install(model, tables=False)  # the tables are kept: nothing collective here
        learning = any(ctx.trials for ctx in dispatch.contexts())
        if learning:
            settled_at = None
        elif settled_at is None:
            settled_at = n + 1
    report = dispatch.report()
    handle.remove()
    torch_ops.configure(learn=False)
    return {"steps_s": times, "unhooked_s": unhooked, "settled_at": settled_at, "report": report}


def use_learned(selector, hardware: str, config: dict) -> None:
    """The ``LEARNED`` way: learning on, every shape's decision from the learning run's record."""
    from ficco_select.runtime import torch_ops

    torch_ops.configure(selector=selector, hardware=hardware, schedule="", learn=True, learn_dir=config["learn_dir"],
                        check_calls=False)  # a way never inherits the debug mode of the way before it


def learning_figures(learned: dict, row: dict) -> dict:
    """The learning run against the ways: its speedup over the unhooked steps beside its own
    (all its steps, exploration included; and from its 51st step), the step after which it
    settled, its total time against each way's over as many steps (the way's speedup over
    unhooked, from the interleaved timing, applied to the learning run's own unhooked
    steps), and the exploration's cost by the agreed times."""
    steps, unhooked = learned["steps_s"], learned["unhooked_s"]
    speedup = sum(unhooked) / sum(steps)
    late = sum(unhooked[50:]) / sum(steps[50:]) if len(steps) > 50 else None
    ways = row["ways"]
    against = {w: round(ways[w]["speedup"] / speedup, 4) for w in ways
               if "speedup" in ways[w] and w not in ("pytorch", "compute-only", "ficco-checked", "async-tp")}
    return {"learn_steps": len(steps), "settled_at": learned["settled_at"], "total_s": round(sum(steps), 4),
            "speedup": round(speedup, 4), "speedup_after_50": None if late is None else round(late, 4),
            "total_vs": against, "exploration_cost_s": round(sum(s["cost_s"] for s in learned["report"]), 4),
            "shapes": len(learned["report"]),
            "settled": {s["scenario_id"]: s["settled"] for s in learned["report"]},
            "contenders": {s["scenario_id"]: s["contenders"] for s in learned["report"]},
            "step_speedups": [round(u / t, 4) for u, t in zip(unhooked, steps)]}


def learning_line(f: dict) -> str:
    """The learning run's figures in one line."""
    vs = ", ".join(f"{w} {r:.3f}" for w, r in f["total_vs"].items())
    return (f"  learning: {f['shapes']} shapes settled at step {f['settled_at']} of {f['learn_steps']}; x{f['speedup']:.3f} "
            f"over its unhooked steps (x{f['speedup_after_50']} from step 51); total time over that of as many steps "
            f"of {vs}; exploration cost {f['exploration_cost_s']:.3f} s")


WAY_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
"""The ways' lines on the learning plot (red is the learning run's)."""


def plot_learning(rows: list[dict], path: str, title: str) -> None:
    """Each configuration's learning run, step by step (its speedup over the unhooked step run
    beside it), against the speedups of the ways timed after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    across = min(3, len(rows))
    down = math.ceil(len(rows) / across)
    fig, axes = plt.subplots(down, across, figsize=(4.2 * across, 3.3 * down), squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows):
        learned = row["learning"]
        ratios = learned["step_speedups"]
        smooth = [statistics.median(ratios[max(0, i - 4):i + 1]) for i in range(len(ratios))]
        ax.plot(range(1, len(ratios) + 1), ratios, lw=0.5, color="tab:red", alpha=0.35)
        ax.plot(range(1, len(ratios) + 1), smooth, lw=1.2, color="tab:red", label="ficco learning (median of 5)")
        for i, way in enumerate(w for w in ("ficco", row["best_fixed"], "oracle", LEARNED) if w in row["ways"]):
            ax.axhline(row["ways"][way]["speedup"], lw=1, ls="--", color=WAY_COLORS[i],
                       label=f"best fixed: {way}" if way == row["best_fixed"] else
                       "what it settled on, in the next job" if way == LEARNED else way)
        ax.axhline(1.0, color="black", lw=0.6)
        if learned["settled_at"]:
            ax.axvline(learned["settled_at"], color="gray", lw=0.8, ls=":", label="settled")
        ax.set_xlabel("step")
        ax.set_title(row["label"], fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("speedup over the unhooked step\n(the ways: interleaved timing's median)", fontsize=8)
    axes.flat[len(rows) - 1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the figures ---------------------------------------------------------------------------------
def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of `values` and a distribution-free confidence interval for it: order
    statistics (k, n + 1 - k), k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2."""
    v, n = sorted(values), len(values)
    below, k = 0.0, 0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= (1 - level) / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)  # too few values for the level: the whole range
    return statistics.median(v), v[k - 1], v[n - k]


def speedups(times: dict, fixed: tuple[str, ...]) -> dict:
    """Each way's median step (ms) and its speedup over ``pytorch`` (the median of the
    per-repeat ratios, with its 95% CI); a way given as text instead of times could not run
    here (``not_run``: why). With comm / compute, the best of the `fixed` rules, and the gap
    ficco captured between that rule and the oracle."""
    base = times["pytorch"]
    out = {"ways": {}}
    for way, ts in times.items():
        if isinstance(ts, str):
            out["ways"][way] = {"not_run": ts}
            continue
        mid, lo, hi = median_ci([b / t for b, t in zip(base, ts)])  # over the same repeat's unhooked step
        out["ways"][way] = {"step_ms": round(1e3 * statistics.median(ts), 3), "speedup": round(mid, 3),
                            "ci": [round(lo, 3), round(hi, 3)]}
    compute = statistics.median(times["compute-only"])
    out["comm_per_compute"] = round((statistics.median(base) - compute) / compute, 3)
    out["best_fixed"] = max((w for w in times if w in fixed), key=lambda w: out["ways"][w]["speedup"])
    out["gap_captured"] = gap_captured(out)
    return out


def gap_captured(row: dict) -> float | None:
    """The share of the gap between the best fixed rule and the per-layer oracle that ficco
    hooked captures (medians; None where the oracle is not above that rule)."""
    best, ficco, oracle = (row["ways"][w]["speedup"] for w in (row["best_fixed"], "ficco", "oracle"))
    return round((ficco - best) / (oracle - best), 3) if oracle > best else None
