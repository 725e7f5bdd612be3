"""Ranks that pass different shapes with the per-call check off (the default, PyTorch's own
contract): the job ends in an error on every rank, unless the shapes still define the result
and every rank has it; no rank gets past its next collective with a wrong result, and no rank
waits on the group's timeout.

Each case is a fresh job: one process per rank (forked from a server that has imported torch
once; a few cases at a time, as each mostly waits on its ranks' sockets), check off, one op
called once with the last rank's M, N or K differing, then a barrier
(the job's next collective). A rank that raises exits at once, as a job's rank does: gloo
then fails its peers' waits on it ("Connection closed by peer"). What gloo sees: a message
longer than the buffer posted for it aborts the receiving process; a shorter one is taken
silently, so a rank may return a wrong tensor from the op itself, and fails at its next
collective, its peer gone (the ``returned`` field). After calls the ranks agreed on ("warm"),
a new token count is a lookup in the layer's table and fails the same way; a rank meeting a
new layer alone waits in the broadcast of its table while the others run theirs, and every
rank raises at the group's timeout (the one case here that waits on it, with a 5 s timeout).

With the debug mode on (PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` or ``FICCO_CHECK_CALLS``),
the same calls are refused on every rank before any transfer, naming the op, the ranks and the
shapes (the last tests here).

One wait is gloo's, not ficco's, and ends at the group's timeout: a send written at the moment
its peer dies. gloo's asynchronous write takes EPIPE/ECONNRESET as "try later" and queues the
send, and closing the pair fails the queued sends of bound buffers only (``Pair::signalException``
in gloo/transport/tcp/pair.cc skips ``op.ubuf``), while ``ProcessGroupGloo::send`` posts
unbound ones: that send's wait ends with gloo's "Timed out waiting ... for send operation". It
was seen about once in a hundred runs of a ring case beside busy processes; PyTorch's own
``isend`` takes the same path. Each case's group timeout is therefore short, and a rank whose
peer died first may raise that timeout; any other wait past 10 s, and any rank still waiting
when the launcher gives up, fails the test.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ficco_select.executor import ranks
from ficco_select.runtime import torch_ops
from ficco_select.runtime.selector import Selector
from helpers.ranks import rand, spawn

TIMEOUT_S = 20
"""The group's timeout: a rank waiting on it shows as a case that takes this long (it raises
before the launcher's watch, at twice this, gives up on it)."""
GLOO_SEND_TIMEOUT = "for send operation to complete"
"""gloo's error for a send queued as its peer died (the module's docstring)."""
WARM_TIMEOUT_S = 5
CONCURRENT_CASES = 4
"""Cases run at once: a case is ranks exchanging a few bytes and one dying, mostly waits."""
"""The group's timeout of the case that waits on it (a rank meeting a new layer alone)."""
BASE, ODD = 8, 12
"""Every dimension is BASE on every rank but the last, whose differing one is ODD."""
SCHEDULES = ("none.sm", "shard.ring.sm", "ficco.d2.ring.gemm_per_piece.m.sm", "")
"""The baseline (PyTorch's own collective), shard-level and finer ring overlap, and the
selector's own pick ("": its layer tables)."""


def _shapes(dim: str, rank: int, P: int) -> dict[str, int]:
    """`dim` ("" for none) differs on the last rank."""
    odd = rank == P - 1
    return {d: (ODD if odd and d == dim else BASE) for d in "MNK"}


def _inputs(op: str, dim: str, rank: int, P: int):
    """Rank `rank`'s inputs: A (its rows or shard, its K), W (its K, its N); seeded by rank, so
    any rank can make every rank's."""
    s = _shapes(dim, rank, P)
    gen = torch.Generator().manual_seed(rank)
    A = torch.rand(s["M"] * (1 if op == "ag" else P), s["K"], generator=gen) * 2 - 1
    return A, torch.rand(s["K"], s["N"], generator=gen) * 2 - 1


def _expected(op: str, dim: str, rank: int, P: int) -> torch.Tensor | None:
    """The result where the ranks' shapes still define one, else None (any result is wrong).
    An all-gather matmul needs the same M and K everywhere (each rank's own N is its own
    business); a reduce of partial products needs the same M and N (K is each rank's slice)."""
    if (op == "ag" and dim == "N") or (op in ("rs", "ar") and dim == "K"):
        every = [_inputs(op, dim, q, P) for q in range(P)]
        if op == "ag":
            return torch.cat([A for A, _ in every]) @ every[rank][1]
        total = sum(A @ W for A, W in every)
        return total if op == "ar" else total.chunk(P)[rank]
    return None


