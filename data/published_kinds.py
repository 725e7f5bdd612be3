"""Which published rows reduce or multicast in the switch, and the schedule each is.

NVLink SHARP (NCCL's NVLS algorithms and symmetric kernels, PyTorch's symmetric-memory
``multimem`` ops) reduces and multicasts in the NVSwitch. A row whose ``baseline`` cell names
one of ``SWITCH_COLLECTIVES`` is such a collective: a plain collective of it is a
``switch_collective`` point (predicted with ``costs.switch_collective_time`` on its preset), and
a collective + GEMM whose serial baseline runs it has ``none.switch`` for its baseline schedule
(the GEMM, then the collective in the switch) where the others have ``none.sm``. A ``method``
cell naming one of ``SWITCH_METHODS`` is that schedule of ours, measured: the twin of a
``none.switch`` pick (``published_calls``)."""

from __future__ import annotations

import re

SWITCH_COLLECTIVES = ("symm_mem_multimem", "multimem_all_reduce_", "multimem_one_shot_all_reduce",
                      "multimem_all_gather", "NCCL_ALGO=NVLS", "NCCL_ALGO=NVLSTree", "LDMC")
"""Names, in a ``baseline`` cell, of collectives the switch reduces or multicasts: vLLM's
``benchmark_device_communicators.py`` column ``symm_mem_multimem`` (PyTorch's
``multimem_all_reduce_``), PyTorch's multimem ops, nccl-tests with NVLS forced, and NCCL's
symmetric all-reduce that loads through the multicast address (``LDMC``: ``multimem.ld_reduce``).
NCCL run without its algorithm stated is not among them: it picks NVLS by size."""
SWITCH_METHODS = {"_multimem_all_gather_matmul": "none.switch"}
"""Published methods that are a switch schedule of ours (named in the ``method`` cell):
PyTorch's ``_multimem_all_gather_matmul`` gathers the whole input by multicast stores, then
multiplies it: the collective in the switch, then one GEMM."""
LIBRARY_BASELINE = "none.sm"
SWITCH_BASELINE = "none.switch"


def _names(cell: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9])", cell) for name in names)


def reduces_in_switch(baseline_cell: str) -> bool:
    """Whether a row's ``baseline`` cell names a collective the switch reduces or multicasts."""
    return _names(baseline_cell, SWITCH_COLLECTIVES)


def baseline_schedule(baseline_cell: str) -> str:
    """The serial schedule a collective + GEMM row's baseline runs: ``none.switch`` where its
    collective is one the switch carries, else the library's (``none.sm``)."""
    return SWITCH_BASELINE if reduces_in_switch(baseline_cell) else LIBRARY_BASELINE


def switch_method(method_cell: str) -> str:
    """The switch schedule a ``method`` cell names, or ""."""
    return next((s for name, s in SWITCH_METHODS.items() if _names(method_cell, (name,))), "")


def is_switch(schedule: str) -> bool:
    """A switch pick: ``none.switch`` or a decomposed schedule on the ``switch`` engine."""
    return schedule.endswith(".switch")
