"""Ficco's DTensor parallel styles against PyTorch's, on a Llama-style block over real gloo ranks.

The same block, weights and inputs are parallelized twice, with torchtitan's sequence-parallel
plan in PyTorch's styles and in ficco's (the class names differ, nothing else): the outputs and
the gradients of the input and of every weight agree, and ficco's ops ran for the calls'
shapes, forward and backward.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ficco_select.runtime import dispatch
from ficco_select.runtime.dtensor import FiccoColwiseParallel, FiccoPrepareModuleInput, FiccoRowwiseParallel
from torch_ranks import check_close, rand, spawn

BATCH, SEQ, DIM, HEADS, HIDDEN = 2, 8, 16, 4, 24


# -- a Llama-style block (torchtitan's names) -------------------------------------------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def llama_plan(colwise, rowwise, prepare_input) -> dict:
    """torchtitan's tensor-parallel plan of a transformer block, in the given styles."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }


TORCH_PLAN = (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
FICCO_PLAN = (FiccoColwiseParallel, FiccoRowwiseParallel, FiccoPrepareModuleInput)


def test_the_ficco_plan_differs_from_pytorchs_in_class_names_only():
    torch_plan, ficco_plan = llama_plan(*TORCH_PLAN), llama_plan(*FICCO_PLAN)
    assert torch_plan.keys() == ficco_plan.keys()
    for name in torch_plan:
        theirs, ours = torch_plan[name], ficco_plan[name]
        assert vars(theirs) == vars(ours), name
        assert isinstance(ours, type(theirs)), name
        assert type(ours).__name__ in (type(theirs).__name__, "Ficco" + type(theirs).__name__), name


# -- one step of each, compared --------------------------------------------------------------
def step(block: nn.Module, x_local: torch.Tensor, dy_local: torch.Tensor):
    """(output, the input's gradient, every parameter's full gradient) of one forward + backward."""
    x = x_local.clone().requires_grad_()
    y = block(x)
    y.backward(dy_local)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in block.named_parameters()}
    return y.detach(), x.grad, grads


def check_block(rank: int, P: int, tmp: Path, plans) -> None:
    mesh = init_device_mesh("cpu", (P,))
    torch.manual_seed(0)  # the same full weights and inputs on every rank
    reference = Block()
    gen = torch.Generator().manual_seed(1)
    x, dy = rand(gen, BATCH, SEQ, DIM), rand(gen, BATCH, SEQ, DIM)
    x_local, dy_local = x.chunk(P, dim=1)[rank], dy.chunk(P, dim=1)[rank]
    failures = []

    results = {}
    for label, styles in plans.items():
        block = parallelize_module(copy.deepcopy(reference), mesh, llama_plan(*styles))
        results[label] = step(block, x_local, dy_local)
    want_y, want_dx, want_grads = results["torch"]
    got_y, got_dx, got_grads = results["ficco"]
    check_close(got_y, want_y, torch.float32, "output", failures)
    check_close(got_dx, want_dx, torch.float32, "input's gradient", failures)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        check_close(got_grads[name], want_grads[name], torch.float32, f"{name}'s gradient", failures)

    # Both equal the unsharded block's (this rank's rows of it).
    full_x = x.clone().requires_grad_()
    full_y = reference(full_x)
    full_y.backward(dy)
    check_close(got_y, full_y.detach().chunk(P, dim=1)[rank], torch.float32, "output vs unsharded", failures)
    check_close(got_dx, full_x.grad.chunk(P, dim=1)[rank], torch.float32, "input's gradient vs unsharded", failures)
    for name, p in reference.named_parameters():
        check_close(got_grads[name], p.grad, torch.float32, f"{name}'s gradient vs unsharded", failures)

    # Ficco's ops ran, for the calls' shapes: rows = this rank's tokens, features as sharded.
    rows = BATCH * SEQ // P
    calls = {key for key, _ in dispatch.decisions()}
    expected = {
        ("ag", (rows, DIM), 3 * DIM // P),  # wq, wk, wv: one gather, three weights
        ("ag", (rows, DIM), 2 * HIDDEN // P),  # w1, w3
        ("rs", (P * rows, DIM // P), DIM, False),  # wo
        ("rs", (P * rows, HIDDEN // P), DIM, False),  # w2
        # backward: the mirrors
        ("rs", (P * rows, 3 * DIM // P), DIM, False),
        ("rs", (P * rows, 2 * HIDDEN // P), DIM, False),
        ("ag", (rows, DIM), DIM // P),  # wo's input gradient (dy @ W)
        ("ag", (rows, DIM), HIDDEN // P),  # w2's
    }
    ran = {key[:-2] for key in calls}  # without dtype and device
    missing = expected - ran
    if missing:
        failures.append(f"ficco's ops did not run for {sorted(missing)}; ran {sorted(ran)}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def check_llama_block(rank: int, P: int, tmp: Path) -> None:
    check_block(rank, P, tmp, {"torch": TORCH_PLAN, "ficco": FICCO_PLAN})


@pytest.mark.gloo
def test_llama_block_equals_pytorchs_styles_and_runs_ficcos_ops(tmp_path):
    spawn(check_llama_block, 2, tmp_path)
