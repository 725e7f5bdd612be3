"""One command for a new GPU node: profile, spec, adapt, register, export, benchmark.

    ficco bring-up --out DIR [--budget 0.02] [--rounds 2] [--ranks loopback] [--base PRESET]
    ficco bring-up --out DIR --rehearse     # every step on this machine's CPU stand-ins (CI)

Steps, in order, each writing into DIR; a step whose result is there already is not run
again, so a killed bring-up resumes where it stopped:

1. ``profile``: GEMM, copies, contention and loopback on the GPU (``data.gpu_profile``)
   -> ``DIR/profile/profile.json``.
2. ``spec``: the profile over the base preset (``ficco hardware from-profile``) -> ``DIR/spec.yaml``.
3. ``adapt``: ``ficco adapt --backend cuda`` on that spec within the budget -> ``DIR/adapt/``.
4. ``register``: the pipeline on the default training data plus the measured rows; the
   champion moves by its usual rules -> ``DIR/adapt/pipeline/``.
5. ``export``: the champion (the new version if it was promoted) into the runtime's folder.
6. ``benchmark``: ``benchmarks/e2e_tp.py`` with that selector: a Llama-style block's training
   step, hooked vs unhooked vs the fixed schedules vs the per-layer oracle, on gloo ranks
   (the CPU: the benchmark has no GPU version) -> ``DIR/benchmark.json``.

The summary (every step's status, seconds and result) is ``DIR/bring_up.json``, rewritten
after each step. ``rehearse``: the same steps with the CPU as the device, tiny profile
shapes, the ``cpu`` preset as the base, the cuda path's CPU stand-in, the pipeline's debug
slice, an MLflow store of its own in DIR and the export into ``DIR/selector``: it checks
that the steps fit together, and its numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

STEPS = ("profile", "spec", "adapt", "register", "export", "benchmark")
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_tp.py"
REHEARSAL_BENCHMARK = ("--configs", "2:48:128", "--reps", "2", "--steps", "1", "--explore-steps", "6")
NODE_BENCHMARK = ("--configs", "2:1536:768", "--reps", "8")


def bring_up(out_dir: str | Path, *, base: str | None = None, budget: float = 0.02, rounds: int = 2,
             ranks: str = "loopback", export_to: str | Path | None = None, profile_s: float = 300.0,
             rehearse: bool = False, on_step: Callable[[dict], None] | None = None) -> dict:
    """Run the steps (the module's docstring) into `out_dir`; the summary. ValueError, in one
    line and before any work, where the node cannot run them (no CUDA without `rehearse`)."""
    import torch

    out = Path(out_dir)
    if not rehearse and not torch.cuda.is_available():
        raise ValueError(f"bring-up needs the node's GPU: CUDA is not available here (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda or 'none'}); --rehearse runs the steps on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    if rehearse:  # the rehearsal's models never reach the user's registry
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    if export_to is None:
        from ficco_select.runtime.selector import DEFAULT_PATH

        export_to = out / "selector" if rehearse else DEFAULT_PATH
    summary_path = out / "bring_up.json"
    summary = {"out": str(out), "rehearsal": rehearse, "steps": []}
    context = {"out": out, "base": base, "budget": budget, "rounds": rounds, "ranks": ranks, "export_to": export_to,
               "profile_s": profile_s, "rehearse": rehearse}
    for name in STEPS:
        started = time.monotonic()
        result = _STEP[name](context)
        record = {"step": name, "seconds": round(time.monotonic() - started, 1), **result}
        summary["steps"].append(record)
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
        if on_step is not None:
            on_step(record)
        if record["status"] == "failed":
            break
    summary["ok"] = len(summary["steps"]) == len(STEPS) and all(s["status"] in ("done", "kept")
                                                                for s in summary["steps"])
    summary_path.write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _profile(c: dict) -> dict:
    from data.gpu_profile.run import profile
    from ficco_select.hardware import load_hardware, preset_for_device

    path = c["out"] / "profile" / "profile.json"
    if path.exists():
        return {"status": "kept", "output": str(path)}
    if c["rehearse"]:
        preset_name, device = "cpu", "cpu"
    else:
        import torch

        preset_name, device = c["base"] or preset_for_device(torch.cuda.get_device_name(0)), "cuda"
    run, returned = profile(path.parent, budget_s=c["profile_s"], preset=load_hardware(preset_name) if preset_name
                            else None, preset_name=preset_name, device=device, tiny=c["rehearse"])
    c["base"] = c["base"] or preset_name
    sections = run.state["sections"]
    failed = [name for name, s in sections.items() if s["status"] not in ("ok", "skipped")]
    return {"status": "done", "output": str(path), "complete": run.state["complete"] and returned,
            "sections_not_ok": failed}


def _spec(c: dict) -> dict:
    from data.gpu_profile.read import ProfileError, write_profiled_spec
    from ficco_select.hardware import HardwareError

    path = c["out"] / "spec.yaml"
    if path.exists():
        return {"status": "kept", "output": str(path)}
    try:
        report, _, base = write_profiled_spec(c["out"] / "profile" / "profile.json", base=c["base"], out=path,
                                              name=None)
    except (ProfileError, HardwareError) as e:
        return {"status": "failed", "error": str(e)}
    return {"status": "done", "output": str(path), "name": report["name"], "base": base,
            "overrides": sorted(report["overrides"])}


def _adapt(c: dict) -> dict:
    from train.adapt import run_adapt

    folder = c["out"] / "adapt"
    if (folder / "summary.json").exists():
        return {"status": "kept", "output": str(folder)}
    try:
        summary = run_adapt(hardware=str(c["out"] / "spec.yaml"), backend="cuda", budget=c["budget"],
                            rounds=c["rounds"], out_dir=folder, ranks=c["ranks"],
                            device="cpu" if c["rehearse"] else None, track=True)
    except ValueError as e:
        return {"status": "failed", "error": str(e)}
    return {"status": "done", "output": str(folder), "measured": summary["rounds"][-1]["measured"],
            "adapted_spec": summary["spec"]}


def _register(c: dict) -> dict:
    from train.adapt import register_adapted

    done_file = c["out"] / "adapt" / "registered.json"
    if done_file.exists():
        return {"status": "kept", **json.loads(done_file.read_text())}
    try:
        registered = register_adapted(c["out"] / "adapt", export_to=None, debug=c["rehearse"], progress=False)
    except ValueError as e:
        return {"status": "failed", "error": str(e)}
    done_file.write_text(json.dumps(registered, default=str))
    return {"status": "done", **registered}


def _export(c: dict) -> dict:
    from train.export import export
    from train.run import ALIAS, REGISTERED_MODEL

    registered = json.loads((c["out"] / "adapt" / "registered.json").read_text())
    # The new version if it became the champion, else the champion; a rehearsal's own
    # registry holds only its debug version: that one.
    uri = (f"models:/{REGISTERED_MODEL}/{registered['version']}" if registered.get("promoted") or c["rehearse"]
           else f"models:/{REGISTERED_MODEL}@{ALIAS}")
    try:
        path = export(c["export_to"], uri)
    except Exception as e:  # noqa: BLE001 - MLflow raises its own kinds: the step says which model failed
        return {"status": "failed", "error": f"{uri}: {e}"}
    return {"status": "done", "output": str(path), "model": uri}


def _benchmark(c: dict) -> dict:
    path = c["out"] / "benchmark.json"
    if path.exists():
        return {"status": "kept", "output": str(path)}
    if not BENCHMARK.exists():
        return {"status": "skipped", "reason": f"{BENCHMARK} is not here (an installed package has no benchmarks/)"}
    args = REHEARSAL_BENCHMARK if c["rehearse"] else NODE_BENCHMARK
    res = subprocess.run([sys.executable, str(BENCHMARK), "--model", str(c["export_to"]), *args, "--json"],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        return {"status": "failed", "error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else
                f"exit {res.returncode}"}
    result = json.loads(res.stdout)
    path.write_text(json.dumps(result, indent=1))
    ways = result[0]["ways"]
    return {"status": "done", "output": str(path), "hooked_speedup": ways["ficco"]["speedup"],
            "best_fixed": result[0]["best_fixed"], "best_fixed_speedup": ways[result[0]["best_fixed"]]["speedup"],
            "oracle_speedup": ways["oracle"]["speedup"] if "oracle" in ways else None}


_STEP = {"profile": _profile, "spec": _spec, "adapt": _adapt, "register": _register, "export": _export,
         "benchmark": _benchmark}
