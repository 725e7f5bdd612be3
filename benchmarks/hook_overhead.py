"""What the hook costs the host per call, and what its caches hold, on a process group with no network.

PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``): every
collective and point-to-point transfer returns at once, so a call's time is its host work
and its GEMMs, and tiny shapes keep the GEMMs cheap. One process plays rank 0 of a group of
``--world-size``. Each figure is the median over ``--reps`` rounds of ``--calls`` calls, the
ways interleaved within a round:

- ``overlap``: ficco's op pinned to an overlapped schedule (``shard.ring.sm``) against a
  hand-written loop of the same transfers and GEMMs (``_hand_*``: what the schedule must do,
  with nothing around it), for ``all_gather_matmul``, ``matmul_reduce_scatter`` and
  ``matmul_all_reduce``; the difference is the hook's host overhead beyond its own work;
- ``baseline``: ficco's op whose decision is the baseline against PyTorch's own calls (the
  decode call: ``mm`` then ``all_reduce``; the all-gather and reduce-scatter of async-TP's
  fallback ops);
- ``layer``: a hooked ``RowParallelLinear`` without sequence parallelism (an inference
  engine's layer) against the same layer unhooked, at a decode shape;
- ``overlap_grad``, ``baseline_grad``: the same calls as training makes them, the weight
  requiring a gradient, through the op's autograd path (``torch_ops``: its thin autograd
  Function, ``library.eager``), against the same hand-written loop or PyTorch calls wrapped
  in a minimal autograd Function (one graph node that saves its inputs: what any
  differentiable op costs). The forward only is timed (each call's graph is dropped, its
  backward never runs). ``registered_op_us``: the registered custom op
  (``torch.ops.ficco.*``, what ``torch.compile`` runs) called eagerly, for comparison.

``--memory``: ``--tokens`` distinct token counts (1, 2, 3, ...) through a hooked
row-parallel layer with the selector's tables (continuous batching), from ``--threads``
threads at once (each its share, interleaved); over the second half, the growth of the
resident memory (after ``malloc_trim``: what the C allocator only keeps free does not count)
and of the Python heap (``tracemalloc``: where ficco's caches live), and the plans the process
keeps. ``--unhooked``: the same layer without the hook, PyTorch alone (run it in its own
process: the allocator's state carries over).

    python benchmarks/hook_overhead.py [--world-size 2] [--rows 8] [--k 64] [--n 64]
                                       [--reps 15] [--calls 200] [--model DIR] [--json]
    python benchmarks/hook_overhead.py --memory [--tokens 12000] [--threads 8] [--unhooked] [--model DIR] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import threading
import time
import tracemalloc

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

SCHEDULE = "shard.ring.sm"


# -- the hand-written loops of shard.ring.sm, rank r of P ----------------------------------------
# Transfers posted on the group itself (what dist.isend/irecv post, without their per-call
# Python checks): the cheapest way to write them, so that ficco is held to the tightest loop.
def _send(buf: torch.Tensor, peer: int):
    return dist.group.WORLD.send([buf], peer, 0)


def _recv(buf: torch.Tensor, peer: int):
    return dist.group.WORLD.recv([buf], peer, 0)


def _hand_all_gather_matmul(A_shard: torch.Tensor, W: torch.Tensor, r: int, P: int) -> torch.Tensor:
    """Ring all-gather of the shards, each shard's GEMM while the next one moves."""
    ms = A_shard.shape[0]
    A = torch.empty(P * ms, A_shard.shape[1])
    A[r * ms:(r + 1) * ms] = A_shard
    out = torch.empty(P * ms, W.shape[1])
    shard = lambda q: slice(q * ms, (q + 1) * ms)  # noqa: E731
    works = [_recv(A[shard((r - 1) % P)], (r - 1) % P), _send(A[shard(r)], (r + 1) % P)]
    torch.mm(A[shard(r)], W, out=out[shard(r)])
    for h in range(P - 1):
        for w in works:
            w.wait()
        if h + 1 < P - 1:
            works = [_recv(A[shard((r - h - 2) % P)], (r - 1) % P),
                     _send(A[shard((r - h - 1) % P)], (r + 1) % P)]
        q = (r - h - 1) % P
        torch.mm(A[shard(q)], W, out=out[shard(q)])
    return out


