"""``matmul_all_reduce`` and ``matmul_all_to_all`` (the MoE combine) on real gloo ranks.

The peer check: every schedule pinned in turn (and the selector's own pick), the ops equal
plain PyTorch: ``mm`` then ``dist.all_reduce``; the expert GEMM then
``dist.all_to_all_single``. Odd shapes, several leading dims, uneven and empty token
counts, bf16. Gradients are checked against independent computations: the unsharded
product for the all-reduce (Megatron's row-parallel linear) and PyTorch's differentiable
all-to-all for the combine. The tensor-parallel MLP without sequence parallelism gives the
unsharded model's output and gradients, hooked and unhooked.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ficco_select.runtime import dispatch, torch_ops
from helpers.ranks import check_close, pinnable, rand, spawn

pytestmark = pytest.mark.gloo


def AR_CASES(P: int) -> list:
    """(A shape, B width, reduce_op, dtype): rows divisible by P run the executor's schedules."""
    return [
        ((3 * P, 7), 5, "sum", torch.float32),  # odd k_local and n
        ((P, 3, 5), 4, "sum", torch.float32),  # leading dims: rows = 3P
        ((5 * P, 3), 1, "avg", torch.float32),  # one output column
        ((8 * P, 6), 9, "sum", torch.float32),  # enough rows for every piece count
        ((2 * P + 1, 6), 5, "sum", torch.float32),  # rows P does not divide: PyTorch's plain form
        ((4 * P, 9), 6, "sum", torch.bfloat16),
    ]


def _plain_all_reduce(A, B, reduce_op, P):
    Y = A.float() @ B.float()
    dist.all_reduce(Y)
    return Y / P if reduce_op == "avg" else Y


def _routing(rank: int, P: int, per_pair) -> tuple[list[int], list[int]]:
    """(send, recv): tokens this rank routes to each expert, and each source's tokens this expert holds."""
    send = [per_pair(rank, q) for q in range(P)]
    counts = torch.zeros(P * P, dtype=torch.int64)
    dist.all_gather_single(counts, torch.tensor(send, dtype=torch.int64))
    return send, counts.view(P, P)[:, rank].tolist()


ROUTINGS = {  # name -> tokens rank src routes to expert dst
    "uneven, one pair empty": lambda src, dst: 0 if (src, dst) == (0, 1) else (src + 2 * dst + 1) % 5,
    "hot expert 0": lambda src, dst: 13 if dst == 0 else 3 + src,
    "nothing for the last expert": lambda src, dst: 0 if dst == 1 else 4 + dst,
}


def check_new_ops(rank: int, P: int, tmp: Path, engine: str = "sm") -> None:
    gen = torch.Generator().manual_seed(500 + rank)
    group = dist.group.WORLD
    torch_ops.configure(check_calls=True)  # the debug mode keeps each call's decision (last_decision)
    failures, pinned = [], {"ar": 0, "combine": 0}
    for shape, n, reduce_op, dtype in AR_CASES(P):
        A, B = rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], n, dtype=dtype)
        want = _plain_all_reduce(A.reshape(-1, shape[-1]), B, reduce_op, P).reshape(*shape[:-1], n)
        for name in pinnable(P, engine):
            torch_ops.configure(schedule=name)
            got = torch_ops.matmul_all_reduce(A, B, reduce_op, group.group_name)
            pinned["ar"] += torch_ops.last_decision.source == "pinned"
            check_close(got, want, dtype, f"AR {shape}x{n} {reduce_op} {dtype} [{name or 'selector'}]", failures)
            if got.dtype != dtype or got.shape != want.shape:
                failures.append(f"AR {shape}x{n} [{name}]: got {got.dtype} {tuple(got.shape)}")
    for label, per_pair in ROUTINGS.items():
        send, recv = _routing(rank, P, per_pair)
        for dtype in (torch.float32, torch.bfloat16):
            X, W = rand(gen, sum(recv), 6, dtype=dtype), rand(gen, 6, 5, dtype=dtype)
            want = torch.empty(sum(send), 5)
            dist.all_to_all_single(want, X.float() @ W.float(), send, recv)
            for name in pinnable(P, engine):
                torch_ops.configure(schedule=name)
                got = torch_ops.matmul_all_to_all(X, W, send, recv, group.group_name)
                pinned["combine"] += torch_ops.last_decision.source == "pinned"
                check_close(got, want, dtype, f"combine {label} {dtype} send {send} [{name or 'selector'}]",
                            failures)
    (tmp / f"pinned-{rank}").write_text(repr(pinned))
    assert not failures, f"rank {rank}: {len(failures)} mismatches:\n" + "\n".join(failures)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_new_ops_equal_plain_pytorch_for_every_schedule(P, tmp_path):
    spawn(check_new_ops, P, tmp_path)
    pinned = eval((tmp_path / "pinned-0").read_text())
    assert pinned["ar"] > 25 and pinned["combine"] > 15, pinned  # the pins really ran


