"""ficco's collective + GEMM ops as they run, without autograd: each call describes itself,
looks up its plan (``dispatch.decide``) and runs it: PyTorch's own collective and GEMM where
the decision is the baseline, the executor's schedule otherwise.

``torch_ops`` (eager, the public functions) and ``library`` (the registered
``torch.ops.ficco.*``, whose autograd formulas are the ops' one backward) both call these.

Per call, where the plan is cached: the call's key (its shapes), one lookup, and the run.
Nothing collective, nothing built: the per-call check that every rank passes the same call
is a debug mode (``dispatch.Settings.check_calls``), which a group's ranks agree on once, at
its first checked call (``agree_on_the_check``), and an overlapped plan keeps its comm and
operator template from its first run. The MoE ops are the exception: their decision
depends on every rank's load, so each call exchanges the ranks' token counts (one small
host all-gather), and that exchange checks them too.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ficco_select.executor.operators import (AllGatherGemm, AllToAllGemm, GemmAllReduce, GemmAllToAll,
                                             GemmReduceScatter, dtype_name)
from ficco_select.executor.supports import (all_gather_matmul_unsupported, matmul_all_reduce_unsupported,
                                            matmul_reduce_scatter_unsupported)
from ficco_select.runtime import dispatch
from ficco_select.runtime.dispatch import decide, fall_back, resolve_group, run_decided, run_native, scenario_for


# -- the ops ----------------------------------------------------------------------------
def all_gather_matmul(A_shard: torch.Tensor, Bs: Sequence[torch.Tensor], gather_dim: int, group_name, *,
                      return_A: bool = True, run_check: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(A or None, [A @ B for B in Bs]) with A = all_gather(A_shard, gather_dim)."""
    group = resolve_group(group_name)
    P = group.size()
    gather_dim = gather_dim % A_shard.ndim
    if _checks_calls(group):
        _same_call_on_every_rank("all_gather_matmul", group, run_check,
                                 f"A_shard {_tensor(A_shard)} gathered along dim {gather_dim} @ Bs "
                                 f"{', '.join(map(_tensor, Bs))}")
    if unsupported := all_gather_matmul_unsupported(gather_dim, A_shard.ndim, len(Bs)):
        fall_back(f"{unsupported}: PyTorch's implementation")
        return symm_mem._fused_all_gather_matmul_fallback(A_shard, list(Bs), gather_dim, group.group_name,
                                                          return_A=return_A)
    k = A_shard.shape[-1]
    widths = [B.shape[-1] for B in Bs]
    plan = all_gather_matmul_plan(A_shard.numel() // k if k else 0, k, sum(widths), A_shard.dtype, A_shard.device,
                                  group, P)
    if plan.native:
        return run_native(plan, A_shard.device, lambda: _native_all_gather_matmul(A_shard, Bs, gather_dim, group,
                                                                                   P, return_A))
    # Gathered rows in rank order, as the executor's row all-gather produces them.
    rows_in = A_shard.ndim == 2 and gather_dim == 0
    A2 = A_shard if rows_in else A_shard.movedim(gather_dim, 0)
    lead = A2.shape[:-1]
    A2 = A2 if rows_in else A2.reshape(-1, k)
    W = Bs[0] if len(Bs) == 1 else torch.cat(list(Bs), dim=1)

    def reference():
        return symm_mem._fused_all_gather_matmul_fallback(A2, [W], 0, group.group_name, return_A=False)[1][0]

    out, op = run_decided(AllGatherGemm, plan, group, reference, A_shard=A2, W=W)
    if rows_in and len(Bs) == 1:  # rows in, rows out: nothing to reshape
        return (op.A_full if return_A else None), [out]
    outs = [o.reshape(P * lead[0], *lead[1:], w).movedim(0, gather_dim)
            for o, w in zip(out.split(widths, dim=1), widths)]
    A = op.A_full.reshape(P * lead[0], *lead[1:], A2.shape[1]).movedim(0, gather_dim) if return_A else None
    return A, outs


_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
"""torch.distributed's all-gather and reduce-scatter into one tensor (older torch: the *_tensor names)."""


