"""The registered ops (``torch.ops.ficco.*``, ``runtime/library.py``) on real gloo ranks.

Each op passes ``torch.library.opcheck`` (schema, autograd registration, fake tensors,
AOTAutograd with static and dynamic shapes: every util runs the op the same number of times with the
same shapes on every rank, so the ranks' collectives stay in lockstep; a util failing on
one rank only breaks that lockstep, and shows as gloo aborting a rank on a collective
mismatch: run one util at a time with a barrier between to see which); its fake shapes
are its real ones; its values and gradients equal the eager ``torch_ops`` path and
PyTorch's differentiable collectives.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ficco_select.runtime import library, torch_ops  # noqa: F401 - library registers torch.ops.ficco
from helpers.ranks import check_close, rand, spawn

# Tier: real ranks (processes over gloo) for every test but the import check; deselect with -m "not gloo"
gloo = pytest.mark.gloo

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")
"""Every opcheck util (the defaults and the deprecated static AOT one): each runs on every rank in the
same order, so the ranks' collectives stay in lockstep."""


def _moe_routing(rank: int, P: int) -> tuple[list[int], list[int]]:
    """(recv, send): uneven token counts, the last expert gets nothing from this rank."""
    send = [(rank + 2 * q + 1) % 5 for q in range(P)]
    send[-1] = 0
    counts = torch.zeros(P * P, dtype=torch.int64)
    dist.all_gather_single(counts, torch.tensor(send, dtype=torch.int64))
    return counts.view(P, P)[:, rank].tolist(), send


def _cases(rank: int, P: int, gen, dtype=torch.float32) -> list[tuple[str, object, tuple]]:
    """(name, op, args) per op, inputs requiring grad."""
    g = dist.group.WORLD.group_name
    leaf = lambda *shape: rand(gen, *shape, dtype=dtype).requires_grad_()  # noqa: E731
    recv, send = _moe_routing(rank, P)
    return [
        ("all_gather_matmul", torch.ops.ficco.all_gather_matmul, (leaf(6, 5), [leaf(5, 4), leaf(5, 3)], 0, g)),
        ("all_gather_matmul 3d dim 1", torch.ops.ficco.all_gather_matmul, (leaf(3, 4, 6), [leaf(6, 5)], 1, g)),
        ("matmul_reduce_scatter", torch.ops.ficco.matmul_reduce_scatter, (leaf(8, 5), leaf(5, 6), "sum", 0, g)),
        ("matmul_reduce_scatter avg dim 1", torch.ops.ficco.matmul_reduce_scatter,
         (leaf(3, 4, 7), leaf(7, 5), "avg", 1, g)),
        ("matmul_all_reduce", torch.ops.ficco.matmul_all_reduce, (leaf(8, 5), leaf(5, 6), "sum", g)),
        # run_check=False (DTensor's styles, the compile pass): one argument more, no gradient for it
        ("all_gather_matmul unchecked", torch.ops.ficco.all_gather_matmul, (leaf(6, 5), [leaf(5, 4)], 0, g, False)),
        ("matmul_reduce_scatter unchecked", torch.ops.ficco.matmul_reduce_scatter,
         (leaf(8, 5), leaf(5, 6), "sum", 0, g, False)),
        ("matmul_all_reduce unchecked", torch.ops.ficco.matmul_all_reduce, (leaf(8, 5), leaf(5, 6), "sum", g, False)),
        ("all_to_all_matmul", torch.ops.ficco.all_to_all_matmul, (leaf(sum(send), 6), leaf(6, 5), recv, send, g)),
        ("matmul_all_to_all", torch.ops.ficco.matmul_all_to_all, (leaf(sum(recv), 6), leaf(6, 5), send, recv, g)),
    ]


def check_opcheck(rank: int, P: int, tmp: Path) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    failures = []
    for name, op, args in _cases(rank, P, gen):
        try:
            torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        except Exception as e:  # noqa: BLE001 - every op's failure, not only the first
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:2000]}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@gloo
def test_every_op_passes_opcheck(tmp_path):
    spawn(check_opcheck, 2, tmp_path)


