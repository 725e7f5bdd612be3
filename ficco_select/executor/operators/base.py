"""What every operator shares: one rank's buffers and inputs, the compute switches, the
piece arithmetic, and the dispatch of the collective-first operators.

Notation (rank r, world size P): shards and blocks are indexed by rank; a shard is cut
into d pieces along the schedule's split dimension (pieces differ in size by at most one
row or column). Transfers of one step carry the same tag on both ends.
"""

from __future__ import annotations

import contextlib
import functools
import zlib

import torch

from ficco_select.executor.comm import NullComm, P2PComm
from ficco_select.executor.cuda import make_timer
from ficco_select.executor.switch import switch_steps
from ficco_select.scenario import Scenario
from ficco_select.schedule import Schedule

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes the executor's GEMMs run, by their names in ``scenario.DTYPES`` (torch's own)."""
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
"""The name of each of those torch dtypes, as a scenario's ``dtype`` column writes it."""


def dtype_name(dtype: torch.dtype) -> str:
    """Any torch dtype's name as a scenario's ``dtype`` column writes it (torch's, unprefixed:
    ``bfloat16``, ``float8_e4m3fn``)."""
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=4096)
def piece_bounds(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """[start, end) of `parts` nearly equal pieces of range(total) (sizes differ by <= 1).
    Cached: every call of a shape asks for the same pieces."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class Operator:
    """One rank's share of an operator: buffers, schedules, reference."""

    def __init__(self, scenario: Scenario, comm: P2PComm, *, seed: int = 0, device: str = "cpu", **inputs) -> None:
        self._set_up(scenario, comm, seed, device)
        self._bind(**inputs)

    @classmethod
    def template(cls, scenario: Scenario, comm: P2PComm, *, device: str = "cpu") -> "Operator":
        """The operator's shape set-up without inputs or buffers: made once per call shape,
        then ``for_call`` per call (the runtime's path)."""
        op = object.__new__(cls)
        op._set_up(scenario, comm, 0, device)
        return op

    def for_call(self, **inputs) -> "Operator":
        """A copy of this template holding one call's inputs and fresh buffers (from the
        allocator, as PyTorch's own ops take theirs: nothing outlives the call)."""
        op = object.__new__(type(self))
        op.__dict__.update(self.__dict__)
        op._bind(**inputs)
        return op

    def _set_up(self, scenario: Scenario, comm: P2PComm, seed: int, device: str) -> None:
        """What depends on the call's shape only."""
        self.scenario = scenario
        self.comm = comm
        self.r, self.P = comm.rank, comm.world_size
        if self.P != scenario.world_size:
            raise ValueError(f"process group has {self.P} ranks but scenario world_size={scenario.world_size}")
        self.dtype = TORCH_DTYPES[scenario.dtype]
        self.device = device
        self.seed = seed

    def _bind(self, **inputs) -> None:  # pragma: no cover - abstract
        """Take one call's inputs (random ones where absent: measurement) and allocate its buffers."""
        raise NotImplementedError

    @functools.cached_property
    def gen(self) -> torch.Generator:
        # Inputs depend on (scenario, rank, seed) only: every run of every schedule sees the
        # same. Seeded on first use: a runtime call brings its inputs and never needs it.
        return torch.Generator().manual_seed(zlib.crc32(f"{self.scenario.scenario_id}/{self.r}/{self.seed}".encode()))

    def _rand(self, *shape: int) -> torch.Tensor:
        # Scaled so that GEMM outputs are O(1) whatever k is: bf16 keeps its relative precision.
        x = torch.rand(*shape, generator=self.gen) * 2 - 1
        return x.to(device=self.device, dtype=self.dtype)

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, device=self.device, dtype=self.dtype)

    # Every GEMM and reduction add of every schedule goes through these three, so a
    # schedule can also run as its communication skeleton (compute off) to measure
    # chunking loss, or as its compute skeleton (comm off) to measure DIL.
    compute_on = True

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        if self.compute_on:
            torch.mm(a, b, out=out)

    def bmm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        if self.compute_on:
            torch.bmm(a, b, out=out)

    def add_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.compute_on:
            dst += src

    @contextlib.contextmanager
    def skeleton(self, *, compute: bool = True, comm: bool = True):
        """Run schedules with their compute or their communication switched off."""
        saved = self.comm
        self.compute_on = compute
        if not comm:
            self.comm = NullComm(saved.rank, saved.world_size)
        try:
            yield self
        finally:
            self.compute_on = True
            self.comm = saved

    def contended(self) -> float:
        """The whole GEMM while the whole collective's transfers are in flight.

        Returns the GEMM's own time (the caller times the whole): GEMM slowdown versus
        compute alone is the contention loss (CIL) of this backend's engine.
        """
        works = self._start_whole_collective()
        # On CUDA, events on the compute stream: the comm streams are still busy, so a
        # device-wide synchronize would time the transfers too.
        timer = make_timer(self.device)
        timer.start()
        self.compute_alone()
        timer.stop()
        self.comm.wait(works)
        return timer.seconds()

    def _start_whole_collective(self) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    # Subclasses implement these.
    def run(self, schedule: Schedule) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def reference(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def comm_alone(self) -> None:
        """The baseline's collective only (to time communication alone)."""
        raise NotImplementedError

    def compute_alone(self) -> None:
        """The baseline's whole GEMM only (to time compute alone)."""
        raise NotImplementedError

    def poison(self) -> None:
        """Fill receive and output buffers with NaN so stale data cannot pass verification."""
        for buf in self._scratch():
            buf.fill_(float("nan"))

    def _scratch(self) -> list[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError


class CollectiveThenGemm(Operator):
    """An operator whose collective feeds its GEMM (ag_gemm, a2a_gemm): the GEMMs consume
    pieces as they arrive, and every schedule writes the same output buffer ``out``."""

    out: torch.Tensor

    def run(self, sch: Schedule) -> torch.Tensor:
        if sch.engine == "switch":  # the a2a steps' all-gathers are the switch comm's multicasts
            switch_steps(self.comm, self.scenario.op, sch)
        if sch.granularity == "none":  # the whole collective, then the whole GEMM
            if sch.engine == "switch":
                self.comm.wait(self._start_whole_collective())  # one multicast of the whole shard
            else:
                self.comm_alone()
            self.compute_alone()
        elif sch.pattern == "ring":
            self._run_ring(sch.degree, per_step=sch.compute != "gemm_per_piece")
        else:
            self._run_a2a(sch.degree, per_step=sch.compute == "gemm_per_step")
        return self.out

    def _run_ring(self, d: int, per_step: bool) -> None:  # pragma: no cover - abstract
        """One peer per step (shard schedules too: d = 1, per_step); d pieces per shard."""
        raise NotImplementedError

    def _run_a2a(self, d: int, per_step: bool) -> None:  # pragma: no cover - abstract
        """Step j moves piece j of every peer's data at once."""
        raise NotImplementedError
