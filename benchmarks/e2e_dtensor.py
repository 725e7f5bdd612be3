"""The ways a DTensor user has (``e2e_tp.py --dtensor``): the block in torchtitan's form
(unfused ``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``) under torchtitan's plan, in PyTorch's
styles or ficco's, eager or compiled, and the Inductor settings each compiled way compiles under.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.nn.functional as F
from torch import nn

DTENSOR = ("dtensor", "dtensor-compiled", "dtensor-compiled+micro-pipeline", "ficco-styles", "dtensor-compiled+ficco")
"""The ways of ``--dtensor``: a DTensor user's."""


class DTBlock(nn.Module):
    """The same block in torchtitan's form (its names, unfused projections) for DTensor plans."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attention, self.feed_forward = _DTAttention(hidden, heads), _DTFeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq / P, hidden), this rank's shard
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class _DTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        return self.wo(attn.transpose(1, 2).reshape(batch, seq, -1))


class _DTFeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def dtensor_plan(colwise, rowwise, prepare_input) -> dict:
    """torchtitan's tensor-parallel plan of a block, in the given styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"attention.{w}": colwise() for w in ("wq", "wk", "wv")},
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(), "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
    }


def dtensor_ways(config: dict, P: int, rank: int) -> dict:
    """{way: {"model", "x", "opt", "parallel"}} of ``--dtensor``: each way its own parallelized
    copy of the same full block (compiled ways: ``model`` is the compiled module), one input."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from ficco_select.runtime.dtensor import FiccoColwiseParallel, FiccoPrepareModuleInput, FiccoRowwiseParallel

    mesh = init_device_mesh("cpu", (P,))
    hidden = config["hidden"]
    torch.manual_seed(1)  # the same full weights and input on every rank
    full = DTBlock(hidden, config["heads"], 3 * hidden)
    x = torch.randn(config["batch"], config["seq"], hidden).chunk(P, dim=1)[rank].clone()
    pytorch_styles = (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    ficco_styles = (FiccoColwiseParallel, FiccoRowwiseParallel, FiccoPrepareModuleInput)
    ways = {}
    for way in DTENSOR:
        parallel = parallelize_module(copy.deepcopy(full), mesh,
                                      dtensor_plan(*(ficco_styles if way == "ficco-styles" else pytorch_styles)))
        if "compiled" in way:
            # Its own class: Dynamo guards the module's type, so each compiled way compiles its own
            # graphs under its settings (same-typed modules would share the first way's).
            parallel.__class__ = type(f"DTBlock[{way}]", (DTBlock,), {})
        model = torch.compile(parallel) if "compiled" in way else parallel
        ways[way] = {"model": model, "x": x, "opt": torch.optim.SGD(parallel.parameters(), lr=1e-4),
                     "parallel": parallel}
    return ways


def _fused_count():
    """A post-grad custom pass that counts the symmetric-memory fused ops that Inductor's
    micro-pipeline pass (which runs before it) left in the graphs. Made on use: importing
    Inductor costs each rank (which imports this file) about a second of CPU."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FusedCount(CustomGraphPass):
        def __init__(self) -> None:
            self.fused = 0

        def __call__(self, graph) -> None:
            self.fused += sum(n.op == "call_function" and str(n.target).startswith("symm_mem.fused")
                              for n in graph.nodes)

        def uuid(self) -> None:  # Inductor's FX graph cache bypassed: the count always runs
            return None

    return FusedCount()


@contextlib.contextmanager
def compiling(way: str, group, notes: dict):
    """Around a compiled way's warm-up step (its forward and backward compile in it): the
    way's Inductor settings. Writes to `notes` what the passes did (rank 0 prints it) and,
    for the micro-pipeline, why it does not run (then the way is not timed)."""
    import torch._inductor.config as inductor_config

    if way == "dtensor-compiled+ficco":
        from ficco_select.runtime.compile import install_pass

        with install_pass() as ficco_pass:
            yield
        done = [r for r in ficco_pass.rewrites if r.rewritten]
        notes[way] = (f"ficco's pass: {len(ficco_pass.rewrites)} matches, {len(done)} rewritten"
                      + "".join(f"\n    {r.line()}" for r in ficco_pass.rewrites))
    elif way == "dtensor-compiled+micro-pipeline":
        counter = _fused_count()
        nccl = dist.is_nccl_available()
        if nccl:  # what the pass wants of the group (on gloo it returns before asking)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        error = None
        with inductor_config.patch(_micro_pipeline_tp=True, post_grad_custom_post_pass=counter):
            try:
                yield
            except Exception as e:  # noqa: BLE001 - the way cannot run here: said, not timed
                error = f"{type(e).__name__}: {str(e)[:200]}"
        ok = torch.tensor([int(error is None and counter.fused > 0)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank times the same ways
        if not ok.item():
            notes[way] = "not on this backend: " + (error or (
                f"Inductor's micro-pipeline pass fused nothing ({counter.fused} symm_mem ops; it needs NCCL and "
                f"symmetric memory; this job is {dist.get_backend(group)}, "
                f"torch.distributed.is_nccl_available() = {nccl})"))
    else:
        yield
