"""One command for a new GPU node: profile, spec, adapt, register, export, benchmark.

    ficco bring-up --out DIR [--budget 0.02] [--rounds 2] [--ranks loopback] [--base PRESET]
    ficco bring-up --out DIR --rehearse     # every step on this machine's CPU stand-ins (CI)

Steps, in order, each writing into DIR; a step whose finished result is there already is
not run again (``kept``), so a killed bring-up resumes where it stopped:

1. ``profile``: GEMM, copies, contention and loopback on the GPU (``ficco_select.data.gpu_profile``)
   -> ``DIR/profile/profile.json``; finished when every section in it ended (a profile
   killed mid-section is profiled again).
2. ``spec``: the profile over the base preset (``ficco hardware from-profile``) -> ``DIR/spec.yaml``.
3. ``adapt``: ``ficco adapt --backend cuda`` on that spec within the budget -> ``DIR/adapt/``.
4. ``register``: the pipeline on the default training data plus the measured rows; the
   champion moves by its usual rules -> ``DIR/adapt/pipeline/``, the version in
   ``DIR/adapt/registered.json``. Bring-up opens the pipeline's MLflow run itself and
   records its id first (``DIR/adapt/training_run.json``): a bring-up killed after MLflow
   registered the model, before registered.json, finds that version again by its run.
5. ``export``: the champion (the new version if it was promoted) into the runtime's folder;
   finished when that folder holds the model of that version's training run.
6. ``benchmark``: ``benchmarks/e2e_tp.py`` with that selector: a Llama-style block's training
   step, hooked vs unhooked vs the fixed schedules vs the per-layer oracle, on gloo ranks
   (the CPU: the benchmark has no GPU version) -> ``DIR/benchmark.json``.

The summary (every step's status, seconds and result) is ``DIR/bring_up.json``, rewritten
atomically as each step starts (``running``, ``ok`` false) and ends; a kept step keeps the
figures its summary had. One bring-up per DIR at a time (``ficco_select.data.locks``: a second refuses,
naming the first). Refused in one line before any work: a DIR holding files bring-up does
not write, a registered.json that is not what bring-up writes (the field named), and a step
to redo while a later step's result, made from its old one, is there. A full disk ends the
command in one line naming the step (``No space left on device``); the steps finished stay.

``rehearse``: the same steps with the CPU as the device, tiny profile shapes, the ``cpu``
preset as the base, the cuda path's CPU stand-in, the pipeline's debug slice (adapt's
training data too), an MLflow store of its own in DIR and the export into ``DIR/selector``:
it checks that the steps fit together, and its numbers mean nothing.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ficco_select.data.locks import output_lock, write_json_atomic

STEPS = ("profile", "spec", "adapt", "register", "export", "benchmark")
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_tp.py"
REHEARSAL_BENCHMARK = ("--configs", "2:48:128", "--reps", "2", "--steps", "1", "--explore-steps", "6")
NODE_BENCHMARK = ("--configs", "2:1536:768", "--reps", "8")

OWN_FILES = ("profile", "spec.yaml", "adapt", "mlflow.db", "selector", "benchmark.json", "bring_up.json")
"""What bring-up writes in DIR (besides hidden files: locks, export versions); a DIR holding
anything else is not a bring-up to resume."""
ENDED = ("ok", "skipped", "error", "timeout")
"""A profile section's statuses once it is over (``pending``, ``running``, ``interrupted``:
the profile was cut short)."""
LEFT_BY = {"spec": ("spec.yaml",), "adapt": ("adapt",), "register": ("adapt/registered.json",),
           "benchmark": ("benchmark.json",)}
"""The results of a step that the earlier steps' outputs went into."""
REGISTERED = "registered.json"
TRAINING_RUN = "training_run.json"