def check_new_ops_dma(rank: int, P: int, tmp: Path) -> None:
    torch_ops.configure(hardware="h200-nvswitch")  # dma legal; the copy engines' host stand-in
    check_new_ops(rank, P, tmp, engine="dma")
    assert dispatch.context(dist.group.WORLD).dma_comms, "no dma comm was built"


@pytest.mark.parametrize("P", [2, 3])
def test_new_ops_dma_schedules_equal_plain_pytorch(P, tmp_path):
    spawn(check_new_ops_dma, P, tmp_path)
    pinned = eval((tmp_path / "pinned-0").read_text())
    assert pinned["ar"] > 20 and pinned["combine"] > 10, pinned


# -- gradients ---------------------------------------------------------------------------
def check_new_ops_grads(rank: int, P: int, tmp: Path) -> None:
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)  # the same full operands on every rank
    moe_gen = torch.Generator().manual_seed(rank)  # each rank's own tokens
    failures = []
    for pin in ("", "shard.ring.sm", "ficco.d2.a2a.gemm_per_step.m.sm", "none.sm"):
        torch_ops.configure(schedule=pin)
        for rows, k, n, reduce_op in ((4 * P, 3 * P, 5, "sum"), (2 * P, 2 * P, 3, "avg"), (2 * P + 1, P, 4, "sum")):
            A_full, B_full = rand(gen, rows, k).requires_grad_(), rand(gen, k, n).requires_grad_()
            Y = A_full @ B_full / (P if reduce_op == "avg" else 1)
            (Y.sin() * Y).sum().backward()  # every rank: the same loss of the replicated output
            cols = slice(rank * k // P, (rank + 1) * k // P)
            A = A_full.detach()[:, cols].clone().requires_grad_()
            B = B_full.detach()[cols].clone().requires_grad_()
            y = torch_ops.matmul_all_reduce(A, B, reduce_op, group)
            (y.sin() * y).sum().backward()
            for what, got, want in (("dA", A.grad, A_full.grad[:, cols]), ("dB", B.grad, B_full.grad[cols])):
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    failures.append(f"AR {rows}x{k}x{n} {reduce_op} [{pin or 'selector'}] {what}: "
                                    f"{(got - want).abs().max().item():.3g}")
        for label, per_pair in ROUTINGS.items():
            send, recv = _routing(rank, P, per_pair)
            X0, W0 = rand(moe_gen, sum(recv), 6), rand(moe_gen, 6, 5)
            grads = {}
            for ours in (True, False):
                X, W = X0.clone().requires_grad_(), W0.clone().requires_grad_()
                if ours:
                    out = torch_ops.matmul_all_to_all(X, W, send, recv, group)
                else:
                    out = funcol.all_to_all_single_autograd(X @ W, send, recv, group)
                (out.sin().sum() * (rank + 1)).backward()
                grads[ours] = (X.grad, W.grad)
            for what, got, want in zip(("dX", "dW"), grads[True], grads[False]):
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    failures.append(f"combine {label} [{pin or 'selector'}] {what}: {(got - want).abs().max()}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("P", [2, 3])
def test_new_ops_gradients_equal_independent_computations(P, tmp_path):
    spawn(check_new_ops_grads, P, tmp_path)


# -- tensor parallelism without sequence parallelism ------------------------------------------
def check_tp_mlp_without_sequence_parallelism(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.tp import install, parallelize

    torch.manual_seed(0)  # the same full model and batch on every rank
    hidden, ffn, tokens = 12, 8 * P, 6 * P
    full = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    x_full = torch.randn(tokens, 2, hidden)
    tp = parallelize(copy.deepcopy(full), {"0": "colwise", "2": "rowwise"}, dist.group.WORLD,
                     sequence_parallel=False)

    def loss(y):
        return (y.square() + y).sum()

    x_ref = x_full.clone().requires_grad_()
    y_ref = full(x_ref)
    loss(y_ref).backward()
    mine = slice(rank * ffn // P, (rank + 1) * ffn // P)  # this rank's ffn features
    want_dw = [full[0].weight.grad[mine], full[0].bias.grad[mine], full[2].weight.grad[:, mine], full[2].bias.grad]

    def run():
        x = x_full.clone().requires_grad_()
        tp.zero_grad()
        y = tp(x)
        loss(y).backward()
        return y.detach(), x.grad, [p.grad.clone() for p in tp.parameters()]

    for pin in (None, "", "ficco.d2.ring.gemm_per_step.m.sm", "shard.ring.sm"):
        dispatch.context(dist.group.WORLD).plans.clear()
        if pin is None:
            y, dx, dw = run()  # unhooked: PyTorch's all-reduces
        else:
            torch_ops.configure(schedule=pin, check_calls=True)  # the debug mode keeps last_decision
            with install(tp):
                y, dx, dw = run()
            # The row-parallel forward and the column-parallel input gradient: one layer shape
            # (rows, ffn/P) @ (ffn/P, hidden), all-reduced, decided once.
            ops = {key[0][0] for key in dispatch.decisions()}
            assert ops == {"ar"}, ops
            if pin:
                assert torch_ops.last_decision.source == "pinned", torch_ops.last_decision
        torch.testing.assert_close(y, y_ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, x_ref.grad, rtol=1e-5, atol=1e-5)
        for got, want in zip(dw, want_dw):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # A column-parallel layer alone: its forward has no collective, its input gradient is
    # the all-reduce. The full loss is the sum of the ranks' losses of their output slices.
    col = parallelize(copy.deepcopy(nn.Sequential(full[0])), {"0": "colwise"}, dist.group.WORLD,
                      sequence_parallel=False)
    x_ref = x_full.clone().requires_grad_()
    loss(full[0](x_ref)).backward()
    dispatch.context(dist.group.WORLD).plans.clear()
    torch_ops.configure(schedule="shard.ring.sm")
    with install(col):
        x = x_full.clone().requires_grad_()
        y = col(x)
        # Its forward has no collective; it looks up the plan of its input gradient's all-reduce.
        assert {key[0][0] for key in dispatch.decisions()} <= {"ar"}
        loss(y).backward()
    assert {key[0][0] for key in dispatch.decisions()} == {"ar"}
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("P", [2, 3])
def test_tensor_parallel_mlp_without_sequence_parallelism_equals_the_unsharded_model(P, tmp_path):
    spawn(check_tp_mlp_without_sequence_parallelism, P, tmp_path)


def check_install_prepares_the_all_reduce_tables(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.tp import install, parallelize

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(12, 8 * P), nn.GELU(), nn.Linear(8 * P, 12))
    tp = parallelize(copy.deepcopy(full), {"0": "colwise", "2": "rowwise"}, dist.group.WORLD,
                     sequence_parallel=False)
    with install(tp):
        tables = dispatch.tables()
        assert [key[0][0] for key in tables] == ["ar"] and all(t is not None for _, t in tables.values()), tables
        for tokens in (P, 5 * P, 64 * P):
            tp(torch.randn(tokens, 12, requires_grad=True)).sum().backward()
        assert dispatch.tables() == tables
        assert {d.source for d in dispatch.decisions().values()} <= {"heuristic", "model"}


def test_install_prepares_the_all_reduce_tables(tmp_path):
    spawn(check_install_prepares_the_all_reduce_tables, 2, tmp_path)
