"""A DTensor-parallelized Llama-style block under ``torch.compile``, on real gloo ranks (Inductor on CPU).

Where PyTorch users already are: torchtitan's sequence-parallel plan (``SequenceParallel``
norms, ``PrepareModuleInput``, colwise / rowwise linears; the block and plan of
``test_dtensor_styles``), compiled.

- PyTorch's plan compiles with no graph break; with ficco's pass installed
  (``runtime/compile.py``) its forward and backward graphs get ficco ops in place of the
  all-gather + mm and mm + reduce-scatter matches (the report names each, with the layer's
  shape), and outputs and gradients (the input's, every weight's, their placements) equal
  PyTorch's plan uncompiled.
- Ficco's styles (``runtime/dtensor.py``) compile with no graph break too, the shared gather
  of ``FiccoPrepareModuleInput`` included: under compile they call the registered ops
  (``torch.ops.ficco``, one graph node each: one gather for wq, wk, wv, one for w1, w3), with
  or without the pass (which then finds nothing left to rewrite), and equal PyTorch's plan
  uncompiled.
- Batch 1: the sequence gathers lower to a dim-0 all-gather flattened by reshapes; the pass
  follows them and rewrites every gather, and the compiled values equal the eager ones.
"""

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ficco_select.runtime import dispatch, torch_ops
from helpers.llama import BATCH, DIM, FICCO_PLAN, HIDDEN, SEQ, TORCH_PLAN, Block, full, llama_plan, step
from helpers.ranks import check_close, counting_checks, rand, spawn

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo

ROWS = BATCH * SEQ  # the gathered tokens of a GEMM (a rank holds ROWS / P)


def _ficco_op(node) -> str | None:
    """The ficco op a traced node calls (Dynamo records the packet, AOTAutograd the overload), else None."""
    name = str(node.target).split(".")
    return name[1] if node.op == "call_function" and name[0] == "ficco" else None


def _setup(rank: int, P: int):
    """(mesh, the full block, this rank's input and output gradient), the same on every rank."""
    mesh = init_device_mesh("cpu", (P,))
    torch.manual_seed(0)
    reference = Block()
    gen = torch.Generator().manual_seed(1)
    x, dy = rand(gen, BATCH, SEQ, DIM), rand(gen, BATCH, SEQ, DIM)
    return mesh, reference, x.chunk(P, dim=1)[rank], dy.chunk(P, dim=1)[rank]


def _graph_breaks(model, x) -> None:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x.clone())
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(r.reason)[:500] for r in explained.break_reasons]
    return explained


def _compare(got, want, got_model, want_model, what: str, failures: list[str]) -> None:
    """`got` and `want` (``step``'s results) equal, every parameter's gradient of the same placements."""
    (got_y, got_dx, got_grads), (want_y, want_dx, want_grads) = got, want
    got_grads = {name.removeprefix("_orig_mod."): g for name, g in got_grads.items()}  # the compiled module's
    check_close(got_y, want_y, torch.float32, f"{what}: output", failures)
    check_close(got_dx, want_dx, torch.float32, f"{what}: input's gradient", failures)
    for name, _ in want_model.named_parameters():
        g, w = got_grads[name], want_grads[name]
        if g is None or getattr(g, "placements", None) != getattr(w, "placements", None):
            failures.append(f"{what}: {name}'s gradient {g if g is None else g.placements}, PyTorch's {w.placements}")
            continue
        check_close(full(g), full(w), torch.float32, f"{what}: {name}'s gradient", failures)


def _summary(rewrites) -> Counter:
    return Counter((r.op, r.graph, r.rows, r.n, r.k, r.rewritten) for r in rewrites)