def bring_up(out_dir: str | Path, *, base: str | None = None, budget: float = 0.02, rounds: int = 2,
             ranks: str = "loopback", export_to: str | Path | None = None, profile_s: float = 300.0,
             rehearse: bool = False, on_step: Callable[[dict], None] | None = None) -> dict:
    """Run the steps (the module's docstring) into `out_dir`; the summary. ValueError, in one
    line and before any work, where the node cannot run them (no CUDA without `rehearse`),
    an option is out of range, or `out_dir` is not one to resume; ValueError naming the step
    when the disk is full."""
    import torch

    out = Path(out_dir)
    if not rehearse and not torch.cuda.is_available():
        raise ValueError(f"bring-up needs the node's GPU: CUDA is not available here (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda or 'none'}); --rehearse runs the steps on the CPU")
    if not 0 < budget <= 1 or rounds < 1 or not profile_s > 0:
        raise ValueError(f"--budget must be in (0, 1], --rounds at least 1 and --profile-s positive, "
                         f"got {budget}, {rounds} and {profile_s}")
    step = None
    try:
        with output_lock(out, "ficco bring-up"):  # a second bring-up into DIR refuses, naming this one
            _check_folder(out)
            out.mkdir(parents=True, exist_ok=True)
            if rehearse:  # the rehearsal's models never reach the user's registry
                os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{(out / 'mlflow.db').resolve()}"
            if export_to is None:
                from ficco_select.runtime.selector import DEFAULT_PATH

                export_to = out / "selector" if rehearse else DEFAULT_PATH
            context = {"out": out, "base": base, "budget": budget, "rounds": rounds, "ranks": ranks,
                       "export_to": Path(export_to), "profile_s": profile_s, "rehearse": rehearse}
            _check_order(context)
            summary_path = out / "bring_up.json"
            previous = _previous_records(summary_path)
            summary: dict[str, Any] = {"out": str(out), "rehearsal": rehearse, "ok": False, "steps": []}
            for step in STEPS:
                record = {"step": step, "status": "running", "since": time.strftime("%Y-%m-%d %H:%M:%S")}
                summary["steps"].append(record)
                write_json_atomic(summary_path, summary)
                started = time.monotonic()
                try:
                    result = _kept_or_run(step, context, previous.get(step))
                except Exception as e:  # the summary says which step stopped, then the error goes on
                    record.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0])
                    _try_write_json(summary_path, summary)
                    raise
                record.clear()
                record.update({"step": step, "seconds": round(time.monotonic() - started, 1), **result})
                write_json_atomic(summary_path, summary)
                if on_step is not None:
                    on_step(record)
                if record["status"] == "failed":
                    break
            summary["ok"] = len(summary["steps"]) == len(STEPS) and all(s["status"] in ("done", "kept")
                                                                        for s in summary["steps"])
            write_json_atomic(summary_path, summary)
            return summary
    except Exception as e:
        if not _disk_full(e):
            raise
        raise ValueError(f"{out}: No space left on device" + (f" (step {step})" if step else "")
                         + "; free some and run it again: the finished steps are kept") from None


# -- what is there already -----------------------------------------------------------------
def _check_folder(out: Path) -> None:
    """Refuse a DIR that bring-up did not write, and a registered.json it did not write as is."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder; choose another --out")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if not _own(p.name))
        if foreign:
            raise ValueError(f"--out {out}: holds {', '.join(foreign[:5])}, which bring-up does not write: not a "
                             "bring-up to resume; choose another --out (nothing was changed)")
    if (out / "adapt" / REGISTERED).exists():
        _read_registered(out / "adapt" / REGISTERED)


def _own(name: str) -> bool:
    return name.startswith(".") or name.removesuffix(".tmp") in OWN_FILES or name.startswith("mlflow.db-")


def _check_order(c: dict) -> None:
    """A step to run again while a later step's result is there: that result was made from
    the step's old output, and keeping it would mix two bring-ups; refuse, naming both."""
    first = next((name for name in STEPS[:4] if _FINISHED[name](c) is None), None)
    if first is None:
        return
    later = [c["out"] / path for name in STEPS[STEPS.index(first) + 1:] for path in LEFT_BY.get(name, ())]
    there = [str(p) for p in later if p.exists()]
    if there:
        raise ValueError(f"{c['out']}: step {first} has no finished result, but later steps' results made from its "
                         f"old one are there ({', '.join(there)}): move them away to redo from {first}, or choose "
                         "another --out (nothing was changed)")


