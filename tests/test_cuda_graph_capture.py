"""A planned call can be captured in a CUDA graph and replayed, as inference engines capture
decode steps: nothing in it syncs the host, reads a device value on the host, or allocates
outside PyTorch's allocator (a capture fails on each). Skips without a GPU.

On PyTorch's fake process group (one process as rank 0 of 2; every transfer returns at once
and moves nothing), so only what this rank computes from its own inputs is checked: the rows
of its own shard (an overlapped all-gather matmul), the whole product (a baseline matmul
all-reduce, whose all-reduce adds nothing).
"""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ficco_select.runtime import dispatch, torch_ops
from ficco_select.runtime.selector import Selector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ROWS, K, N = 64, 128, 256


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch_ops.reset()
    try:
        yield dist.group.WORLD
    finally:
        torch_ops.reset()
        dist.destroy_process_group()


def _captured(call):
    """call() warmed up on a side stream (its plan made, its runner bound), then captured in a
    CUDA graph; returns (the graph, the output the graph writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


@pytest.mark.parametrize("schedule", ["shard.ring.sm", "ficco.d2.ring.gemm_per_piece.m.sm"])
def test_an_overlapped_call_replays_in_a_cuda_graph(fake_group, schedule):
    torch_ops.configure(selector=Selector(), hardware="h100-nvswitch", schedule=schedule)
    gen = torch.Generator(device="cuda").manual_seed(0)
    A_shard = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    W = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    name = fake_group.group_name
    graph, out = _captured(lambda: torch_ops.all_gather_matmul(A_shard, [W], 0, name, return_A=False)[1][0])
    assert {d.schedule.name for d in dispatch.decisions().values()} == {schedule}
    for _ in range(2):  # new inputs in the captured buffers, then replay
        A_shard.copy_(torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[:ROWS].float(), (A_shard.float() @ W.float()), rtol=2e-2, atol=2e-2)


def test_a_baseline_call_replays_in_a_cuda_graph(fake_group):
    torch_ops.configure(selector=Selector(), hardware="h100-nvswitch", schedule="none.sm")
    gen = torch.Generator(device="cuda").manual_seed(1)
    A = torch.randn(2 * ROWS, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    W = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    name = fake_group.group_name
    graph, out = _captured(lambda: torch_ops.matmul_all_reduce(A, W, "sum", name))
    assert {d.schedule.name for d in dispatch.decisions().values()} == {"none.sm"}
    A.copy_(torch.randn(2 * ROWS, K, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), A.float() @ W.float(), rtol=2e-2, atol=2e-2)
