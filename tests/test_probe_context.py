"""The runtime's per-group context as a careless job drives it, on real gloo ranks: a group
destroyed and re-made under the same name (another size), two groups at once and threads
calling on each, ``configure`` between calls, a shape that changes every call, and switch
decisions pinned on a cpu group (run by the ``HostSwitchComm`` stand-in). Every call's
result is checked against PyTorch's own."""

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ficco_select.executor import ranks
from ficco_select.runtime import dispatch, torch_ops
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import is_legal, parse
from helpers.ranks import check_close, rand, spawn

pytestmark = pytest.mark.gloo

SWITCH_MACHINE = "h200-nvswitch"
"""A GPU preset whose fabric reduces in the switch: it makes switch schedules legal on cpu ranks."""


def all_reduce_call(group: dist.ProcessGroup, rows: int, gen, dtype=torch.float32):
    """matmul_all_reduce on `group` and what PyTorch's plain form gives."""
    A, B = rand(gen, rows, 6, dtype=dtype), rand(gen, 6, 5, dtype=dtype)
    want = A.float() @ B.float()
    dist.all_reduce(want, group=group)
    return torch_ops.matmul_all_reduce(A, B, "sum", group.group_name), want


def reduce_scatter_call(group: dist.ProcessGroup, rows: int, gen, dtype=torch.float32):
    from torch.distributed import _symmetric_memory as symm_mem
    A, B = rand(gen, rows, 7, dtype=dtype), rand(gen, 7, 3, dtype=dtype)
    want = symm_mem._fused_matmul_reduce_scatter_fallback(A, B, "sum", 0, group.group_name)
    return torch_ops.matmul_reduce_scatter(A, B, "sum", 0, group.group_name), want


# -- a group destroyed and re-made under the same name ----------------------------------------------
def remade_groups(rank: int, P: int, pinned: str, sizes: list[int]) -> list[str]:
    """World groups of `sizes` one after the other (each named "0"), each making the same
    call shape (12 rows: divisible by 2 and 3) under `pinned`."""
    torch_ops.reset()
    torch_ops.configure(selector=Selector(), hardware=SWITCH_MACHINE, schedule=pinned, check_calls=True)
    failures, ran = [], []
    store = ranks.rendezvous()
    for i, size in enumerate(sizes):
        if rank >= size:
            continue
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{i}", store), rank=rank, world_size=size)
        try:
            gen = torch.Generator().manual_seed(rank + 10 * i)
            got, want = all_reduce_call(dist.group.WORLD, 12, gen)
            check_close(got, want, torch.float32, f"round {i} ({size} ranks) {pinned}", failures)
            ran.append(torch_ops.last_decision.schedule.name)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    torch_ops.reset()
    assert not failures, f"rank {rank}: " + "; ".join(failures)
    return ran


@pytest.mark.parametrize("pinned", ["none.switch", "ficco.d2.ring.gemm_per_piece.m.sm"])
def test_a_group_remade_under_its_name_with_another_size_gets_a_fresh_context(pinned):
    # Before: the context (plans, switch comm) of the 3-rank group "0" ran the 2-rank one:
    # "process group has 3 ranks but scenario world_size=2" (or the other way round).
    got = ranks.run_ranks(remade_groups, 3, (pinned, [3, 2, 3]), group=None, timeout_s=120)
    assert got == [[pinned] * 3, [pinned] * 3, [pinned] * 2]


# -- two groups at once, threads on each ----------------------------------------------------------
ROUNDS = 4
"""Fresh pairs of groups: each pair's first calls are its ranks' agreement on the check."""


def two_groups_two_threads(rank: int, P: int, tmp: Path) -> None:
    torch_ops.configure(hardware=SWITCH_MACHINE, schedule="none.switch")
    failures: list[str] = []
    errors: list[BaseException] = []
    for r in range(ROUNDS):
        groups = [dist.new_group(list(range(P))), dist.new_group(list(range(P)))]

        def calls(g: int) -> None:
            try:
                gen = torch.Generator().manual_seed(100 * g + rank)
                for rows in (3 * P, 5 * P, 3 * P):
                    for call in (all_reduce_call, reduce_scatter_call):
                        got, want = call(groups[g], rows, gen)
                        check_close(got, want, torch.float32, f"group {g} {call.__name__} rows {rows}", failures)
            except BaseException as e:  # noqa: BLE001 - reported on the main thread
                errors.append(e)

        threads = [threading.Thread(target=calls, args=(g,), daemon=True) for g in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        # Before: one process-wide lock around the agreement on the check; rank 0's thread on
        # group 0 held it waiting for rank 1, whose thread on group 1 held it: both hung.
        assert not any(t.is_alive() for t in threads), f"rank {rank}, round {r}: a thread hung"
        assert not errors and not failures, f"rank {rank}: {errors} {failures}"
        comms = [dispatch.context(g).switch_comms.get("cpu") for g in groups]
        assert [type(c).__name__ for c in comms] == ["HostSwitchComm"] * 2 and comms[0] is not comms[1]


def test_two_groups_called_from_two_threads_each_run_their_own_switch_comm(tmp_path):
    spawn(two_groups_two_threads, 3, tmp_path)


# -- configure between calls, a shape that changes every call ------------------------------------
def configure_between_calls(rank: int, P: int, tmp: Path) -> None:
    failures = []
    gen = torch.Generator().manual_seed(rank)
    torch_ops.configure(hardware=SWITCH_MACHINE, check_calls=True, cache_size=3)
    for i, pinned in enumerate(["none.switch", "", "ficco.d2.a2a.gemm_per_step.m.switch", "none.sm",
                                f"ficco.d{P}.a2a.gemm_per_piece.m.switch", "none.switch"]):
        torch_ops.configure(schedule=pinned)
        for rows in range(P, 9 * P, P):  # a new shape every call: more than the plans kept
            for dtype in (torch.float32, torch.bfloat16):
                for call in (all_reduce_call, reduce_scatter_call):
                    got, want = call(dist.group.WORLD, rows, gen, dtype)
                    check_close(got, want, dtype, f"[{pinned or 'selector'}] {call.__name__} rows {rows}", failures)
                    ran = torch_ops.last_decision.schedule.name
                    op = "gemm_ar" if call is all_reduce_call else "gemm_rs"
                    if pinned and ran != pinned and is_legal(parse(pinned), _scenario(op, rows, P), "cuda"):
                        failures.append(f"pinned {pinned}, {op} ran {ran} at rows {rows}")
        assert len(dispatch.context(dist.group.WORLD).plans) <= 3
    assert not failures, f"rank {rank}: {len(failures)}:\n" + "\n".join(failures[:10])


def _scenario(op: str, rows: int, P: int) -> Scenario:
    return Scenario(op=op, m=rows, n=5, k=6 * P, group="t", dtype="float32", world_size=P, hardware=SWITCH_MACHINE)


@pytest.mark.parametrize("P", [2, 3])
def test_configure_between_calls_and_a_new_shape_every_call(P, tmp_path):
    spawn(configure_between_calls, P, tmp_path)