def _previous_records(path: Path) -> dict[str, dict]:
    """The finished steps of the summary an earlier bring-up left (none if it cannot be read:
    it is rewritten)."""
    try:
        summary = json.loads(path.read_text())
        return {r["step"]: r for r in summary["steps"] if r.get("status") in ("done", "kept")}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _kept_or_run(step: str, c: dict, previous: dict | None) -> dict:
    kept = _FINISHED[step](c)
    if kept is None:
        return _RUN[step](c)
    carried = {k: v for k, v in (previous or {}).items() if k not in ("step", "seconds", "status", "since")}
    return {"status": "kept", **carried, **kept}


def _read_registered(path: Path) -> dict:
    """registered.json as the register step wrote it; ValueError naming the field otherwise."""
    hint = "it records the register step: restore it, or delete it and a rerun finds the version in the registry"
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); {hint}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: must be a JSON object (version, promoted, run_id, report); {hint}")
    for field, kind, what in (("version", str, "the version number as a string"), ("promoted", bool, "true or false"),
                              ("run_id", str, "the MLflow run id")):
        value = doc.get(field)
        if not isinstance(value, kind) or (kind is str and not value.strip()) or \
                (field == "version" and not value.isdigit()):
            raise ValueError(f"{path}: field '{field}' must be {what}, got {value!r}; {hint}")
    if doc.get("report") is not None and not isinstance(doc["report"], str):
        raise ValueError(f"{path}: field 'report' must be a path or null, got {doc['report']!r}; {hint}")
    return doc


# -- each step: its finished result if there (the record's fields), else None ---------------
def _profile_finished(c: dict) -> dict | None:
    from ficco_select.data.gpu_profile.read import ProfileError, read_profile

    path = c["out"] / "profile" / "profile.json"
    if not path.exists():
        return None
    try:
        data = read_profile(path).data
    except ProfileError:
        return None
    sections = data.get("sections") or {}
    if not sections or not all(isinstance(s, dict) and s.get("status") in ENDED for s in sections.values()):
        return None
    return {"output": str(path), "complete": data.get("complete") is True,
            "sections_not_ok": [name for name, s in sections.items() if s["status"] not in ("ok", "skipped")]}


def _spec_finished(c: dict) -> dict | None:
    from ficco_select.hardware import HardwareError, load_hardware

    path = c["out"] / "spec.yaml"
    if not path.exists():
        return None
    try:
        return {"output": str(path), "name": load_hardware(path).name}
    except HardwareError:
        return None


def _adapt_finished(c: dict) -> dict | None:
    folder = c["out"] / "adapt"
    try:
        summary = json.loads((folder / "summary.json").read_text())
        return {"output": str(folder), "measured": summary["rounds"][-1]["measured"], "adapted_spec": summary["spec"]}
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return None  # not there, or cut short: adapt resumes from its state


def _register_finished(c: dict) -> dict | None:
    path = c["out"] / "adapt" / REGISTERED
    if path.exists():
        return _read_registered(path)
    return _found_in_registry(c)


