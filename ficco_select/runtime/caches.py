"""The runtime's one cache: a dict of at most `limit` entries, least recently used out.

Every cache on the hook's path is one of these (a group's plans and layer tables, the
contexts of the process groups, the telemetry writers and their call counts, the names of
the shared candidate tuples), so that a job's memory never grows with the shapes it sees:
continuous batching sends every token count.

Safe from any number of threads without a lock on the read path: a lookup and its
move-to-the-end are each atomic under the GIL, and every entry is written whole (one
assignment), so a reader sees an entry or its absence, never half of one. Writes and
eviction take one lock, so that two writers never evict past each other.

Runtime path: standard library only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """At most `limit` entries; a ``put`` beyond it evicts the least recently used."""

    __slots__ = ("limit", "_entries", "_lock", "peek")

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.peek = self._entries.get
        """A lookup that leaves the order alone: one C call, for hot paths that read far more
        often than they write (an entry read this way may be the one evicted next)."""

    def get(self, key: K, default: V | None = None) -> V | None:
        entry = self._entries.get(key, default)
        if entry is not default:
            try:
                self._entries.move_to_end(key)
            except KeyError:  # evicted by another thread in between: still a valid answer for this call
                pass
        return entry

    def put(self, key: K, value: V) -> V:
        """Store `value` (whole) under `key` and return it."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
        return value

    def pop(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            return self._entries.pop(key, default)

    def drop(self, keep: Callable[[K, V], bool]) -> None:
        """Drop the entries for which keep(key, value) is false."""
        with self._lock:
            for key, value in self._snapshot():
                if not keep(key, value):
                    self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def items(self) -> list[tuple[K, V]]:
        """A snapshot, least recently used first."""
        with self._lock:
            return self._snapshot()

    def values(self) -> list[V]:
        with self._lock:
            return [value for _, value in self._snapshot()]

    def _snapshot(self) -> list[tuple[K, V]]:
        # Readers reorder entries without the lock (get's move_to_end), and walking an
        # OrderedDict that is reordered meanwhile raises: copy again until one walk is whole.
        while True:
            try:
                return list(self._entries.items())
            except RuntimeError:
                continue

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"BoundedCache({len(self._entries)}/{self.limit})"
