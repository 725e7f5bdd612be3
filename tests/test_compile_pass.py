"""ficco's torch.compile pass (``runtime/compile.py``) on real gloo ranks, compiled by Inductor on CPU.

A tensor-parallel model written with PyTorch's functional collectives (all-gather + mm, mm +
reduce-scatter, mm + all-reduce) compiles without graph breaks; with the pass installed its
forward and backward graphs get ficco ops where the selector's layer tables overlap
somewhere, keep the serial pattern where they say the baseline at every m, the report says
which, and outputs and gradients equal the uncompiled model's.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ficco_select.runtime import dispatch, torch_ops
from helpers.ranks import counting_checks, spawn

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo

SMALL = (16, 32)
"""(hidden, ffn) of a layer the cpu heuristic's table overlaps somewhere: rewritten."""
LARGE = (256, 512)
"""(hidden, ffn) of a layer whose table says the baseline at every m on cpu: kept serial."""


class SequenceParallelMLP(nn.Module):
    """Megatron's MLP with sequence parallelism, in functional collectives: all-gather the
    sequence shards, the column-parallel up projection, the row-parallel down projection,
    reduce-scatter back to sequence shards; then a row-parallel output head all-reduced
    (tensor parallelism without sequence parallelism)."""

    def __init__(self, hidden: int, ffn: int, P: int, seq_dim: int, gen: torch.Generator):
        super().__init__()
        self.seq_dim, self.group = seq_dim, dist.group.WORLD.group_name
        self.up = nn.Parameter(torch.randn(hidden, ffn // P, generator=gen) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(ffn // P, hidden, generator=gen) / ffn ** 0.5)
        self.head = nn.Parameter(torch.randn(hidden // P, 8, generator=gen) / hidden ** 0.5)

    def forward(self, x_shard):
        x = funcol.all_gather_tensor(x_shard, self.seq_dim, self.group)
        h = torch.relu(x @ self.up)
        y = funcol.reduce_scatter_tensor(h @ self.down, "sum", self.seq_dim, self.group)
        rank, P = dist.get_rank(), dist.get_world_size()
        width = y.shape[-1] // P
        head_in = y[..., rank * width:(rank + 1) * width]  # this rank's slice of the head's input
        return funcol.all_reduce(head_in @ self.head, "sum", self.group)


def _run(model, x):
    """(output, input grad, parameter grads) of one forward and backward."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _compiled_equals_eager(rank: int, P: int, hidden: int, ffn: int, x_shape: tuple, seq_dim: int):
    """The compiled model with the pass installed, checked against the eager one; the pass's report."""
    from ficco_select.runtime.compile import install_pass

    torch._dynamo.reset()
    model = SequenceParallelMLP(hidden, ffn, P, seq_dim, torch.Generator().manual_seed(7 + rank))
    x = torch.randn(*x_shape, hidden, generator=torch.Generator().manual_seed(11 + rank))
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    want = _run(model, x)
    with install_pass() as ficco_pass, counting_checks() as checks:
        compiled = torch.compile(model, fullgraph=True)
        got = _run(compiled, x)
    assert checks == [], checks  # the ops the pass inserts trust the graph's shapes (SPMD)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    return ficco_pass.rewrites


def _summary(rewrites) -> list[tuple[str, str, bool]]:
    return sorted((r.op, r.graph, r.rewritten) for r in rewrites)


def check_pinned(rank: int, P: int, tmp: Path) -> None:
    # A pinned schedule rewrites every match: the forward's three and the backward's
    # all-gather matmul (the down projection's input gradient) and matmul reduce-scatter
    # (the up projection's). The backward's all-reduce precedes its matmul: no ficco op.
    torch_ops.configure(schedule="shard.ring.sm", check_calls=True)  # the debug mode keeps last_decision
    # 2-D; (batch, seq) gathered along seq; and batch 1, whose backward regroups the rows
    # (mm, reshapes, reduce-scatter along dim 0)
    for x_shape, seq_dim in (((8,), 0), ((2, 4), 1), ((1, 8), 1)):
        rewrites = _compiled_equals_eager(rank, P, *SMALL, x_shape, seq_dim)
        assert _summary(rewrites) == [
            ("all_gather_matmul", "backward", True), ("all_gather_matmul", "forward", True),
            ("matmul_all_reduce", "forward", True), ("matmul_reduce_scatter", "backward", True),
            ("matmul_reduce_scatter", "forward", True)], [r.line() for r in rewrites]
        layers = {(r.op, r.graph): (r.rows, r.n, r.k) for r in rewrites}
        rows = P * 8 if seq_dim == 0 else x_shape[0] * P * x_shape[1]
        hidden, ffn = SMALL
        assert layers[("all_gather_matmul", "forward")] == (rows, ffn // P, hidden)
        assert layers[("matmul_reduce_scatter", "forward")] == (rows, hidden, ffn // P)
        assert layers[("matmul_reduce_scatter", "backward")] == (rows, hidden, ffn // P)
        assert layers[("matmul_all_reduce", "forward")] == (rows // P, 8, hidden // P)
    # The compiled graphs ran ficco's ops: their pinned decisions are in the cache.
    ops = {key[0][0] for key in dispatch.decisions()}
    assert {"ag", "rs", "ar"} <= ops, ops
    assert torch_ops.last_decision.source == "pinned"


def test_pinned_schedule_rewrites_every_match_and_matches_eager(tmp_path):
    spawn(check_pinned, 2, tmp_path)


class LastDimsMLP(nn.Module):
    """Tensor parallelism over the features: all-gather the input's feature shards (the
    contraction dim), reduce-scatter the output's features (the last dim)."""

    def __init__(self, hidden: int, ffn: int, P: int, gen: torch.Generator, dtype: torch.dtype):
        super().__init__()
        self.group = dist.group.WORLD.group_name
        self.up = nn.Parameter((torch.randn(hidden, ffn, generator=gen) / hidden ** 0.5).to(dtype))
        self.down = nn.Parameter((torch.randn(ffn, hidden, generator=gen) / ffn ** 0.5).to(dtype))

    def forward(self, x_shard):
        x = funcol.all_gather_tensor(x_shard, 1, self.group)
        return funcol.reduce_scatter_tensor(torch.relu(x @ self.up) @ self.down, "sum", 1, self.group)


def check_last_dims(rank: int, P: int, tmp: Path) -> None:
    # A gather along the contraction dim stays serial (ficco would run PyTorch's form there);
    # a scatter along the last dim becomes the ficco op, decided per call. In bfloat16.
    from ficco_select.runtime.compile import install_pass

    torch_ops.configure(schedule="shard.ring.sm")
    hidden, ffn = SMALL
    model = LastDimsMLP(hidden, ffn, P, torch.Generator().manual_seed(7), torch.bfloat16)
    x = torch.randn(8, hidden // P, generator=torch.Generator().manual_seed(11 + rank)).to(torch.bfloat16)
    want = _run(model, x)
    with install_pass() as ficco_pass:
        got = _run(torch.compile(model, fullgraph=True), x)
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    lines = [r.line() for r in ficco_pass.rewrites]
    assert _summary(ficco_pass.rewrites) == [
        ("all_gather_matmul", "backward", False), ("all_gather_matmul", "forward", False),
        ("matmul_reduce_scatter", "backward", True), ("matmul_reduce_scatter", "forward", True)], lines
    forward_ag = next(r for r in ficco_pass.rewrites if r.op == "all_gather_matmul" and r.graph == "forward")
    assert (forward_ag.rows, forward_ag.n, forward_ag.k, forward_ag.dtype) == (8, ffn, hidden, "bfloat16"), lines
    assert all("contraction dim" in r.reason for r in ficco_pass.rewrites if not r.rewritten), lines


def test_last_dim_gather_stays_serial_and_last_dim_scatter_is_rewritten(tmp_path):
    spawn(check_last_dims, 2, tmp_path)


def check_selector(rank: int, P: int, tmp: Path) -> None:
    # The cpu heuristic: a small layer's table overlaps somewhere (rewritten, decided per
    # call at run time), a large one's says the baseline at every m (kept serial).
    small = _compiled_equals_eager(rank, P, *SMALL, (8,), 0)
    assert all(r.rewritten for r in small), [r.line() for r in small]
    assert all("overlaps somewhere" in r.reason for r in small), [r.line() for r in small]
    large = _compiled_equals_eager(rank, P, *LARGE, (8,), 0)
    assert len(large) == 5 and not any(r.rewritten for r in large), [r.line() for r in large]
    assert all("baseline at every m" in r.reason for r in large), [r.line() for r in large]


def test_selector_tables_decide_what_is_rewritten(tmp_path):
    spawn(check_selector, 2, tmp_path)


def check_inference_with_varying_m(rank: int, P: int, tmp: Path) -> None:
    # Serving: no grad, the token count varies between calls (dynamic dim 0). One graph; its
    # k and n are static, so the tables decide at compile time; the op decides each m at run time.
    from ficco_select.runtime.compile import install_pass

    torch._dynamo.reset()
    hidden, ffn = SMALL
    model = SequenceParallelMLP(hidden, ffn, P, 0, torch.Generator().manual_seed(7 + rank))
    gen = torch.Generator().manual_seed(11 + rank)
    with install_pass() as ficco_pass, torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        for m in (8, 12, 20):
            x = torch.randn(m, hidden, generator=gen)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    rewrites = ficco_pass.rewrites
    assert _summary(rewrites) == [("all_gather_matmul", "inference", True), ("matmul_all_reduce", "inference", True),
                                  ("matmul_reduce_scatter", "inference", True)], [r.line() for r in rewrites]
    assert all(isinstance(r.rows, str) and isinstance(r.n, int) and isinstance(r.k, int) for r in rewrites), \
        [r.line() for r in rewrites]
    # One compiled graph, every m decided at run time (the all-gather matmul's rows: P * m).
    assert {key[0][1][0] for key in dispatch.decisions() if key[0][0] == "ag"} == {8, 12, 20}


def test_inference_with_varying_token_count_compiles_once(tmp_path):
    spawn(check_inference_with_varying_m, 2, tmp_path)


def check_install_and_remove(rank: int, P: int, tmp: Path) -> None:
    import torch._inductor.config as inductor_config

    from ficco_select.runtime.compile import install_pass

    def other(graph):
        pass

    inductor_config.post_grad_custom_post_pass = other
    with install_pass() as ficco_pass:
        assert inductor_config.post_grad_custom_post_pass == [other, ficco_pass]
        assert ficco_pass.uuid() is None  # Inductor's FX graph cache is bypassed: the pass always runs
    assert inductor_config.post_grad_custom_post_pass is other
    inductor_config.post_grad_custom_post_pass = None


def test_install_keeps_a_pass_already_there_and_remove_restores_it(tmp_path):
    spawn(check_install_and_remove, 1, tmp_path)