def _hand_matmul_reduce_scatter(A: torch.Tensor, W: torch.Tensor, r: int, P: int) -> torch.Tensor:
    """Ring reduce-scatter: each hop's block GEMM, plus what the left neighbour summed, to the right."""
    mb = A.shape[0] // P
    C = torch.empty(A.shape[0], W.shape[1])
    recv = torch.empty(2, mb, W.shape[1])
    block = lambda b: slice(b * mb, (b + 1) * mb)  # noqa: E731
    pending, sends = None, []
    for h in range(P):
        b = (r - h - 1) % P
        torch.mm(A[block(b)], W, out=C[block(b)])
        if h > 0:
            pending.wait()
            C[block(b)] += recv[(h - 1) % 2]
        if h < P - 1:
            pending = _recv(recv[h % 2], (r - 1) % P)
            sends.append(_send(C[block(b)], (r + 1) % P))
    for w in sends:
        w.wait()
    return C[block(r)]


def _hand_matmul_all_reduce(A: torch.Tensor, W: torch.Tensor, r: int, P: int) -> torch.Tensor:
    """The reduce-scatter above, then a ring all-gather of the reduced blocks."""
    mb = A.shape[0] // P
    own = _hand_matmul_reduce_scatter(A, W, r, P)
    C = torch.empty(A.shape[0], W.shape[1])
    C[r * mb:(r + 1) * mb] = own
    for h in range(P - 1):
        send, recv = (r - h) % P, (r - h - 1) % P
        works = [_recv(C[recv * mb:(recv + 1) * mb], (r - 1) % P),
                 _send(C[send * mb:(send + 1) * mb], (r + 1) % P)]
        for w in works:
            w.wait()
    return C


# -- PyTorch's own calls (the baseline's) ------------------------------------------------------
def _mm_all_reduce(A: torch.Tensor, W: torch.Tensor, group) -> torch.Tensor:
    y = A @ W
    dist.all_reduce(y, group=group)
    return y


def _gather_mm(A_shard: torch.Tensor, W: torch.Tensor, group, P: int) -> torch.Tensor:
    full = torch.empty(P * A_shard.shape[0], A_shard.shape[1])
    dist.all_gather_into_tensor(full, A_shard, group=group)
    return full @ W


