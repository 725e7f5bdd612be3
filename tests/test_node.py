"""The cuda backend's node mode (a process per GPU): its comms and its measure path.

On a CPU the same code runs with its host stand-ins: ``NcclComm`` over gloo (the grouping
code; gloo issues the ops one by one) and ``PeerCopyComm`` over ``HostPeerMemory``
(shared-memory slots, a worker thread per stream, signals as shared flags), in real
processes. Tiny slots (a few bytes, one or two per pair) force every transfer into many
pieces and every slot to be reused, which is where a protocol error would show. The CUDA
test needs two GPUs; it has not been run yet.
"""

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from helpers.ranks import no_rank_left
from helpers.scenarios import correctness_set

from ficco_select.data.dataset import provenance
from ficco_select.data.measure.gloo import MeasureConfig, MeasureError, measure_spawned
from ficco_select.data.measure.node import NodeOptions
from ficco_select.data.measure.sweep import measure
from ficco_select.cli.main import main
from ficco_select import Scenario, candidates
from ficco_select.executor import ranks
from ficco_select.executor.peer import EngineComm, HostPeerMemory, NcclComm, PeerCopyComm, PeerMemory

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = pytest.mark.gloo

FAST = MeasureConfig(warmup=0, reps=5, max_remeasure=0, timeout_s=60, min_rep_s=0.0)  # correctness: one run a repetition


@pytest.mark.parametrize("P, slots, slot_bytes, dtypes", [(2, 1, 50, ("float32", "bfloat16")),
                                                          (3, 2, 24, ("float32",)), (4, 1, 64, ("bfloat16",))],
                         ids=["P2-both-dtypes", "P3-float32", "P4-bfloat16"])
def test_every_schedule_of_both_engines_equals_the_reference(P, slots, slot_bytes, dtypes):
    # slot_bytes 50: pieces split float32 and bfloat16 elements across slots (bytes move).
    # The slots carry bytes, so a dtype changes only where pieces end: P=2 splits elements of
    # both; P=3 (two slots a pair) and P=4 (one, reused) run one dtype each, half the time.
    scenarios = correctness_set(P, dtypes)
    rows = []
    measure_spawned(scenarios, FAST, on_scenario=rows.extend,
                    node=NodeOptions(device="cpu", dma_slots=slots, dma_slot_bytes=slot_bytes))
    assert len(rows) == sum(len(candidates(s, "cuda")) for s in scenarios)
    engines = {r["schedule"].rsplit(".", 1)[1] for r in rows}
    assert engines == {"sm", "dma"}
    bad = [(r["op"], r["dtype"], r["schedule"], r["rel_error"]) for r in rows if not r["verified"]]
    assert not bad


def test_a_corrupted_dma_schedule_is_caught():
    s = Scenario(op="gemm_rs", m=24, n=6, k=9, world_size=3, dtype="float32", hardware="cpu", group="t")
    victim = "ficco.d2.a2a.gemm_per_piece.n.dma"
    rows = []
    measure_spawned([s], MeasureConfig(warmup=0, reps=5, max_remeasure=0, timeout_s=60, min_rep_s=0.0,
                                               fault=f"corrupt@{victim}"),
                    on_scenario=rows.extend, node=NodeOptions(device="cpu", dma_slots=2, dma_slot_bytes=40))
    verdict = {r["schedule"]: r["verified"] for r in rows}
    assert verdict.pop(victim) is False
    assert all(verdict.values())


def test_a_dead_rank_ends_the_job_with_no_process_or_shared_memory_left():
    before = set(Path("/dev/shm").glob("ficco-peer-*"))
    with pytest.raises(MeasureError, match="rank 1 died"):
        measure_spawned(correctness_set(3)[:1], MeasureConfig(warmup=0, reps=5, min_rep_s=0.0, timeout_s=8, fault="exit@1"),
                        on_scenario=lambda rows: None, node=NodeOptions(device="cpu", dma_slot_bytes=64))
    assert no_rank_left()
    deadline = time.monotonic() + 10
    # Unlinked once every rank mapped them. (Another test process's jobs may hold segments of
    # their own for a moment: a leaked one stays.)
    while set(Path("/dev/shm").glob("ficco-peer-*")) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(Path("/dev/shm").glob("ficco-peer-*")) - before


# -- the dma protocol, rank by rank ---------------------------------------------------------
def _entry(rank: int, P: int, fn) -> object:
    try:
        return fn(rank, P)
    except Exception as e:  # noqa: BLE001 - the parent asserts on what each rank saw
        return f"{type(e).__name__}: {e}"