def _native_all_gather_matmul(A_shard, Bs, gather_dim: int, group: dist.ProcessGroup, P: int, return_A: bool):
    """PyTorch's own form: the group's all-gather along `gather_dim`, then each GEMM."""
    shard = (A_shard if gather_dim == 0 else A_shard.movedim(gather_dim, 0)).contiguous()
    A = shard.new_empty((P * shard.shape[0], *shard.shape[1:]))
    _all_gather_single(A, shard, group=group)
    if gather_dim:
        A = A.movedim(0, gather_dim)
    return (A if return_A else None), [A @ B for B in Bs]


def _native_matmul_reduce_scatter(A, B, reduce_op: str, scatter_dim: int, group: dist.ProcessGroup, P: int):
    """PyTorch's own form: the GEMM, then the group's reduce-scatter along `scatter_dim`."""
    Y = A @ B
    rows = (Y if scatter_dim == 0 else Y.movedim(scatter_dim, 0)).contiguous()
    out = rows.new_empty((rows.shape[0] // P, *rows.shape[1:]))
    _reduce_scatter_single(out, rows, group=group)
    if reduce_op == "avg":
        out /= P
    return out if scatter_dim == 0 else out.movedim(0, scatter_dim)


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int, group_name, *,
                          run_check: bool = True) -> torch.Tensor:
    """reduce_scatter(A @ B, scatter_dim) with ``sum`` or ``avg``."""
    group = resolve_group(group_name)
    P = group.size()
    scatter_dim = scatter_dim % A.ndim
    if _checks_calls(group):
        _same_call_on_every_rank("matmul_reduce_scatter", group, run_check,
                                 f"A {_tensor(A)} @ B {_tensor(B)}, {reduce_op} scattered along dim {scatter_dim}")
    extent = B.shape[-1] if scatter_dim == A.ndim - 1 else A.shape[scatter_dim]
    if unsupported := matmul_reduce_scatter_unsupported(reduce_op, extent, P):
        fall_back(f"{unsupported}: PyTorch's implementation")
        return symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, group.group_name)
    k_local, scatter_last = A.shape[-1], scatter_dim == A.ndim - 1
    rows = A.numel() // k_local if k_local else 0
    plan = matmul_reduce_scatter_plan(B.shape[-1] if scatter_last else rows, k_local,
                                      rows if scatter_last else B.shape[-1], scatter_last, A.dtype, A.device, group, P)
    if plan.native:
        return run_native(plan, A.device, lambda: _native_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group, P))
    if scatter_last:
        # Scatter the output's columns: (A @ B)^T = B^T @ A^T has them as rows.
        rows_lead, A2 = A.shape[:-1], A.reshape(-1, k_local)
        left, right = B.t(), A2.t()
    else:
        At = A if scatter_dim == 0 else A.movedim(scatter_dim, 0)
        rows_lead = At.shape[:-1]
        left, right = (At if At.ndim == 2 else At.reshape(-1, k_local)), B

    def reference():
        return symm_mem._fused_matmul_reduce_scatter_fallback(left, right, "sum", 0, group.group_name)

    out, _ = run_decided(GemmReduceScatter, plan, group, reference, A=left, W=right, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    if scatter_last:
        return out.t().reshape(*rows_lead, out.shape[0])
    if len(rows_lead) == 1 and scatter_dim == 0:  # rows in, rows out: nothing to reshape
        return out
    return out.reshape(rows_lead[0] // P, *rows_lead[1:], out.shape[1]).movedim(0, scatter_dim)


def matmul_all_reduce(A: torch.Tensor, B: torch.Tensor, reduce_op: str = "sum", group_name=None, *,
                      run_check: bool = True) -> torch.Tensor:
    """all_reduce(A @ B) with ``sum`` or ``avg``: every rank gets the whole result."""
    group = resolve_group(group_name)
    P = group.size()
    if _checks_calls(group):
        _same_call_on_every_rank("matmul_all_reduce", group, run_check,
                                 f"A {_tensor(A)} @ B {_tensor(B)}, {reduce_op}")
    A2 = A if A.ndim == 2 else _rows(A)
    rows, n = A2.shape[0], B.shape[-1]

    def plain():  # PyTorch's form, in the caller's dtype
        Y = A2 @ B
        dist.all_reduce(Y, group=group)
        return Y

    if unsupported := matmul_all_reduce_unsupported(reduce_op, rows, P):
        fall_back(f"{unsupported}: PyTorch's mm + all_reduce")
        out = plain()
    else:
        plan = matmul_all_reduce_plan(rows, A2.shape[1], n, A.dtype, A.device, group, P)
        if plan.native:
            out = run_native(plan, A.device, plain)
        else:
            out, _ = run_decided(GemmAllReduce, plan, group, plain, A=A2, W=B, eager_buffers=False)
    if reduce_op == "avg":
        out = out / P
    return out if A.ndim == 2 else out.reshape(*A.shape[:-1], n)



# -- every rank passes the same call --------------------------------------------------------
CALL_BYTES = 256
"""Room for one rank's description of its call in the per-call check (any real call fits)."""


def _tensor(t: torch.Tensor) -> str:
    """A tensor as a call's description names it: its shape and dtype, ``(4, 8) float32``."""
    return f"{tuple(t.shape)} {dtype_name(t.dtype)}"


SETTING_BYTES = 64
"""Room for one rank's check setting in the agreement on it (``agree_on_the_check``)."""
_AGREEING = threading.Lock()


def _checks_calls(group: dist.ProcessGroup) -> bool:
    """Whether this call on `group` runs the per-call check (the debug mode); the group's
    ranks agree on that at its first checked call (one host collective; none after)."""
    if not dispatch.check_agreed(group):
        agree_on_the_check(group)
    return dispatch.checks_calls()


def agree_on_the_check(group: dist.ProcessGroup) -> None:
    """The ranks of `group` agree on the per-call check (``dispatch.Settings.check_calls``),
    once until the next ``reset`` or ``configure(check_calls=...)``: one host all-gather of
    every rank's setting. A rank with the check on would run a collective per call that
    the others never join, and wait on them until the group's timeout; so where the ranks
    differ, every rank raises ValueError naming the setting and the ranks on either side
    (and agrees again at its next call)."""
    with _AGREEING:  # the forward's and autograd's threads: one agreement per rank
        if dispatch.check_agreed(group):
            return
        settings = dispatch.settings()
        mine = f"{'on' if settings.check_calls else 'off'} ({settings.check_source})"
        every = _texts(_host_all_gather(group, mine, SETTING_BYTES))
        if len({text.split(" ", 1)[0] for text in every if text}) > 1:
            sides: dict[str, list[int]] = {}
            for r, text in enumerate(every):
                sides.setdefault(text, []).append(dist.get_global_rank(group, r))
            raise ValueError(
                f"ficco's per-call check differs between the ranks of group {group.group_name!r}: "
                + ", ".join(f"{text.split(' ', 1)[0]} at rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} "
                            f"{text.split(' ', 1)[1]}" for text, rs in sorted(sides.items(), reverse=True))
                + "; set it alike on every rank (FICCO_CHECK_CALLS, TORCH_DISTRIBUTED_DEBUG=DETAIL or "
                "configure(check_calls=...))")
        dispatch.note_check_agreed(group)


def _same_call_on_every_rank(op: str, group: dist.ProcessGroup, run_check: bool, call: str) -> None:
    """ValueError on every rank of `group` where a rank describes its call otherwise than
    rank 0 (the ranks' shapes must match for the collective to mean anything). The debug
    mode's check (``dispatch.Settings.check_calls``). Every rank joins it, also where its
    caller vouches for the call (``run_check=False``: the shapes are then not compared), so
    that ranks passing ``run_check`` differently raise instead of waiting on each other."""
    every = _gathered(group, f"{int(run_check)}{call}", CALL_BYTES)
    if every[0, 0] and bool((every == every[0]).all()):  # the common case: one comparison, nothing decoded
        return
    calls = _texts(every)
    checked = [c[:1] == "1" if c else None for c in calls]
    if len(set(checked) - {None}) > 1:
        on = [r for r, v in enumerate(checked) if v]
        raise ValueError(f"{op}: run_check differs between the ranks of group {group.group_name!r}: True at ranks "
                         f"{', '.join(map(str, on))}, False at the others; every rank must pass the same run_check")
    if not any(checked):
        return  # every rank's caller vouched for the call
    calls = [c[1:] if c else None for c in calls]
    odd = next(r for r, c in enumerate(calls) if c != calls[0] or c is None)
    raise ValueError(f"{op}: rank {odd} passed {calls[odd] or 'a call too long to compare'}, rank 0 passed "
                     f"{calls[0] or 'a call too long to compare'}; every rank of the group must pass the same "
                     "shapes, dtype and dims")


def _gathered(group: dist.ProcessGroup, mine: str, size: int) -> torch.Tensor:
    """Every rank's `mine` as a (ranks, 1 + size) uint8 CPU tensor in group rank order, from
    one all-gather: a row is a flag (0: the text did not fit, so that every rank sees the
    same and raises alike), then the text's bytes, zero-padded. On the host
    (``_host_group``): no CUDA stream waits for it."""
    return _host_all_gather(group, mine, size)


def _host_all_gather(group: dist.ProcessGroup, mine: str, size: int) -> torch.Tensor:
    """``_gathered`` (which counts as a call's check; this alone is also the agreement on it)."""
    data = mine.encode()
    row = b"\1" + data.ljust(size, b"\0") if len(data) <= size else bytes(1 + size)
    host = _host_group(group)
    every = torch.empty(dist.get_world_size(host) * (1 + size), dtype=torch.uint8)
    dist.all_gather_single(every, torch.frombuffer(bytearray(row), dtype=torch.uint8), group=host)
    return every.view(-1, 1 + size)


_HOST_GROUPS: dict[str, dist.ProcessGroup] = {}
_HOST_GROUPS_LOCK = threading.Lock()


def _host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Where the per-call check runs: `group` itself if it has a CPU backend, else a gloo
    group of the same ranks, made once, at the group's first call (every rank of it makes
    that call; ``use_local_synchronization``: no other rank takes part). A check on an
    NCCL-only group's device would make the host wait for the GPU at every call."""
    if torch.device("cpu") in group._device_types:
        return group
    with _HOST_GROUPS_LOCK:
        if group.group_name not in _HOST_GROUPS:
            _HOST_GROUPS[group.group_name] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                            use_local_synchronization=True)
        return _HOST_GROUPS[group.group_name]


