"""The hook learns from the job (``configure(learn=True)``, ``runtime/learning.py``) on real
gloo ranks: every rank runs the same contender at every call, also where the ranks' own
timings disagree; a shape settles within its bound and its result stays right; the next
job on the machine starts from the record."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ficco_select.runtime import dispatch, learning, torch_ops
from ficco_select.runtime.selector import Selector
from ficco_select.schedule import BASELINE, parse
from helpers.ranks import check_close, rand, spawn

pytestmark = pytest.mark.gloo

CALLS = 40
SHAPE = (24, 16)  # A (rows, k_local) @ B (k_local, 12), rows scattered: gemm_rs m=24 n=12 k=16P
N = 12


class _Wide(Selector):
    """The heuristic, checked against three rivals (on the cpu preset the heuristic's own
    contenders are its pick and the baseline: one contender where they agree)."""

    def contenders(self, scenario, decision):
        rivals = ("shard.ring.sm", "ficco.d2.a2a.gemm_per_step.m.sm", "ficco.d3.ring.gemm_per_step.m.sm")
        return tuple(dict.fromkeys((decision.schedule, *map(parse, rivals), BASELINE)))


def _learning(tmp: Path) -> None:
    torch_ops.configure(selector=_Wide(), learn=True, learn_dir=tmp / "record", telemetry=str(tmp / "t{rank}.jsonl"))


def _skewed(rank: int) -> None:
    """This rank's clock reads one contender far slower than it ran (rank 1: the first, rank 2:
    the second): the ranks' own timings disagree on the fastest."""
    if rank == 0:
        return
    observe = learning.Trial.observe

    def slow(self, i, elapsed):
        return observe(self, i, elapsed * 20 if i == rank - 1 else elapsed)

    learning.Trial.observe = slow


def _rs_calls(rank: int, P: int, tmp: Path, calls: int = CALLS) -> list[str]:
    """`calls` matmul reduce-scatters of one shape, each checked against PyTorch's; the
    schedules they ran, in order (from this rank's telemetry)."""
    gen = torch.Generator().manual_seed(7 + rank)
    group = dist.group.WORLD
    A, B = rand(gen, *SHAPE), rand(gen, SHAPE[1], N)
    want = symm_mem._fused_matmul_reduce_scatter_fallback(A, B, "sum", 0, group.group_name)
    failures = []
    for c in range(calls):
        got = torch_ops.matmul_reduce_scatter(A, B, "sum", 0, group.group_name)
        check_close(got, want, torch.float32, f"call {c}", failures)
    assert not failures, failures[:3]
    lines = [json.loads(line) for line in (tmp / f"t{rank}.jsonl").read_text().splitlines()]
    return [line["schedule"] for line in lines]


def _learns_the_same_on_every_rank(rank: int, P: int, tmp: Path) -> None:
    _learning(tmp)
    _skewed(rank)
    ran = _rs_calls(rank, P, tmp)
    (tmp / f"ran{rank}.json").write_text(json.dumps({"ran": ran, "report": dispatch.report()}))


def test_every_rank_runs_the_same_contender_at_every_call_when_their_timings_disagree(tmp_path):
    spawn(_learns_the_same_on_every_rank, 3, tmp_path)
    got = [json.loads((tmp_path / f"ran{r}.json").read_text()) for r in range(3)]
    assert got[0]["ran"] == got[1]["ran"] == got[2]["ran"], [g["ran"][:12] for g in got]
    (shape,) = got[0]["report"]
    assert [g["report"] for g in got[1:]] == [got[0]["report"]] * 2  # the agreed times, the same numbers
    assert len(shape["contenders"]) > 1
    assert shape["settled"] is not None
    n = len(shape["contenders"])
    assert shape["explored_calls"] <= learning.MAX_ROUNDS * learning.CALLS_PER_ROUND * n
    # Settled: every later call runs the settled contender.
    assert set(got[0]["ran"][shape["explored_calls"]:]) == {shape["settled"]}
    # The skew made ranks 1 and 2 read their contender 20x slower; the slowest rank's times
    # decide, so neither of those two is kept unless it was the only one left.
    agreed = shape["agreed_s"]
    finite = [t for t in agreed if t is not None and math.isfinite(t)]
    assert agreed[shape["contenders"].index(shape["settled"])] == min(finite)


