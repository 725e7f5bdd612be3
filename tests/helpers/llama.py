"""A Llama-style transformer block with torchtitan's names, its tensor-parallel plan in
PyTorch's styles and in ficco's, and one forward + backward step: what the DTensor tests
parallelize both ways and compare."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from ficco_select.runtime.dtensor import FiccoColwiseParallel, FiccoPrepareModuleInput, FiccoRowwiseParallel

BATCH, SEQ, DIM, HEADS, HIDDEN, VOCAB = 2, 8, 16, 4, 24, 20


# -- a Llama-style block (torchtitan's names) -------------------------------------------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, freqs_cis), rotary(k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def rotary(x, freqs_cis):
    """Llama's rotary embedding of (bs, seq, heads, head_dim) by (seq, head_dim / 2) complex."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


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
        head_dim = DIM // HEADS
        angles = torch.outer(torch.arange(SEQ).float(), 1e4 ** -(torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x), self.freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


def llama_plan(colwise, rowwise, prepare_input) -> dict:
    """torchtitan's tensor-parallel plan of a transformer block, in the given styles."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
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


def step(block: nn.Module, x_local: torch.Tensor, dy_local: torch.Tensor):
    """(output, the input's gradient, every parameter's gradient) of one forward + backward."""
    x = x_local.clone().requires_grad_(x_local.is_floating_point())
    y = block(x)
    y.backward(dy_local)
    return y.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t