def check_pytorch_plan_compiled(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.compile import install_pass

    torch_ops.configure(schedule="shard.ring.sm")  # every match rewritten, whatever the tables say
    mesh, reference, x, dy = _setup(rank, P)
    eager = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*TORCH_PLAN))
    want = step(eager, x, dy)
    assert not dispatch.decisions(), "PyTorch's plan eager runs no ficco op"

    model = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*TORCH_PLAN))
    _graph_breaks(model, x)
    with install_pass() as ficco_pass:
        got = step(torch.compile(model), x, dy)
    failures = []
    _compare(got, want, model, eager, "PyTorch's plan compiled with ficco's pass", failures)

    lines = [r.line() for r in ficco_pass.rewrites]
    expected = Counter([
        # forward: one all-gather + its matmuls per PrepareModuleInput (the weights together)
        ("all_gather_matmul", "forward", ROWS, 3 * DIM // P, DIM, True),  # wq, wk, wv
        ("all_gather_matmul", "forward", ROWS, 2 * HIDDEN // P, DIM, True),  # w1, w3 (as wide, at these sizes)
        ("matmul_reduce_scatter", "forward", ROWS, DIM, DIM // P, True),  # wo
        ("matmul_reduce_scatter", "forward", ROWS, DIM, HIDDEN // P, True),  # w2
        # backward: the rowwise linears' input gradients, all-gather dy then @ W
        ("all_gather_matmul", "backward", ROWS, DIM // P, DIM, True),  # wo's
        ("all_gather_matmul", "backward", ROWS, HIDDEN // P, DIM, True),  # w2's
        # Not matched: the colwise linears' input gradient, reduce_scatter(dq @ Wq + dk @ Wk + dv @ Wv)
        # (and w1, w3's): the reduce-scatter's producer is the sum, not one mm.
    ])
    if _summary(ficco_pass.rewrites) != expected:
        failures.append("rewrites:\n  " + "\n  ".join(lines))
    if not all(r.dtype == "float32" and r.world_size == P for r in ficco_pass.rewrites):
        failures.append("rewrites' dtype / world size:\n  " + "\n  ".join(lines))
    # The compiled graphs ran ficco's ops: their decisions, forward and backward.
    ran = {key[0][0] for key in dispatch.decisions()}
    if ran != {"ag", "rs"}:
        failures.append(f"ficco's ops ran: {sorted(ran)}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_pytorch_plan_compiled_with_ficcos_pass_equals_eager_and_rewrites_the_matches(tmp_path):
    spawn(check_pytorch_plan_compiled, 2, tmp_path)


def check_ficco_styles_compiled(rank: int, P: int, tmp: Path) -> None:
    from ficco_select.runtime.compile import install_pass

    mesh, reference, x, dy = _setup(rank, P)
    eager = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*TORCH_PLAN))
    want = step(eager, x, dy)

    model = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*FICCO_PLAN))
    explained = _graph_breaks(model, x)
    # One graph, ficco's registered ops in it: the shared gathers (attention's, the feed-forward's)
    # and the two rowwise reduce-scatters.
    (graph,) = explained.graphs
    ops = Counter(op for op in map(_ficco_op, graph.graph.nodes) if op)
    failures = []
    if ops != Counter({"all_gather_matmul": 2, "matmul_reduce_scatter": 2}):
        failures.append(f"ficco ops in the traced graph: {dict(ops)}; its calls: "
                        f"{sorted({str(n.target) for n in graph.graph.nodes if n.op == 'call_function'})}")

    for with_pass in (False, True):
        torch._dynamo.reset()
        dispatch.configure()  # no decisions yet: those below are this compile's
        fresh = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*FICCO_PLAN))
        with counting_checks() as checks:
            if with_pass:
                with install_pass() as ficco_pass:
                    got = step(torch.compile(fresh, fullgraph=True), x, dy)
                if ficco_pass.rewrites:  # every collective is a ficco op already
                    failures.append("the pass rewrote: " + "; ".join(r.line() for r in ficco_pass.rewrites))
            else:
                got = step(torch.compile(fresh, fullgraph=True), x, dy)
        what = f"ficco's styles compiled {'with' if with_pass else 'without'} the pass"
        if checks:
            failures.append(f"{what}: {len(checks)} per-call checks ran: {checks[:2]}")
        _compare(got, want, fresh, eager, what, failures)
        ran = {key[:-2] for key, _ in dispatch.decisions()}  # without dtype and device
        expected = {
            ("ag", (ROWS // P, DIM), 3 * DIM // P),  # wq, wk, wv: one gather, three weights
            ("ag", (ROWS // P, DIM), 2 * HIDDEN // P),  # w1, w3
            ("rs", (ROWS, DIM // P), DIM, False),  # wo
            ("rs", (ROWS, HIDDEN // P), DIM, False),  # w2
            ("rs", (ROWS, 3 * DIM // P), DIM, False),  # backward: wq, wk, wv's input gradient
            ("rs", (ROWS, 2 * HIDDEN // P), DIM, False),  # w1, w3's
            ("ag", (ROWS // P, DIM), DIM // P),  # wo's
            ("ag", (ROWS // P, DIM), HIDDEN // P),  # w2's
        }
        if expected - ran:
            failures.append(f"{what}: ficco's ops did not run for {sorted(expected - ran)}; ran {sorted(ran)}")
        if any(isinstance(p, DTensor) and p.grad is None for p in fresh.parameters()):
            failures.append(f"{what}: a parameter without gradient")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_ficco_styles_compile_without_graph_breaks_and_equal_pytorchs_plan(tmp_path):
    spawn(check_ficco_styles_compiled, 2, tmp_path)


def check_batch_one(rank: int, P: int, tmp: Path) -> None:
    import json

    from ficco_select.runtime.compile import install_pass

    torch_ops.configure(schedule="shard.ring.sm")
    mesh = init_device_mesh("cpu", (P,))
    torch.manual_seed(0)
    reference = Block()
    gen = torch.Generator().manual_seed(1)
    x, dy = (rand(gen, 1, SEQ, DIM).chunk(P, dim=1)[rank] for _ in range(2))
    eager = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*TORCH_PLAN))
    want = step(eager, x, dy)
    model = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*TORCH_PLAN))
    with install_pass() as ficco_pass:
        got = step(torch.compile(model), x, dy)
    failures = []
    _compare(got, want, model, eager, "batch 1, compiled with ficco's pass", failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    if rank == 0:
        (tmp / "rewrites.json").write_text(json.dumps([[r.op, r.graph] for r in ficco_pass.rewrites]))


def test_batch_one_compiles_equal_and_its_sequence_gathers_are_matched(tmp_path):
    """With batch 1 DTensor's sequence gather (``Shard(1)`` to ``Replicate()``) lowers to an
    all-gather along dim 0 then reshapes to 2-D rows (no split + cat), which PyTorch's
    pattern finder alone does not take to a matmul: the pass follows the reshapes, so the
    forward's two gathers (q/k/v, w1/w3) and the backward's two (wo's and w2's input
    gradients) are rewritten, and the values equal the uncompiled plan's."""
    import json

    spawn(check_batch_one, 2, tmp_path)
    rewrites = json.loads((tmp_path / "rewrites.json").read_text())
    gathers = [graph for op, graph in rewrites if op == "all_gather_matmul"]
    assert sorted(gathers) == ["backward", "backward", "forward", "forward"], rewrites
