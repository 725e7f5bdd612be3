"""The schedule space: how one (collective + GEMM) is split and overlapped.

A ``Schedule`` is a small hashable value with a stable name (DESIGN.md, "The schedule
space"). Names, by granularity:

    none.<engine>                                      whole collective, then whole GEMM
    shard.ring.<engine>                                P ring steps, one shard per step
    ficco.d<d>.<pattern>.<compute>.<split>.<engine>    every shard split again into d pieces

e.g. ``none.sm``, ``shard.ring.sm``, ``ficco.d4.a2a.gemm_per_step.m.dma``.

Engines: ``sm`` (kernels on the compute units move the bytes), ``dma`` (copy engines) and
``switch`` (the NVSwitch reduces and multicasts: NVLS, PyTorch's ``multimem`` ops). A switch
operation reaches every peer at once, so the switch runs the baseline's whole collective
(``none.switch``: a reduce-scatter or all-reduce reduced in the switch, an all-gather by
multicast stores) and the all-to-all pattern's steps along m (``ficco.d<d>.a2a.*.m.switch``:
each step's pieces reduced or multicast while the next step's GEMM runs); it has no ring
(``shard.ring.switch`` is not a schedule) and no all-to-all of tokens (legal for ``ag_gemm``,
``gemm_rs`` and ``gemm_ar`` only), and is legal only on a spec with ``switch_reduce``.
For ``gemm_ar`` the engine of ``none`` is the small all-reduce's algorithm: ``none.sm`` the
collective library's (NCCL), ``none.switch`` the one-call multimem all-reduce.
``parse(name)`` round-trips ``schedule.name``. ``candidates(scenario, backend)``
enumerates the legal schedules of a scenario on a backend.

``gemm_ar`` (GEMM then all-reduce) reads the axes so: ``none``, the whole GEMM then the
whole all-reduce (a ring reduce-scatter and a ring all-gather); ``shard.ring`` and
``ficco.d<d>.ring.*``, the reduce-scatter + all-gather form, whose reduce-scatter is the
``gemm_rs`` schedule of the same name (overlapped with the GEMM) followed by the
all-gather of the reduced blocks; ``ficco.d<d>.a2a.*.m``, pieces along m, each piece's
all-reduce (a direct reduce-scatter to the block owners, then the owners' all-gather)
overlapped with the next piece's GEMM (d = P: shard-sized pieces).
``gemm_a2a`` (the MoE combine) mirrors ``a2a_gemm``: a hop's (ring) or a step's (a2a)
GEMM output goes back to its tokens' owners while the next piece's GEMM runs.

This module is on the runtime path: plain Python only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from ficco_select.hardware import HardwareSpec
from ficco_select.scenario import Scenario

Granularity = Literal["none", "shard", "ficco"]
Pattern = Literal["ring", "a2a"]
Compute = Literal["gemm_per_piece", "gemm_per_step"]
Split = Literal["m", "n"]
Engine = Literal["sm", "dma", "switch"]

GRANULARITIES = ("none", "shard", "ficco")
PATTERNS = ("ring", "a2a")
COMPUTES = ("gemm_per_piece", "gemm_per_step")
SPLITS = ("m", "n")
ENGINES = ("sm", "dma", "switch")
SWITCH_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
"""Ops whose collective the switch carries: multicast (all-gather) or in-switch reduction."""


class ScheduleError(ValueError):
    """A schedule name or combination of axes is invalid."""


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class Schedule:
    granularity: str
    """``none`` (baseline), ``shard`` (one shard per ring step) or ``ficco`` (d pieces per shard)."""
    degree: int = 1
    """Decomposition degree d: pieces per shard (1 for none and shard)."""
    pattern: str | None = None
    """``ring`` (one peer per step) or ``a2a`` (one piece from every peer per step); None for none."""
    compute: str | None = None
    """``gemm_per_piece`` (a GEMM per arriving piece) or ``gemm_per_step`` (one per step); ficco only."""
    split: str | None = None
    """Dimension a shard is split along into pieces (``m`` rows, ``n`` columns); ficco only."""
    engine: str = "sm"
    """Who moves the bytes: ``sm`` (kernels/threads sharing the compute units), ``dma`` (copy
    engines) or ``switch`` (the NVSwitch reduces and multicasts; kernels issue the requests)."""

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ScheduleError(f"granularity {self.granularity!r} not in {GRANULARITIES}")
        if self.engine not in ENGINES:
            raise ScheduleError(f"engine {self.engine!r} not in {ENGINES}")
        if self.granularity == "none":
            ok = self.degree == 1 and self.pattern is None and self.compute is None and self.split is None
        elif self.granularity == "shard":
            ok = self.degree == 1 and self.pattern == "ring" and self.compute is None and self.split is None
        else:
            ok = (self.degree >= 2 and self.pattern in PATTERNS and self.compute in COMPUTES
                  and self.split in SPLITS)
        if not ok:
            raise ScheduleError(f"inconsistent axes for granularity {self.granularity!r}: {self!r}")
        if self.engine == "switch" and (self.granularity == "shard" or (self.granularity == "ficco" and (
                self.pattern != "a2a" or self.split != "m"))):
            raise ScheduleError(f"engine 'switch' reaches every peer at once: it runs none.switch and "
                                f"ficco.d<d>.a2a.<compute>.m.switch only, not {self.name}")

    @property
    def name(self) -> str:
        if self.granularity == "none":
            return f"none.{self.engine}"
        if self.granularity == "shard":
            return f"shard.ring.{self.engine}"
        return f"ficco.d{self.degree}.{self.pattern}.{self.compute}.{self.split}.{self.engine}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_baseline(self) -> bool:
        return self.granularity == "none"


BASELINE = Schedule(granularity="none")
SHARD = Schedule(granularity="shard", pattern="ring")


TIE = 0.02
"""Two schedule times within this fraction of each other are a tie, everywhere: near-opt@2%
scores a choice within it of the best (``ficco_select.train.metrics``), a choice is a slowdown only
beyond it over the baseline (``ficco_select.train.shipped``), a measured label counts a schedule as
near-best unless it is shown slower by more (``MeasureConfig.tie_floor``), and the simulator
and the overlap map use it as their floor."""


def parse(name: str) -> Schedule:
    """Inverse of ``Schedule.name``."""
    parts = str(name).split(".")
    try:
        if parts[0] == "none" and len(parts) == 2:
            return Schedule(granularity="none", engine=parts[1])
        if parts[0] == "shard" and len(parts) == 3 and parts[1] == "ring":
            return Schedule(granularity="shard", pattern="ring", engine=parts[2])
        # ASCII digits only: str.isdigit takes '³' (int() refuses it) and '٣' (a name that is not its schedule's)
        if parts[0] == "ficco" and len(parts) == 6 and parts[1][:1] == "d" and parts[1][1:].isascii() \
                and parts[1][1:].isdigit():
            return Schedule(granularity="ficco", degree=int(parts[1][1:]), pattern=parts[2],
                            compute=parts[3], split=parts[4], engine=parts[5])
    except ScheduleError as e:
        raise ScheduleError(f"invalid schedule name {name!r}: {e}") from None
    raise ScheduleError(
        f"invalid schedule name {name!r}; expected none.<engine>, shard.ring.<engine> or "
        "ficco.d<d>.<ring|a2a>.<gemm_per_piece|gemm_per_step>.<m|n>.<sm|dma|switch>"
    )


# -- backends ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendCaps:
    """What a backend can honestly execute."""

    engines: tuple[str, ...]
    """Engines whose schedules it offers as candidates (the cpu backend has no DMA engine and
    no switch; its executor runs the switch's schedules on a shared-memory stand-in, for
    verification, but never offers them)."""
    dtypes: tuple[str, ...]
    max_world_size: int


BACKENDS: dict[str, BackendCaps] = {
    # gloo moves bytes with CPU threads that share the cores with the GEMMs: that is `sm`.
    "cpu": BackendCaps(engines=("sm",), dtypes=("float32", "bfloat16"), max_world_size=8),
    "cuda": BackendCaps(engines=("sm", "dma", "switch"), dtypes=("float32", "bfloat16", "float16"), max_world_size=64),
    # fp8 GEMMs need scaled matmuls the executor does not run yet: only the simulator has fp8.
    "sim": BackendCaps(engines=("sm", "dma", "switch"), dtypes=("float32", "bfloat16", "float16", "float8_e4m3fn"),
                       max_world_size=1024),
}


def backend_problem(scenario: Scenario, backend: str) -> str | None:
    """Why `backend` cannot run `scenario` at all (naming the column), or None."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}"
    caps = BACKENDS[backend]
    if scenario.world_size > caps.max_world_size:
        return (f"column 'world_size': {scenario.world_size} exceeds what the {backend} backend "
                f"runs (at most {caps.max_world_size})")
    if scenario.dtype not in caps.dtypes:
        return f"column 'dtype': the {backend} backend does not run {scenario.dtype} (runs {', '.join(caps.dtypes)})"
    return None