def _texts(every: torch.Tensor) -> list[str | None]:
    """The texts of ``_gathered``'s rows (None where one did not fit)."""
    return [row[1:].rstrip(b"\0").decode() if row[0] else None
            for row in map(bytes, every.numpy())]


# -- layers: a call's shape without its token count -----------------------------------------
TABLE_ROWS = 64
"""Rows per rank of the scenario a prepared layer's table is built from (the table covers every m)."""


def _ag_layer(n_local: int, dtype: torch.dtype, device_type: str, k: int) -> tuple:
    """An all-gather matmul's layer: A_shard (rows, k) @ B (k, n_local), any rows."""
    return ("ag", n_local, dtype, device_type, k)


def _rs_layer(n: int, scatter_last: bool, dtype: torch.dtype, device_type: str, k_local: int) -> tuple:
    """A matmul reduce-scatter's layer: A (rows, k_local) @ B (k_local, n), any rows."""
    return ("rs", n, scatter_last, dtype, device_type, k_local)


def _ar_layer(n: int, dtype: torch.dtype, device_type: str, k_local: int) -> tuple:
    """A matmul all-reduce's layer: A (rows, k_local) @ B (k_local, n), any rows."""
    return ("ar", n, dtype, device_type, k_local)


def all_gather_matmul_plan(rows: int, k: int, n_local: int, dtype: torch.dtype, device: torch.device,
                           group: dist.ProcessGroup, P: int) -> dispatch.Plan:
    """The plan of an all-gather matmul of A_shard (rows, k) along its rows @ B (k, n_local)."""
    key = ("ag", (rows, k), n_local, dtype, device.type)
    return dispatch.cached_plan(key, group) or decide(
        key, group, lambda: scenario_for("ag_gemm", P * rows, P * n_local, k, dtype, P, device),
        layer=_ag_layer(n_local, dtype, device.type, k), m=P * rows)


