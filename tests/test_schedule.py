"""The schedule vocabulary: names, parsing, legality, candidates."""

import itertools

import pytest

from ficco_select import Scenario, ScheduleError, candidates, parse
from ficco_select.hardware import load_hardware
from ficco_select.schedule import (BACKENDS, BASELINE, SHARD, Schedule, all_schedules, backend_problem, degrees,
                                   engines_on, is_legal)


@pytest.mark.parametrize("P", range(2, 9))
def test_every_schedule_name_round_trips(P):
    schedules = all_schedules(P)
    names = [s.name for s in schedules]
    assert len(set(names)) == len(names)
    for s in schedules:
        assert parse(s.name) == s
        assert hash(parse(s.name)) == hash(s)


def test_names_are_stable():
    assert BASELINE.name == "none.sm"
    assert SHARD.name == "shard.ring.sm"
    s = Schedule(granularity="ficco", degree=4, pattern="a2a", compute="gemm_per_step", split="m", engine="dma")
    assert s.name == "ficco.d4.a2a.gemm_per_step.m.dma"


@pytest.mark.parametrize("bad", ["", "none", "none.gpu", "shard.a2a.sm", "ficco.d1.ring.gemm_per_piece.m.sm",
                                 "ficco.dx.ring.gemm_per_piece.m.sm", "ficco.d2.mesh.gemm_per_piece.m.sm",
                                 "ficco.d2.ring.gemm_per_piece.k.sm", "ficco.d2.ring.gemm_per_piece.m"])
def test_bad_names_are_refused(bad):
    with pytest.raises(ScheduleError):
        parse(bad)


def test_degrees_include_p():
    assert degrees(2) == (2, 4)
    assert degrees(3) == (2, 3, 4)
    assert degrees(8) == (2, 4, 8)


def scenario(op="ag_gemm", m=64, n=64, k=64, P=2, **kw):
    return Scenario(group="t", op=op, m=m, n=n, k=k, dtype="float32", world_size=P, hardware="cpu", **kw)


def test_cpu_candidates_are_legal_sm_only_and_start_with_baseline():
    for op in ("ag_gemm", "gemm_rs", "a2a_gemm"):
        for P in (2, 3, 4):
            s = scenario(op=op, m=48 * P, n=12 * P, k=8 * P, P=P)
            cands = candidates(s, "cpu")
            assert cands[0] == BASELINE and SHARD in cands
            assert all(c.engine == "sm" and is_legal(c, s, "cpu") for c in cands)
            assert {c.degree for c in cands if c.granularity == "ficco"} == set(degrees(P))
    # cuda and sim also offer the dma engine
    assert any(c.engine == "dma" for c in candidates(scenario(), "sim"))


def test_legality_rules():
    two = candidates(scenario(P=2), "cpu")
    assert not any(c.pattern == "a2a" for c in two), "at P=2 the a2a pattern is the ring"
    rs = candidates(scenario(op="gemm_rs", P=3, m=48, k=48), "cpu")
    assert any(c.split == "n" for c in rs)
    assert not any(c.split == "n" and c.compute == "gemm_per_step" for c in rs)
    assert not any(c.split == "n" for c in candidates(scenario(op="ag_gemm"), "cpu"))
    moe = candidates(scenario(op="a2a_gemm", P=3, imbalance=2.0), "cpu")
    assert not any(c.pattern == "a2a" and c.compute == "gemm_per_step" for c in moe)
    # shards too small for d pieces: 6 rows per shard allow d=2 and d=4 but not d=8
    tiny = candidates(scenario(m=48, n=8, P=8), "cpu")
    assert {c.degree for c in tiny if c.granularity == "ficco"} == {2, 4}
    # a shard of one row cannot be split at all
    assert candidates(scenario(m=2, P=2), "cpu") == [BASELINE, SHARD]


# -- the cached candidate lists equal the uncached enumeration -------------------------------
def enumerate_candidates(s, backend, spec=None):
    """``candidates`` as it was before its cache: ``is_legal`` on every schedule of the space,
    on the spec's engines (without one, every engine of the backend but the switch)."""
    if backend_problem(s, backend) is not None:
        return []
    engines = engines_on(backend, spec) if spec is not None else tuple(e for e in BACKENDS[backend].engines
                                                                        if e != "switch")
    return [c for c in all_schedules(s.world_size, engines) if is_legal(c, s, backend)]