def _rank(rank: int, P: int, case: dict) -> dict:
    """One rank of a case: what it saw (``outcome`` ok), or raised after reporting what it saw."""
    import torch.distributed as dist

    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector

    op, dim = case["op"], case["dim"]
    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", store=ranks.rendezvous(), rank=rank, world_size=P,
                                timeout=datetime.timedelta(seconds=case.get("timeout", TIMEOUT_S)))
        torch_ops.configure(selector=Selector(), hardware="cpu", schedule=case["schedule"])
        assert not torch_ops.dispatch.checks_calls()
        g = dist.group.WORLD.group_name
        call = {"ag": lambda A, W: torch_ops.all_gather_matmul(A, [W], 0, g, return_A=False)[1][0],
                "rs": lambda A, W: torch_ops.matmul_reduce_scatter(A, W, "sum", 0, g),
                "ar": lambda A, W: torch_ops.matmul_all_reduce(A, W, "sum", g)}[op]
        if case.get("warm"):  # the ranks agree first: every plan the call needs is made
            call(*_inputs(op, "", rank, P))
        got = call(*_inputs(op, dim, rank, P))
        want = _expected(op, dim, rank, P)
        right = want is not None and got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
        result.update(returned=True, right=bool(right), ran=sorted({d.schedule.name for d in torch_ops.dispatch.decisions().values()}))
        dist.barrier()  # the job's next collective: a step cannot complete past it
    except Exception:
        ranks.report("seen", result)
        raise  # the launcher's rank leaves at once, as a job's would
    return {**result, "outcome": "ok"}


def _run_case(case: dict) -> list[dict]:
    """Every rank's outcome: ok, raised (with what it saw first), died (gloo aborts a process
    that meets a collective of another size) or hung (waited far longer than any error takes)."""
    seen = {}
    outcomes = ranks.launch(_rank, case["P"], (case,), timeout_s=2 * TIMEOUT_S, group=None, stop_on_error=False,
                            start_method="forkserver", on_report=lambda kind, result: seen.update({result["rank"]: result}))
    results = []
    for o in outcomes:
        if o.ok:
            res = o.value
        elif o.exitcode is None:
            res = {"rank": o.rank, "outcome": "hung"}
        elif o.exitcode == 1 and o.rank in seen:
            res = {**seen[o.rank], "outcome": "raised", "error": o.error.splitlines()[0][:200],
                   "gloo_send_timeout": GLOO_SEND_TIMEOUT in o.error}
        else:
            res = {"rank": o.rank, "outcome": "died", "exitcode": o.exitcode}
        results.append({**res, "seconds": round(o.seconds, 1)})
    return results


CASES = (# A rank meeting a new layer (another N) alone waits in the broadcast of its table while
         # the others run their plan: every rank raises at the group's timeout, not before.
         # First: the longest case, the others run beside it.
         [{"op": "rs", "schedule": "", "dim": "N", "P": 2, "warm": True, "timeout": WARM_TIMEOUT_S}]
         + [{"op": op, "schedule": s, "dim": dim, "P": 2} for op in ("ag", "rs", "ar") for s in SCHEDULES
          for dim in "MNK"]
         + [{"op": op, "schedule": "ficco.d2.a2a.gemm_per_step.m.sm", "dim": dim, "P": 3}
            for op in ("ag", "rs", "ar") for dim in "MN"]
         # After calls the ranks agreed on: a new token count is a lookup in the layer's table
         # (no collective), so the transfers disagree at once.
         + [{"op": op, "schedule": "", "dim": "M", "P": 2, "warm": True} for op in ("ag", "rs", "ar")])


@pytest.mark.gloo
def test_ranks_passing_different_shapes_never_return_a_wrong_result_nor_hang():
    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "ficco_select.runtime.torch_ops",
                                                         "ficco_select.runtime.selector", __name__])
    bad, seen = [], set()
    with ThreadPoolExecutor(CONCURRENT_CASES) as pool:
        outcomes = list(pool.map(_run_case, CASES))
    for case, results in zip(CASES, outcomes):
        seen |= {res["outcome"] for res in results}
        for res in results:
            wrong = res["outcome"] == "ok" and not res["right"]  # past the barrier with a wrong result
            if wrong or res["outcome"] == "hung" or res["seconds"] >= case.get("timeout", TIMEOUT_S) + 10:
                bad.append((case, res))
            peer_died = any(other["outcome"] == "died" for other in results if other is not res)
            gloo_wait = res.get("gloo_send_timeout") and peer_died  # gloo's queued send (docstring)
            if "timeout" not in case and res["seconds"] >= 10 and not gloo_wait:  # an error reaches every rank at once
                bad.append((case, res))
        if _expected(case["op"], case["dim"], 0, case["P"]) is None:
            # No result is right: every rank must end in an error.
            assert all(res["outcome"] != "ok" for res in results), (case, results)
    assert not bad, "\n".join(map(str, bad))
    assert seen >= {"ok", "raised", "died"}, seen  # the ranks ran the op: every way a job ends was seen