def matmul_reduce_scatter_plan(rows: int, k_local: int, n: int, scatter_last: bool, dtype: torch.dtype,
                               device: torch.device, group: dist.ProcessGroup, P: int) -> dispatch.Plan:
    """The plan of a matmul reduce-scatter of A (rows, k_local) @ B (k_local, n) (its rows
    scattered; with `scatter_last`, the transposed product's)."""
    key = ("rs", (rows, k_local), n, scatter_last, dtype, device.type)
    return dispatch.cached_plan(key, group) or decide(
        key, group, lambda: scenario_for("gemm_rs", rows, n, P * k_local, dtype, P, device),
        layer=_rs_layer(n, scatter_last, dtype, device.type, k_local), m=rows)


def matmul_all_reduce_plan(rows: int, k_local: int, n: int, dtype: torch.dtype, device: torch.device,
                           group: dist.ProcessGroup, P: int) -> dispatch.Plan:
    """The plan of a matmul all-reduce of A (rows, k_local) @ B (k_local, n)."""
    key = ("ar", (rows, k_local), n, dtype, device.type)
    return dispatch.cached_plan(key, group) or decide(
        key, group, lambda: scenario_for("gemm_ar", rows, n, P * k_local, dtype, P, device),
        layer=_ar_layer(n, dtype, device.type, k_local), m=rows)