def check_fake_shapes(rank: int, P: int, tmp: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(200 + rank)
    failures = []
    for name, op, args in _cases(rank, P, gen):
        real = torch.utils._pytree.tree_leaves(op(*args))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
            fake = torch.utils._pytree.tree_leaves(op(*fake_args))
        got = [(tuple(t.shape), t.dtype, t.stride()) for t in fake]
        want = [(tuple(t.shape), t.dtype, t.stride()) for t in real]
        if got != want:
            failures.append(f"{name}: fake {got}, real {want}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@gloo
def test_fake_shapes_are_the_real_ones(tmp_path):
    spawn(check_fake_shapes, 2, tmp_path)


def _reference(name: str, args: tuple, P: int):
    """The op's result by PyTorch's differentiable collectives (its ground truth)."""
    group = dist.group.WORLD
    if name.startswith("all_gather_matmul"):
        A_shard, Bs, gdim = args[:3]
        A = funcol.all_gather_tensor_autograd(A_shard, gdim, group)
        return A, [A @ B for B in Bs]
    if name.startswith("matmul_reduce_scatter"):
        A, B, op, sdim = args[:4]
        Y = funcol.reduce_scatter_tensor_autograd(A @ B, "sum", sdim, group)  # its backward knows sum only
        return Y / P if op == "avg" else Y
    if name.startswith("matmul_all_reduce"):
        A, B = args[:2]
        # The row-parallel linear: all-reduce forward, identity backward.
        Y = A @ B
        return Y + (funcol.all_reduce(Y.detach(), "sum", group) - Y.detach())
    X, W, recv, send, _ = args
    if name == "all_to_all_matmul":
        X_recv = funcol.all_to_all_single_autograd(X, recv, send, group)
        return X_recv @ W, X_recv.detach()
    return funcol.all_to_all_single_autograd(X @ W, recv, send, group)


def _eager(name: str, args: tuple):
    """The op's result through ``torch_ops``' eager Python path (in the custom op's layout)."""
    run_check = not name.endswith("unchecked")  # its args end with run_check=False
    if name.startswith("all_gather_matmul"):
        A_shard, Bs, gdim, g = args[:4]
        return torch_ops.all_gather_matmul(A_shard, Bs, gdim, g, run_check=run_check)
    if name.startswith("matmul_reduce_scatter"):
        return torch_ops.matmul_reduce_scatter(*args[:5], run_check=run_check)
    if name.startswith("matmul_all_reduce"):
        return torch_ops.matmul_all_reduce(*args[:4], run_check=run_check)
    if name == "all_to_all_matmul":
        return torch_ops.all_to_all_matmul(*args)
    return torch_ops.matmul_all_to_all(*args)


def check_values_and_gradients(rank: int, P: int, tmp: Path) -> list[str]:
    """Mismatches raise; returns the decision source of every forward the registered op ran."""
    torch_ops.configure(check_calls=True)  # the debug mode keeps each call's decision (last_decision)
    failures, sources = [], []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(300 + rank)
        for name, op, args in _cases(rank, P, gen, dtype):
            leaves = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            results = {}
            for way, fn in (("ficco op", lambda a: op(*a)), ("torch_ops", lambda a: _eager(name, a)),
                            ("pytorch", lambda a: _reference(name, a, P))):
                copies = [t.detach().clone().requires_grad_() for t in leaves]
                it = iter(copies)
                a = torch.utils._pytree.tree_map_only(torch.Tensor, lambda _: next(it), args)
                outs = [t for t in torch.utils._pytree.tree_leaves(fn(a)) if t is not None]
                if way == "ficco op":
                    sources.append(torch_ops.last_decision.source)
                # A fixed cotangent per output, the same for every way (outputs not requiring
                # grad, the MoE op's X_recv, take no part).
                cot = torch.Generator().manual_seed(400 + rank)
                loss = sum((o.float() * rand(cot, *o.shape)).sum() for o in outs if o.requires_grad)
                loss.backward()
                results[way] = ([o.detach() for o in outs], [c.grad for c in copies])
            want_outs, want_grads = results["pytorch"]
            for way in ("ficco op", "torch_ops"):
                outs, grads = results[way]
                if way == "torch_ops" and name == "all_to_all_matmul":
                    want = want_outs[:1]  # torch_ops returns the output only
                else:
                    want = want_outs
                for i, (o, w) in enumerate(zip(outs, want)):
                    check_close(o, w, dtype, f"{name} {dtype} [{way}] out[{i}]", failures)
                for i, (g, w) in enumerate(zip(grads, want_grads)):
                    if g is None or w is None:
                        if (g is None) != (w is None):
                            failures.append(f"{name} {dtype} [{way}] grad {i}: {g is None=}, {w is None=}")
                        continue
                    check_close(g, w, dtype, f"{name} {dtype} [{way}] grad[{i}]", failures)
    assert not failures, f"rank {rank}: {len(failures)} mismatches:\n" + "\n".join(failures)
    return sources


@gloo
@pytest.mark.parametrize("schedule", ["", "pinned"])
def test_values_and_gradients_equal_torch_ops_and_pytorch(schedule, tmp_path):
    spawn(check_pinned_values_and_gradients if schedule else check_values_and_gradients, 2, tmp_path)


def check_pinned_values_and_gradients(rank: int, P: int, tmp: Path) -> None:
    # A schedule that splits (where legal): the executor's overlapped path, not its baseline.
    torch_ops.configure(schedule="shard.ring.sm")
    sources = check_values_and_gradients(rank, P, tmp)
    assert sources.count("pinned") >= len(sources) // 2, sources


def test_the_registered_ops_and_the_compile_pass_stay_light():
    # What a compiled job imports: no offline tool (the runtime's rule, tests/test_import_graph.py).
    import subprocess
    import sys

    code = ("import sys, ficco_select.runtime.library, ficco_select.runtime.compile\n"
            "print(' '.join(sorted(sys.modules)))")
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert {"ficco_select.runtime.library", "ficco_select.runtime.compile"} <= mods
    assert not mods & {"pandas", "sklearn", "mlflow", "xgboost", "ficco_select.data", "ficco_select.train", "ficco_select.cli"}


def check_compiled_ops(rank: int, P: int, tmp: Path) -> None:
    # A model calling the registered ops directly: one graph (no break), compiled by
    # Inductor with the ops as extern kernels, its values and gradients the eager ones.
    torch_ops.configure(schedule="shard.ring.sm", check_calls=True)  # the debug mode keeps last_decision
    g = dist.group.WORLD.group_name
    recv, send = _moe_routing(rank, P)

    def block(x, w_up, w_down, w_head, w_expert):
        _, (h,) = torch.ops.ficco.all_gather_matmul(x, [w_up], 0, g)
        y = torch.ops.ficco.matmul_reduce_scatter(torch.relu(h), w_down, "sum", 0, g)
        z = torch.ops.ficco.matmul_all_reduce(y, w_head, "sum", g)
        routed = z[: sum(send)]
        expert, _ = torch.ops.ficco.all_to_all_matmul(routed, w_expert, recv, send, g)
        return z, torch.ops.ficco.matmul_all_to_all(expert, w_expert.t(), send, recv, g)

    gen = torch.Generator().manual_seed(500 + rank)
    args = [rand(gen, 8, 16), rand(gen, 16, 32), rand(gen, 32, 16), rand(gen, 16, 8), rand(gen, 8, 6)]
    explained = torch._dynamo.explain(block)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        leaves = [a.clone().requires_grad_() for a in args]
        outs = fn(*leaves)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        results.append(([o.detach() for o in outs], [t.grad for t in leaves]))
    (want_outs, want_grads), (got_outs, got_grads) = results
    for got, want in zip(got_outs + got_grads, want_outs + want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch_ops.last_decision.source == "pinned"


@gloo
def test_the_ops_compile_into_one_graph_with_eager_values_and_gradients(tmp_path):
    spawn(check_compiled_ops, 2, tmp_path)
