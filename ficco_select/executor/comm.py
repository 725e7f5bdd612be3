"""Point-to-point transfers that progress in the background while the caller computes.

Schedules are written against this small interface so that a backend only has to say
how bytes move: the cpu backend posts gloo ``isend``/``irecv`` (gloo's transport
threads move the bytes on the same cores as the GEMMs: the ``sm`` engine); the cuda
backend brings copy-engine transfers (``dma``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

Transfer = tuple[torch.Tensor, int]
"""(buffer, peer rank): what to send to or receive from one peer."""


class Comm:
    """What every comm derives from its ``start`` and ``wait``."""

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list:  # pragma: no cover
        raise NotImplementedError

    def wait(self, works: Sequence) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> None:
        """Blocking transfer: post and wait (non-overlapped collectives use it)."""
        self.wait(self.start(sends, recvs, tag))

    def start_all_gather(self, send: torch.Tensor, recvs: Sequence[Transfer], tag: int) -> list:
        """One all-gather step: `send` to every peer that `recvs` names, their pieces into `recvs`.

        Every rank of the step calls it. The same as ``start`` with `send` to each peer,
        except that a comm may move `send` once for all of them (the dma comm stages it
        once instead of once per peer).
        """
        return self.start([(send, peer) for _, peer in recvs], recvs, tag)


class P2PComm(Comm):
    """Asynchronous point-to-point transfers over a torch.distributed process group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        group = group if group is not None else dist.group.WORLD
        # A weak reference: a comm kept per group (the runtime's) must not keep a destroyed
        # group's threads alive until interpreter teardown.
        self._group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group()

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list[dist.Work]:
        """Post every transfer of one step; return handles to wait on.

        Both ends of a transfer must post it with the same tag; empty buffers are
        skipped on both ends (their sizes are known to both). The handles are the
        receives', then the sends', in post order (every comm keeps this order: ops
        wait on a one-peer step's receive as ``works[:1]``). Posted on the group itself
        with its own ranks: what ``dist.isend``/``irecv`` post, without their per-call
        argument checks and rank translations.
        """
        group = self._group()
        works = []
        for buf, peer in recvs:
            if buf.numel():
                works.append(group.recv([buf], peer, tag))
        for buf, peer in sends:
            if buf.numel():
                works.append(group.send([buf], peer, tag))
        return works

    def wait(self, works: Sequence[dist.Work]) -> None:
        # Blocking, not polling: gloo's send/recv handles report completion only from
        # inside wait() (a poll on is_completed() never ends; tried for the label issue).
        for w in works:
            w.wait()

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)


class NullComm(Comm):
    """Moves nothing: a schedule run with it is its compute skeleton (for DIL)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> list:
        return []

    def wait(self, works: Sequence) -> None:
        pass