# -- with the debug mode on -------------------------------------------------------------------
def _raises_on_this_rank(call, *needles: str) -> None:
    with pytest.raises(ValueError) as caught:
        call()
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def check_disagreeing_ranks(rank: int, P: int, tmp: Path) -> None:
    # The debug mode, off by default, turned on by PyTorch's own switch (read when ficco's
    # settings are made: here, at reset).
    assert not torch_ops.dispatch.checks_calls()
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    torch_ops.reset()
    torch_ops.configure(selector=Selector(), hardware="cpu")
    assert torch_ops.dispatch.checks_calls()
    gen = torch.Generator().manual_seed(rank)
    g = dist.group.WORLD.group_name
    m = 4 if rank == 0 else 6  # rows of this rank's shard
    B = rand(gen, 8, 6)
    ag = lambda rows: torch_ops.all_gather_matmul(rand(gen, rows, 8), [B], 0, g)  # noqa: E731
    _raises_on_this_rank(lambda: ag(m), "all_gather_matmul", "rank 1", "(6, 8)", "(4, 8)")
    # A shape every rank has passed before, then one rank's new one: still refused on both.
    ag(4)
    _raises_on_this_rank(lambda: ag(m), "all_gather_matmul", "rank 1", "(6, 8)", "(4, 8)")
    _raises_on_this_rank(lambda: torch_ops.matmul_reduce_scatter(rand(gen, 2 * m, 8), B, "sum", 0, g),
                         "matmul_reduce_scatter", "rank 1", "(12, 8)", "(8, 8)")
    _raises_on_this_rank(lambda: torch_ops.matmul_all_reduce(rand(gen, 2 * m, 8), B, "sum", g),
                         "matmul_all_reduce", "rank 1", "(12, 8)", "(8, 8)")
    k = 8 if rank == 0 else 6  # the experts' contraction dim
    _raises_on_this_rank(lambda: torch_ops.all_to_all_matmul(rand(gen, 6, k), rand(gen, k, 5), [3, 3], [3, 3], g),
                         "all_to_all_matmul", "rank 1", "(6, 6)", "(6, 8)")
    # Rank 1 expects 4 rows from rank 0, which sends it 3.
    expects = [3, 3] if rank == 0 else [4, 3]
    _raises_on_this_rank(lambda: torch_ops.all_to_all_matmul(rand(gen, 6, 8), rand(gen, 8, 5), expects, [3, 3], g),
                         "all_to_all_matmul", "rank 1 expects 4 rows from rank 0", "sends it 3")
    _raises_on_this_rank(lambda: torch_ops.matmul_all_to_all(rand(gen, 6, 8), rand(gen, 8, 5), expects, [3, 3], g),
                         "matmul_all_to_all", "rank 1 expects 4 rows from rank 0", "sends it 3")
    n = 5 if rank == 0 else 7
    _raises_on_this_rank(lambda: torch_ops.matmul_all_to_all(rand(gen, 6, 8), rand(gen, 8, n), [3, 3], [3, 3], g),
                         "matmul_all_to_all", "rank 1", "(8, 7)", "(8, 5)")
    # The group is still in step: a call the ranks agree on runs.
    A_shard = rand(gen, 4, 8)
    _, [got] = torch_ops.all_gather_matmul(A_shard, [B], 0, g)
    full = torch.empty(P * 4, 8)
    dist.all_gather_into_tensor(full, A_shard)
    torch.testing.assert_close(got, full @ B)


