"""ficco's torch ops and tensor-parallel hooks on real gloo ranks.

The ops are compared with PyTorch's own fallbacks of the fused async-TP ops
(``_fused_all_gather_matmul_fallback``, ``_fused_matmul_reduce_scatter_fallback``) for
every gather/scatter dim, several Bs, odd shapes, and every schedule pinned in turn;
the tensor-parallel MLP gives the same output and gradients hooked and unhooked; a job may
turn the per-call shape check off, and a caller that vouches for its calls skips it.
Each test is one job of real ranks; a rank collects its mismatches and fails with all.
"""

import copy
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch import nn

from ficco_select.executor.operators import relative_error
from ficco_select.runtime import dispatch, running, torch_ops
from helpers.ranks import check_close, counting_checks, pinnable, rand, spawn

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo


# -- all_gather_matmul / matmul_reduce_scatter vs PyTorch's fallbacks --------------------
AG_CASES = [  # (A_shard shape, gather_dim, B widths, dtype)
    ((5, 7), 0, (3,), torch.float32),
    ((5, 7), 0, (4, 1, 6), torch.float32),
    ((3, 4, 6), 0, (5,), torch.float32),
    ((3, 4, 6), 1, (2, 7), torch.float32),
    ((2, 3, 5, 4), 2, (3,), torch.float32),
    ((3, 4, 6), -1, (5,), torch.float32),  # gathers the contraction dim: PyTorch's path
    ((7, 9), 0, (6, 2), torch.bfloat16),
]
RS_CASES = [  # (A shape, B width, scatter_dim, reduce_op, dtype); extents divisible by P=2, 4
    ((8, 5), 6, 0, "sum", torch.float32),
    ((12, 3, 7), 5, 0, "sum", torch.float32),
    ((3, 12, 7), 5, 1, "avg", torch.float32),
    ((3, 5, 7), 12, -1, "sum", torch.float32),
    ((16, 9), 4, 0, "sum", torch.bfloat16),
]


def check_ops(rank: int, P: int, tmp: Path, engine: str = "sm") -> None:
    gen = torch.Generator().manual_seed(1000 + rank)
    group = dist.group.WORLD
    torch_ops.configure(check_calls=True)  # the debug mode keeps each call's decision (last_decision)
    failures, pinned_runs = [], 0
    for shape, gdim, widths, dtype in AG_CASES:
        A_shard = rand(gen, *shape, dtype=dtype)
        Bs = [rand(gen, shape[-1] * (P if gdim == -1 else 1), w, dtype=dtype) for w in widths]
        for return_A in (True, False):
            want_A, want = symm_mem._fused_all_gather_matmul_fallback(A_shard, Bs, gdim, group.group_name,
                                                                      return_A=return_A)
            for name in pinnable(P, engine):
                torch_ops.configure(schedule=name)
                A, outs = torch_ops.all_gather_matmul(A_shard, Bs, gdim, group.group_name, return_A=return_A)
                what = f"AG {shape} dim {gdim} Bs {widths} {dtype} return_A={return_A} [{name or 'selector'}]"
                pinned_runs += torch_ops.last_decision.source == "pinned"
                if (A is None) != (want_A is None) or len(outs) != len(want):
                    failures.append(f"{what}: returned {A is None=}, {len(outs)} outputs")
                    continue
                if A is not None:
                    check_close(A, want_A, dtype, what + " A", failures)
                for i, (o, w) in enumerate(zip(outs, want)):
                    check_close(o, w, dtype, f"{what} out[{i}]", failures)
    for shape, width, sdim, op, dtype in RS_CASES:
        A = rand(gen, *shape, dtype=dtype)
        B = rand(gen, shape[-1], width, dtype=dtype)
        want = symm_mem._fused_matmul_reduce_scatter_fallback(A, B, op, sdim, group.group_name)
        for name in pinnable(P, engine):
            torch_ops.configure(schedule=name)
            got = torch_ops.matmul_reduce_scatter(A, B, op, sdim, group.group_name)
            pinned_runs += torch_ops.last_decision.source == "pinned"
            check_close(got, want, dtype, f"RS {shape}x{width} dim {sdim} {op} {dtype} [{name or 'selector'}]", failures)
    # MoE: uneven routing, one rank sends nothing to the last expert.
    k, n = 6, 5
    send = [(rank + 2 * q + 1) % 5 for q in range(P)]
    send[-1] = 0
    counts = torch.zeros(P * P, dtype=torch.int64)
    dist.all_gather_single(counts, torch.tensor(send, dtype=torch.int64))
    recv = counts.view(P, P)[:, rank].tolist()
    X, W = rand(gen, sum(send), k), rand(gen, k, n)
    X_recv = torch.empty(sum(recv), k)
    dist.all_to_all_single(X_recv, X, recv, send)
    for name in pinnable(P, engine):
        torch_ops.configure(schedule=name)
        got = torch_ops.all_to_all_matmul(X, W, recv, send, group.group_name)
        pinned_runs += torch_ops.last_decision.source == "pinned"
        check_close(got, X_recv @ W, torch.float32, f"A2A send {send} [{name or 'selector'}]", failures)
    (tmp / f"pinned-{rank}").write_text(str(pinned_runs))
    assert not failures, f"rank {rank}: {len(failures)} mismatches:\n" + "\n".join(failures)


