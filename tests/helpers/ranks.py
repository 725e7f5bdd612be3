"""Real gloo ranks for the torch ops' tests: one job per test, every rank running `fn`.

A rank starts from fresh torch_ops state with the heuristic selector on the cpu preset (no
exported model), collects its mismatches and fails with all of them.

The ranks are forked from a server that imported torch and the runtime once per test
process (started by its first job; no test that runs ranks here patches the environment,
which the server keeps): a 4-rank job starts in about 0.1 s instead of paying a torch
import (about 3 s on 2 cores) per rank.
"""

import contextlib
import multiprocessing as mp
import time
from pathlib import Path

import torch

from ficco_select.executor import ranks
from ficco_select.executor.operators import TOLERANCE, relative_error
from ficco_select.runtime import checks, torch_ops
from ficco_select.runtime.selector import Selector
from ficco_select.schedule import all_schedules


PRELOAD = ["torch", "torch.distributed", "ficco_select.runtime.torch_ops", "ficco_select.runtime.selector",
           "ficco_select.executor.ranks", "ficco_select.data.measure.gloo"]
"""What the suite's forkserver imports once for every rank it forks (tests/conftest.py)."""


def _entry(rank: int, P: int, fn, tmp: str) -> None:
    try:
        torch_ops.reset()
        torch_ops.configure(selector=Selector(), hardware="cpu")  # heuristic; no exported model
        fn(rank, P, Path(tmp))
    finally:
        torch_ops.reset()


def spawn(fn, P: int, tmp: Path) -> None:
    """`fn(rank, P, tmp)` on P gloo ranks (``ficco_select.executor.ranks``); a rank's failure
    raises ``RankError`` with its message."""
    ranks.run_ranks(_entry, P, (fn, str(tmp)), timeout_s=600)  # forked from the suite's server (conftest.py)


def rand(gen, *shape, dtype=torch.float32):
    return (torch.rand(*shape, generator=gen) * 2 - 1).to(dtype)


def pinnable(P: int, engine: str = "sm") -> list[str]:
    return [s.name for s in all_schedules(P, engines=(engine,))] + [""]  # "" = the selector decides


def check_close(got, want, dtype, what, failures):
    err = relative_error(got, want.float())
    if not err <= TOLERANCE[{torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]]:
        failures.append(f"{what}: rel. error {err:.3g} (shape {tuple(got.shape)} vs {tuple(want.shape)})")


@contextlib.contextmanager
def counting_checks():
    """The per-call shape comparisons that run inside (each one host all-gather), listed by
    the text each rank passed, with the debug mode on (it is off by default): the real check
    still runs, it is only counted."""
    texts = []
    real = checks._gathered
    settings = torch_ops.dispatch.settings()
    was_on = settings.check_calls

    def counted(group, mine, size):
        # A call's check text starts with its run_check: "0", a call its caller vouched for,
        # joins the exchange but is not compared, so it is not counted.
        if not mine.startswith("0"):
            texts.append(mine.removeprefix("1"))
        return real(group, mine, size)

    checks._gathered = counted
    settings.check_calls = True
    try:
        yield texts
    finally:
        checks._gathered = real
        settings.check_calls = was_on


def rank_processes() -> list:
    """This process's live children, less joblib's reusable worker pool (an evaluation another
    test ran here keeps it): the ranks a job may have left behind."""
    return [p for p in mp.active_children() if type(p).__name__ != "LokyProcess"]


def no_rank_left(wait_s: float = 5.0) -> bool:
    """Whether every rank process is gone, given `wait_s` to be reaped."""
    deadline = time.monotonic() + wait_s
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not rank_processes()