def hardware_problem(scenario: Scenario, backend: str, spec: HardwareSpec) -> str | None:
    """Why rows of `backend` cannot carry `spec` as the scenario's machine (naming the
    column), or None. The cpu backend measures this machine's CPU, so its rows never name a
    GPU; the cuda backend measures a GPU; a spec describes one node of ``devices`` ranks."""
    if backend == "cpu" and spec.kind == "gpu":
        return (f"column 'hardware': {spec.name!r} is a GPU ({spec.copy_engines} copy engines), but the cpu "
                "backend measures this machine's CPU; set the column to cpu (or a spec without copy "
                "engines), or measure that GPU with --backend cuda")
    if backend == "cuda" and spec.kind == "cpu":
        return (f"column 'hardware': {spec.name!r} is not a GPU (no copy engines), but the cuda backend "
                "measures this machine's GPU; set the column to its preset name (e.g. h100-nvswitch) or "
                "spec file, or use --backend cpu")
    if backend in ("sim", "cuda") and (beyond := spec.beyond_devices(scenario.world_size)):
        return f"column 'world_size': {beyond}"
    return None


def backend_for(kind: str, *, runs: bool = False) -> str:
    """The backend of a machine of `kind` (``HardwareSpec.kind``): ``cpu`` on the cpu kind; on
    a GPU, ``cuda`` where a call runs (the executor's schedules) and ``sim`` where it is
    decided or predicted (the simulator's candidates, fp8 and larger worlds included)."""
    if kind == "cpu":
        return "cpu"
    return "cuda" if runs else "sim"


