"""The schedule vocabulary: names, parsing, legality, candidates."""

import pytest

from ficco_select import Scenario, ScheduleError, candidates, parse
from ficco_select.schedule import BASELINE, SHARD, Schedule, all_schedules, degrees, is_legal


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