def prepare_all_gather_matmul(k: int, n_local: int, dtype: torch.dtype, device: torch.device, group_name) -> bool:
    """Build now the decision table of ``all_gather_matmul`` calls of A_shard (rows, k) @ B
    (k, n_local) along dim 0, for every row count: such a call then decides by a lookup,
    with no collective and no model, from its first step on. Every rank of the group calls
    it, in the same order (rank 0 builds the table and shares it). Whether a table was built."""
    group = resolve_group(group_name)
    agree_on_the_check(group)  # now, so that no step does
    P = group.size()
    return dispatch.prepare_layer(_ag_layer(n_local, dtype, device.type, k), group, lambda: scenario_for(
        "ag_gemm", P * TABLE_ROWS, P * n_local, k, dtype, P, device)) is not None


def prepare_matmul_reduce_scatter(k_local: int, n: int, dtype: torch.dtype, device: torch.device,
                                  group_name) -> bool:
    """``prepare_all_gather_matmul`` for ``matmul_reduce_scatter`` calls of A (rows, k_local)
    @ B (k_local, n) scattered along dim 0."""
    group = resolve_group(group_name)
    agree_on_the_check(group)  # now, so that no step does
    P = group.size()
    return dispatch.prepare_layer(_rs_layer(n, False, dtype, device.type, k_local), group, lambda: scenario_for(
        "gemm_rs", P * TABLE_ROWS, n, P * k_local, dtype, P, device)) is not None


def prepare_matmul_all_reduce(k_local: int, n: int, dtype: torch.dtype, device: torch.device, group_name) -> bool:
    """``prepare_all_gather_matmul`` for ``matmul_all_reduce`` calls of A (rows, k_local) @ B (k_local, n)."""
    group = resolve_group(group_name)
    agree_on_the_check(group)  # now, so that no step does
    P = group.size()
    return dispatch.prepare_layer(_ar_layer(n, dtype, device.type, k_local), group, lambda: scenario_for(
        "gemm_ar", P * TABLE_ROWS, n, P * k_local, dtype, P, device)) is not None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])



def _routing(op: str, X: torch.Tensor, W: torch.Tensor, splits, group: dist.ProcessGroup) -> list[dict]:
    """Every rank's side of a MoE call (X's rows and shapes, its splits), from one small
    all-gather, in group rank order. ValueError on every rank where the ranks disagree:
    another k, n or dtype, a split list that is not one entry per rank, a rank whose
    ``input_split_sizes`` do not add up to X's rows, or a rank expecting rows
    (``output_split_sizes``) that another does not send it (its ``input_split_sizes``)."""
    output_split_sizes, input_split_sizes = splits
    P = dist.get_world_size(group)
    mine = {"call": f"X {_tensor(X)} @ W {_tensor(W)}", "same": [X.shape[-1], *W.shape, str(X.dtype), str(W.dtype)],
            "rows": X.shape[0], "recv": list(map(int, output_split_sizes)), "send": list(map(int, input_split_sizes))}
    texts = _texts(_gathered(group, json.dumps(mine), CALL_BYTES + 48 * P))
    if None in texts:
        raise ValueError(f"{op}: rank {texts.index(None)} passed a call too long to compare "
                         "(split lists of one entry per rank expected)")
    every = [json.loads(t) for t in texts]
    for r, side in enumerate(every):
        if side["same"] != every[0]["same"]:
            raise ValueError(f"{op}: rank {r} passed {side['call']}, rank 0 passed {every[0]['call']}; every rank "
                             "of the group must pass the same k, n and dtype (X's rows may differ)")
        if len(side["recv"]) != P or len(side["send"]) != P:
            raise ValueError(f"{op}: rank {r} passed {len(side['recv'])} output and {len(side['send'])} input split "
                             f"sizes; one per rank of the group ({P})")
        if sum(side["send"]) != side["rows"]:
            raise ValueError(f"{op}: rank {r}'s input_split_sizes {side['send']} add up to {sum(side['send'])}, "
                             f"its X has {side['rows']} rows")
    for r, q in itertools.product(range(P), range(P)):
        if every[r]["recv"][q] != every[q]["send"][r]:
            raise ValueError(f"{op}: rank {r} expects {every[r]['recv'][q]} rows from rank {q} (output_split_sizes), "
                             f"rank {q} sends it {every[q]['send'][r]} (input_split_sizes)")
    return every