def engines_on(backend: str, spec: HardwareSpec) -> tuple[str, ...]:
    """Engines whose schedules `backend` has for a scenario on `spec`: on a GPU, ``dma`` only
    on a machine with copy engines and ``switch`` only where the spec's fabric reduces in the
    switch (``switch_reduce``). The cuda backend's measurements and exploration leave the
    switch out: its executor path has never run on a GPU (a decision for it still runs, or
    falls back to its sm twin: ``runtime.running.comm_for``)."""
    engines = BACKENDS[backend].engines
    if backend == "cuda":
        engines = tuple(e for e in engines if e != "switch")
    return tuple(e for e in engines if e in spec.engines) if backend in ("sim", "cuda") else engines


def degrees(world_size: int) -> tuple[int, ...]:
    """Decomposition degrees tried: 2, 4 and P (the paper's one level deeper), deduplicated."""
    return tuple(sorted({2, 4, world_size}))


def split_extent(scenario: Scenario, split: str) -> int | None:
    """Size of a shard along `split` (what d pieces must fit in), or None if not legal."""
    P = scenario.world_size
    if split == "m":
        # ag_gemm: rows of A_r; gemm_rs, gemm_ar: rows of an output block; the MoE ops: mean
        # chunk of tokens.
        return scenario.m // P
    if split == "n" and scenario.op in ("gemm_rs", "gemm_ar"):
        return scenario.n
    return None


def is_legal(schedule: Schedule, scenario: Scenario, backend: str) -> bool:
    if backend_problem(scenario, backend) is not None:
        return False
    if schedule.engine not in BACKENDS[backend].engines:
        return False
    if schedule.engine == "switch" and scenario.op not in SWITCH_OPS:
        return False
    if schedule.granularity != "ficco":
        return True
    P = scenario.world_size
    if schedule.degree not in degrees(P):
        return False
    # At P = 2 there is one peer: the a2a pattern is the ring.
    if schedule.pattern == "a2a" and P < 3:
        return False
    extent = split_extent(scenario, schedule.split)
    if extent is None or extent < schedule.degree:
        return False
    # gemm_ar's a2a pattern is its piece-wise all-reduce, along m only.
    if scenario.op == "gemm_ar" and schedule.pattern == "a2a" and schedule.split != "m":
        return False
    if schedule.compute == "gemm_per_step":
        # A per-step GEMM needs its step's pieces in one (strided) block: column pieces of
        # gemm_rs are not, and uneven token chunks of an a2a step are not.
        if schedule.split != "m":
            return False
        if scenario.op in ("a2a_gemm", "gemm_a2a") and schedule.pattern == "a2a":
            return False
    return True


