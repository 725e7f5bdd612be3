"""New hardware in a few measurements: ``ficco adapt``.

Start from a model trained without the machine and from its spec (a data sheet's numbers,
or a preset to start from); then, in rounds until the budget (a fraction of the machine's
grid of scenarios) is spent:

1. choose the scenarios to measure next (``choose``): the ``active`` rule takes those where
   the model is least sure (the smallest predicted gap between its two best schedules),
   scenarios where it disagrees with the simulator on the current spec first, spread over
   strata of operator, world size and size; ``random`` draws them (the reference);
2. measure them (rows in the schema of ``ficco measure``): ``sim`` simulates the machine's
   spec with noise, for experiments; ``cpu`` times them on this machine's gloo ranks with
   the harness (``cpu_machine``);
3. recalibrate the spec's primitive numbers from every row measured so far
   (``ficco_select.data.calibrate.recalibrate``), so the features of *every* scenario on the machine,
   measured or not, use what the machine showed; kept only where, cross-fitted over the
   measured scenarios, the adapted model picks better with it than with the start spec
   (``checked_spec``): the spec is how the model reads the machine;
4. refit the model on the training data plus the measured rows.

The state lives in the output folder and survives a kill: ``measured.parquet`` (every
measured row, written atomically after each round, carrying the adapted spec),
``rounds.json`` (what each round chose, the spec after it, its score) and ``pending.json``
(the scenarios of the round under way, written before it measures). A restarted run reads
them, redoes a killed round on the same scenarios (the cpu harness keeps what it finished
itself), never measures a scenario twice, and goes on from the last finished round.

Scored on the rest of the machine's grid (the scenarios not measured) against the truth,
beside the ceiling (what a perfect selector scores on the same labels): noise-free
simulated times on ``sim`` (ceiling 1); on ``cpu`` the committed full measurement, judged
on its repeat sweep where there is one (the repeat oracle).

The stages, one module each: ``machines`` (what a ``Machine`` is, the sim, cpu and cuda
ones, perturbed specs), ``rounds`` (choosing, measuring, refitting, predicting, scoring a
round), ``state`` (what the folder keeps between rounds and how a run resumes from it) and
``tracking`` (the summary, MLflow, registration). This module runs them: ``adapt`` (the
rounds on one machine) and ``run_adapt`` (``ficco adapt``); every name callers use is
importable from here.

``ficco_select.train.adapt_curve`` draws the learning curve over the GPU presets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from ficco_select.data.locks import output_lock, write_json_atomic
from ficco_select.hardware import HardwareSpec, load_hardware
from ficco_select.hardware import machines as knowing  # this package has a module named machines
from ficco_select.train.adapt.machines import (
    ADAPT_NOISE,
    PERTURBED,
    Machine,
    adapted_machine,
    check_cuda,
    check_start,
    cpu_machine,
    cuda_grid,
    cuda_machine,
    fabric_grid,
    load_target,
    perturbed,
    sim_machine,
)
from ficco_select.train.adapt.rounds import (
    STRATEGIES,
    active_priority,
    adapted_model,
    candidate_rows,
    check_plan,
    checked_spec,
    choose,
    finished_round,
    fit_model,
    measure_chosen,
    measured_ids,
    predictions,
    refit,
    strata,
    usable_base,
)
from ficco_select.train.adapt.state import (
    OPTIONS_FILE,
    Round,
    check_state,
    last_spec,
    pending,
    resume,
    save,
    spec_record,
    verify_state,
    write_pending,
)
from ficco_select.train.adapt.tracking import EXPERIMENT, register_adapted, run_summary, summary_curve, tracked
from ficco_select.train.selectors import with_features


__all__ = ["ADAPT_NOISE", "EXPERIMENT", "OPTIONS_FILE", "PERTURBED", "STRATEGIES", "Machine", "Round", "adapt",
           "adapted_model", "candidate_rows", "check_state", "choose", "cpu_machine", "cuda_grid", "cuda_machine",
           "fit_model", "perturbed", "predictions", "register_adapted", "run_adapt", "sim_machine", "strata",
           "summary_curve", "usable_base", "verify_state"]

def adapt(machine: Machine, base: pd.DataFrame, *, checkpoints: Sequence[float], strategy: str = "active",
          out_dir: str | Path | None = None, seed: int = 0, progress: Callable[[Round], None] | None = None,
          debug: bool = False) -> list[Round]:
    """Adapt to `machine` in rounds, one per fraction of its grid in `checkpoints`
    (ascending, cumulative; 0 scores the start alone). `base`: the training rows, with
    their features (``with_features``); the machine's own rows must not be in it.
    With `out_dir`, the state is kept there and a restarted call resumes (module docstring).
    `debug`: tiny models (``adapted_model``). Returns every round, in order, resumed ones included."""
    check_plan(strategy, checkpoints)
    out = Path(out_dir) if out_dir is not None else None
    with machine.known():  # its name means the spec the run believes, round by round
        start_spec = machine.spec
        measured, rounds = resume(out, machine.name)
        if rounds:  # the spec the last finished round adapted to (a run resumed with nothing left to do keeps it)
            machine.believe(last_spec(out, rounds))
        ids = [s.scenario_id for s in machine.grid]
        groups = strata(machine.grid)
        for target in checkpoints[len(rounds):]:
            done = measured_ids(measured)
            # The spec the last round chose (checked_spec fits models: not twice on the same rows).
            if rounds:
                spec = machine.spec
            else:
                spec = checked_spec(machine, start_spec, base, measured, debug=debug) if len(measured) else start_spec
            model, candidates = refit(machine, spec, base, measured, debug)
            k = round(target * len(ids)) - len(done)
            priority = active_priority(model, candidates, ids) if strategy == "active" and k > 0 else None
            chosen = pending(out, target, known=ids) or choose(ids, groups, k, measured=done, priority=priority,
                                                               seed=seed + len(rounds))
            chosen = [sid for sid in chosen if sid not in done]  # a killed round's measured ones stay measured
            write_pending(out, target, chosen)  # before measuring: a killed round is redone on the same ones
            if chosen:
                measured = measure_chosen(machine, chosen, measured)
                model, candidates = refit(machine, checked_spec(machine, start_spec, base, measured, debug=debug),
                                          base, measured, debug)
            rounds.append(finished_round(model, candidates, machine, measured, target, chosen))
            if out is not None:
                save(out, measured, rounds)
            if progress is not None:
                progress(rounds[-1])
        return rounds


def run_adapt(*, hardware: str, backend: str = "sim", start: str | None = None, budget: float = 0.1,
              rounds: int = 4, strategy: str = "active", perturb: float = 1.0, seed: int = 0,
              out_dir: str | Path = "out/adapt", track: bool = True, register: bool = False,
              export_to: str | Path | None = None, on_round: Callable[[Round], None] | None = None,
              ranks: str = "loopback", device: str | None = None, fabric: str | None = None,
              debug: bool = False) -> dict:
    """``ficco adapt``: adapt to `hardware` (a preset or a spec file) within `budget` (a
    fraction of its full-scale grid) in `rounds` equal steps, starting from `start`'s numbers
    (a preset or a spec file; default: the hardware's own) on the hardware's make-up
    (``started_from``: its devices, topology and copy engines) and a model trained on the
    default training data without the hardware's preset family. ``sim``: the measurements
    follow the hardware's spec, each number off by up to `perturb` (1: exactly), with noise.
    ``cpu``: this machine measured for real (``cpu_machine``); `perturb` > 1 puts the spec to
    start from off by up to that. ``cuda``: a GPU measured for real (``cuda_machine``; `ranks`
    loopback or node, as ``ficco measure``), likewise; `device` ``cpu`` is its stand-in
    (tests, on the ``cpu`` spec). `fabric` (``cpu`` only, this process inside it): a shaped
    fabric of this host (``fabric_machine``), starting from its profile, the model trained
    without it (the other fabrics stay in the training data).
    The adapted machine takes the hardware's name, or ``<name>-adapted`` where the training
    data already means another machine by it (``load_target``). Keeps its state in `out_dir`
    (resumable; ``options.json`` records the specs' numbers, so that a resume on another
    machine under the same name is refused), writes the adapted spec there (``spec.yaml``)
    and, with `track`, keeps the run and its learning curve in MLflow (``tracked``: FINISHED
    only once ``summary.json`` is written). With `register`, the measured rows then join the
    training data and the pipeline trains, registers and promotes by its usual rules
    (``register_adapted``), exporting a new champion to `export_to`. `debug`: the model learns
    from the pipeline's debug slice of the default training data (a few scenarios per
    machine), with tiny models, and registering runs the pipeline's debug: a rehearsal's,
    whose numbers mean nothing. Everything that can be refused is refused, in one line,
    before anything is measured. Returns the summary."""
    from ficco_select.data.calibrate import write_spec
    from ficco_select.data.measure.fabric import parse_fabric
    from ficco_select.train.pipeline import DEBUG_SCENARIOS_PER_MACHINE, debug_slice
    from ficco_select.train.training_data import SAMPLED_PER_PRESET, default_training_data, training_machines

    if backend not in ("sim", "cpu", "cuda"):
        raise ValueError(f"--backend {backend}: sim, cpu or cuda")
    if fabric is not None and start is not None:
        raise ValueError(f"--start {start}: a fabric starts from its own profile (kept in --out); leave --start out")
    if backend == "cuda" and device != "cpu":
        check_cuda(ranks)
    if not 0 < budget <= 1 or rounds < 1:
        raise ValueError(f"--budget must be in (0, 1] and --rounds at least 1, got {budget} and {rounds}")
    sampled = 1 if debug else SAMPLED_PER_PRESET
    training = training_machines(sampled_per_preset=sampled)
    spec, name = load_target(hardware, backend, device, fabric,
                             taken={(m if isinstance(m, HardwareSpec) else m[0]).name for m in training})
    start_spec = load_hardware(start) if start else spec  # its numbers; its name means nothing to this run
    if start:
        check_start(start_spec, start, spec, hardware)
    out = Path(out_dir)
    options = dict(hardware=spec.name, backend=backend, start=start_spec.name, budget=budget, rounds=rounds,
                   strategy=strategy, perturb=perturb, seed=seed)
    if backend == "cuda":  # the modes label differently: a folder holds one
        options.update(ranks=ranks, device=device or "cuda")
    if fabric is not None:  # another network: another machine
        options.update(fabric=fabric)
    if debug:  # another training slice: another start
        options.update(debug=True)
    options["specs"] = {"hardware": spec_record(spec, hardware), "start": spec_record(start_spec, start or hardware)}
    # A second run into the same folder refuses, naming this one. The job knows the training
    # data's machines and the spec file it was given (the measured machine by its name, which
    # the adapted machine takes where it is free: inside the rounds, the machine as the run
    # believes it, ``Machine.known``).
    with output_lock(out, "ficco adapt"), contextlib.ExitStack() as job:
        job.enter_context(knowing(training))
        job.enter_context(knowing([spec], hardware))
        verify_state(out, options)
        # Built before the folder records anything, and refused if the budget measures nothing
        # (a fabric's machine profiles the fabric into the folder: it is built once recorded).
        machine = None if fabric else adapted_machine(spec, start_spec, name, out, options)
        check_budget(budget, len(machine.grid) if machine else len(fabric_grid()))
        check_state(out, options)
        machine = machine or adapted_machine(spec, start_spec, name, out, options)
        params = {**{k: v for k, v in options.items() if k != "specs"}, "hardware": hardware,
                  "start": start or hardware}
        with tracked(machine.name, params, out, enabled=track) as run:
            def each_round(r: Round) -> None:
                if run is not None:
                    run.log_round(r)
                if on_round is not None:
                    on_round(r)

            with machine.known():
                # Without the machine's rows: a fabric's own committed sweeps (the host and the other
                # fabrics stay), else the hardware's preset family.
                rows = default_training_data(sampled_per_preset=sampled)
                if debug:
                    rows = debug_slice(rows, DEBUG_SCENARIOS_PER_MACHINE)
                base = with_features(usable_base(rows, parse_fabric(fabric).name if fabric else spec.name))
                checkpoints = [0.0] + [budget * (i + 1) / rounds for i in range(rounds)]
                done = adapt(machine, base, checkpoints=checkpoints, strategy=strategy, out_dir=out, seed=seed,
                             progress=each_round, debug=debug)
                made_by = " ".join(["ficco adapt --hardware", str(hardware), "--backend", backend,
                                    *(["--start", str(start)] if start else []),
                                    *(["--fabric", fabric] if fabric else [])])
                write_spec(machine.spec, out / "spec.yaml", f"{made_by}, {done[-1].measured} scenarios measured")
                summary = run_summary(machine, done, out, hardware=hardware, backend=backend, strategy=strategy)
            # Registering is the pipeline's job, not this one's: it knows the measured machine by
            # the adapted spec its rows carry, not by the spec file's numbers it started from
            # (another machine under the same name when --start gave the numbers).
            job.close()
            if register:
                summary["registered"] = register_adapted(out, export_to=export_to, debug=debug)
            if run is not None:
                summary["mlflow_run_id"] = run.run_id
                run.log_outputs(summary)
            write_json_atomic(out / "summary.json", summary)  # whole or absent: a reader takes it as done
            if run is not None:
                run.log_summary()
        return summary


def check_budget(budget: float, grid: int) -> None:
    """Refuse, before any work, a budget that measures no scenario of the machine's `grid`
    scenarios (nothing to adapt to, nothing to register)."""
    if round(budget * grid) < 1:
        raise ValueError(f"--budget {budget:g} measures no scenario of the machine's grid of {grid}: give at least "
                         f"{1 / grid:.2g} (one scenario)")
