"""The runtime selector from many threads: every answer is the one-thread answer.

Autograd runs the backward in its own thread and a server decides from many request
threads, so ``Selector.select`` is called concurrently on fresh Scenario objects and dicts
while its caches fill, start over (their bounds made tiny here, so that they do many
times a second) and are cleared.
"""

from __future__ import annotations

import random
import sys
import threading

import pytest

import ficco_select.runtime.layers as layers_module
import ficco_select.runtime.selector as selector_module
from ficco_select.runtime.selector import Selector
from ficco_select.scenario import Scenario
from ficco_select.schedule import is_legal

LAYERS = [
    dict(group="g", op="ag_gemm", n=4096, k=4096, dtype="bfloat16", world_size=8, hardware="h100-nvswitch"),
    dict(group="g", op="gemm_rs", n=8192, k=28672, dtype="bfloat16", world_size=2, hardware="mi300x-8"),
    dict(group="g", op="a2a_gemm", n=2048, k=4096, dtype="float16", world_size=4, hardware="a100-nvswitch",
         imbalance=1.5),
]
MS = [8 * i for i in range(1, 257)]
CALLS_PER_THREAD = 1500
EVICTING_CALLS = 150


def _calls(seed: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(len(LAYERS)), rng.choice(MS)) for _ in range(n)]


@pytest.mark.parametrize("tables", [True, False])
def test_eight_threads_get_the_one_thread_answers(monkeypatch, tables):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: races show in seconds
    one, shared = Selector(layer_tables=tables), Selector(layer_tables=tables)
    expected = {(i, m): one.select(Scenario(**layer, m=m)).schedule for i, layer in enumerate(LAYERS) for m in MS}

    wrong, illegal, done = [], [], []

    def work(seed: int) -> None:
        # A fixed count, not a time: a loaded machine runs the same races, only slower.
        count = 0
        for i, m in _calls(seed, CALLS_PER_THREAD):
            scenario = Scenario(**LAYERS[i], m=m)  # a fresh object: ids are reused as objects die
            as_dict = count % 3 == 0
            decision = shared.select(scenario.as_record() if as_dict else scenario)
            if decision.schedule != expected[i, m]:
                wrong.append((i, m, decision.schedule.name, expected[i, m].name))
                if not is_legal(decision.schedule, scenario, "sim"):
                    illegal.append((i, m, decision.schedule.name))
            count += 1
            if seed == 0 and count % 250 == 0:
                shared.clear_cache()
        done.append(count)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.setswitchinterval(interval)
    assert done == [CALLS_PER_THREAD] * 8
    assert not illegal, illegal[:5]
    assert not wrong, wrong[:5]


def test_a_batch_of_rows_silences_its_own_thread_only(caplog):
    # decide_rows (``ficco select``) reports each row's fallback itself, so its warnings are
    # off; a thread deciding meanwhile keeps its own. Changing the logger's level for the
    # batch dropped the other thread's warning.
    import logging

    from ficco_select.runtime.batch import decide_rows
    from ficco_select.runtime.selector import log

    inside, carry_on = threading.Event(), threading.Event()

    def rows():
        yield {**LAYERS[0], "m": 4096, "hardware": "no-such-machine"}  # a fallback, with its reason
        inside.set()
        carry_on.wait(10)
        yield {**LAYERS[0], "m": 0}

    caplog.set_level(logging.WARNING, logger=log.name)
    decided = []
    batch = threading.Thread(target=lambda: decided.extend(decide_rows(Selector(), rows())))
    batch.start()
    assert inside.wait(10)
    log.warning("another thread's warning")
    carry_on.set()
    batch.join(10)
    assert [d["source"] for d in decided] == ["fallback", "fallback"], decided
    warned = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert warned == ["another thread's warning"], warned


def test_eight_threads_deciding_while_tables_are_built_and_evicted_see_whole_tables_only(monkeypatch):
    from ficco_select.runtime.layers import m_grid

    # Three layers' tables, built before the threads start, fill the three places kept. A quarter
    # of the way in, a ninth thread builds a fourth layer's: every table is evicted, and the eight
    # deciding threads build them again, each from whatever m it meets (each thread that
    # misses a table builds it: the documented race). Every decision is the direct one, at
    # the grid points and between them; nothing raises.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # often enough for races, seldom enough for table builds to finish
    monkeypatch.setattr(layers_module, "MEMO_LIMIT", 64)
    monkeypatch.setattr(selector_module, "_TABLES_LIMIT", len(LAYERS))
    direct, shared = Selector(layer_tables=False), Selector(layer_tables=True)
    grid = {}
    for i, layer in enumerate(LAYERS):
        table = shared.layer_table(Scenario(**layer, m=8))
        grid[i] = set(m_grid(table.grid[0], table.grid[-1], table.step)) & set(MS)
        assert grid[i], layer
    expected = {(i, m): direct.select(Scenario(**layer, m=m)).schedule for i, layer in enumerate(LAYERS) for m in MS}

    wrong, illegal, errors, done = [], [], [], []
    calls = [_calls(seed, EVICTING_CALLS) for seed in range(8)]
    progress, quarter_done = [0] * 8, threading.Event()
    decided_at_eviction = []

    def decide(seed: int) -> None:
        count = 0
        try:
            for i, m in calls[seed]:
                decision = shared.select(Scenario(**LAYERS[i], m=m))
                if not is_legal(decision.schedule, Scenario(**LAYERS[i], m=m), "sim"):
                    illegal.append((i, m, decision.schedule.name))
                elif decision.schedule != expected[i, m]:
                    wrong.append((i, m, decision.schedule.name, expected[i, m].name, decision.reason))
                count += 1
                progress[seed] = count
                if sum(progress) >= 2 * EVICTING_CALLS:
                    quarter_done.set()
        except Exception as e:  # noqa: BLE001 - select never raises: any exception is the failure
            errors.append(repr(e))
        done.append(count)

    def evict() -> None:
        # By progress, not by the clock: the eviction falls among the calls however loaded the machine.
        quarter_done.wait(600)
        decided_at_eviction.append(sum(progress))
        shared.layer_table(Scenario(**{**LAYERS[0], "n": 2048}, m=8))
        shared.clear_cache()

    threads = [threading.Thread(target=decide, args=(seed,)) for seed in range(8)]
    threads.append(threading.Thread(target=evict))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert done == [EVICTING_CALLS] * 8
    assert decided_at_eviction and decided_at_eviction[0] < 6 * EVICTING_CALLS  # evicted among the calls
    assert not illegal, illegal[:5]
    assert not wrong, wrong[:5]
