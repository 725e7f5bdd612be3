"""The switch engine (``executor/switch.py``) on real gloo ranks, and on GPUs where there are.

Every legal switch schedule of ag_gemm, gemm_rs and gemm_ar at P = 2, 3, 4 runs on the cpu
stand-in (``HostSwitchComm``: shared-memory slots, one write per rank, the sum over ranks
0..P-1 read by every rank) and equals the reference, with odd shapes (pieces of unequal
size, odd element counts) and with slots so small that every step goes as many chunks
through reused slots. Reductions are bit-identical on every rank. The runtime runs a pinned
switch decision on cpu ranks (a GPU preset makes it legal) through that stand-in, and the
sm twin, with one warning, where the switch comm cannot be built. The cuda test runs the same
schedules with PyTorch's multimem ops and skips without >= 2 GPUs with multicast.
"""

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ficco_select.executor import ranks
from ficco_select.executor.comm import NullComm, P2PComm
from ficco_select.executor.operators import TOLERANCE, build_operator, relative_error
from ficco_select.executor.peer import EngineComm
from ficco_select.executor.switch import CudaSwitchComm, HostSwitchComm, switch_steps
from ficco_select.runtime import dispatch, running, torch_ops
from ficco_select.scenario import Scenario
from ficco_select.schedule import SWITCH_OPS, all_schedules, is_legal, parse
from helpers.ranks import check_close, rand, spawn
from helpers.scenarios import correctness_set

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo

COMMS = {"default": {}, "tiny": dict(slots=1, slot_bytes=64), "two": dict(slots=2, slot_bytes=48)}
"""Stand-ins each schedule runs on: the runtime's slots, and slots so small that a step is
many chunks through one (or two) reused slots."""


def switch_cases(P: int, dtypes=("float32", "bfloat16")) -> list[tuple[Scenario, list[str]]]:
    """Each scenario of the executor's correctness set whose op the switch carries, with its
    legal switch schedules (on a GPU backend: the cpu backend never offers them)."""
    out = []
    for s in correctness_set(P, dtypes):
        if s.op in SWITCH_OPS:
            names = [x.name for x in all_schedules(P, engines=("switch",)) if is_legal(x, s, "cuda")]
            out.append((s, names))
    return out


def expected_runs(P: int) -> int:
    return len(COMMS) * sum(len(names) for _, names in switch_cases(P))


# -- every schedule, on the stand-in ------------------------------------------------------------
def check_schedules(rank: int, P: int, tmp: str) -> int:
    failures, runs = [], 0
    for label, kw in COMMS.items():
        comm = HostSwitchComm(dist.group.WORLD, timeout_s=30, **kw)
        try:
            for scenario, names in switch_cases(P):
                op = build_operator(scenario, comm, seed=3)
                ref = op.reference()
                for name in names:
                    op.poison()
                    out = op.run(parse(name))
                    runs += 1
                    what = f"{scenario.op} {scenario.dtype} m={scenario.m} n={scenario.n} {name} [{label}]"
                    err = relative_error(out, ref)
                    if not err <= TOLERANCE[scenario.dtype]:
                        failures.append(f"{what}: rel. error {err:.3g}")
                    if scenario.op == "gemm_ar":  # one sum on every rank: the same bits everywhere
                        mine = out.float().contiguous()
                        every = [torch.empty_like(mine) for _ in range(P)]
                        dist.all_gather(every, mine)
                        if not all(torch.equal(e, mine) for e in every):
                            failures.append(f"{what}: ranks hold different sums")
        finally:
            comm.close()
    assert not failures, f"rank {rank}: {len(failures)} mismatches:\n" + "\n".join(failures)
    return runs


@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_switch_schedule_equals_the_reference(P):
    runs = ranks.run_ranks(check_schedules, P, ("",), timeout_s=300)
    assert runs == [expected_runs(P)] * P
    if P >= 3:  # the a2a pattern along m, every degree and compute
        assert any("a2a" in n for _, names in switch_cases(P) for n in names)


def test_the_legal_switch_schedules_are_none_and_a2a_along_m():
    for P in (2, 3, 4):
        for scenario, names in switch_cases(P):
            assert names[0] == "none.switch" and len(names) == (1 if P == 2 else 1 + 2 * len({2, 4, P}))
            assert all(n == "none.switch" or (".a2a." in n and n.endswith(".m.switch")) for n in names)


