"""The Llama-style block the end-to-end benchmarks time (``e2e_tp.py``'s training step,
``e2e_infer.py``'s inference step): full (unsharded) weights, laid out for ``tp.parallelize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 32
"""Every head's width: a configuration's heads are hidden / HEAD_DIM."""


class Block(nn.Module):
    """The full (unsharded) Llama-style block; ``parallelize`` shards it."""

    def __init__(self, hidden: int, heads: int, ffn: int, P: int) -> None:
        super().__init__()
        self.heads, self.P = heads, P
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        with torch.no_grad():  # rank r's rows of the fused weights: its heads' q, k, v; its gate and up
            q, k, v = self.qkv.weight.chunk(3)
            self.qkv.weight.copy_(torch.cat([torch.cat([w.chunk(P)[r] for w in (q, k, v)]) for r in range(P)]))
            g, u = self.gate_up.weight.chunk(2)
            self.gate_up.weight.copy_(torch.cat([torch.cat([g.chunk(P)[r], u.chunk(P)[r]]) for r in range(P)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (seq / P, batch, hidden), this rank's shard
        qkv = self.qkv(self.norm1(x))  # (seq, batch, 3 * hidden / P)
        seq, batch, width = qkv.shape
        heads = self.heads // self.P
        q, k, v = (t.reshape(seq, batch, heads, -1).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(seq, batch, -1)
        h = x + self.o(attn)
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)
