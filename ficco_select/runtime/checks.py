"""Every rank of a group passes the same call: the debug mode's check of each call
(``Settings.check_calls``), the ranks' agreement on the debug mode itself, and the MoE
ops' exchange of every rank's routing, which checks their calls too. Each is one small
all-gather on the host (``_host_group``): no CUDA stream waits for it.
"""

from __future__ import annotations

import itertools
import json

import torch
import torch.distributed as dist

from ficco_select.executor.operators import dtype_name
from ficco_select.runtime.context import context

CALL_BYTES = 256
"""Room for one rank's description of its call in the per-call check (any real call fits)."""


def described(t: torch.Tensor) -> str:
    """A tensor as a call's description names it: its shape and dtype, ``(4, 8) float32``."""
    return f"{tuple(t.shape)} {dtype_name(t.dtype)}"


SETTING_BYTES = 64
"""Room for one rank's check setting in the agreement on it (``agree_on_the_check``)."""


def agree_on_the_check(group: dist.ProcessGroup) -> None:
    """The ranks of `group` agree on the per-call check (``dispatch.Settings.check_calls``),
    once until the next ``reset`` or ``configure(check_calls=...)``: one host all-gather of
    every rank's setting. A rank with the check on would run a collective per call that
    the others never join, and wait on them until the group's timeout; so where the ranks
    differ, every rank raises ValueError naming the setting and the ranks on either side
    (and agrees again at its next call)."""
    ctx = context(group)
    with ctx.agreeing:  # the forward's and autograd's threads: one agreement per rank and group
        if ctx.check_agreed:
            return
        settings = ctx.settings
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
        ctx.check_agreed = True


def same_call_on_every_rank(op: str, group: dist.ProcessGroup, run_check: bool, call: str) -> None:
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


def _host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Where the per-call check runs: `group` itself if it has a CPU backend, else a gloo
    group of the same ranks, made once, at the group's first call (every rank of it makes
    that call; ``use_local_synchronization``: no other rank takes part). A check on an
    NCCL-only group's device would make the host wait for the GPU at every call."""
    if torch.device("cpu") in group._device_types:
        return group
    ctx = context(group)
    with ctx.agreeing:
        if ctx.host_group is None:
            ctx.host_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                            use_local_synchronization=True)
        return ctx.host_group


def _texts(every: torch.Tensor) -> list[str | None]:
    """The texts of ``_gathered``'s rows (None where one did not fit)."""
    return [row[1:].rstrip(b"\0").decode() if row[0] else None
            for row in map(bytes, every.numpy())]


def routing(op: str, X: torch.Tensor, W: torch.Tensor, splits, group: dist.ProcessGroup) -> list[dict]:
    """Every rank's side of a MoE call (X's rows and shapes, its splits), from one small
    all-gather, in group rank order. ValueError on every rank where the ranks disagree:
    another k, n or dtype, a split list that is not one entry per rank, a rank whose
    ``input_split_sizes`` do not add up to X's rows, or a rank expecting rows
    (``output_split_sizes``) that another does not send it (its ``input_split_sizes``)."""
    output_split_sizes, input_split_sizes = splits
    P = dist.get_world_size(group)
    mine = {"call": f"X {described(X)} @ W {described(W)}", "same": [X.shape[-1], *W.shape, str(X.dtype), str(W.dtype)],
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