def _found_in_registry(c: dict) -> dict | None:
    """The version registered by this bring-up's training run (``TRAINING_RUN``), if MLflow
    has one: the bring-up was killed before it wrote registered.json, which it writes now."""
    record = c["out"] / "adapt" / TRAINING_RUN
    try:
        run_id = json.loads(record.read_text())["run_id"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    import mlflow
    from ficco_select.train.run import ALIAS, REGISTERED_MODEL

    client = mlflow.MlflowClient()
    found = [v for v in client.search_model_versions(f"run_id = '{run_id}'") if v.name == REGISTERED_MODEL]
    if not found:
        return None
    version = client.get_model_version(REGISTERED_MODEL, found[0].version)
    tags = client.get_run(run_id).data.tags  # "promoted": the run's own decision, once it reached it
    report = c["out"] / "adapt" / "pipeline" / "report.html"
    registered = {"version": str(version.version),
                  "promoted": tags["promoted"] == "True" if "promoted" in tags else ALIAS in version.aliases,
                  "run_id": run_id, "report": str(report) if report.exists() else None}
    write_json_atomic(c["out"] / "adapt" / REGISTERED, registered)
    return registered


def _export_finished(c: dict) -> dict | None:
    path = c["out"] / "adapt" / REGISTERED
    if not path.exists():
        return None
    uri, run_id = _export_source(c, _read_registered(path))
    try:
        exported = json.loads((c["export_to"] / "selector.json").read_text())
    except (OSError, ValueError):
        return None
    if run_id is None or not isinstance(exported, dict) or exported.get("mlflow_run_id") != run_id:
        return None
    return {"output": str(c["export_to"]), "model": uri}


def _export_source(c: dict, registered: dict) -> tuple[str, str | None]:
    """The model the export step copies (its URI) and its training run (None: no champion)."""
    from ficco_select.train.run import ALIAS, REGISTERED_MODEL

    # The new version if it became the champion, else the champion; a rehearsal's own
    # registry holds only its debug version: that one.
    if registered["promoted"] or c["rehearse"]:
        return f"models:/{REGISTERED_MODEL}/{registered['version']}", registered["run_id"]
    import mlflow

    try:
        return f"models:/{REGISTERED_MODEL}@{ALIAS}", mlflow.MlflowClient().get_model_version_by_alias(
            REGISTERED_MODEL, ALIAS).run_id
    except Exception:  # noqa: BLE001 - no champion (MLflow raises its own kinds): the export says so
        return f"models:/{REGISTERED_MODEL}@{ALIAS}", None


def _benchmark_finished(c: dict) -> dict | None:
    path = c["out"] / "benchmark.json"
    try:
        return {"output": str(path), **_benchmark_figures(json.loads(path.read_text()))}
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return None


def _benchmark_figures(result: list) -> dict:
    ways = result[0]["ways"]
    return {"hooked_speedup": ways["ficco"]["speedup"], "best_fixed": result[0]["best_fixed"],
            "best_fixed_speedup": ways[result[0]["best_fixed"]]["speedup"],
            "oracle_speedup": ways["oracle"]["speedup"] if "oracle" in ways else None}


# -- each step run -------------------------------------------------------------------------
def _profile(c: dict) -> dict:
    from ficco_select.data.gpu_profile.run import profile
    from ficco_select.hardware import load_hardware, preset_for_device

    path = c["out"] / "profile" / "profile.json"
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
    from ficco_select.data.gpu_profile.read import ProfileError, write_profiled_spec
    from ficco_select.hardware import HardwareError

    path = c["out"] / "spec.yaml"
    try:
        report, _, base = write_profiled_spec(c["out"] / "profile" / "profile.json", base=c["base"], out=path,
                                              name=None)
    except (ProfileError, HardwareError) as e:
        return {"status": "failed", "error": str(e)}
    return {"status": "done", "output": str(path), "name": report["name"], "base": base,
            "overrides": sorted(report["overrides"])}


def _adapt(c: dict) -> dict:
    from ficco_select.train.adapt import run_adapt

    folder = c["out"] / "adapt"
    try:
        summary = run_adapt(hardware=str(c["out"] / "spec.yaml"), backend="cuda", budget=c["budget"],
                            rounds=c["rounds"], out_dir=folder, ranks=c["ranks"],
                            device="cpu" if c["rehearse"] else None, track=True, debug=c["rehearse"])
    except ValueError as e:
        return {"status": "failed", "error": str(e)}
    return {"status": "done", "output": str(folder), "measured": summary["rounds"][-1]["measured"],
            "adapted_spec": summary["spec"]}


def _register(c: dict) -> dict:
    from ficco_select.train.adapt import register_adapted

    run_id = _open_training_run(c)
    os.environ["MLFLOW_RUN_ID"] = run_id  # the pipeline's mlflow.start_run() resumes (and unsets) it
    try:
        registered = register_adapted(c["out"] / "adapt", export_to=None, debug=c["rehearse"], progress=False)
    except ValueError as e:
        return {"status": "failed", "error": str(e)}
    finally:
        os.environ.pop("MLFLOW_RUN_ID", None)
    write_json_atomic(c["out"] / "adapt" / REGISTERED, registered)
    return {"status": "done", **registered}


def _open_training_run(c: dict) -> str:
    """A new MLflow run for the pipeline to train and register in, its id recorded in DIR
    before anything is registered; an earlier one that registered nothing (killed) is
    marked so."""
    import mlflow
    from ficco_select.train.run import EXPERIMENT

    client = mlflow.MlflowClient()
    record = c["out"] / "adapt" / TRAINING_RUN
    try:
        earlier = client.get_run(json.loads(record.read_text())["run_id"])
        if earlier.info.status == "RUNNING":
            client.set_terminated(earlier.info.run_id, "KILLED")
    except Exception:  # noqa: BLE001 - none recorded, or not in this store (MLflow raises its own kinds)
        pass
    experiment = mlflow.set_experiment(EXPERIMENT)
    run = client.create_run(experiment.experiment_id, run_name="train-bring-up",
                            tags={"ficco.bring_up": str(c["out"].resolve())})
    write_json_atomic(record, {"run_id": run.info.run_id})
    return run.info.run_id


def _export(c: dict) -> dict:
    from ficco_select.train.export import export

    uri, _ = _export_source(c, _read_registered(c["out"] / "adapt" / REGISTERED))
    try:
        path = export(c["export_to"], uri)
    except Exception as e:  # noqa: BLE001 - MLflow raises its own kinds: the step says which model failed
        if _disk_full(e):
            raise
        return {"status": "failed", "error": f"{uri}: {e}"}
    return {"status": "done", "output": str(path), "model": uri}


def _benchmark(c: dict) -> dict:
    path = c["out"] / "benchmark.json"
    if not BENCHMARK.exists():
        return {"status": "skipped", "reason": f"{BENCHMARK} is not here (an installed package has no benchmarks/)"}
    args = REHEARSAL_BENCHMARK if c["rehearse"] else NODE_BENCHMARK
    res = subprocess.run([sys.executable, str(BENCHMARK), "--model", str(c["export_to"]), *args, "--json"],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        return {"status": "failed", "error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else
                f"exit {res.returncode}"}
    result = json.loads(res.stdout)
    write_json_atomic(path, result)
    return {"status": "done", "output": str(path), **_benchmark_figures(result)}


_FINISHED = {"profile": _profile_finished, "spec": _spec_finished, "adapt": _adapt_finished,
             "register": _register_finished, "export": _export_finished, "benchmark": _benchmark_finished}
_RUN = {"profile": _profile, "spec": _spec, "adapt": _adapt, "register": _register, "export": _export,
        "benchmark": _benchmark}


# -- files and faults ----------------------------------------------------------------------
def _try_write_json(path: Path, doc: Any) -> None:
    try:
        write_json_atomic(path, doc)
    except OSError:  # a full disk: the summary keeps saying the step is running
        pass


def _disk_full(e: BaseException | None) -> bool:
    """ENOSPC (or a quota) anywhere in the chain of `e`, also as SQLite says it ("database or
    disk is full", wrapped by SQLAlchemy and MLflow) or as text in another library's error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(e) for text in ("database or disk is full", "No space left on device")):
            return True
        e = e.__cause__ or e.__context__
    return False
