"""The switch engine as a careless user meets it: schedule names no schedule has, spec files
with odd switch fields, odd shapes through the cpu stand-in (``HostSwitchComm``) at P = 2..5,
a stand-in used after it is closed, two on one group, one used after its group is destroyed,
and ranks that die while the stand-ins are made: nothing is left in /dev/shm."""

import glob
import math
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ficco_select import costs
from ficco_select.executor import ranks
from ficco_select.executor.operators import TOLERANCE, build_operator, relative_error
from ficco_select.executor.peer import HostPeerMemory
from ficco_select.executor.switch import HostSwitchComm
from ficco_select.hardware import HardwareError, load_hardware, presets_dir
from ficco_select.scenario import Scenario
from ficco_select.schedule import SWITCH_OPS, ScheduleError, all_schedules, is_legal, parse

# -- names ----------------------------------------------------------------------------------------
TOKENS = ["none", "shard", "ficco", "ring", "a2a", "gemm_per_piece", "gemm_per_step", "m", "n", "sm", "dma",
          "switch", "d2", "d4", "d0", "d-2", "d³", "d٣", "d２", "", "SWITCH", " switch"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=7))
def test_parse_gives_the_schedule_of_that_name_or_a_schedule_error(tokens):
    name = ".".join(tokens)
    try:
        schedule = parse(name)
    except ScheduleError:
        return
    assert schedule.name == name  # before: 'ficco.d٣...' parsed as d3, 'ficco.d³...' raised int()'s ValueError


@pytest.mark.parametrize("name", ["ficco.d³.a2a.gemm_per_step.m.switch", "ficco.d٣.a2a.gemm_per_step.m.switch",
                                  "ficco.d２.a2a.gemm_per_step.m.switch"])
def test_a_degree_in_other_digits_is_not_a_schedule(name):
    with pytest.raises(ScheduleError, match="invalid schedule name"):
        parse(name)


# -- spec files -----------------------------------------------------------------------------------
BASE = yaml.safe_load((presets_dir() / "h100-nvswitch.yaml").read_text())
ODD = {"switch_reduce": ["true", "yes", 1, 0, None, []],
       "switch_bw_gbps": [math.nan, math.inf, -1, 1e308, "fast", None],
       "switch_latency_us": [math.nan, -1, 1e308, "slow", None],
       "provenance": ["measured", ["switch_bw_gbps"], {"switch_bw_gbps": "guessed"}, {"nonsense": "measured"},
                      {"switch_bw_gbps": None}]}
CASES = [(field, value) for field, values in ODD.items() for value in values]


@pytest.mark.parametrize("field, value", CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_an_odd_switch_field_is_refused_naming_the_file_and_field(tmp_path, field, value):
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump({**BASE, "name": "odd", field: value}))
    with pytest.raises(HardwareError, match=rf"{path}: field '{field}"):
        load_hardware(path)


@pytest.mark.parametrize("switch_reduce, bw, latency", [(True, 0, 5.0), (True, 1e-9, 0), (False, 0, 0),
                                                        (False, 300, 2.0), (True, 1e6, 1e7)])
def test_a_switch_spec_is_refused_or_gives_finite_times(tmp_path, switch_reduce, bw, latency):
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump({**BASE, "name": "odd", "switch_reduce": switch_reduce,
                                    "switch_bw_gbps": bw, "switch_latency_us": latency}))
    if switch_reduce and not bw:
        with pytest.raises(HardwareError, match="field 'switch_bw_gbps' must be above 0 where switch_reduce"):
            load_hardware(path)
        return
    spec = load_hardware(path)
    assert ("switch" in spec.engines) == switch_reduce
    times = costs.switch_collective_time(spec, np.array([0, 1, 4]), np.array([0.0, 1.0, 1e9]), 8)
    assert times[0] == 0 and (np.isfinite(times).all() if switch_reduce else True)


# -- odd shapes through the stand-in ----------------------------------------------------------------
SHAPES = [(1, 1, 1), (1, 2, 1), (1, 1, 3), (2, 1, 1), (3, 5, 1), (5, 1, 2)]
"""(m, n, k) per rank: m rows per rank (1: a piece smaller than any degree), n = 1 (fewer
columns than any degree), k = 1."""