def check_sums_in_rank_order(rank: int, P: int, tmp: str) -> list:
    """Contributions whose float32 sum depends on the order: every rank gets the order 0..P-1's."""
    comm = HostSwitchComm(dist.group.WORLD, slots=2, slot_bytes=32, timeout_s=30)
    try:
        big = [1e8, 1.0, -1e8, 3.0][rank]
        segments = [torch.full((5,), big), torch.arange(7, dtype=torch.float32) * (rank + 1)]
        comm.wait(comm.start_all_reduce(segments, tag=0))
        parts = [torch.full((3,), float(rank * 10 + q)) for q in range(P)]
        out = torch.empty(3)
        comm.wait(comm.start_reduce_scatter(parts, out, tag=1))
        gathered = [torch.empty(6, dtype=torch.bfloat16) for _ in range(P)]
        gathered[rank] = torch.full((6,), float(rank), dtype=torch.bfloat16)
        comm.wait(comm.start_all_gather(gathered[rank], [(g, q) for q, g in enumerate(gathered) if q != rank], tag=2))
        return [segments[0].tolist(), segments[1].tolist(), out.tolist(), [g.tolist() for g in gathered]]
    finally:
        comm.close()


def test_the_stand_in_sums_in_rank_order_and_multicasts_every_piece():
    P = 4
    got = ranks.run_ranks(check_sums_in_rank_order, P, ("",), timeout_s=120)
    ordered = torch.tensor(0.0)
    for x in (1e8, 1.0, -1e8, 3.0):
        ordered += x  # float32, ranks 0..P-1: 1.0 is lost to rounding, 3.0 is not
    assert ordered.item() == 3.0
    for rank, (big, ramp, out, gathered) in enumerate(got):
        assert big == [3.0] * 5 and ramp == [float(i * 10) for i in range(7)]
        assert out == [float(sum(r * 10 + rank for r in range(P)))] * 3
        assert gathered == [[float(q)] * 6 for q in range(P)]


# -- refusals -----------------------------------------------------------------------------------
def test_an_op_the_switch_does_not_carry_is_refused_by_name():
    for op in ("a2a_gemm", "gemm_a2a"):
        s = Scenario(op=op, m=12, n=5, k=6, group="test", dtype="float32", world_size=2, hardware="cpu")
        operator = build_operator(s, NullComm(0, 2))
        with pytest.raises(ValueError, match=rf"schedule none.switch: engine 'switch' runs ag_gemm, gemm_rs, "
                                             rf"gemm_ar, not {op}"):
            operator.run(parse("none.switch"))


def check_point_to_point_refused(rank: int, P: int, tmp: str) -> None:
    s = [x for x, _ in switch_cases(P, ("float32",)) if x.op == "gemm_rs"][0]
    with pytest.raises(ValueError, match=r"engine 'switch' needs a switch comm .*, this operator has a P2PComm"):
        build_operator(s, P2PComm()).run(parse("none.switch"))
    comm = HostSwitchComm(dist.group.WORLD, timeout_s=10)
    try:
        with pytest.raises(ValueError, match=rf"rank {rank}: engine 'switch' has no point-to-point transfers "
                                             r"\(tag 4\)"):
            comm.start([(torch.ones(2), 1 - rank)], [], tag=4)
        with pytest.raises(ValueError, match=rf"rank {rank}: a switch all-gather receives from every peer once, "
                                             r"got peers \[\] \(tag 5\)"):
            comm.start_all_gather(torch.ones(2), [], tag=5)
        assert switch_steps(NullComm(rank, P), "gemm_ar", parse("none.switch")).start_all_reduce([], 0) == []
        with pytest.raises(ValueError, match=r"buffer_bytes: 16 is below 192 for 2 ranks"):
            CudaSwitchComm(buffer_bytes=16)  # checked before any CUDA call
        # The measurement harness's comm of several engines runs the switch's steps under "switch".
        engines = EngineComm({"sm": P2PComm(), "switch": comm})
        for scenario, names in switch_cases(P, ("float32",)):
            op = build_operator(scenario, engines, seed=1)
            ref = op.reference()
            engines.select("sm")
            with pytest.raises(ValueError, match="the engine comm has engine 'sm' selected"):
                op.run(parse(names[0]))
            engines.select("switch")
            op.poison()
            assert relative_error(op.run(parse(names[0])), ref) <= TOLERANCE["float32"], (scenario.op, names[0])
    finally:
        comm.close()


def test_a_switch_schedule_on_a_point_to_point_comm_is_refused():
    ranks.run_ranks(check_point_to_point_refused, 2, ("",), timeout_s=120)


