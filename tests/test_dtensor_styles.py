"""Ficco's DTensor parallel styles against PyTorch's, on a Llama-style block over real gloo ranks.

The same block, weights and inputs are parallelized twice, with torchtitan's sequence-parallel
plan in PyTorch's styles and in ficco's (the class names differ, nothing else): the outputs,
the gradients of the input and of every weight (and their placements) agree, with each other
and with the unsharded block's, after an optimizer step too, and ficco's ops ran for the
calls' shapes, forward and backward. Also: the whole model's plan (embedding, output), the
plan without ``PrepareModuleInput``, biased and replicated MLPs, activation checkpointing,
linears that do not all take the prepared input, and the tables ``prepare_tables`` builds.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

from ficco_select.runtime import dispatch
from ficco_select.runtime.dtensor import prepare_tables
from helpers.llama import BATCH, DIM, FICCO_PLAN, HIDDEN, SEQ, TORCH_PLAN, VOCAB, Block, full, llama_plan, step
from helpers.ranks import check_close, counting_checks, rand, spawn


def test_the_ficco_plan_differs_from_pytorchs_in_class_names_only():
    torch_plan, ficco_plan = llama_plan(*TORCH_PLAN), llama_plan(*FICCO_PLAN)
    assert torch_plan.keys() == ficco_plan.keys()
    for name in torch_plan:
        theirs, ours = torch_plan[name], ficco_plan[name]
        assert vars(theirs) == vars(ours), name
        assert isinstance(ours, type(theirs)), name
        assert type(ours).__name__ in (type(theirs).__name__, "Ficco" + type(theirs).__name__), name


class Transformer(nn.Module):
    """Embedding, a block, the final norm and the output projection (torchtitan's names)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings, self.layers = nn.Embedding(VOCAB, DIM), nn.ModuleDict({"0": Block()})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def transformer_plan(colwise, rowwise, prepare_input) -> dict:
    """torchtitan's plan of the whole model: its embedding, final norm and output, and its blocks'."""
    return {
        "tok_embeddings": rowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": colwise(input_layouts=Shard(1), output_layouts=Replicate()),
        **{f"layers.0.{name}": style for name, style in llama_plan(colwise, rowwise, prepare_input).items()},
    }


class MLP(nn.Module):
    """Two linears with biases: the layouts the block does not use (replicated, biased)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Checkpointed(nn.Module):
    """The block under activation checkpointing (torchtitan's, non-reentrant): its forward,
    ficco's ops included, runs again in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


class GatedFFN(nn.Module):
    """Colwise linears that do not all take the prepared input, one of them twice: each then
    multiplies its own input (the shared gather's output for it is left unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.c = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.c(F.silu(self.a(x)) * self.b(2 * x) + self.a(x))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = GatedFFN()

    def forward(self, x):
        return self.ffn(x)


def gated_plan(colwise, rowwise, prepare_input) -> dict:
    return {"ffn": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.a": colwise(), "ffn.b": colwise(), "ffn.c": rowwise(output_layouts=Shard(1))}


# -- one step of each, compared --------------------------------------------------------------
def check_plans(rank: int, P: int, make_model, plan, sharded_in: bool, sharded_out: bool, expected: set,
                tokens: bool = False) -> None:
    """`plan(colwise, rowwise, prepare_input)` in PyTorch's styles and in ficco's, from the
    same weights and inputs (sequence-sharded or replicated, in and out): the same outputs,
    gradients and placements, equal to the unsharded model's; ficco's ops ran for the call
    shapes `expected` (their keys without dtype and device). With `tokens` the input is token
    ids and the output logits."""
    mesh = init_device_mesh("cpu", (P,))
    dispatch.configure()  # no decisions yet: those below are this check's
    torch.manual_seed(0)  # the same full weights and inputs on every rank
    reference = make_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(VOCAB, (BATCH, SEQ), generator=gen) if tokens else rand(gen, BATCH, SEQ, DIM)
    dy = rand(gen, BATCH, SEQ, VOCAB if tokens else DIM)
    mine = lambda t, sharded: t.chunk(P, dim=1)[rank] if sharded else t  # noqa: E731
    failures = []

    models, results = {}, {}
    for label, styles in {"torch": TORCH_PLAN, "ficco": FICCO_PLAN}.items():
        models[label] = parallelize_module(copy.deepcopy(reference), mesh, plan(*styles))
        with counting_checks() as checks:  # the debug mode on: the styles still skip the check
            results[label] = step(models[label], mine(x, sharded_in), mine(dy, sharded_out))
        if checks:  # DTensor's shapes are the same on every rank: the styles' ops trust them
            failures.append(f"{label}'s styles ran {len(checks)} per-call checks: {checks[:2]}")
    (want_y, want_dx, want_grads), (got_y, got_dx, got_grads) = results["torch"], results["ficco"]
    check_close(got_y, want_y, torch.float32, "output", failures)
    if not tokens:
        check_close(got_dx, want_dx, torch.float32, "input's gradient", failures)
    for (name, theirs), ours in zip(models["torch"].named_parameters(), models["ficco"].parameters()):
        # The same DTensor parameters (state_dict, optimizers), with gradients of the same placements.
        if (type(ours), ours.placements, ours.shape) != (type(theirs), theirs.placements, theirs.shape):
            failures.append(f"{name}: {ours.placements} {ours.shape}, PyTorch's {theirs.placements} {theirs.shape}")
        got, want = got_grads[name], want_grads[name]
        if got is None or getattr(got, "placements", None) != getattr(want, "placements", None):
            failures.append(f"{name}'s gradient: {got if got is None else got.placements}, PyTorch's "
                            f"{want.placements}")
            continue
        check_close(full(got), full(want), torch.float32, f"{name}'s gradient", failures)

    # An optimizer step on the DTensor parameters: the same next output.
    for model in models.values():
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    with torch.no_grad():
        want_y2, got_y2 = (models[label](mine(x, sharded_in)) for label in ("torch", "ficco"))
    check_close(got_y2, want_y2, torch.float32, "output after an AdamW step", failures)

    # Both equal the unsharded model's (this rank's rows of it).
    full_x = x.clone().requires_grad_(not tokens)
    full_y = reference(full_x)
    full_y.backward(dy)
    check_close(got_y, mine(full_y.detach(), sharded_out), torch.float32, "output vs unsharded", failures)
    if not tokens:
        check_close(got_dx, mine(full_x.grad, sharded_in), torch.float32, "input's gradient vs unsharded", failures)
    for name, p in reference.named_parameters():
        check_close(full(got_grads[name]), p.grad, torch.float32, f"{name}'s gradient vs unsharded", failures)

    ran = {key[:-2] for key, _ in dispatch.decisions()}  # without dtype and device
    if expected - ran:
        failures.append(f"ficco's ops did not run for {sorted(expected - ran)}; ran {sorted(ran)}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


ROWS = BATCH * SEQ // 2  # a rank's tokens, sequence-sharded over 2 ranks


def check_llama_block(rank: int, P: int, tmp: Path) -> None:
    check_plans(rank, P, Block, llama_plan, sharded_in=True, sharded_out=True, expected={
        ("ag", (ROWS, DIM), 3 * DIM // P),  # wq, wk, wv: one gather, three weights
        ("ag", (ROWS, DIM), 2 * HIDDEN // P),  # w1, w3
        ("rs", (P * ROWS, DIM // P), DIM, False),  # wo
        ("rs", (P * ROWS, HIDDEN // P), DIM, False),  # w2
        # backward: the mirrors
        ("rs", (P * ROWS, 3 * DIM // P), DIM, False),  # wq, wk, wv's input gradient
        ("rs", (P * ROWS, 2 * HIDDEN // P), DIM, False),  # w1, w3's
        ("ag", (ROWS, DIM), DIM // P),  # wo's (all-gather dy, @ W)
        ("ag", (ROWS, DIM), HIDDEN // P),  # w2's
    })


@pytest.mark.gloo
def test_llama_block_equals_pytorchs_styles_and_runs_ficcos_ops(tmp_path):
    spawn(check_llama_block, 2, tmp_path)


def check_transformer(rank: int, P: int, tmp: Path) -> None:
    check_plans(rank, P, Transformer, transformer_plan, sharded_in=False, sharded_out=False, tokens=True, expected={
        ("ag", (ROWS, DIM), VOCAB // P),  # output (its logits then all-gathered, as PyTorch's)
        ("rs", (P * ROWS, VOCAB // P), DIM, False),  # its input gradient
        ("ag", (ROWS, DIM), 3 * DIM // P),  # the block's, as above
        ("rs", (P * ROWS, HIDDEN // P), DIM, False),
    })


@pytest.mark.gloo
def test_torchtitans_whole_model_plan_equals_pytorchs_styles(tmp_path):
    """The embedding (no matmul: PyTorch's rowwise path) and the output projection around the block."""
    spawn(check_transformer, 2, tmp_path)


def plan_without_prepare(colwise, rowwise, prepare_input) -> dict:
    """The block's plan with the colwise linears taking the norms' sequence-sharded output
    themselves (``input_layouts=Shard(1)``)."""
    return {
        "attention_norm": SequenceParallel(),
        **{f"attention.{w}": colwise(input_layouts=Shard(1)) for w in ("wq", "wk", "wv")},
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward.w1": colwise(input_layouts=Shard(1)),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(input_layouts=Shard(1)),
    }


def sequence_parallel_mlp(colwise, rowwise, prepare_input) -> dict:
    """Sequence-sharded in and out; the activation between the linears a DTensor."""
    return {"up": colwise(input_layouts=Shard(1), use_local_output=False), "down": rowwise(output_layouts=Shard(1))}


def replicated_mlp(colwise, rowwise, prepare_input) -> dict:
    """Inference engines' tensor parallelism: replicated in, all-reduced out."""
    return {"up": colwise(), "down": rowwise()}


def check_other_layouts(rank: int, P: int, tmp: Path) -> None:
    check_plans(rank, P, Block, plan_without_prepare, sharded_in=True, sharded_out=True, expected={
        ("ag", (ROWS, DIM), DIM // P),  # each of wq, wk, wv gathers (no FiccoPrepareModuleInput to share)
        ("ag", (ROWS, DIM), HIDDEN // P),
        ("rs", (P * ROWS, DIM // P), DIM, False),
        ("rs", (P * ROWS, HIDDEN // P), DIM, False),
    })
    check_plans(rank, P, MLP, sequence_parallel_mlp, sharded_in=True, sharded_out=True, expected={
        ("ag", (ROWS, DIM), HIDDEN // P), ("rs", (P * ROWS, HIDDEN // P), DIM, False),
    })
    check_plans(rank, P, Checkpointed, lambda *styles: {f"block.{name}": style
                                                       for name, style in llama_plan(*styles).items()},
                sharded_in=True, sharded_out=True, expected={("ag", (ROWS, DIM), 3 * DIM // P)})
    # Ficco's prepare and rowwise styles, PyTorch's colwise: the prepare leaves PyTorch its gather.
    check_plans(rank, P, Block, lambda colwise, *others: llama_plan(ColwiseParallel, *others),
                sharded_in=True, sharded_out=True, expected={("rs", (P * ROWS, DIM // P), DIM, False)})
    check_plans(rank, P, Gated, gated_plan, sharded_in=True, sharded_out=True, expected={
        ("ag", (ROWS, DIM), 2 * HIDDEN // P),  # a's first call: a and b's weights
        ("ag", (ROWS, DIM), HIDDEN // P),  # b on 2x, a's second call (and c's input gradient)
    })
    check_plans(rank, P, MLP, replicated_mlp, sharded_in=False, sharded_out=False, expected={
        ("ar", (P * ROWS, HIDDEN // P), DIM),  # down: matmul_all_reduce (up has no collective to overlap)
    })
    for style in FICCO_PLAN[:2]:  # the tensor-parallel mesh only
        with pytest.raises(ValueError, match="1-D"):
            parallelize_module(MLP(), init_device_mesh("cpu", (1, P)), {"up": style()})


@pytest.mark.gloo
def test_other_layouts_and_biases_equal_pytorchs_styles(tmp_path):
    spawn(check_other_layouts, 2, tmp_path)


def check_prepared_tables(rank: int, P: int, tmp: Path) -> None:
    mesh = init_device_mesh("cpu", (P,))
    torch.manual_seed(0)
    block = parallelize_module(Block(), mesh, llama_plan(*FICCO_PLAN))
    prepare_tables(block)
    tables = dispatch.tables()
    # The shared gathers (attention's, the feed-forward's) and the rowwise linears, forward and
    # input gradient each: (op, n, k) of A (rows, k) @ B (k, n), this rank's shards.
    layers = {(layer[0], layer[1], layer[-1]) for layer, _ in tables}
    assert layers == {
        ("ag", 3 * DIM // P, DIM), ("rs", DIM, 3 * DIM // P),  # wq, wk, wv
        ("ag", 2 * HIDDEN // P, DIM), ("rs", DIM, 2 * HIDDEN // P),  # w1, w3
        ("rs", DIM, DIM // P), ("ag", DIM // P, DIM),  # wo
        ("rs", DIM, HIDDEN // P), ("ag", HIDDEN // P, DIM),  # w2
    }, sorted(layers)
    assert all(table is not None for _, table in tables.values())
    broadcasts = []
    real_broadcast = dist.broadcast_object_list

    def counted(*args, **kw):  # the decisions' broadcasts, counted (and made)
        broadcasts.append(1)
        return real_broadcast(*args, **kw)

    dispatch.dist.broadcast_object_list = counted
    gen = torch.Generator().manual_seed(1)
    for batch in (1, 3, 2):  # the token count changes; the first step decides nothing either
        x = rand(gen, batch, SEQ, DIM).chunk(P, dim=1)[rank].clone().requires_grad_()
        block(x).square().sum().backward()
    dispatch.dist.broadcast_object_list = real_broadcast
    assert broadcasts == [] and dispatch.tables() == tables, (len(broadcasts), sorted(map(str, tables)))
    assert {d.source for d in dispatch.decisions().values()} <= {"model", "heuristic", "fallback"}


@pytest.mark.gloo
def test_prepare_tables_builds_every_table_before_the_first_step(tmp_path):
    spawn(check_prepared_tables, 2, tmp_path)
