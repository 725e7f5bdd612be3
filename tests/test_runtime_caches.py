"""The runtime's one cache (``runtime/caches.py``): bounded, least recently used out, safe from threads."""

import threading

from ficco_select.runtime.caches import BoundedCache


def test_a_bounded_cache_keeps_the_most_recently_used():
    cache = BoundedCache(3)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a is now the most recent: b goes first
    cache.put("d", "D")
    assert "b" not in cache and len(cache) == 3
    assert [key for key, _ in cache.items()] == ["c", "a", "d"]
    assert cache.get("b") is None and cache.get("b", 0) == 0


def test_a_bounded_cache_drops_pops_and_clears():
    cache = BoundedCache(10)
    for i in range(6):
        cache.put(i, i * i)
    cache.drop(lambda key, value: key % 2 == 0)
    assert cache.values() == [0, 4, 16]
    assert cache.pop(2) == 4 and cache.pop(2) is None
    cache.clear()
    assert len(cache) == 0
    assert BoundedCache(0).limit == 1


def test_a_bounded_cache_stays_bounded_under_threads():
    cache = BoundedCache(64)
    seen_wrong = []

    def work(t: int) -> None:
        for i in range(2000):
            key = (t, i % 97)
            cache.put(key, key)
            got = cache.get(key)
            if got is not None and got != key:  # an entry is always written whole
                seen_wrong.append(got)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not seen_wrong and len(cache) == 64


def test_dropping_while_a_reader_reorders_the_entries_drops_only_what_it_should():
    # A reader's get moves its entry to the end without the writers' lock; a drop walking the
    # entries meanwhile (another thread's clear_cache) died with "OrderedDict mutated during
    # iteration". The reader here runs inside keep, as a thread switch between two steps would.
    cache = BoundedCache(8)
    for key in range(6):
        cache.put(key, key)

    def keep(key, value):
        cache.get(0)
        cache.get(3)
        return value % 2 == 0

    cache.drop(keep)
    assert sorted(key for key, _ in cache.items()) == [0, 2, 4]