def _mm_reduce_scatter(A: torch.Tensor, W: torch.Tensor, group, P: int) -> torch.Tensor:
    y = torch.empty(A.shape[0] // P, W.shape[1])
    dist.reduce_scatter_tensor(y, A @ W, group=group)
    return y


# -- timing -----------------------------------------------------------------------------------
def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _compare(ways: dict, reps: int, calls: int) -> dict:
    """Median per-call microseconds of each way, and of the first's (ficco's) minus the
    second's (the reference's) per round."""
    for fn in ways.values():  # warm-up: first calls decide, allocate
        _per_call_us(fn, 20)
    rounds = {name: [] for name in ways}
    for rep in range(reps):
        names = list(ways)
        for name in names[rep % 2:] + names[:rep % 2]:  # alternate which goes first
            rounds[name].append(_per_call_us(ways[name], calls))
    ficco, ref = (rounds[name] for name in list(ways)[:2])
    return {**{f"{name}_us": round(statistics.median(v), 2) for name, v in rounds.items()},
            "overhead_us": round(statistics.median(f - r for f, r in zip(ficco, ref)), 2)}


class _AsTrainingOp(torch.autograd.Function):
    """A hand-written forward as a training op: one autograd node that saves its inputs (the
    least a differentiable op costs the host; its backward is not timed)."""

    @staticmethod
    def forward(ctx, forward, A, W, *args):
        ctx.save_for_backward(A, W)
        return forward(A, W, *args)

    @staticmethod
    def backward(ctx, dY):  # pragma: no cover - the benchmark times forwards only
        raise NotImplementedError


def _schedules_run() -> set[str]:
    """The schedules of the plans the process holds (``configure`` clears them)."""
    from ficco_select.runtime import dispatch

    return {decision.schedule.name for decision in dispatch.decisions().values()}


def _overheads(args) -> dict:
    from ficco_select.runtime import torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import RowParallelLinear, install

    P, r, group = args.world_size, 0, dist.group.WORLD
    name = group.group_name
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.rand(*shape, generator=gen) * 2 - 1  # noqa: E731
    selector = Selector.load(args.model) if args.model else Selector()
    out = {"world_size": P, "rows_per_rank": args.rows, "k": args.k, "n": args.n, "reps": args.reps,
           "calls": args.calls, "schedule": SCHEDULE}

    A_shard, W_ag = rand(args.rows, args.k), rand(args.k, args.n)
    A_rs, W_rs = rand(P * args.rows, args.k), rand(args.k, args.n)
    torch_ops.configure(selector=selector, hardware="cpu", schedule=SCHEDULE)
    # The fake group moves no bytes: only this rank's own rows are comparable.
    torch.testing.assert_close(torch_ops.all_gather_matmul(A_shard, [W_ag], 0, name)[1][0][:args.rows],
                               _hand_all_gather_matmul(A_shard, W_ag, r, P)[:args.rows])
    out["overlap"] = {
        "all_gather_matmul": _compare({
            "ficco": lambda: torch_ops.all_gather_matmul(A_shard, [W_ag], 0, name, return_A=False),
            "hand": lambda: _hand_all_gather_matmul(A_shard, W_ag, r, P)}, args.reps, args.calls),
        "matmul_reduce_scatter": _compare({
            "ficco": lambda: torch_ops.matmul_reduce_scatter(A_rs, W_rs, "sum", 0, name),
            "hand": lambda: _hand_matmul_reduce_scatter(A_rs, W_rs, r, P)}, args.reps, args.calls),
        "matmul_all_reduce": _compare({
            "ficco": lambda: torch_ops.matmul_all_reduce(A_rs, W_rs, "sum", name),
            "hand": lambda: _hand_matmul_all_reduce(A_rs, W_rs, r, P)}, args.reps, args.calls),
    }
    Wg_ag, Wg_rs = W_ag.clone().requires_grad_(), W_rs.clone().requires_grad_()  # a training step's weights
    out["overlap_grad"] = {
        "all_gather_matmul": _compare({
            "ficco": lambda: torch_ops.all_gather_matmul(A_shard, [Wg_ag], 0, name, return_A=False),
            "hand": lambda: _AsTrainingOp.apply(_hand_all_gather_matmul, A_shard, Wg_ag, r, P),
            "registered_op": lambda: torch.ops.ficco.all_gather_matmul(A_shard, [Wg_ag], 0, name)},
            args.reps, args.calls),
        "matmul_reduce_scatter": _compare({
            "ficco": lambda: torch_ops.matmul_reduce_scatter(A_rs, Wg_rs, "sum", 0, name),
            "hand": lambda: _AsTrainingOp.apply(_hand_matmul_reduce_scatter, A_rs, Wg_rs, r, P),
            "registered_op": lambda: torch.ops.ficco.matmul_reduce_scatter(A_rs, Wg_rs, "sum", 0, name)},
            args.reps, args.calls),
        "matmul_all_reduce": _compare({
            "ficco": lambda: torch_ops.matmul_all_reduce(A_rs, Wg_rs, "sum", name),
            "hand": lambda: _AsTrainingOp.apply(_hand_matmul_all_reduce, A_rs, Wg_rs, r, P),
            "registered_op": lambda: torch.ops.ficco.matmul_all_reduce(A_rs, Wg_rs, "sum", name)},
            args.reps, args.calls),
    }
    assert _schedules_run() == {SCHEDULE}, _schedules_run()

    torch_ops.configure(schedule="none.sm")
    out["baseline"] = {
        "matmul_all_reduce": _compare({"ficco": lambda: torch_ops.matmul_all_reduce(A_rs, W_rs, "sum", name),
                                       "pytorch": lambda: _mm_all_reduce(A_rs, W_rs, group)}, args.reps, args.calls),
        "all_gather_matmul": _compare({
            "ficco": lambda: torch_ops.all_gather_matmul(A_shard, [W_ag], 0, name, return_A=False),
            "pytorch": lambda: _gather_mm(A_shard, W_ag, group, P)}, args.reps, args.calls),
        "matmul_reduce_scatter": _compare({
            "ficco": lambda: torch_ops.matmul_reduce_scatter(A_rs, W_rs, "sum", 0, name),
            "pytorch": lambda: _mm_reduce_scatter(A_rs, W_rs, group, P)}, args.reps, args.calls),
    }
    out["baseline_grad"] = {
        "matmul_all_reduce": _compare({
            "ficco": lambda: torch_ops.matmul_all_reduce(A_rs, Wg_rs, "sum", name),
            "pytorch": lambda: _AsTrainingOp.apply(_mm_all_reduce, A_rs, Wg_rs, group),
            "registered_op": lambda: torch.ops.ficco.matmul_all_reduce(A_rs, Wg_rs, "sum", name)},
            args.reps, args.calls),
        "all_gather_matmul": _compare({
            "ficco": lambda: torch_ops.all_gather_matmul(A_shard, [Wg_ag], 0, name, return_A=False),
            "pytorch": lambda: _AsTrainingOp.apply(_gather_mm, A_shard, Wg_ag, group, P),
            "registered_op": lambda: torch.ops.ficco.all_gather_matmul(A_shard, [Wg_ag], 0, name)},
            args.reps, args.calls),
        "matmul_reduce_scatter": _compare({
            "ficco": lambda: torch_ops.matmul_reduce_scatter(A_rs, Wg_rs, "sum", 0, name),
            "pytorch": lambda: _AsTrainingOp.apply(_mm_reduce_scatter, A_rs, Wg_rs, group, P),
            "registered_op": lambda: torch.ops.ficco.matmul_reduce_scatter(A_rs, Wg_rs, "sum", 0, name)},
            args.reps, args.calls),
    }
    assert _schedules_run() == {"none.sm"}, _schedules_run()

    torch_ops.configure(schedule="")  # the selector decides (its table: no collective per call)
    layer = RowParallelLinear(rand(args.n, args.k), None, group, sequence_parallel=False)
    x = rand(P * args.rows, args.k)
    hooked = RowParallelLinear(layer.weight.detach(), None, group, sequence_parallel=False)
    install(hooked)
    with torch.no_grad():
        hooked(x)
        out["layer"] = {"decision": "/".join(sorted(_schedules_run())),
                        **_compare({"ficco": lambda: hooked(x), "pytorch": lambda: layer(x)}, args.reps, args.calls)}
    return out


def _rss_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free memory the allocator holds is not the caches'
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory(args) -> dict:
    from ficco_select.runtime import dispatch, torch_ops
    from ficco_select.runtime.selector import Selector
    from ficco_select.runtime.tp import RowParallelLinear, install

    P, group = args.world_size, dist.group.WORLD
    torch_ops.configure(selector=Selector.load(args.model) if args.model else Selector(), hardware="cpu")
    layer = RowParallelLinear(torch.randn(args.n, args.k), None, group, sequence_parallel=False)
    if not args.unhooked:
        install(layer)
    rss, heap, half = [], [], args.tokens // 2
    tracemalloc.start()

    def calls(first: int, last: int, thread: int) -> None:
        with torch.no_grad():
            for tokens in range(first + thread, last + 1, args.threads):
                layer(torch.randn(tokens, args.k))

    for first, last in ((1, half), (half + 1, args.tokens)):
        workers = [threading.Thread(target=calls, args=(first, last, t)) for t in range(args.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        gc.collect()
        rss.append(_rss_mb())
        heap.append(tracemalloc.get_traced_memory()[0] / 2**20)
    tracemalloc.stop()
    sources = {}
    for decision in dispatch.decisions().values():
        sources[decision.schedule.name] = sources.get(decision.schedule.name, 0) + 1
    return {"world_size": P, "tokens": args.tokens, "threads": args.threads, "hooked": not args.unhooked,
            "k": args.k, "n": args.n, "rss_at_half_mb": round(rss[0], 1), "rss_at_end_mb": round(rss[1], 1),
            "growth_second_half_mb": round(rss[1] - rss[0], 2), "python_heap_at_half_mb": round(heap[0], 2),
            "python_heap_growth_second_half_mb": round(heap[1] - heap[0], 2), "plans_kept": len(dispatch.decisions()),
            "cache_size": dispatch.settings().cache_size, "kept_by_schedule": sources}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="An exported selector folder (default: the heuristic).")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="Rows per rank (the all-gather's shard).")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--memory", action="store_true", help="Resident memory under continuous batching instead.")
    ap.add_argument("--tokens", type=int, default=12000)
    ap.add_argument("--threads", type=int, default=1, help="Threads calling the layer at once (--memory).")
    ap.add_argument("--unhooked", action="store_true", help="--memory of the layer without the hook.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # The fake group receives nothing: received rows hold whatever the allocator gave, and
    # denormal garbage would make some GEMMs many times slower than others.
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        out = _memory(args) if args.memory else _overheads(args)
    finally:
        dist.destroy_process_group()
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