def _expert_load(loads: Sequence[int]) -> tuple[int, float]:
    """(m, imbalance) of a MoE call from every expert's token count.

    Token counts differ per rank and per step: m = mean tokens per expert, rounded up to a
    quarter-octave so that a drifting load reuses its decision, and imbalance = max load /
    mean load, in steps of 1/8.
    """
    P = len(loads)
    mean = sum(loads) / P
    m = math.ceil(2 ** (math.ceil(4 * math.log2(mean)) / 4)) if mean >= 1 else 0
    imbalance = min(float(P), math.ceil(8 * max(loads) / mean) / 8) if mean > 0 else 1.0
    return m, imbalance


def all_to_all_matmul(X: torch.Tensor, W: torch.Tensor, splits, group_name) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_to_all_single(X) @ W, all_to_all_single(X)); splits: (output_split_sizes, input_split_sizes)."""
    output_split_sizes, input_split_sizes = splits
    group = resolve_group(group_name)
    P = group.size()
    every = _routing("all_to_all_matmul", X, W, splits, group)
    m, imbalance = _expert_load([sum(side["recv"]) for side in every])
    key = ("a2a", m, imbalance, X.shape[1], W.shape[1], X.dtype, X.device.type)
    plan = decide(key, group, lambda: scenario_for(
        "a2a_gemm", m, W.shape[1], X.shape[1], X.dtype, P, X.device, imbalance=imbalance),
        layer=key[:1] + key[2:], m=m)

    def received():
        recv = X.new_empty(sum(output_split_sizes), X.shape[1])
        dist.all_to_all_single(recv, X.contiguous(), list(output_split_sizes), list(input_split_sizes), group=group)
        return recv

    if plan.native:  # PyTorch's own: all_to_all_single, then the GEMM
        recv = run_native(plan, X.device, received)
        return recv @ W, recv
    out, op = run_decided(AllToAllGemm, plan, group, lambda: received() @ W, X=X, W=W,
                          send_sizes=list(input_split_sizes), recv_sizes=list(output_split_sizes))
    # Overlapped schedules read the local chunk from X in place: complete X_recv.
    op.X_recv[op.recv_rows(op.r)] = op.send_chunk(op.r)
    return out, op.X_recv


def matmul_all_to_all(X: torch.Tensor, W: torch.Tensor, splits, group_name) -> torch.Tensor:
    """all_to_all_single(X @ W); splits: (output_split_sizes, input_split_sizes)."""
    output_split_sizes, input_split_sizes = splits
    group = resolve_group(group_name)
    P = group.size()
    every = _routing("matmul_all_to_all", X, W, splits, group)
    m, imbalance = _expert_load([side["rows"] for side in every])
    key = ("combine", m, imbalance, X.shape[1], W.shape[1], X.dtype, X.device.type)
    plan = decide(key, group, lambda: scenario_for(
        "gemm_a2a", m, W.shape[1], X.shape[1], X.dtype, P, X.device, imbalance=imbalance),
        layer=key[:1] + key[2:], m=m)

    def plain():  # PyTorch's form: the expert's GEMM, then all_to_all_single
        out = X.new_empty(sum(output_split_sizes), W.shape[1])
        dist.all_to_all_single(out, (X @ W).contiguous(), list(output_split_sizes), list(input_split_sizes),
                               group=group)
        return out

    if plan.native:
        return run_native(plan, X.device, plain)
    # The executor's names: recv_sizes are the tokens this expert received (they go back),
    # send_sizes those this rank routed (their answers come back).
    out, _ = run_decided(GemmAllToAll, plan, group, plain, X_recv=X, W=W,
                         send_sizes=list(output_split_sizes), recv_sizes=list(input_split_sizes))
    return out