def all_schedules(world_size: int, engines: tuple[str, ...] = ENGINES) -> list[Schedule]:
    """Every schedule of the space for a world size, legal or not for a given shape."""
    out: list[Schedule] = []
    for engine in engines:
        out.append(Schedule(granularity="none", engine=engine))
        if engine != "switch":
            out.append(Schedule(granularity="shard", pattern="ring", engine=engine))
        for d in degrees(world_size):
            for pattern in PATTERNS:
                for compute in COMPUTES:
                    for split in SPLITS:
                        if engine == "switch" and (pattern != "a2a" or split != "m"):
                            continue
                        out.append(Schedule(granularity="ficco", degree=d, pattern=pattern,
                                            compute=compute, split=split, engine=engine))
    return out


def candidates(scenario: Scenario, backend: str, spec: HardwareSpec | None = None) -> list[Schedule]:
    """Legal schedules of `scenario` on `backend`, baseline first; [] if it cannot run. With
    `spec`, only its engines' (``engines_on``): a GPU without copy engines has no ``dma``
    schedule, one whose fabric does not reduce in the switch no ``switch`` schedule; without,
    the backend's engines but the switch."""
    return list(legal_candidates(scenario, backend, spec))


def legal_candidates(scenario: Scenario, backend: str, spec: HardwareSpec | None = None) -> tuple[Schedule, ...]:
    """``candidates(scenario, backend, spec)`` as a tuple, shared: the runtime selector's path.

    Cached per legality key: what ``is_legal`` reads of a scenario is its op, world size P
    and dtype, and the shard extents (rows m // P; columns n for gemm_rs, gemm_ar) only through
    ``extent < degree``; clipped at the largest degree, every such comparison is unchanged.
    A new key enumerates with ``is_legal`` itself, on the scenario at hand.
    """
    if backend not in BACKENDS:
        return ()
    # Without a spec, no switch: only a fabric that says so reduces in the switch.
    engines = tuple(e for e in BACKENDS[backend].engines if e != "switch") if spec is None else engines_on(backend, spec)
    return engine_candidates(scenario, backend, engines)


def engine_candidates(scenario: Scenario, backend: str, engines: tuple[str, ...]) -> tuple[Schedule, ...]:
    """The legal schedules of `scenario` on `backend` that run on `engines`, cached (the
    simulator's path: it knows its machine's engines, not always its spec)."""
    P = scenario.world_size
    top = _max_degree(P)
    op = scenario.op
    key = (op, P, scenario.dtype, backend, min(scenario.m // P, top),
           min(scenario.n, top) if op in ("gemm_rs", "gemm_ar") else 0, engines)
    legal = _LEGAL.get(key)
    if legal is None:
        legal = tuple(s for s in _enumerate_legal(scenario, backend) if s.engine in engines)
        if len(_LEGAL) >= _LEGAL_LIMIT:
            _LEGAL.clear()
        _LEGAL[key] = legal
    return legal


_LEGAL: dict[tuple, tuple[Schedule, ...]] = {}
_LEGAL_LIMIT = 1 << 14
"""Legality keys the candidate cache holds before it starts over."""


@functools.lru_cache(maxsize=1024)
def _max_degree(world_size: int) -> int:
    return max(degrees(world_size))


def _enumerate_legal(scenario: Scenario, backend: str) -> tuple[Schedule, ...]:
    """The legal schedules, by ``is_legal`` on every schedule of the space (uncached)."""
    if backend_problem(scenario, backend) is not None:
        return ()
    return tuple(s for s in all_schedules(scenario.world_size, BACKENDS[backend].engines)
                 if is_legal(s, scenario, backend))