@pytest.mark.parametrize("P", [2, 4])
def test_ops_equal_pytorch_fallbacks_for_every_schedule(P, tmp_path):
    spawn(check_ops, P, tmp_path)
    # The pins really ran: most of the sm schedules are legal for most cases.
    assert int((tmp_path / "pinned-0").read_text()) > 100


def check_ops_dma(rank: int, P: int, tmp: Path) -> None:
    # A GPU preset makes dma schedules legal; on CPU tensors their transfers go through the
    # dma comm's host stand-in (shared-memory staging slots, threads as streams).
    torch_ops.configure(hardware="h200-nvswitch")
    check_ops(rank, P, tmp, engine="dma")
    assert dispatch.context(dist.group.WORLD).dma_comms, "no dma comm was built"


@pytest.mark.parametrize("P", [2, 4])
def test_dma_schedules_equal_pytorch_fallbacks(P, tmp_path):
    spawn(check_ops_dma, P, tmp_path)
    assert int((tmp_path / "pinned-0").read_text()) > 100


class _NoSymmetricMemory:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("symmetric memory is not supported here")


def check_dma_without_transport(rank: int, P: int, tmp: Path) -> None:
    running.HostPeerMemory = _NoSymmetricMemory  # this rank's process only
    torch_ops.configure(hardware="h200-nvswitch", schedule="ficco.d2.ring.gemm_per_piece.m.dma", check_calls=True)
    gen = torch.Generator().manual_seed(rank)
    A_shard, B = rand(gen, 6, 5), rand(gen, 5, 4)
    name = dist.group.WORLD.group_name
    _, [want] = symm_mem._fused_all_gather_matmul_fallback(A_shard, [B], 0, name, return_A=False)
    for _ in range(2):  # the second call finds the failed transport remembered
        _, [got] = torch_ops.all_gather_matmul(A_shard, [B], 0, name, return_A=False)
        assert relative_error(got, want) < 1e-5
        decision = torch_ops.last_decision
        assert decision.schedule.name == "ficco.d2.ring.gemm_per_piece.m.sm", decision
        assert "as its sm twin: no dma transport" in decision.reason, decision


def test_a_group_without_dma_transport_runs_the_sm_twin(tmp_path):
    spawn(check_dma_without_transport, 2, tmp_path)


