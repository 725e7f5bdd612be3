"""A planned call (its shape seen before) builds nothing and writes nothing outside its plan:
no plan, no runner, no operator copied, no closure made and run, no ``last_decision``
(``runtime/context.py``). What a CUDA graph's capture needs on the host side; the capture
itself is ``tests/test_cuda_graph_capture.py``.

On PyTorch's fake process group (every transfer returns at once), one process as rank 0 of 2.
"""

import sys

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ficco_select.runtime import dispatch, torch_ops
from ficco_select.runtime.selector import Selector

RUNTIME = "/ficco_select/runtime/"
OPERATOR_BASE = "/ficco_select/executor/operators/base.py"  # where an operator is made or copied


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch_ops.reset()
    try:
        yield dist.group.WORLD
    finally:
        torch_ops.reset()
        dist.destroy_process_group()


def _calls(group, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    A_shard, A = torch.rand(8, 16, generator=gen), torch.rand(16, 16, generator=gen)
    W = torch.rand(16, 16, generator=gen).requires_grad_(requires_grad)
    name = group.group_name
    return [lambda: torch_ops.all_gather_matmul(A_shard, [W], 0, name, return_A=False),
            lambda: torch_ops.matmul_reduce_scatter(A, W, "sum", 0, name),
            lambda: torch_ops.matmul_all_reduce(A, W, "sum", name)]


def _what_runs(calls, times: int) -> dict[str, int]:
    """The ficco functions run by `times` rounds of `calls`, by qualified name, with how often."""
    seen: dict[str, int] = {}

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if RUNTIME in path or path.endswith(OPERATOR_BASE):
                seen[frame.f_code.co_qualname] = seen.get(frame.f_code.co_qualname, 0) + 1

    sys.setprofile(profile)
    try:
        for _ in range(times):
            for call in calls:
                call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("schedule", ["shard.ring.sm", "none.sm"])
def test_a_planned_call_builds_nothing_and_writes_no_global(fake_group, schedule, grad):
    torch_ops.configure(selector=Selector(), hardware="cpu", schedule=schedule)
    calls = _calls(fake_group, requires_grad=grad)
    for call in calls:  # the first calls plan, bind the runners, build the comms
        call()
    assert {d.schedule.name for d in dispatch.decisions().values()} == {schedule}
    seen = _what_runs(calls, 100)
    built = {name: n for name, n in seen.items()
             if name.startswith(("Plan.", "Runner.", "GroupContext.__init__", "Operator.for_call",
                                 "Operator.template", "decide", "_new_plan", "_bind"))
             or "<locals>" in name or "<lambda>" in name}
    assert not built, built  # nothing made per call, no closure run, no decision taken
    assert dispatch.last_decision() is None  # unwatched: no process-wide write


def test_a_watched_call_keeps_its_decision(fake_group, tmp_path):
    # Telemetry (and the debug mode, and exploration) keeps the latest call's decision.
    torch_ops.configure(selector=Selector(), hardware="cpu", schedule="shard.ring.sm")
    calls = _calls(fake_group)
    calls[0]()
    assert dispatch.last_decision() is None
    torch_ops.configure(telemetry=tmp_path / "t.jsonl")
    calls[0]()
    assert dispatch.last_decision().schedule.name == "shard.ring.sm"
    assert dispatch.last_decision().source == "pinned"


def test_each_group_has_its_own_context(fake_group):
    torch_ops.configure(selector=Selector(), hardware="cpu", schedule="shard.ring.sm")
    other = dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(0)
    A, W = torch.rand(16, 16, generator=gen), torch.rand(16, 16, generator=gen)
    torch_ops.matmul_all_reduce(A, W, "sum", fake_group.group_name)
    torch_ops.matmul_all_reduce(A, W, "sum", other.group_name)
    one, two = dispatch.context(fake_group), dispatch.context(other)
    assert one is not two and len(one.plans) == len(two.plans) == 1
    plan_one, plan_two = one.plans.values()[0], two.plans.values()[0]
    assert plan_one is not plan_two and plan_one.runner.comm is not plan_two.runner.comm
    assert {group for (_, group) in dispatch.decisions()} == {fake_group.group_name, other.group_name}
    torch_ops.configure(cache_size=7)  # every group follows the process's settings
    assert one.plans.limit == two.plans.limit == 7 and not one.plans and not two.plans


def test_eager_training_takes_the_thin_autograd_path(fake_group):
    # The registered op's dispatch costs the host more; its formulas are the same (library.eager).
    torch_ops.configure(selector=Selector(), hardware="cpu", schedule="shard.ring.sm")
    gen = torch.Generator().manual_seed(0)
    A, W = torch.rand(16, 16, generator=gen), torch.rand(16, 16, generator=gen).requires_grad_()
    name = fake_group.group_name
    y = torch_ops.matmul_all_reduce(A, W, "sum", name)
    assert type(y.grad_fn).__name__ == "_MatmulAllReduceBackward", y.grad_fn
    _, [y] = torch_ops.all_gather_matmul(A, [W], 0, name)
    assert type(y.grad_fn).__name__ == "_AllGatherMatmulBackward", y.grad_fn
    y.sum().backward()  # the backward's mirror op (a matmul reduce-scatter) runs eagerly too
    assert W.grad is not None and W.grad.shape == W.shape


def test_a_call_while_another_thread_runs_its_shape_runs_a_copy(fake_group):
    # The plan's one operator is bound to one call at a time; a call of the same shape from
    # another thread meanwhile runs a copy of it, and neither keeps a call's tensors after.
    torch_ops.configure(selector=Selector(), hardware="cpu", schedule="shard.ring.sm")
    gen = torch.Generator().manual_seed(0)
    A_shard, W = torch.rand(8, 16, generator=gen), torch.rand(16, 16, generator=gen)
    name = fake_group.group_name
    first = torch_ops.all_gather_matmul(A_shard, [W], 0, name)[1][0]
    runner = dispatch.context(fake_group).plans.values()[0].runner
    shape_only = dict(vars(runner.operator))
    with runner.busy:  # as if another thread were inside the call
        second = torch_ops.all_gather_matmul(A_shard, [W], 0, name)[1][0]
    assert vars(runner.operator) == shape_only  # untouched by the copy's call
    torch.testing.assert_close(second[:8], first[:8])  # this rank's own rows (the fake group moves nothing)
    torch.testing.assert_close(first[:8], A_shard @ W)
    assert not {"A_full", "W", "out"} & set(vars(runner.operator))  # no call's tensors outlive it