def candidate_grid():
    """All ops, P = 2..8 and a few large, extents from 1 to far past every degree, a2a imbalance."""
    out = []
    for P in (*range(2, 9), 16, 1024, 2048):
        for op in ("ag_gemm", "gemm_rs", "a2a_gemm"):
            for rows in sorted({1, 2, 3, 4, 5, 7, 8, 9, P - 1, P, P + 1, 1000}):  # m // P
                for m in (rows * P, rows * P + P - 1) if op == "a2a_gemm" else (rows * P,):
                    # n matters to gemm_rs only (its n-split): the others try two
                    ns = sorted({1, 2, 3, 4, 5, 7, 8, 9, P - 1, P, P + 1, 4096}) if op == "gemm_rs" else (1, 5)
                    for n in ns:
                        imbalances = (1.0, float(P)) if op == "a2a_gemm" else (1.0,)
                        for imb, dtype in itertools.product(imbalances, ("float32", "float16")):
                            out.append(Scenario(group="g", op=op, m=m, n=n * P if op == "ag_gemm" else n,
                                                k=8 * P, dtype=dtype, world_size=P, hardware="h100-nvswitch",
                                                imbalance=imb))
    return out


GRID = candidate_grid()


@pytest.mark.parametrize("order", ["forward", "reversed", "shuffled"])
def test_candidates_equal_the_uncached_enumeration_on_a_grid(order, monkeypatch):
    import random

    from ficco_select import schedule as schedule_module

    monkeypatch.setattr(schedule_module, "_LEGAL", {})  # start cold: the order of first sight varies
    grid = GRID[::-1] if order == "reversed" else random.Random(0).sample(GRID, len(GRID)) if order == "shuffled" \
        else GRID
    backends = (*BACKENDS, "tpu")  # an unknown backend: no candidates
    specs = (None, load_hardware("h100-nvswitch"), load_hardware("a100-nvswitch"))  # with and without the switch
    seen = set()
    for s in grid:
        for backend, spec in itertools.product(backends, specs):
            if backend == "tpu" and spec is not None:
                continue
            got = candidates(s, backend, spec)
            want = enumerate_candidates(s, backend, spec)
            assert got == want, f"{s} on {backend}, {spec and spec.name}"
            assert [c.name for c in got] == [c.name for c in want]  # the same order, by name
            assert schedule_module.legal_candidates(s, backend, spec) == tuple(want)
            seen.add(len(want))
    assert 0 in seen and len(seen) > 10, "the grid must reach empty, tiny and full candidate lists"


def test_candidates_returns_a_fresh_list_each_call():
    s = scenario(P=4, m=64)
    first = candidates(s, "sim")
    first.clear()
    assert candidates(s, "sim") == enumerate_candidates(s, "sim") != []


# -- the switch engine ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shard.ring.switch", "ficco.d2.ring.gemm_per_step.m.switch",
                                  "ficco.d2.a2a.gemm_per_piece.n.switch"])
def test_the_switch_has_no_ring_and_no_column_pieces(name):
    with pytest.raises(ScheduleError, match="engine 'switch' reaches every peer at once"):
        parse(name)


def test_the_switch_runs_where_the_fabric_reduces_in_it_and_only_the_collectives_it_can_carry():
    h100, a100 = load_hardware("h100-nvswitch"), load_hardware("a100-nvswitch")
    for op in ("ag_gemm", "gemm_rs", "gemm_ar", "a2a_gemm", "gemm_a2a"):
        s = scenario(op=op, P=4, m=256, imbalance=1.5 if op in ("a2a_gemm", "gemm_a2a") else 1.0)
        on_h100 = [c.name for c in candidates(s, "sim", h100) if c.engine == "switch"]
        carries = op in ("ag_gemm", "gemm_rs", "gemm_ar")
        assert bool(on_h100) == carries, (op, on_h100)
        if carries:
            assert on_h100[0] == "none.switch" and all(".a2a." in n and ".m." in n for n in on_h100[1:])
        assert not [c for c in candidates(s, "sim", a100) if c.engine == "switch"]  # no SHARP on A100
        assert not [c for c in candidates(s, "sim") if c.engine == "switch"]  # no spec: no switch
    assert [parse(n).name for n in ("none.switch", "ficco.d4.a2a.gemm_per_step.m.switch")] == \
        ["none.switch", "ficco.d4.a2a.gemm_per_step.m.switch"]
