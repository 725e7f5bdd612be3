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
   (``data.calibrate.recalibrate``), so the features of *every* scenario on the machine,
   measured or not, use what the machine showed;
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

``train.adapt_curve`` draws the learning curve over the GPU presets.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from data.calibrate import recalibrate
from data.dataset import read_dataset, write_parquet_atomic
from data.locks import output_lock
from data.machines import base_machine
from data.simulate import simulate, simulate_rows
from ficco_select.hardware import HardwareSpec, fields_of, register_hardware, spec_as_dict, spec_field, spec_from_dict
from ficco_select.scenario import Scenario
from train.metrics import ceiling_choices, score, usable_rows
from train.selectors import FEATURE_COLUMNS, XGBTimeRegressor, feature_pairs, with_features

log = logging.getLogger("train.adapt")

STRATEGIES = ("active", "random")
ADAPT_NOISE = 0.03
"""Log-normal sigma of a simulated measurement (``--backend sim``): a quiet GPU's."""


def adapted_model() -> XGBTimeRegressor:
    """The model refitted each round: the pipeline champion's (100 trees, rate 0.12)."""
    return XGBTimeRegressor(n_estimators=100, learning_rate=0.12)


# -- which scenarios next -------------------------------------------------------------------
def strata(scenarios: Sequence[Scenario]) -> list[tuple]:
    """Each scenario's stratum: operator, world size, and the octave band of its per-rank
    FLOPs (4 octaves wide), so that a round's picks spread over kinds and sizes."""
    return [(s.op, s.world_size, int(math.log2(max(s.busiest_rank_gflop(), 1e-9) * 1e9) // 4)) for s in scenarios]


def choose(ids: Sequence[str], groups: Sequence, k: int, *, measured: set[str], priority: Sequence[float] | None,
           seed: int = 0) -> list[str]:
    """`k` scenario ids to measure next among `ids` not in `measured`.

    `priority` (lower first, one per id): the active rule, taken round-robin over the
    strata `groups` (one per id) so every stratum gives its most uncertain scenario before
    any gives a second; None: a uniform random draw (`seed`). Never an id in `measured`,
    never one twice, at most what is left."""
    left = [i for i, sid in enumerate(ids) if sid not in measured]
    k = min(k, len(left))
    if k <= 0:
        return []
    if priority is None:
        picks = np.random.default_rng(seed).choice(len(left), size=k, replace=False)
        return [ids[left[j]] for j in sorted(picks)]
    by_stratum: dict = {}
    for i in sorted(left, key=lambda i: (priority[i], ids[i])):
        by_stratum.setdefault(groups[i], []).append(i)
    queues = sorted(by_stratum.values(), key=lambda q: (priority[q[0]], ids[q[0]]))
    out: list[str] = []
    while len(out) < k:
        for q in queues:
            if q and len(out) < k:
                out.append(ids[q.pop(0)])
    return out


# -- one machine's adaptation ------------------------------------------------------------
@dataclasses.dataclass
class Machine:
    """The machine being adapted to: its name (in every row), the spec the run believes
    (registered under the name, replaced each round), its grid of scenarios, and how to
    measure some of them (a function of scenarios -> rows in the dataset schema)."""

    name: str
    spec: HardwareSpec
    grid: list[Scenario]
    measure: Callable[[list[Scenario]], pd.DataFrame]
    truth: pd.DataFrame | None = None
    """Every grid scenario's rows with true times (``time_model_s`` on sim), to score against."""


def sim_machine(name: str, start: HardwareSpec, truth_spec: HardwareSpec, grid: Sequence[Scenario], *,
                noise: float = ADAPT_NOISE, seed: int = 0) -> Machine:
    """A simulated machine: measurements follow `truth_spec` with `noise`; the run starts
    from `start`. Rows carry `name`."""
    grid = [dataclasses.replace(s, hardware=name) for s in grid]
    calls = iter(range(1 << 30))
    return Machine(name, dataclasses.replace(start, name=name), grid,
                   lambda scenarios: simulate(scenarios, truth_spec, noise=noise, seed=seed * 1000 + next(calls)),
                   truth=simulate_rows(grid, truth_spec).assign(
                       time_model_s=lambda d: d["time_s"], status="ok", verified=True, near_best=False))


PERTURBED = ("peak_tflops", "compute_units", *fields_of("fraction", "rate", "latency"))
"""The numbers ``perturbed`` draws: every rate, latency, unit count and contention factor.
The compute units are among them (``recalibrate`` searches them count by count: a count a
few units off misplaces schedules in ways a rescaled rate only approximates)."""


def perturbed(spec: HardwareSpec, name: str, *, spread: float = 1.3, seed: int = 0) -> HardwareSpec:
    """`spec` with each of ``PERTURBED`` times its own log-uniform factor in [1/spread,
    spread] (bounded fractions stay in range): a machine whose data sheet is off by up to
    that much, for experiments. Named `name`."""
    rng = np.random.default_rng(seed)
    factor = {f: float(spread ** rng.uniform(-1, 1)) for f in PERTURBED}
    changes = {f: getattr(spec, f) * factor[f] for f in PERTURBED if f != "peak_tflops"}
    changes["peak_tflops"] = {d: v * factor["peak_tflops"] for d, v in spec.peak_tflops.items()}
    changes["compute_units"] = max(1, round(changes["compute_units"]))
    for f in fields_of("fraction"):  # within the cap machine sampling keeps them under
        changes[f] = min(changes[f], spec_field(f).metadata["sample"][1])
    return dataclasses.replace(spec, name=name, description=f"{spec.name}, every number off by up to x{spread:g}",
                               **changes)


def _measured_as(name: str, grid: Sequence[Scenario], out_dir: str | Path, **options):
    """`grid` under the machine name `name`, measured for real by ``ficco measure`` (with
    `options`: backend, device, ranks) as the grid's own machine, into
    ``<out_dir>/harness.parquet`` (crash-safe on its own): (the named grid, how to measure
    some of its scenarios, how to relabel the grid machine's rows as `name`'s). The adapted
    spec cannot take a preset's name, so rows carry `name`."""
    from data.measure.config import MeasureConfig
    from data.measure.sweep import measure

    named = [dataclasses.replace(s, hardware=name) for s in grid]
    renamed = {s.scenario_id: g.scenario_id for s, g in zip(grid, named)}
    back = dict(zip(renamed.values(), grid))

    def relabel(rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows[rows["scenario_id"].isin(renamed)]
        return rows.assign(hardware=name, scenario_id=rows["scenario_id"].map(renamed))

    def measure_here(scenarios: list[Scenario]) -> pd.DataFrame:
        ids = {back[s.scenario_id].scenario_id for s in scenarios}
        rows = measure([back[s.scenario_id] for s in scenarios], config=MeasureConfig(),
                       out=Path(out_dir) / "harness.parquet", **options)
        return relabel(rows[rows["scenario_id"].isin(ids)])  # the harness file holds earlier rounds too

    return named, measure_here, relabel


def cpu_machine(name: str, start: HardwareSpec, out_dir: str | Path, *, progress: bool = True) -> Machine:
    """This machine's cpu backend, measured for real: the grid is the committed cpu catalog
    (``data/scenarios/catalog_cpu.csv``), each round's scenarios are timed by the harness
    (gloo ranks, the ``ficco measure`` defaults; ``_measured_as``); the truth to score
    against is the committed full measurement (its repeat sweep where there is one:
    ``train.metrics``)."""
    from data.dataset import attach_repeat, read_dataset
    from data.scenarios import packaged, read_scenarios
    from train.training_data import MEASURED_REPEAT, measured_path

    grid, measure_here, relabel = _measured_as(name, read_scenarios(packaged("catalog_cpu.csv"), backend="cpu"),
                                               out_dir, backend="cpu", progress=progress)
    truth = read_dataset(measured_path())
    if MEASURED_REPEAT is not None:
        truth = attach_repeat(truth, read_dataset(measured_path(MEASURED_REPEAT)))
    return Machine(name, dataclasses.replace(start, name=name), grid, measure_here, truth=relabel(truth))


def cuda_machine(name: str, start: HardwareSpec, grid: Sequence[Scenario], out_dir: str | Path, *,
                 ranks: str = "loopback", device: str | None = None, progress: bool = True) -> Machine:
    """A GPU measured for real, through ``ficco measure --backend cuda``'s path
    (``_measured_as``; ``ranks`` loopback: every scenario's ranks virtual on one GPU; node:
    a process per GPU). The grid is `grid`'s scenarios whose buffers fit (``fitting``).
    Nothing measured the whole grid, so there is no truth to score rounds against: the
    adapted spec and the measured rows are the result. `device` ``cpu``: the path's stand-in
    on this machine's CPU (the loopback executor on CPU threads, the cpu backend's
    schedules; tests)."""
    from data.measure.sweep import fitting

    backend = "cpu" if device == "cpu" else "cuda"
    grid, measure_here, _ = _measured_as(name, fitting(grid, backend=backend, device=device, ranks=ranks), out_dir,
                                         backend=backend, device=device, progress=progress,
                                         ranks=ranks if backend == "cuda" else "loopback")
    return Machine(name, dataclasses.replace(start, name=name), grid, measure_here)


def cuda_grid(spec: HardwareSpec) -> list[Scenario]:
    """The scenarios ``ficco adapt --backend cuda`` measures from: the full catalog on the
    GPU's spec, at world sizes its devices hold, without fp8 (the executor's GEMMs do not run
    fp8). On a spec without copy engines (the CPU stand-in's), the cpu catalog on it."""
    from data.catalog import catalog
    from data.scenarios import packaged, read_scenarios

    if not spec.copy_engines:
        return [dataclasses.replace(s, hardware=spec.name)
                for s in read_scenarios(packaged("catalog_cpu.csv"), backend="cpu")]
    return [Scenario.from_record(r) for r in catalog("full", hardware=spec.name, world_sizes=(2, 4, 8))
            if r["world_size"] <= spec.devices and r["dtype"] != "float8_e4m3fn"]


def register_spec(spec: HardwareSpec) -> None:
    register_hardware(spec, "ficco adapt", replace=True)


def fit_model(base: pd.DataFrame, measured: pd.DataFrame) -> XGBTimeRegressor:
    rows = pd.concat([base, with_features(measured)], ignore_index=True) if len(measured) else base
    return adapted_model().fit(rows)


def predictions(model: XGBTimeRegressor, grid_rows: pd.DataFrame) -> pd.DataFrame:
    """Per scenario of `grid_rows`: the model's pick and its margin (second-best minus best
    predicted log time)."""
    ok, X = feature_pairs(grid_rows)
    frame = pd.DataFrame({"sid": ok["scenario_id"].to_numpy(), "schedule": ok["schedule"].to_numpy(),
                          "p": model.model_.predict(X)}).sort_values(["sid", "p", "schedule"])
    first = frame.groupby("sid", sort=False)
    best = first.nth(0).set_index("sid")
    second = first.nth(1).set_index("sid")["p"]
    return pd.DataFrame({"pick": best["schedule"], "margin": (second - best["p"]).reindex(best.index).fillna(np.inf)})


def candidate_rows(machine: Machine) -> pd.DataFrame:
    """Every grid scenario's legal schedules on the believed spec (the rows to predict on),
    with the simulator's pick there (time_s: the spec's model time)."""
    rows = simulate_rows(machine.grid, machine.spec)
    return rows.assign(status="ok", verified=True)


@dataclasses.dataclass
class Round:
    measured: int
    fraction: float
    chosen: list[str]
    spec: dict
    scores: dict


def adapt(machine: Machine, base: pd.DataFrame, *, checkpoints: Sequence[float], strategy: str = "active",
          out_dir: str | Path | None = None, seed: int = 0, progress: Callable[[Round], None] | None = None
          ) -> list[Round]:
    """Adapt to `machine` in rounds, one per fraction of its grid in `checkpoints`
    (ascending, cumulative; 0 scores the start alone). `base`: the training rows, with
    their features (``with_features``); the machine's own rows must not be in it.
    With `out_dir`, the state is kept there and a restarted call resumes (module docstring).
    Returns every round, in order, resumed ones included."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if list(checkpoints) != sorted(checkpoints) or not all(0 <= c <= 1 for c in checkpoints):
        raise ValueError(f"checkpoints must ascend within [0, 1], got {list(checkpoints)}")
    out = Path(out_dir) if out_dir is not None else None
    start_spec = machine.spec
    measured, rounds = _resume(out, machine)
    if rounds:  # the spec the last finished round adapted to (a run resumed with nothing left to do keeps it)
        machine.spec = dataclasses.replace(spec_from_dict(rounds[-1].spec, f"{out / 'rounds.json'}: last round's "
                                                          "spec"), name=machine.name)
        register_spec(machine.spec)
    ids = [s.scenario_id for s in machine.grid]
    groups = strata(machine.grid)
    for target in checkpoints[len(rounds):]:
        done = set(measured["scenario_id"]) if len(measured) else set()
        spec = recalibrate(start_spec, measured) if len(measured) else start_spec
        machine.spec = dataclasses.replace(spec, name=machine.name)
        register_spec(machine.spec)
        model = fit_model(base, measured)
        candidates = candidate_rows(machine)
        k = round(target * len(ids)) - len(done)
        priority = None
        if strategy == "active" and k > 0:
            pred = predictions(model, candidates)
            physics = candidates.sort_values(["scenario_id", "time_s", "schedule"]).groupby("scenario_id").first()
            agree = (pred["pick"] == physics["schedule"].reindex(pred.index)).astype(float)
            priority = [(agree.get(sid, 1.0), pred["margin"].get(sid, np.inf)) for sid in ids]
        chosen = _pending(out, target, known=ids) or choose(ids, groups, k, measured=done, priority=priority,
                                                            seed=seed + len(rounds))
        chosen = [sid for sid in chosen if sid not in done]  # a killed round's measured ones stay measured
        if out is not None:  # before measuring: a killed round is redone on the same scenarios
            _write_json(out / "pending.json", {"fraction": target, "chosen": chosen})
        if chosen:
            by_id = dict(zip(ids, machine.grid))
            new = machine.measure([by_id[sid] for sid in chosen])
            measured = pd.concat([measured, new], ignore_index=True) if len(measured) else new
            measured = measured.drop(columns=[c for c in FEATURE_COLUMNS if c in measured.columns])
            spec = recalibrate(start_spec, measured)
            machine.spec = dataclasses.replace(spec, name=machine.name)
            register_spec(machine.spec)
            model = fit_model(base, measured)
            candidates = candidate_rows(machine)
        scores = _score(model, candidates, machine, set(measured["scenario_id"]) if len(measured) else set())
        r = Round(measured=int(measured["scenario_id"].nunique()) if len(measured) else 0,
                  fraction=target, chosen=chosen, spec=spec_as_dict(machine.spec), scores=scores)
        rounds.append(r)
        if out is not None:
            _save(out, measured, rounds)
        if progress is not None:
            progress(r)
    return rounds


def _score(model, candidates: pd.DataFrame, machine: Machine, measured: set[str]) -> dict:
    """The model's picks on the scenarios not measured, scored against the machine's truth
    (an empty dict without one)."""
    if machine.truth is None:
        return {}
    rest = candidates[~candidates["scenario_id"].isin(measured)]
    if rest.empty:
        return {}
    picks = predictions(model, rest)["pick"].to_dict()
    physics = rest.sort_values(["scenario_id", "time_s", "schedule"]).groupby("scenario_id")["schedule"].first()
    truth = machine.truth[machine.truth["scenario_id"].isin(picks)]
    return {**score(truth, picks), "simulator": score(truth, physics.to_dict()),
            "ceiling": score(truth, ceiling_choices(truth))}


def _pending(out: Path | None, target: float, known: Sequence[str] = ()) -> list[str]:
    """The scenarios a killed round chose for `target`, if that round was under way
    (ValueError naming the file if it holds anything but ids of `known` scenarios)."""
    path = None if out is None else out / "pending.json"
    if path is None or not path.exists():
        return []
    pending = _read_json(path)
    if not isinstance(pending, dict) or not isinstance(pending.get("chosen"), list):
        raise ValueError(f"{path}: expected an object with a 'chosen' list of scenario ids, got {str(pending)[:80]}")
    unknown = set(map(str, pending["chosen"])) - set(known)
    if known and unknown:
        raise ValueError(f"{path}: field 'chosen' names {len(unknown)} scenario(s) not on this machine's grid "
                         f"(e.g. {sorted(unknown)[0]!r}): another run's state; choose another --out")
    return list(pending["chosen"]) if pending.get("fraction") == target else []


def _read_json(path: Path):
    """A state file's contents; ValueError naming the file if it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e}); a state file of this folder, damaged: "
                         "choose another --out") from None


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def _resume(out: Path | None, machine: Machine) -> tuple[pd.DataFrame, list[Round]]:
    if out is None or not (out / "rounds.json").exists():
        return pd.DataFrame(), []
    state = _read_json(out / "rounds.json")
    if not isinstance(state, dict) or state.get("machine") != machine.name:
        got = state.get("machine") if isinstance(state, dict) else state
        raise ValueError(f"{out / 'rounds.json'}: field 'machine' is {got!r}, not "
                         f"{machine.name!r}: another run's folder")
    try:
        rounds = [Round(**r) for r in state["rounds"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{out / 'rounds.json'}: field 'rounds' is malformed ({e}): not a state this version "
                         "wrote; choose another --out") from None
    measured = read_dataset(out / "measured.parquet") if (out / "measured.parquet").exists() else pd.DataFrame()
    if len(measured):
        theirs = sorted(set(measured["hardware"]) - {machine.name})
        if theirs:
            raise ValueError(f"{out / 'measured.parquet'}: holds rows of {theirs[0]!r}, not of {machine.name!r}: "
                             "another run's measurements; choose another --out")
    missing = {sid for r in rounds for sid in r.chosen} - (set(measured["scenario_id"]) if len(measured) else set())
    if missing:
        raise ValueError(f"{out / 'measured.parquet'}: lacks {len(missing)} scenario(s) that rounds.json says were "
                         "measured: the file was replaced or removed; choose another --out")
    have = int(measured["scenario_id"].nunique()) if len(measured) else 0
    # More rows than the last finished round says: a round killed after its measurements were
    # saved. They are kept (never measured again); its redo measures only what it still lacks.
    log.info("resuming %s: %d round(s) done, %d scenario(s) measured", out, len(rounds), have)
    return measured, rounds


def _save(out: Path, measured: pd.DataFrame, rounds: list[Round]) -> None:
    """measured.parquet first, then rounds.json, each replaced atomically: a kill between
    them leaves a round's rows that rounds.json does not list yet, which a resume keeps."""
    out.mkdir(parents=True, exist_ok=True)
    if len(measured):
        write_parquet_atomic(measured, out / "measured.parquet")
    _write_json(out / "rounds.json", {"machine": rounds[0].spec["name"] if rounds else "",
                                      "rounds": [dataclasses.asdict(r) for r in rounds]})


def usable_base(df: pd.DataFrame, machine: str) -> pd.DataFrame:
    """The training rows without `machine` and the machines sampled around it (its preset's
    family): the start must not have seen the machine."""
    base = df["hardware"].map({h: base_machine(h) for h in set(df["hardware"])})
    return usable_rows(df[base != base_machine(machine)]).reset_index(drop=True)


# -- ficco adapt ------------------------------------------------------------------------------
EXPERIMENT = "ficco-adapt"


def run_adapt(*, hardware: str, backend: str = "sim", start: str | None = None, budget: float = 0.1,
              rounds: int = 4, strategy: str = "active", perturb: float = 1.0, seed: int = 0,
              out_dir: str | Path = "out/adapt", track: bool = True, register: bool = False,
              export_to: str | Path | None = None, on_round: Callable[[Round], None] | None = None,
              ranks: str = "loopback", device: str | None = None) -> dict:
    """``ficco adapt``: adapt to `hardware` (a preset or a spec file) within `budget` (a
    fraction of its full-scale grid) in `rounds` equal steps, starting from `start`'s spec
    (default: the hardware's own) and a model trained on the default training data without
    the hardware's preset family. ``sim``: the measurements follow the hardware's spec, each
    number off by up to `perturb` (1: exactly), with noise. ``cpu``: this machine measured
    for real (``cpu_machine``); `perturb` > 1 puts the spec to start from off by up to that.
    ``cuda``: a GPU measured for real (``cuda_machine``; `ranks` loopback or node, as
    ``ficco measure``), likewise; `device` ``cpu`` is its stand-in (tests, on the ``cpu``
    spec).
    Keeps its state in `out_dir` (resumable), writes the adapted spec there (``spec.yaml``)
    and, with `track`, logs the run and its learning curve to MLflow. With `register`, the
    measured rows then join the training data and the pipeline trains, registers and
    promotes by its usual rules (``register_adapted``), exporting a new champion to
    `export_to`. Returns the summary."""
    from ficco_select.hardware import load_hardware, preset_names

    if backend not in ("sim", "cpu", "cuda"):
        raise ValueError(f"--backend {backend}: sim, cpu or cuda")
    if backend == "cuda" and device != "cpu":
        _check_cuda(ranks)
    if not 0 < budget <= 1 or rounds < 1:
        raise ValueError(f"--budget must be in (0, 1] and --rounds at least 1, got {budget} and {rounds}")
    spec = load_hardware(hardware)
    name = f"{spec.name}-adapted" if spec.name in preset_names() else spec.name
    if backend == "cpu" and spec.name != "cpu":
        raise ValueError(f"--backend cpu measures this machine's cpu backend: --hardware cpu, not {hardware!r}")
    if backend == "cuda" and bool(spec.copy_engines) == (device == "cpu"):
        raise ValueError(f"--backend cuda measures a GPU: --hardware names its spec (a preset such as h100-nvswitch, "
                         f"or a file), not {hardware!r}" if device != "cpu" else
                         "device 'cpu' is the cuda path's stand-in on a machine without copy engines: "
                         "--hardware cpu (or a spec of the CPU)")
    out = Path(out_dir)
    options = dict(hardware=spec.name, backend=backend, start=load_hardware(start).name if start else spec.name,
                   budget=budget, rounds=rounds, strategy=strategy, perturb=perturb, seed=seed)
    if backend == "cuda":  # the modes label differently: a folder holds one
        options.update(ranks=ranks, device=device or "cuda")
    with output_lock(out, "ficco adapt"):  # a second run into the same folder refuses, naming this one
        _check_state(out, options)
        return _run(spec, name, out, options, hardware=hardware, track=track, register=register,
                    export_to=export_to, on_round=on_round)


def _check_cuda(ranks: str) -> None:
    """Refuse, in one line and before any work, a cuda adapt this machine cannot run."""
    import torch

    if ranks not in ("loopback", "node"):
        raise ValueError(f"--ranks {ranks!r}: loopback (virtual ranks on one GPU) or node (a process per GPU)")
    if not torch.cuda.is_available():
        raise ValueError(f"--backend cuda: CUDA is not available here (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda or 'none'}); run it on the GPU node, or adapt with --backend sim")


OPTIONS_FILE = "options.json"
"""What an adapt folder was made with: the machine and every option that shapes its rounds."""


def _check_state(out: Path, options: dict) -> None:
    """Refuse a folder that ``ficco adapt`` did not write, or wrote for another machine or
    other options (resuming it would mix two experiments); record them in a new one."""
    path = out / OPTIONS_FILE
    if path.exists():
        recorded = _read_json(path)
        changed = [k for k in options if recorded.get(k) != options[k]]
        if changed:
            k = changed[0]
            raise ValueError(f"--out {out} was made with --{k.replace('_', '-')} {recorded.get(k)!r}, not "
                             f"{options[k]!r}: resuming would mix two runs; choose another --out "
                             f"(or the same options)")
        return
    if out.exists() and any(out.iterdir()):
        found = sorted(p.name for p in out.iterdir())[:4]
        raise ValueError(f"--out {out} holds {', '.join(found)} but no {OPTIONS_FILE}: not a ficco adapt "
                         "folder; choose another --out (nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(path, options)


def _run(spec, name: str, out: Path, options: dict, *, hardware: str, track: bool, register: bool,
         export_to, on_round) -> dict:
    """``run_adapt`` with the folder's lock held and its state checked."""
    from data.calibrate import write_spec
    from data.catalog import catalog
    from ficco_select.hardware import load_hardware
    from train.training_data import default_training_data

    backend, start, perturb, seed = options["backend"], options["start"], options["perturb"], options["seed"]
    budget, rounds, strategy = options["budget"], options["rounds"], options["strategy"]
    if backend in ("cpu", "cuda"):
        start_spec = load_hardware(start) if start != spec.name else spec
        if perturb > 1:  # the truth is this machine: the spec to start from is the one that is off
            start_spec = perturbed(start_spec, name, spread=perturb, seed=seed)
        machine = (cpu_machine(name, start_spec, out) if backend == "cpu" else
                   cuda_machine(name, start_spec, cuda_grid(spec), out, ranks=options["ranks"],
                                device=None if options["device"] == "cuda" else options["device"]))
    else:
        start_spec = load_hardware(start) if start != spec.name else spec
        truth = (perturbed(spec, name, spread=perturb, seed=seed) if perturb > 1
                 else dataclasses.replace(spec, name=name))
        grid = [Scenario.from_record(r) for r in catalog("full", hardware=spec.name, world_sizes=(2, 4, 8))
                if r["world_size"] <= spec.devices]
        machine = sim_machine(name, start_spec, truth, grid, seed=seed)
    grid = machine.grid
    base = with_features(usable_base(default_training_data(), spec.name))
    checkpoints = [0.0] + [budget * (i + 1) / rounds for i in range(rounds)]
    done = adapt(machine, base, checkpoints=checkpoints, strategy=strategy, out_dir=out, seed=seed, progress=on_round)
    write_spec(machine.spec, out / "spec.yaml", f"ficco adapt --hardware {hardware} --backend {backend}, "
               f"{done[-1].measured} scenarios measured")
    summary = {"machine": name, "hardware": hardware, "backend": backend, "strategy": strategy, "grid": len(grid),
               "rounds": [{"fraction": r.fraction, "measured": r.measured, **_headline(r.scores)} for r in done],
               "spec": str(out / "spec.yaml"), "out_dir": str(out)}
    if track:
        params = {**options, "hardware": hardware}
        summary["mlflow_run_id"] = _track(summary, out, params)
    if register:
        summary["registered"] = register_adapted(out, export_to=export_to)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def register_adapted(out_dir: str | Path, *, export_to: str | Path | None = None, debug: bool = False,
                     progress: bool = True) -> dict:
    """Train on the default training data plus an adapt run's measured rows (``measured.parquet``
    in `out_dir`, which carries the adapted spec): the pipeline's grouped evaluation, MLflow
    run and registration, and its promotion rule (``train.run``: the champion moves only if
    what ships beats the heuristic on both grouped hold-outs and is not worse than the
    champion), exporting a new champion to `export_to`. The pipeline's output goes to
    ``<out_dir>/pipeline``. `debug`: the pipeline's tiny slice (tests). Returns the version,
    whether it was promoted, and where it was exported."""
    from train.pipeline import run_pipeline

    measured = Path(out_dir) / "measured.parquet"
    if not measured.exists():
        raise ValueError(f"{measured}: nothing measured yet, nothing to register (a budget of 0 scenarios?)")
    done = run_pipeline(datasets=[measured], out_dir=Path(out_dir) / "pipeline", progress=progress, debug=debug,
                        export_to=export_to)
    return {k: done[k] for k in ("version", "promoted", "run_id", "report", "exported", "export_error") if k in done}


def summary_curve(summary: dict) -> pd.DataFrame:
    """A run's summary as learning-curve rows (``train.report.adapt_curve``): one per round, the
    machine and backend as the preset, the round's headline scores."""
    return pd.DataFrame([{"preset": f"{summary['machine']} on {summary['backend']}", "strategy": summary["strategy"],
                          **r} for r in summary["rounds"]])


def _headline(scores: dict) -> dict:
    if not scores:
        return {}
    return {"near_opt_2": scores["near_opt_2"], "speedup": scores["speedup"],
            "simulator_near_opt_2": scores["simulator"]["near_opt_2"],
            "ceiling_near_opt_2": scores["ceiling"]["near_opt_2"]}


def _track(summary: dict, out: Path, params: dict) -> str:
    """One MLflow run: the options, near-opt@2% per round (step: scenarios measured), the
    curve's plot and the output folder."""
    import mlflow

    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name=f"adapt-{summary['machine']}") as run:
        mlflow.log_params(params)
        for r in summary["rounds"]:
            for key in ("near_opt_2", "speedup", "simulator_near_opt_2", "ceiling_near_opt_2"):
                if key in r:
                    mlflow.log_metric(key, float(r[key]), step=int(r["measured"]))
        curve = summary_curve(summary)
        if "near_opt_2" in curve:
            from train.report import plot_curve

            plot_curve(curve, out / "curve.png")
        mlflow.log_artifacts(str(out), artifact_path="adapt")
        return run.info.run_id