def run_ranks(fn, P: int, **launch) -> dict[int, object]:
    """What `fn(rank, P)` returned, or raised (its type and message), on each of P gloo ranks."""
    return dict(enumerate(ranks.run_ranks(_entry, P, (fn,), timeout_s=120, **launch)))


def _sender_runs_ahead(rank: int, P: int, device: str = "cpu"):
    # Five 40-byte transfers through 2 slots of 16 bytes: 15 pieces, each slot reused 7 times.
    if device == "cpu":
        memory = HostPeerMemory(slots=2, slot_bytes=16, timeout_s=20)
    else:
        from ficco_select.executor.peer import CudaPeerMemory
        memory = CudaPeerMemory(slots=2, slot_bytes=16, timeout_s=20)
    comm = PeerCopyComm(memory)
    bufs = [torch.full((10,), float(i) if rank == 0 else float("nan"), device=device) for i in range(5)]
    if rank == 0:
        t0 = time.monotonic()
        works = [comm.start([(b, 1)], [], tag=i)[0] for i, b in enumerate(bufs)]
        posted_s = time.monotonic() - t0  # the host never blocks on a free slot
        dist.barrier()  # only now does rank 1 post its receives
        comm.wait(works)
        result = posted_s
    else:
        dist.barrier()
        comm.wait([comm.start([], [(b, 0)], tag=i)[0] for i, b in enumerate(bufs)])
        result = [b.tolist() for b in bufs]  # on CUDA: after the compute stream's wait
    if device != "cpu":
        torch.cuda.synchronize()
    dist.barrier()
    memory.close()
    return result


def _sender_runs_ahead_cuda(rank: int, P: int):
    return _sender_runs_ahead(rank, P, "cuda")


def test_a_sender_runs_ahead_of_its_receiver_through_reused_slots():
    out = run_ranks(_sender_runs_ahead, 2)
    assert isinstance(out[0], float) and out[0] < 5.0, out[0]
    assert out[1] == [[float(i)] * 10 for i in range(5)]


def _all_gather_steps(rank: int, P: int):
    # Four all-gather steps of 40 bytes through one broadcast slot of 16 bytes: 12 pieces
    # per rank, each staged once and pulled by both peers before the slot is reused.
    memory = HostPeerMemory(slots=1, slot_bytes=16, timeout_s=20)
    comm = PeerCopyComm(memory)
    sends = [torch.full((10,), float(10 * rank + step)) for step in range(4)]
    recvs = {(q, step): torch.full((10,), float("nan")) for q in range(P) if q != rank for step in range(4)}
    works = []
    for step in range(4):
        works += comm.start_all_gather(sends[step], [(recvs[q, step], q) for q in range(P) if q != rank], tag=step)
    comm.wait(works)
    dist.barrier()
    memory.close()
    return {f"{q}/{step}": buf.unique().tolist() for (q, step), buf in recvs.items()}


def test_an_all_gather_step_is_staged_once_and_pulled_by_every_peer():
    out = run_ranks(_all_gather_steps, 3)
    assert out == {r: {f"{q}/{step}": [float(10 * q + step)] for q in range(3) if q != r for step in range(4)}
                   for r in range(3)}


def _receiver_never_posts(rank: int, P: int):
    comm = PeerCopyComm(HostPeerMemory(slots=1, slot_bytes=64, timeout_s=1.5))
    try:
        if rank == 0:  # the second transfer needs slot 0 back, which rank 1 never frees
            comm.wait(comm.start([(torch.ones(4), 1), (torch.ones(4), 1)], [], tag=0))
            return "no error"
        return "idle"
    finally:
        dist.barrier()
        comm.memory.close()


def test_a_missing_receive_times_out_naming_rank_peer_and_channel():
    out = run_ranks(_receiver_never_posts, 2)
    assert out[1] == "idle"
    assert out[0].startswith("PeerTimeout"), out[0]
    assert "rank 0's send lane to rank 1" in out[0] and "signal channel 1 from rank 1" in out[0]


def _nccl_comm_exchanges(rank: int, P: int):
    # The sm comm's grouped start: every rank sends to and receives from every peer at once.
    comm = NcclComm()
    peers = [q for q in range(P) if q != rank]
    recv = {q: torch.full((3, 2), float("nan")) for q in peers}
    works = comm.start([(torch.full((3, 2), float(10 * rank + q)), q) for q in peers],
                       [(recv[q], q) for q in peers], tag=4)
    comm.wait(works)
    got = {q: recv[q].unique().tolist() for q in peers}
    # On a subgroup, peers are group ranks: ranks 1 and 2 are its 0 and 1.
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        sub_comm, other = NcclComm(sub), torch.full((2,), float("nan"))
        sub_comm.exchange([(torch.full((2,), float(rank)), 2 - rank)], [(other, 2 - rank)], tag=0)
        got["sub"] = other.unique().tolist()
    return got


