"""The machine being adapted to (``ficco adapt``'s machines stage).

What a ``Machine`` is (a name, the spec the run believes, a grid of scenarios, how to
measure some of them, and the truth to score against where there is one) and how each
backend makes one: ``sim_machine`` (the spec simulated with noise; ``perturbed`` puts a
spec off by up to a spread), ``cpu_machine`` (this machine's gloo ranks, timed by the
harness) and ``cuda_machine`` (a GPU through ``ficco measure --backend cuda``'s path, on the
grid ``cuda_grid``). ``load_target`` and ``check_cuda`` refuse what cannot be adapted to, before
any work; ``adapted_machine`` makes the machine a ``ficco adapt`` run's options name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select.data.simulate import simulate, simulate_rows
from ficco_select.hardware import HardwareSpec, Scope, fields_of, load_hardware, machines, shipped_names, spec_field
from ficco_select.scenario import Scenario

ADAPT_NOISE = 0.03
"""Log-normal sigma of a simulated measurement (``--backend sim``): a quiet GPU's."""


@dataclasses.dataclass
class Machine:
    """The machine being adapted to: its name (in every row), the spec the run believes
    (what its name means inside ``known``, refined each round), its grid of scenarios, and
    how to measure some of them (a function of scenarios -> rows in the dataset schema)."""

    name: str
    spec: HardwareSpec
    grid: list[Scenario]
    measure: Callable[[list[Scenario]], pd.DataFrame]
    truth: pd.DataFrame | None = None
    """Every grid scenario's rows with true times (``time_model_s`` on sim), to score against."""

    _scope: Scope | None = dataclasses.field(default=None, repr=False)

    def believe(self, spec: HardwareSpec) -> None:
        """From now on the run believes `spec`, under the machine's name."""
        self.spec = dataclasses.replace(spec, name=self.name)
        if self._scope is not None:
            self._scope.refine(self.spec)

    @contextlib.contextmanager
    def known(self) -> Iterator[None]:
        """The work inside the block knows the machine by name as the spec the run believes,
        round by round (over what the job knew by that name: the run believes its own)."""
        outer = self._scope
        with machines([self.spec], "ficco adapt", replace=True) as scope:
            self._scope = scope
            try:
                yield
            finally:
                self._scope = outer


def sim_machine(name: str, start: HardwareSpec, truth_spec: HardwareSpec, grid: Sequence[Scenario], *,
                noise: float = ADAPT_NOISE, seed: int = 0) -> Machine:
    """A simulated machine: measurements follow `truth_spec` with `noise` (drawn with
    ``noise_seed``); the run starts from `start`. Rows carry `name`."""
    grid = [dataclasses.replace(s, hardware=name) for s in grid]
    return Machine(name, dataclasses.replace(start, name=name), grid,
                   lambda scenarios: simulate(scenarios, truth_spec, noise=noise, seed=noise_seed(seed, scenarios)),
                   truth=simulate_rows(grid, truth_spec).assign(
                       time_model_s=lambda d: d["time_s"], status="ok", verified=True, near_best=False))