# -- the runtime: a pinned switch decision on cpu ranks -------------------------------------------
def runtime_calls(rank: int, P: int, name: str, failures: list) -> None:
    """all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce under `name`, each
    against PyTorch's own result; the decision that ran must be `name`."""
    gen = torch.Generator().manual_seed(50 + rank)
    group = dist.group.WORLD.group_name
    for dtype in (torch.float32, torch.bfloat16):
        A_shard, B = rand(gen, 5, 7, dtype=dtype), rand(gen, 7, 6, dtype=dtype)  # m = 5P: uneven pieces
        _, [want] = symm_mem._fused_all_gather_matmul_fallback(A_shard, [B], 0, group, return_A=False)
        _, [got] = torch_ops.all_gather_matmul(A_shard, [B], 0, group, return_A=False)
        check_close(got, want, dtype, f"AG {dtype} [{name}]", failures)
        ran = [torch_ops.last_decision.schedule.name]
        A, B = rand(gen, 5 * P, 9, dtype=dtype), rand(gen, 9, 3, dtype=dtype)
        want = symm_mem._fused_matmul_reduce_scatter_fallback(A, B, "sum", 0, group)
        check_close(torch_ops.matmul_reduce_scatter(A, B, "sum", 0, group), want, dtype, f"RS {dtype} [{name}]",
                    failures)
        ran.append(torch_ops.last_decision.schedule.name)
        want = (A.float() @ B.float())
        dist.all_reduce(want)
        check_close(torch_ops.matmul_all_reduce(A, B, "sum", group), want, dtype, f"AR {dtype} [{name}]", failures)
        ran.append(torch_ops.last_decision.schedule.name)
        if ran != [name] * 3:
            failures.append(f"{dtype}: ran {ran}, not {name}")


def check_runtime(rank: int, P: int, tmp: Path) -> None:
    torch_ops.configure(hardware="h200-nvswitch", check_calls=True)
    failures = []
    names = ["none.switch"] + (["ficco.d2.a2a.gemm_per_step.m.switch", f"ficco.d{P}.a2a.gemm_per_piece.m.switch"]
                               if P >= 3 else [])
    for name in names:
        torch_ops.configure(schedule=name)
        runtime_calls(rank, P, name, failures)
    comms = dispatch.context(dist.group.WORLD).switch_comms
    assert [type(c).__name__ for c in comms.values()] == ["HostSwitchComm"], comms
    assert not failures, f"rank {rank}: {len(failures)} mismatches:\n" + "\n".join(failures)


@pytest.mark.parametrize("P", [2, 3])
def test_the_runtime_runs_a_switch_decision_on_cpu_ranks(P, tmp_path):
    spawn(check_runtime, P, tmp_path)


class _NoMulticast:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("no multicast here")


def check_switch_without_transport(rank: int, P: int, tmp: Path) -> None:
    running.HostSwitchComm = _NoMulticast  # this rank's process only
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    running.log.addHandler(handler)
    failures = []
    try:
        for name, twin in [("none.switch", "none.sm"),
                           ("ficco.d2.a2a.gemm_per_piece.m.switch", "ficco.d2.a2a.gemm_per_piece.m.sm")]:
            torch_ops.configure(hardware="h200-nvswitch", schedule=name, check_calls=True)
            for _ in range(2):  # the second call finds the failed transport remembered
                runtime_calls(rank, P, twin, failures)
                decision = torch_ops.last_decision
                if f"{name} as its sm twin: no switch transport" not in decision.reason:
                    failures.append(f"reason: {decision.reason}")
    finally:
        running.log.removeHandler(handler)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    assert len(warnings) == 1 and "no switch transport on group" in warnings[0], warnings
    assert "switch schedules run as their sm twins" in warnings[0]


def test_a_group_without_a_switch_runs_the_sm_twin_with_one_warning(tmp_path):
    spawn(check_switch_without_transport, 3, tmp_path)


# -- cuda: PyTorch's multimem ops (>= 2 GPUs on an NVSwitch with multicast) -------------------------
def _multicast_gpus() -> int:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return 0
    from torch._C._autograd import DeviceType
    from torch._C._distributed_c10d import _SymmetricMemory
    return torch.cuda.device_count() if _SymmetricMemory.has_multicast_support(DeviceType.CUDA, 0) else 0


def check_cuda_schedules(rank: int, P: int, tmp: str) -> int:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=ranks.rendezvous(), rank=rank, world_size=P,
                            device_id=torch.device("cuda", rank))
    try:
        comm, failures, runs = CudaSwitchComm(dist.group.WORLD, buffer_bytes=4096), [], 0
        for scenario, names in switch_cases(P):
            op = build_operator(scenario, comm, seed=3, device="cuda")
            ref = op.reference()
            for name in names:
                op.poison()
                err = relative_error(op.run(parse(name)), ref)
                runs += 1
                if not err <= TOLERANCE[scenario.dtype]:
                    failures.append(f"{scenario.op} {scenario.dtype} {name}: rel. error {err:.3g}")
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
        return runs
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(_multicast_gpus() < 2, reason="needs >= 2 GPUs on an NVSwitch with multicast (NVLS)")
def test_every_switch_schedule_on_gpus_equals_the_reference():
    P = min(_multicast_gpus(), 4)
    runs = ranks.run_ranks(check_cuda_schedules, P, ("",), group=None, timeout_s=600, start_method="spawn")
    assert runs == [sum(len(names) for _, names in switch_cases(P))] * P