def test_nccl_comm_groups_a_step_and_delivers_every_peer():
    out = run_ranks(_nccl_comm_exchanges, 3)
    want = {r: {q: [float(10 * q + r)] for q in range(3) if q != r} for r in range(3)}
    want[1]["sub"], want[2]["sub"] = [2.0], [1.0]
    assert out == want


# -- pieces that need no ranks ----------------------------------------------------------------
class _Layout(PeerMemory):
    def __init__(self, P, slots, slot_bytes):
        self.rank, self.world_size, self.slots, self.slot_bytes = 0, P, slots, slot_bytes


def test_staging_slots_tile_each_buffer_without_overlap():
    m = _Layout(P=5, slots=3, slot_bytes=7)
    for owner in range(5):
        starts = sorted(m.slot_offset(owner, d, k) for d in [*range(5), None] if d != owner for k in range(3))
        assert starts == list(range(0, m.buffer_bytes(), 7))


def test_engine_comm_names_the_engines_it_has():
    class Dummy:
        rank, world_size = 0, 2

    comm = EngineComm({"sm": Dummy()})
    with pytest.raises(ValueError, match=r"engine 'dma': this comm has \['sm'\]"):
        comm.select("dma")


@pytest.mark.parametrize("slots, slot_bytes, needle", [(0, 8, "slots: 1..8"), (9, 8, "slots: 1..8"),
                                                       (2, 0, "slot_bytes: must be >= 1")])
def test_bad_slot_options_are_named(slots, slot_bytes, needle):
    with pytest.raises(ValueError, match=needle):
        HostPeerMemory(slots=slots, slot_bytes=slot_bytes)


def test_the_fingerprint_says_which_cuda_mode_measured():
    assert provenance("cuda", "node")["hardware_fingerprint"].endswith("-node")
    assert provenance("cuda", "loopback")["hardware_fingerprint"].endswith("-loopback")
    assert provenance("cpu")["hardware_fingerprint"] == provenance("cpu", None)["hardware_fingerprint"]


def test_node_mode_is_refused_where_it_cannot_run():
    s = Scenario(op="ag_gemm", m=64, n=64, k=64, world_size=2, dtype="bfloat16", hardware="h100-nvswitch", group="t")
    with pytest.raises(ValueError, match="cuda backend's mode, not 'cpu'"):
        measure([s], backend="cpu", config=FAST, ranks="node")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="world size 2 need 2 GPUs"):
            measure([s], backend="cuda", config=FAST, ranks="node")
    cpu_hw = Scenario(op="ag_gemm", m=64, n=64, k=64, world_size=2, dtype="bfloat16", hardware="cpu", group="t")
    with pytest.raises(ValueError, match="column 'hardware'"):
        measure([cpu_hw], backend="cuda", config=FAST, ranks="node")
    result = CliRunner().invoke(main, ["measure", "--ranks", "node"])
    assert result.exit_code != 0 and "add --backend cuda" in result.output


# -- on GPUs (not run yet: no GPU where this was written) ---------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peer_copies_through_symmetric_memory_on_one_gpu(monkeypatch):
    # Two processes on GPU 0: symmetric memory allows it with this switch (NCCL would not),
    # so the dma protocol's CUDA side (slots, streams, signal kernels) runs on one GPU.
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    out = run_ranks(_sender_runs_ahead_cuda, 2, start_method="spawn")  # fresh ranks: they read the switch
    assert isinstance(out[0], float), out[0]
    assert out[1] == [[float(i)] * 10 for i in range(5)]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_node_mode_on_two_gpus_verifies_every_schedule():
    scenarios = [Scenario(op=op, m=1024, n=512, k=768, world_size=2, dtype=dtype, hardware="h100-nvswitch",
                          group="gpu-test") for op in ("ag_gemm", "gemm_rs", "a2a_gemm")
                 for dtype in ("bfloat16", "float32")]
    rows = []
    measure_spawned(scenarios, FAST, on_scenario=rows.extend, node=NodeOptions(dma_slot_bytes=1 << 16))
    assert rows and all(r["verified"] for r in rows)