@pytest.mark.gloo
def test_ranks_passing_different_shapes_raise_on_every_rank(tmp_path):
    spawn(check_disagreeing_ranks, 2, tmp_path)


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, True),
    ({"TORCH_DISTRIBUTED_DEBUG": "INFO"}, False),
    ({"FICCO_CHECK_CALLS": "1"}, True),
    ({"FICCO_CHECK_CALLS": "0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, False),
])
def test_the_per_call_check_is_a_debug_mode_off_by_default(monkeypatch, env, on):
    from ficco_select.runtime import dispatch

    for name in ("TORCH_DISTRIBUTED_DEBUG", "FICCO_CHECK_CALLS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert dispatch.Settings().check_calls is on


# -- ranks that set the debug mode differently -----------------------------------------------
SETTING_TIMEOUT_S = 20
"""The group's timeout in the cases below: a rank waiting on it would take this long (the
test asks for an error within 10 s)."""


def _setting_on_one_rank(rank: int, P: int, case: dict) -> dict:
    """One rank of a job where only the last rank turns the check on (by `case["how"]`), then
    every rank calls `case["op"]`: what it raised and how long that took."""
    import time

    from torch import nn

    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import install, parallelize

    odd = rank == P - 1
    for name in ("FICCO_CHECK_CALLS", "TORCH_DISTRIBUTED_DEBUG"):
        os.environ.pop(name, None)
    if odd and case["how"] != "configure":
        name, value = case["how"].split("=")
        os.environ[name] = value
    torch_ops.reset()  # the settings read the environment when they are made
    torch_ops.configure(selector=Selector(), hardware="cpu", check_calls=True if odd and case["how"] == "configure"
                        else None)
    assert torch_ops.dispatch.checks_calls() is odd
    g = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    A, W = torch.rand(8, 8, generator=gen), torch.rand(8, 8, generator=gen)
    t0 = time.monotonic()
    try:
        if case["op"] == "ag":
            torch_ops.all_gather_matmul(A, [W], 0, g)
        elif case["op"] == "rs":
            torch_ops.matmul_reduce_scatter(A, W, "sum", 0, g)
        elif case["op"] == "ar":
            torch_ops.matmul_all_reduce(A, W, "sum", g)
        else:  # the hook of a tensor-parallel MLP, which builds its layers' tables at install
            mlp = parallelize(nn.Sequential(nn.Linear(8, 8 * P), nn.GELU(), nn.Linear(8 * P, 8)),
                              {"0": "colwise", "2": "rowwise"}, dist.group.WORLD)
            with install(mlp):
                mlp(A.reshape(4, 2, 8)).sum().backward()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    finally:
        torch_ops.reset()
    return {"raised": None, "seconds": time.monotonic() - t0}


@pytest.mark.gloo
@pytest.mark.parametrize(("how", "op"), [("FICCO_CHECK_CALLS=1", "ag"), ("TORCH_DISTRIBUTED_DEBUG=DETAIL", "rs"),
                                         ("configure", "ar"), ("FICCO_CHECK_CALLS=1", "install")])
def test_ranks_setting_the_per_call_check_differently_all_raise_naming_it_not_hang(how, op):
    outcomes = ranks.launch(_setting_on_one_rank, 2, ({"how": how, "op": op},), timeout_s=2 * SETTING_TIMEOUT_S,
                            group_timeout_s=SETTING_TIMEOUT_S, stop_on_error=False, start_method="forkserver")
    setting = "configure(check_calls=True)" if how == "configure" else how
    for o in outcomes:
        assert o.ok, o.error  # neither died nor hung
        got = o.value
        assert got["raised"] and got["seconds"] < 10, (o.rank, got)
        for needle in ("per-call check", setting, "on at rank 1", "off at rank 0"):
            assert needle in got["raised"], (o.rank, got["raised"])


def _run_check_on_one_rank(rank: int, P: int, op: str) -> dict:
    """One rank of a job with the debug mode on everywhere, where only rank 0 vouches for its
    call (``run_check=False``): what each rank raised and how long that took."""
    import time

    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector

    torch_ops.reset()
    torch_ops.configure(selector=Selector(), hardware="cpu", check_calls=True)
    g = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    A, W = torch.rand(8, 8, generator=gen), torch.rand(8, 8, generator=gen)
    t0 = time.monotonic()
    try:
        if op == "ag":
            torch_ops.all_gather_matmul(A, [W], 0, g, run_check=rank != 0)
        else:
            torch_ops.matmul_reduce_scatter(A, W, "sum", 0, g, run_check=rank != 0)
        return {"raised": None, "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    finally:
        torch_ops.reset()


@pytest.mark.gloo
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_ranks_passing_run_check_differently_all_raise_naming_it_not_hang(op):
    outcomes = ranks.launch(_run_check_on_one_rank, 2, (op,), timeout_s=2 * SETTING_TIMEOUT_S,
                            group_timeout_s=SETTING_TIMEOUT_S, stop_on_error=False, start_method="forkserver")
    for o in outcomes:
        assert o.ok, o.error
        got = o.value
        assert got["raised"] and got["seconds"] < 10, (o.rank, got)
        for needle in ("run_check differs", "True at ranks 1", "False at the others"):
            assert needle in got["raised"], (o.rank, got["raised"])


def _vouched_on_every_rank(rank: int, P: int) -> dict:
    """The debug mode on, every rank vouching for its call (``run_check=False``): the ranks
    join the check's exchange, find that they all vouch, and run the call."""
    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector

    torch_ops.reset()
    torch_ops.configure(selector=Selector(), hardware="cpu", check_calls=True)
    A, W = torch.ones(8, 8), torch.ones(8, 8)
    try:
        _, (y,) = torch_ops.all_gather_matmul(A, [W], 0, dist.group.WORLD.group_name, run_check=False)
        return {"shape": tuple(y.shape)}
    finally:
        torch_ops.reset()


@pytest.mark.gloo
def test_calls_every_rank_vouches_for_run_under_the_debug_mode():
    for o in ranks.launch(_vouched_on_every_rank, 2, (), timeout_s=60, start_method="forkserver"):
        assert o.ok, o.error
        assert o.value["shape"] == (16, 8)