# -- gradients vs PyTorch's differentiable collectives -----------------------------------
GRAD_CASES = [  # ("ag", A_shard shape, gather_dim, B widths, use A) / ("rs", A shape, B width, scatter_dim, op)
    ("ag", (4, 3, 5), 1, (2, 6), False),
    ("ag", (6, 5), 0, (3,), True),
    ("ag", (3, 2, 4), -1, (5,), False),
    ("rs", (8, 3, 5), 6, 0, "sum"),
    ("rs", (3, 8, 5), 4, 1, "avg"),
    ("rs", (3, 5), 8, -1, "sum"),
]


def check_grads(rank: int, P: int, tmp: Path) -> None:
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7 + rank)
    failures = []
    for case in GRAD_CASES:
        for pin in ("", "ficco.d2.ring.gemm_per_piece.m.sm", "none.sm"):
            torch_ops.configure(schedule=pin)
            if case[0] == "ag":
                _, shape, gdim, widths, use_A = case
                A0 = rand(gen, *shape)
                B0 = [rand(gen, shape[-1] * (P if gdim == -1 else 1), w) for w in widths]

                def loss(A_shard, Bs, ours):
                    if ours:
                        A, outs = torch_ops.all_gather_matmul(A_shard, Bs, gdim, group, return_A=use_A)
                    else:
                        if gdim == -1:
                            A = torch.cat(funcol.all_gather_single_autograd(A_shard, 0, group).chunk(P), dim=-1)
                        else:
                            A = funcol.all_gather_single_autograd(A_shard, gdim, group)
                        outs = [A @ B for B in Bs]
                    total = sum((o * (i + 1)).sin().sum() for i, o in enumerate(outs))
                    return total + (A.square().sum() if use_A else 0)

                inputs = [A0, *B0]
            else:
                _, shape, width, sdim, op = case
                A0, B0 = rand(gen, *shape), rand(gen, shape[-1], width)

                def loss(A, B, ours):
                    if ours:
                        y = torch_ops.matmul_reduce_scatter(A, B, op, sdim, group)
                    else:
                        # (PyTorch's differentiable reduce-scatter sums only)
                        y = funcol.reduce_scatter_single_autograd(A @ B, "sum", sdim % A.ndim, group)
                        y = y / P if op == "avg" else y
                    return y.sin().sum()

                inputs = [A0, B0]
            grads = {}
            for ours in (True, False):
                leaves = [t.clone().requires_grad_() for t in inputs]
                args = (leaves[0], leaves[1:]) if case[0] == "ag" else tuple(leaves)
                loss(*args, ours).backward()
                grads[ours] = [t.grad for t in leaves]
            for i, (g, want) in enumerate(zip(grads[True], grads[False])):
                if g is None or not torch.allclose(g, want, rtol=1e-4, atol=1e-5):
                    failures.append(f"{case} [{pin or 'selector'}] grad of input {i}: "
                                    f"{'missing' if g is None else (g - want).abs().max().item()}")
    # MoE: uneven routing, the reverse all-to-all carries dX back.
    send = [(2 * rank + q + 1) % 4 for q in range(P)]
    counts = torch.zeros(P * P, dtype=torch.int64)
    dist.all_gather_single(counts, torch.tensor(send, dtype=torch.int64))
    recv = counts.view(P, P)[:, rank].tolist()
    X0, W0 = rand(gen, sum(send), 6), rand(gen, 6, 5)
    for pin in ("", "ficco.d2.ring.gemm_per_piece.m.sm", "none.sm"):
        torch_ops.configure(schedule=pin)
        grads = {}
        for ours in (True, False):
            X, W = X0.clone().requires_grad_(), W0.clone().requires_grad_()
            if ours:
                out = torch_ops.all_to_all_matmul(X, W, recv, send, group)
            else:
                out = funcol.all_to_all_single_autograd(X, recv, send, group) @ W
            (out.sin().sum()).backward()
            grads[ours] = [X.grad, W.grad]
        for i, (g, want) in enumerate(zip(grads[True], grads[False])):
            if not torch.allclose(g, want, rtol=1e-4, atol=1e-5):
                failures.append(f"a2a send {send} [{pin or 'selector'}] grad of input {i}: {(g - want).abs().max()}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_gradients_equal_pytorchs_differentiable_collectives(tmp_path):
    spawn(check_grads, 2, tmp_path)


# -- every rank runs rank 0's decision -------------------------------------------------
def check_agreement(rank: int, P: int, tmp: Path) -> None:
    # Ranks disagree on what they would pick; rank 0's pin must win everywhere.
    torch_ops.configure(schedule="ficco.d2.ring.gemm_per_piece.m.sm" if rank == 0 else "none.sm", check_calls=True)
    gen = torch.Generator().manual_seed(rank)
    A, B = rand(gen, 6, 4), rand(gen, 4, 3)
    _, (out,) = torch_ops.all_gather_matmul(A, [B], 0, dist.group.WORLD)
    _, (want,) = symm_mem._fused_all_gather_matmul_fallback(A, [B], 0, dist.group.WORLD.group_name)
    torch.testing.assert_close(out, want)
    assert torch_ops.last_decision.schedule.name == "ficco.d2.ring.gemm_per_piece.m.sm", torch_ops.last_decision
    # A dtype the executor does not run: PyTorch's implementation, on every rank, and said so.
    _, (out64,) = torch_ops.all_gather_matmul(A.double(), [B.double()], 0, dist.group.WORLD)
    torch.testing.assert_close(out64, want.double(), rtol=1e-5, atol=1e-5)
    assert torch_ops.last_decision.source == "fallback" and "dtype" in torch_ops.last_decision.reason


def test_every_rank_runs_rank_zeros_decision(tmp_path):
    spawn(check_agreement, 2, tmp_path)


# -- telemetry ------------------------------------------------------------------------
def check_telemetry(rank: int, P: int, tmp: Path) -> None:
    torch_ops.configure(telemetry=tmp / "telemetry-{rank}.jsonl")
    gen = torch.Generator().manual_seed(rank)
    A, B = rand(gen, 8, 5), rand(gen, 5, 6)
    for _ in range(3):
        torch_ops.matmul_reduce_scatter(A, B, "sum", 0, dist.group.WORLD)
    torch_ops.configure(schedule="shard.ring.sm")
    torch_ops.matmul_reduce_scatter(A, B, "sum", 0, dist.group.WORLD)


def test_telemetry_records_every_execution_and_checks_the_first(tmp_path):
    spawn(check_telemetry, 2, tmp_path)
    for rank in range(2):
        lines = [json.loads(x) for x in (tmp_path / f"telemetry-{rank}.jsonl").read_text().splitlines()]
        assert len(lines) == 4
        assert [x["rank"] for x in lines] == [rank] * 4
        first = lines[0]["schedule"]
        assert [x["call"] for x in lines[:3]] == [0, 1, 2] and {x["schedule"] for x in lines[:3]} == {first}
        assert lines[0]["verified"] is True and lines[1]["verified"] is None
        assert lines[3]["schedule"] == "shard.ring.sm" and lines[3]["source"] == "pinned"
        assert lines[3]["verified"] is True and lines[3]["call"] == 0
        assert all(x["op"] == "gemm_rs" and x["m"] == 8 and x["k"] == 10 and x["time_s"] > 0 for x in lines)
    # ... and `ficco train --telemetry` reads them: one labeled row per schedule that ran.
    from ficco_select.data.telemetry import read_telemetry

    rows = read_telemetry(sorted(tmp_path.glob("telemetry-*.jsonl"))).set_index("schedule")
    assert len(rows) == 2 and rows["verified"].all() and (rows["status"] == "ok").all()
    assert rows.loc["shard.ring.sm", "attempts"] == 1 and rows.drop("shard.ring.sm")["attempts"].item() == 3


def check_explore(rank: int, P: int, tmp: Path) -> None:
    torch_ops.configure(telemetry=tmp / "explore-{rank}.jsonl", explore_every=2)
    gen = torch.Generator().manual_seed(rank)
    A, B = rand(gen, 8, 5), rand(gen, 5, 6)
    sources = []
    for _ in range(8):
        torch_ops.matmul_reduce_scatter(A, B, "sum", 0, dist.group.WORLD)
        sources.append(torch_ops.last_decision.source)
    assert sources == ["heuristic", "explore"] * 4, sources


def test_exploration_times_the_alternatives_training_needs(tmp_path):
    from ficco_select.data.telemetry import read_telemetry
    from ficco_select import Scenario, candidates
    from ficco_select.train.training_data import telemetry_training_rows

    spawn(check_explore, 2, tmp_path)
    lines = [[json.loads(x) for x in (tmp_path / f"explore-{r}.jsonl").read_text().splitlines()] for r in range(2)]
    assert [x["schedule"] for x in lines[0]] == [x["schedule"] for x in lines[1]]  # ranks agree
    explored = [x["schedule"] for x in lines[0] if x["source"] == "explore"]
    scenario = Scenario.from_record(lines[0][0])
    assert explored == [s.name for s in candidates(scenario, "cpu")[:4]]  # in turn, baseline first
    rows = telemetry_training_rows(read_telemetry([tmp_path / "explore-0.jsonl", tmp_path / "explore-1.jsonl"]),
                                   pd.DataFrame({"scenario_id": []}))
    assert "none.sm" in set(rows["schedule"]) and len(rows) >= 2  # usable by `ficco train --telemetry`


# -- the per-call shape check, off for a job -------------------------------------------
def check_unchecked_calls(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime import library  # noqa: F401 - registers torch.ops.ficco

    gen = torch.Generator().manual_seed(0)
    g = dist.group.WORLD.group_name
    A_shard, B = rand(gen, 4, 8), rand(gen, 8, 6)
    try:
        with counting_checks() as checks:
            torch_ops.configure(check_calls=False)
            _, [got] = torch_ops.all_gather_matmul(A_shard, [B], 0, g)
            torch_ops.matmul_reduce_scatter(got, B.t().contiguous(), "sum", 0, g)
            assert checks == []  # no check, and the ops still run
            torch_ops.configure(check_calls=True)
            torch_ops.all_gather_matmul(A_shard, [B], 0, g)
            assert len(checks) == 1

            # A caller that vouches for its calls (run_check=False: DTensor's styles, the compile
            # pass) skips the check, forward and backward, the job's setting on.
            A, W = A_shard.clone().requires_grad_(), B.clone().requires_grad_()
            _, [y] = torch_ops.all_gather_matmul(A, [W], 0, g, run_check=False)
            z = torch_ops.matmul_reduce_scatter(y, W.t(), "sum", 0, g, run_check=False)
            r = torch_ops.matmul_all_reduce(z, W, "sum", g, run_check=False)
            r.sum().backward()
            torch.ops.ficco.all_gather_matmul(A_shard, [B], 0, g, False)
            torch.ops.ficco.matmul_reduce_scatter(got, B.t().contiguous(), "sum", 0, g, False)
            torch.ops.ficco.matmul_all_reduce(got, B.t().contiguous(), "sum", g, False)
            assert len(checks) == 1, checks
            assert A.grad is not None and W.grad is not None

            # Checked calls check their backward too (a rank whose loss skips an op is caught there).
            _, [y] = torch_ops.all_gather_matmul(A, [W], 0, g)
            y.sum().backward()
            assert len(checks) == 3, checks
    finally:
        torch_ops.reset()


def test_a_job_may_turn_the_per_call_check_off(tmp_path):
    spawn(check_unchecked_calls, 2, tmp_path)


# -- the tensor-parallel MLP, hooked and unhooked --------------------------------------
def check_tp_mlp(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.tp import ColumnParallelLinear, RowParallelLinear, install, parallelize

    torch.manual_seed(0)  # the same full model and batch on every rank
    hidden, ffn, seq, batch = 12, 8 * P, 5 * P, 3
    full = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    x_full = torch.randn(seq, batch, hidden)
    group = dist.group.WORLD
    tp = parallelize(copy.deepcopy(full), {"0": "colwise", "2": "rowwise"}, group)
    assert isinstance(tp[0], ColumnParallelLinear) and isinstance(tp[2], RowParallelLinear)
    x = x_full.chunk(P, dim=0)[rank].clone().requires_grad_()

    def run():
        x.grad = None
        tp.zero_grad()
        y = tp(x)
        (y.square().sum() + y.sum()).backward()
        return y.detach(), x.grad.clone(), [p.grad.clone() for p in tp.parameters()]

    y_plain, dx_plain, dw_plain = run()
    torch.testing.assert_close(y_plain, full(x_full).detach().chunk(P, dim=0)[rank], rtol=1e-5, atol=1e-5)
    sources, max_diff = {}, {"y": 0.0, "dx": 0.0, "dw": 0.0}
    for pin in ("", "ficco.d2.ring.gemm_per_piece.m.sm", "shard.ring.sm"):
        torch_ops.configure(schedule=pin, check_calls=True)  # the debug mode keeps last_decision
        with install(tp) as handle:
            assert len(handle.layers) == 2
            y_hooked, dx_hooked, dw_hooked = run()
            sources[pin] = torch_ops.last_decision.source
        max_diff["y"] = max(max_diff["y"], (y_hooked - y_plain).abs().max().item())
        max_diff["dx"] = max(max_diff["dx"], (dx_hooked - dx_plain).abs().max().item())
        max_diff["dw"] = max([max_diff["dw"]] + [(a - b).abs().max().item() for a, b in zip(dw_hooked, dw_plain)])
        torch.testing.assert_close(y_hooked, y_plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx_hooked, dx_plain, rtol=1e-5, atol=1e-5)
        for a, b in zip(dw_hooked, dw_plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert all("forward" not in vars(m) for m in tp.modules())  # uninstalled cleanly
    assert sources == {"": "heuristic", "ficco.d2.ring.gemm_per_piece.m.sm": "pinned",
                       "shard.ring.sm": "pinned"}, sources
    y_again, _, _ = run()
    torch.testing.assert_close(y_again, y_plain, rtol=0, atol=0)
    assert max(max_diff.values()) < 1e-5, max_diff


def test_tensor_parallel_mlp_same_hooked_and_unhooked(tmp_path):
    spawn(check_tp_mlp, 2, tmp_path)


def _counting_broadcasts() -> list:
    """The decisions' broadcasts from now on in this rank's process, one entry each."""
    broadcasts = []
    real_broadcast = dist.broadcast_object_list

    def counted(*args, **kw):
        broadcasts.append(1)
        return real_broadcast(*args, **kw)

    dispatch.dist.broadcast_object_list = counted
    return broadcasts


def check_tp_mlp_varying_m(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.tp import install, parallelize

    torch.manual_seed(0)
    hidden, ffn, batch = 12, 8 * P, 3
    full = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    tp = parallelize(copy.deepcopy(full), {"0": "colwise", "2": "rowwise"}, dist.group.WORLD)
    broadcasts = _counting_broadcasts()
    seqs = [3, 5, 7, 9, 16, 40, 5, 3]  # per rank; m = P * seq * batch changes between calls
    schedules = []
    for seq in seqs:
        x = torch.randn(P * seq, batch, hidden).chunk(P, dim=0)[rank].clone().requires_grad_()
        tp.zero_grad()
        y_plain = tp(x)
        y_plain.square().sum().backward()
        dx_plain, dw_plain = x.grad.clone(), [p.grad.clone() for p in tp.parameters()]
        x.grad = None
        tp.zero_grad()
        with install(tp):
            y = tp(x)
            y.square().sum().backward()
        torch.testing.assert_close(y, y_plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, dx_plain, rtol=1e-5, atol=1e-5)
        for got, want in zip([p.grad for p in tp.parameters()], dw_plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        schedules.append(sorted((str(k), d.schedule.name) for k, d in dispatch.decisions().items()))
    tables = dispatch.tables()
    assert tables and all(table is not None for _, table in tables.values()), tables
    # One broadcast per layer (forward and backward GEMMs), and one per m off its table's grid
    # (rank 0 decides it and sends it, once): fewer than a broadcast per shape.
    assert len(tables) <= 4 and len(tables) <= len(broadcasts) < len(set(seqs)) * len(tables), \
        (len(broadcasts), len(tables))
    everyone = [None] * P
    dist.all_gather_object(everyone, schedules)
    assert all(other == schedules for other in everyone), "ranks ran different schedules"


def test_tensor_parallel_mlp_with_m_varying_between_calls_decides_from_layer_tables(tmp_path):
    spawn(check_tp_mlp_varying_m, 2, tmp_path)


def check_install_builds_every_table_before_the_first_step(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.tp import install, parallelize

    torch.manual_seed(0)
    hidden, ffn, batch = 12, 8 * P, 3
    full = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    tp = parallelize(copy.deepcopy(full), {"0": "colwise", "2": "rowwise"}, dist.group.WORLD)
    handle = install(tp)
    tables = dispatch.tables()
    # Both layers' forward ops and their input-gradient ops, each built. In an MLP they pair
    # up: the down projection's forward and the up projection's gradient are one layer
    # (A (rows, ffn/P) @ B (ffn/P, hidden), reduce-scattered), and so are the other two.
    assert len(tables) == 2 and all(table is not None for _, table in tables.values()), sorted(map(str, tables))
    broadcasts = _counting_broadcasts()
    # m = P * seq * batch rows: every valid m this small is a grid point of its table.
    for seq in (1, 2, 3, 5):  # the first step too: no step decides or waits on a broadcast
        x = torch.randn(P * seq, batch, hidden).chunk(P, dim=0)[rank].clone().requires_grad_()
        tp(x).square().sum().backward()
    assert broadcasts == [] and dispatch.tables() == tables
    sources = {d.source for d in dispatch.decisions().values()}
    assert sources <= {"model", "heuristic", "fallback"} and len(dispatch.decisions()) == 2 * 4
    # An m off the grid: decided on rank 0 and sent, once per table, at its first call only.
    off_grid = 4099  # m = 24594 rows, between two grid points of every table here
    assert all(table.on_grid(P * off_grid * batch) is None for _, table in tables.values())
    for _ in range(2):
        x = torch.randn(P * off_grid, batch, hidden).chunk(P, dim=0)[rank].clone().requires_grad_()
        tp(x).square().sum().backward()
    assert len(broadcasts) == len(tables), (len(broadcasts), len(tables))
    handle.remove()
    again = install(tp, tables=False)  # opting out builds nothing more
    assert dispatch.tables() == tables
    again.remove()


def test_install_builds_every_table_before_the_first_step(tmp_path):
    spawn(check_install_builds_every_table_before_the_first_step, 2, tmp_path)


def test_parallelize_names_what_is_wrong_in_the_plan():
    from ficco_select.runtime.tp import parallelize

    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"plan\['0'\]: 'diagonal' is not one of colwise, rowwise"):
        parallelize(model, {"0": "diagonal"}, None)
    with pytest.raises(ValueError, match=r"plan\['1'\]: no nn.Linear of that name .*GELU"):
        parallelize(model, {"1": "colwise"}, None)
    with pytest.raises(ValueError, match=r"plan\['mlp.up'\]: no nn.Linear .*NoneType"):
        parallelize(model, {"mlp.up": "colwise"}, None)