def odd_shapes(rank: int, P: int) -> int:
    comms = [HostSwitchComm(dist.group.WORLD, timeout_s=30),
             HostSwitchComm(dist.group.WORLD, slots=1, slot_bytes=4 * P * 4, timeout_s=30)]  # 4 fp32 per part
    failures, runs = [], 0
    try:
        for comm in comms:
            for op in SWITCH_OPS:
                for dtype in ("float32", "bfloat16"):
                    for m, n, k in SHAPES:
                        s = Scenario(op=op, m=m * P, n=n * P, k=k * P, group="odd", dtype=dtype, world_size=P,
                                     hardware="cpu")
                        # before: gemm_rs and gemm_ar with n below a degree failed to build (KeyError)
                        operator = build_operator(s, comm, seed=2)
                        ref = operator.reference()
                        for x in all_schedules(P, engines=("switch",)):
                            if not is_legal(x, s, "cuda"):
                                continue
                            operator.poison()
                            err = relative_error(operator.run(x), ref)
                            runs += 1
                            if not err <= TOLERANCE[dtype]:
                                failures.append(f"{op} {dtype} {m * P}x{n * P}x{k * P} {x.name}: {err:.3g}")
    finally:
        for comm in comms:
            comm.close()
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    return runs


@pytest.mark.gloo
@pytest.mark.parametrize("P", [2, 3, 5])
def test_odd_shapes_run_every_legal_switch_schedule(P):
    runs = ranks.run_ranks(odd_shapes, P, (), timeout_s=240)
    assert runs[0] > 0 and len(set(runs)) == 1


# -- the stand-in's life ---------------------------------------------------------------------------
def life(rank: int, P: int) -> dict:
    out = {}
    a = HostSwitchComm(dist.group.WORLD, timeout_s=30)
    b = HostSwitchComm(dist.group.WORLD, timeout_s=30)  # a second one on the same group
    xs = [torch.full((5,), float(rank)), torch.full((3,), 10.0 * rank)]
    works_a, works_b = a.start_all_reduce([xs[0]], 0), b.start_all_reduce([xs[1]], 0)
    b.wait(works_b)
    a.wait(works_a)
    out["two"] = [xs[0].tolist(), xs[1].tolist()]
    a.close()
    a.close()  # twice: harmless
    t0 = time.monotonic()
    try:
        a.start_all_reduce([torch.ones(2)], 1)
        out["closed"] = "no error"
    except RuntimeError as e:  # before: no error here, then a wait of the whole timeout (31 s)
        out["closed"] = str(e)
    out["closed_s"] = time.monotonic() - t0
    dist.barrier()
    dist.destroy_process_group()  # b stays usable: it speaks shared memory only
    y = torch.full((4,), rank + 1.0)
    b.wait(b.start_all_reduce([y], 2))
    out["after_destroy"] = y.tolist()
    b.close()
    dist.init_process_group("gloo", store=dist.PrefixStore("again", ranks.rendezvous()), rank=rank, world_size=P)
    return out


@pytest.mark.gloo
def test_a_closed_stand_in_refuses_at_once_and_two_share_a_group():
    P = 3
    for rank, out in enumerate(ranks.run_ranks(life, P, (), timeout_s=120)):
        total = sum(range(P))
        assert out["two"] == [[float(total)] * 5, [10.0 * total] * 3]
        assert out["closed"] == f"rank {rank}: this switch comm is closed; make a new one"
        assert out["closed_s"] < 5
        assert out["after_destroy"] == [float(sum(range(1, P + 1)))] * 4


def dies_while_made(rank: int, P: int, kind: str) -> None:
    real = dist.barrier

    def barrier(*args, **kwargs):  # rank 1 dies at its first barrier, as a killed rank would
        if rank == 1:
            os._exit(7)
        return real(*args, **kwargs)

    dist.barrier = barrier
    HostSwitchComm(dist.group.WORLD, timeout_s=30) if kind == "switch" else HostPeerMemory(dist.group.WORLD)


def _ours() -> set[str]:
    return set(glob.glob("/dev/shm/ficco-switch-*") + glob.glob("/dev/shm/ficco-peer-*"))


@pytest.mark.gloo
@pytest.mark.parametrize("kind", ["switch", "peer"])
def test_a_rank_dying_while_the_stand_in_is_made_leaves_nothing_in_dev_shm(kind):
    before = _ours()
    with pytest.raises(ranks.RankError, match="rank 1 died"):
        ranks.run_ranks(dies_while_made, 3, (kind,), timeout_s=60)
    time.sleep(0.5)  # another test's stand-in, made meanwhile, holds its file for microseconds
    left = _ours() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"  # before: every rank's file