def test_a_shape_that_settles_then_runs_without_the_trial(tmp_path):
    spawn(_learns_then_plans, 2, tmp_path)


def _learns_then_plans(rank: int, P: int, tmp: Path) -> None:
    _learning(tmp)
    _rs_calls(rank, P, tmp)
    ctx = dispatch.context(dist.group.WORLD)
    assert not ctx.trials
    ((key, plan),) = ctx.plans.items()
    assert plan.trial is None and plan.decision.source == "learned", plan.decision
    assert "measured fastest in this job" in plan.decision.reason


def _starts_from_the_record(rank: int, P: int, tmp: Path) -> None:
    _learning(tmp)
    _rs_calls(rank, P, tmp, calls=1)
    assert not dispatch.report()  # nothing learns: the shape's choice came from the record
    ((key, plan),) = dispatch.context(dist.group.WORLD).plans.items()
    assert plan.decision.source == "learned" and "earlier job" in plan.decision.reason, plan.decision
    (tmp / f"next{rank}.json").write_text(json.dumps(plan.decision.schedule.name))


def test_the_next_job_on_the_machine_starts_from_what_the_last_one_measured(tmp_path):
    spawn(_learns_the_same_on_every_rank, 2, tmp_path)
    settled = json.loads((tmp_path / "ran0.json").read_text())["report"][0]["settled"]
    (record,) = (tmp_path / "record").glob("*.json")
    assert settled == next(iter(json.loads(record.read_text())["shapes"].values()))["schedule"]
    for rank in range(2):
        (tmp_path / f"t{rank}.jsonl").unlink()
    spawn(_starts_from_the_record, 2, tmp_path)
    assert [json.loads((tmp_path / f"next{r}.json").read_text()) for r in range(2)] == [settled] * 2


def _trial(*names: str) -> learning.Trial:
    from ficco_select.scenario import Scenario

    scenario = Scenario(group="g", op="gemm_rs", m=24, n=12, k=48, dtype="float32", world_size=3, hardware="cpu")
    return learning.Trial(scenario, tuple(map(parse, names)), torch.device("cpu"))


def test_a_contender_slower_than_the_baseline_goes_at_its_first_round_and_halving_waits_for_the_second():
    trial = _trial("shard.ring.sm", "ficco.d2.a2a.gemm_per_step.m.sm", "ficco.d3.ring.gemm_per_step.m.sm", "none.sm")
    trial.rounds = 1
    # 4% slower than the baseline: out; 2% slower: kept; no lead of 10%: no early settling.
    assert trial._survivors([1.04, 0.95, 1.02, 1.0]) == [1, 3, 2]
    trial.rounds = 2
    assert trial._survivors([1.04, 0.95, 1.02, 1.0]) == [1, 3]
    # A lead of 10% over every other settles at once; a wrong contender (inf) is out.
    trial.rounds = 1
    assert trial._survivors([math.inf, 0.8, 0.95, 1.0]) == [1]
    # Nothing right and timed: the baseline, PyTorch's own.
    assert trial._survivors([math.inf, math.nan, math.inf, math.inf]) == [3]


class _NoBaseline(Selector):
    def contenders(self, scenario, decision):  # a caller's selector that leaves the baseline out
        return (parse("shard.ring.sm"), parse("ficco.d2.a2a.gemm_per_step.m.sm"))


def _learns_without_a_named_baseline(rank: int, P: int, tmp: Path) -> None:
    torch_ops.configure(selector=_NoBaseline(), learn=True, learn_dir=tmp / "record",
                        telemetry=str(tmp / "t{rank}.jsonl"))
    _rs_calls(rank, P, tmp)
    (shape,) = dispatch.report()
    assert "none.sm" in shape["contenders"] and shape["settled"] is not None, shape


def test_the_baseline_races_even_where_the_selector_leaves_it_out(tmp_path):
    spawn(_learns_without_a_named_baseline, 2, tmp_path)