def noise_seed(seed: int, scenarios: Sequence[Scenario]) -> int:
    """The noise seed of one simulated measurement: from the run's seed and the scenarios
    measured, in order, never from how many measurements came before, so that a resumed run
    (a new process) draws for a round what an uninterrupted one draws."""
    return zlib.crc32("\n".join([str(seed), *(s.scenario_id for s in scenarios)]).encode())


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
    from ficco_select.data.measure.config import MeasureConfig
    from ficco_select.data.measure.sweep import measure

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
    ``ficco_select.train.metrics``)."""
    from ficco_select.data.scenarios import packaged, read_scenarios
    from ficco_select.train.training_data import MEASURED, MEASURED_REPEAT, measured_sweep

    grid, measure_here, relabel = _measured_as(name, read_scenarios(packaged("catalog_cpu.csv"), backend="cpu"),
                                               out_dir, backend="cpu", progress=progress)
    truth = measured_sweep(MEASURED, MEASURED_REPEAT)
    return Machine(name, dataclasses.replace(start, name=name), grid, measure_here, truth=relabel(truth))


FABRIC_CATALOG = "catalog_fabric.csv"
"""The grid of a shaped fabric: the real layers sized for gloo ranks on a slow network
(``ficco catalog --scale fabric``), the catalog of the committed fabric sweeps."""


def fabric_grid() -> list[Scenario]:
    """``FABRIC_CATALOG``'s scenarios on this host's cpu (a fabric moves them onto its machine)."""
    from ficco_select.data.scenarios import packaged, read_scenarios

    return read_scenarios(packaged(FABRIC_CATALOG), backend="cpu")


def fabric_machine(fabric, out_dir: str | Path, *, name: str | None = None, progress: bool = True) -> Machine:
    """A shaped fabric of this host measured for real (``ficco adapt --fabric RATE``; this
    process runs inside it): the grid is ``FABRIC_CATALOG`` on the fabric, under the machine
    name `name` (default: the fabric's, ``cpu-<rate>``; ``load_target`` names it apart from a
    committed sweep's machine); the spec to start from is its quick profile (``on_fabric``:
    the host's cpu spec with the profiled link, kept in the folder, so a resumed run believes
    the same start); each round's scenarios are timed by the harness on the fabric's gloo
    ranks. The truth to score against: the committed sweep of that fabric (``data/measured/
    fabric_<rate>.parquet``), judged on its second sweep, where there is one."""
    from ficco_select.data.measure.config import MeasureConfig
    from ficco_select.data.measure.fabric_profile import on_fabric
    from ficco_select.data.measure.sweep import measure
    from ficco_select.train.training_data import measured_path, measured_sweep

    name = name or fabric.name
    on_host = fabric_grid()
    harness = Path(out_dir) / "harness.parquet"
    on_the_fabric, profiled = on_fabric(on_host, fabric, harness)  # profiles the fabric once per folder
    grid = [dataclasses.replace(s, hardware=name) for s in on_the_fabric]
    host_of = {s.scenario_id: h for s, h in zip(grid, on_host)}
    renamed = {f.scenario_id: s.scenario_id for f, s in zip(on_the_fabric, grid)}

    def relabel(rows: pd.DataFrame) -> pd.DataFrame:
        """The fabric's rows (the harness's, the committed sweep's) as the machine `name`'s."""
        rows = rows[rows["scenario_id"].isin(renamed)]
        return rows.assign(hardware=name, scenario_id=rows["scenario_id"].map(renamed))

    def measure_here(scenarios: list[Scenario]) -> pd.DataFrame:
        ids = {s.scenario_id for s in scenarios}
        rows = relabel(measure([host_of[s.scenario_id] for s in scenarios], config=MeasureConfig(), out=harness,
                               backend="cpu", fabric=fabric, progress=progress))
        return rows[rows["scenario_id"].isin(ids)]  # the harness file holds earlier rounds too

    truth = None
    sweep, repeat = f"fabric_{fabric.rate}.parquet", f"fabric_{fabric.rate}_repeat.parquet"
    if measured_path(sweep).is_file():  # read for its times: the run believes its own spec
        truth = relabel(measured_sweep(sweep, repeat if measured_path(repeat).is_file() else None))
    return Machine(name, dataclasses.replace(profiled, name=name), grid, measure_here, truth=truth)


def cuda_machine(name: str, start: HardwareSpec, grid: Sequence[Scenario], out_dir: str | Path, *,
                 ranks: str = "loopback", device: str | None = None, progress: bool = True) -> Machine:
    """A GPU measured for real, through ``ficco measure --backend cuda``'s path
    (``_measured_as``; ``ranks`` loopback: every scenario's ranks virtual on one GPU; node:
    a process per GPU). The grid is `grid`'s scenarios whose buffers fit (``fitting``).
    Nothing measured the whole grid, so there is no truth to score rounds against: the
    adapted spec and the measured rows are the result. `device` ``cpu``: the path's stand-in
    on this machine's CPU (the loopback executor on CPU threads, the cpu backend's
    schedules; tests)."""
    from ficco_select.data.measure.preflight import fitting

    backend = "cpu" if device == "cpu" else "cuda"
    grid, measure_here, _ = _measured_as(name, fitting(grid, backend=backend, device=device, ranks=ranks), out_dir,
                                         backend=backend, device=device, progress=progress,
                                         ranks=ranks if backend == "cuda" else "loopback")
    return Machine(name, dataclasses.replace(start, name=name), grid, measure_here)


def cuda_grid(spec: HardwareSpec) -> list[Scenario]:
    """The scenarios ``ficco adapt --backend cuda`` measures from: the full catalog on the
    GPU's spec, at world sizes its devices hold, without fp8 (the executor's GEMMs do not run
    fp8). On a spec without copy engines (the CPU stand-in's), the cpu catalog on it."""
    from ficco_select.data.catalog import catalog
    from ficco_select.data.scenarios import packaged, read_scenarios

    if spec.kind == "cpu":
        return [dataclasses.replace(s, hardware=spec.name)
                for s in read_scenarios(packaged("catalog_cpu.csv"), backend="cpu")]
    return [Scenario.from_record(r) for r in catalog("full", hardware=spec.name, world_sizes=(2, 4, 8))
            if r["world_size"] <= spec.devices and r["dtype"] != "float8_e4m3fn"]


# -- which machine a ``ficco adapt`` run adapts to ------------------------------------------
def check_cuda(ranks: str) -> None:
    """Refuse, in one line and before any work, a cuda adapt this machine cannot run."""
    import torch

    if ranks not in ("loopback", "node"):
        raise ValueError(f"--ranks {ranks!r}: loopback (virtual ranks on one GPU) or node (a process per GPU)")
    if not torch.cuda.is_available():
        raise ValueError(f"--backend cuda: CUDA is not available here (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda or 'none'}); run it on the GPU node, or adapt with --backend sim")


def load_target(hardware: str, backend: str, device: str | None, fabric: str | None = None, *,
                taken: Collection[str] = ()) -> tuple[HardwareSpec, str]:
    """The spec `hardware` names (a preset or a spec file) and the adapted machine's name: the
    measured machine's own (on a `fabric`, the fabric's, ``cpu-<rate>``), with ``-adapted``
    where that name already means a machine, a shipped one or one of `taken` (the training
    data's): the adapted spec has other numbers, and its rows join that data when registered
    (``adapted_name``). ValueError where `backend` cannot measure that hardware."""
    spec = load_hardware(hardware)
    if fabric is not None:
        from ficco_select.data.measure.fabric import inside, parse_fabric

        if backend != "cpu" or spec.name != "cpu":
            raise ValueError(f"--fabric {fabric}: a shaped fabric carries this host's cpu backend: "
                             f"--backend cpu --hardware cpu, not --backend {backend} --hardware {hardware}")
        if inside() != parse_fabric(fabric):
            raise ValueError(f"--fabric {fabric}: this process is not inside that fabric's network namespace "
                             "(`ficco adapt --fabric` makes one)")
        return spec, adapted_name(parse_fabric(fabric).name, taken)
    if backend == "cpu" and spec.name != "cpu":
        raise ValueError(f"--backend cpu measures this machine's cpu backend: --hardware cpu, not {hardware!r}")
    if backend == "cuda" and (spec.kind == "gpu") == (device == "cpu"):
        raise ValueError(f"--backend cuda measures a GPU: --hardware names its spec (a preset such as h100-nvswitch, "
                         f"or a file), not {hardware!r}" if device != "cpu" else
                         "device 'cpu' is the cuda path's stand-in on a machine without copy engines: "
                         "--hardware cpu (or a spec of the CPU)")
    return spec, adapted_name(spec.name, taken)


def adapted_name(name: str, taken: Collection[str] = ()) -> str:
    """The name the adapted spec of the machine `name` goes by: `name`, or ``<name>-adapted``
    where `name` is a shipped machine's or one of `taken`, which mean other numbers."""
    return f"{name}-adapted" if name in shipped_names() or name in set(taken) else name


MAKE_UP = ("name", "description", "devices", "topology", "copy_engines", "switch_reduce", "switch_bw_gbps",
           "switch_latency_us")
"""What the adapted spec takes from the measured machine rather than from the spec it starts
from: what the machine is (its devices, how they connect, its copy engines, whether its
fabric reduces in the switch: the grid's world sizes and the schedules it can run), which no
measurement refits (``ficco_select.data.calibrate.RECALIBRATED``), and the switch's terms with
its flag (a start without a switch has none to give); the other numbers come from the start."""


def started_from(start: HardwareSpec, machine: HardwareSpec, name: str) -> HardwareSpec:
    """`start`'s numbers on `machine`'s make-up (``MAKE_UP``), named `name`; each number says
    where it came from as the spec that gave it does."""
    provenance = {**start.provenance, **{f: machine.provenance[f] for f in MAKE_UP if f in machine.provenance}}
    return dataclasses.replace(start, **{f: getattr(machine, f) for f in MAKE_UP if f != "name"}, name=name,
                               provenance=provenance)


def check_start(start: HardwareSpec, start_arg: str, machine: HardwareSpec, hardware: str) -> None:
    """Refuse, before any work, a spec to start from that cannot describe `machine`: one of the
    other kind (a GPU's numbers for the cpu backend's machine, or the reverse), or one without
    a peak for a dtype the machine has (its peak would be read as float32's, and recalibration
    scales every dtype's peak together, so it would never be right)."""
    if start.kind != machine.kind:
        raise ValueError(f"--start {start_arg}: a {start.kind} spec, and --hardware {hardware} is a {machine.kind} "
                         f"machine: start from a {machine.kind} spec (or leave --start out)")
    lacking = sorted(set(machine.peak_tflops) - set(start.peak_tflops))
    if lacking:
        raise ValueError(f"--start {start_arg}: field 'peak_tflops' has no {', '.join(lacking)}, which --hardware "
                         f"{hardware} has and its grid measures: start from a spec with a peak for each dtype of "
                         "the machine (or leave --start out)")


def adapted_machine(spec: HardwareSpec, start: HardwareSpec, name: str, out: Path, options: dict) -> Machine:
    """The machine a run with `options` (``ficco adapt``'s, as recorded in its folder) adapts
    to, named `name`: on cpu and cuda the real one, starting from `start`'s numbers on its
    make-up (``started_from``; off by up to ``perturb`` where that is above 1); on sim
    `spec`'s full catalog (world sizes 2, 4, 8 its devices hold), measured on `spec` off by
    up to ``perturb``, starting from `start` likewise. On a fabric, the fabric's machine
    (``fabric_machine``), which starts from its own profile."""
    from ficco_select.data.catalog import catalog

    backend, perturb, seed = options["backend"], options["perturb"], options["seed"]
    if options.get("fabric"):
        from ficco_select.data.measure.fabric import parse_fabric

        return fabric_machine(parse_fabric(options["fabric"]), out, name=name)
    start_spec = started_from(start, spec, name)
    if backend in ("cpu", "cuda"):
        if perturb > 1:  # the truth is this machine: the spec to start from is the one that is off
            start_spec = perturbed(start_spec, name, spread=perturb, seed=seed)
        return (cpu_machine(name, start_spec, out) if backend == "cpu" else
                cuda_machine(name, start_spec, cuda_grid(spec), out, ranks=options["ranks"],
                             device=None if options["device"] == "cuda" else options["device"]))
    truth = (perturbed(spec, name, spread=perturb, seed=seed) if perturb > 1
             else dataclasses.replace(spec, name=name))
    grid = [Scenario.from_record(r) for r in catalog("full", hardware=spec.name, world_sizes=(2, 4, 8))
            if r["world_size"] <= spec.devices]
    return sim_machine(name, start_spec, truth, grid, seed=seed)
