"""A rank launcher killed with SIGKILL takes its ranks with it and leaves nothing on disk.

Real processes: a launcher (``measure_spawned`` in a child python) is killed with
``kill -9``, either while its ranks measure or while they are still importing torch. Rank
1 hangs at the second scenario, so ranks left behind would otherwise wait for the process
group timeout (minutes).
"""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Tier: real ranks (processes over gloo); deselect with -m "not gloo"
pytestmark = [pytest.mark.gloo, pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")]

REPO = Path(__file__).resolve().parents[1]

LAUNCHER = """
from ficco_select.data.measure.gloo import MeasureConfig, measure_spawned
from ficco_select.scenario import Scenario

shape = dict(op="ag_gemm", m=64, n=64, k=64, dtype="float32", world_size=2, hardware="cpu")
measure_spawned([Scenario(group="t", **shape), Scenario(group="stall", **shape)],
                MeasureConfig(reps=5, warmup=0, max_remeasure=0, timeout_s=300, fault="hang@1/stall"),
                on_scenario=lambda rows: print("scenario measured", flush=True))
"""


def start_launcher(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """The launcher, with its own empty TMPDIR (where a file rendezvous would go)."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    log = open(tmp_path / "launcher.log", "w")
    env = dict(os.environ, TMPDIR=str(tmpdir))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    return launcher, tmpdir


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from the state field on (index 0: state, 1: ppid, 19: start time)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces


def ranks_of(launcher_pid: int) -> list[tuple[int, str]]:
    """The launcher's spawned ranks, as (pid, start time): a reused pid is not mistaken for one."""
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields is None or int(fields[1]) != launcher_pid:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"spawn_main" in cmdline:  # not multiprocessing's resource tracker
            ranks.append((int(entry.name), fields[19]))
    return ranks


def running(rank: tuple[int, str]) -> bool:
    # A zombie has ended: whoever adopted it may not reap it soon.
    fields = stat_fields(rank[0])
    return fields is not None and fields[19] == rank[1] and fields[0] not in ("Z", "X")


def wait_for(condition, timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def kill_launcher(launcher: subprocess.Popen) -> None:
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)


def kill_leftovers(ranks) -> None:
    """Kill the ranks a failing run left behind (this test's own processes only)."""
    for rank in ranks:
        if running(rank):
            os.kill(rank[0], signal.SIGKILL)


def launcher_log(tmp_path: Path) -> str:
    return (tmp_path / "launcher.log").read_text()[-3000:]


def assert_killing_it_leaves_nothing(launcher, ranks, tmpdir: Path, tmp_path: Path, timeout_s: float) -> None:
    """kill -9 the launcher: its ranks must be gone within timeout_s, its TMPDIR empty."""
    kill_launcher(launcher)
    gone = wait_for(lambda: not any(map(running, ranks)), timeout_s=timeout_s)
    kill_leftovers(ranks)
    assert gone, f"ranks outlived their launcher by {timeout_s} s\n{launcher_log(tmp_path)}"
    assert list(tmpdir.iterdir()) == [], "the killed launcher left files in TMPDIR"


def test_ranks_of_a_launcher_killed_while_measuring_die_and_nothing_is_left_on_disk(tmp_path):
    launcher, tmpdir = start_launcher(tmp_path)
    try:
        # The first scenario reported: the ranks have joined the process group and measure.
        ready, _, _ = select.select([launcher.stdout], [], [], 90)
        assert ready and launcher.stdout.readline().strip() == "scenario measured", \
            launcher_log(tmp_path)
        ranks = ranks_of(launcher.pid)
        assert len(ranks) == 2
    except BaseException:
        launcher.kill()
        launcher.wait()
        raise
    assert_killing_it_leaves_nothing(launcher, ranks, tmpdir, tmp_path, timeout_s=5)


def test_ranks_of_a_launcher_killed_while_they_start_die_once_started(tmp_path):
    launcher, tmpdir = start_launcher(tmp_path)
    try:
        # Both ranks exist but are still importing torch (seconds): the launcher dies
        # before they could ask the kernel to kill them with it.
        assert wait_for(lambda: len(ranks_of(launcher.pid)) == 2, timeout_s=60, poll_s=0.01), \
            launcher_log(tmp_path)
        ranks = ranks_of(launcher.pid)
    except BaseException:
        launcher.kill()
        launcher.wait()
        raise
    # Importing torch takes a few seconds on a busy 2-core machine; a rank left behind
    # would wait for its dead launcher's rendezvous or its hung peer for minutes.
    assert_killing_it_leaves_nothing(launcher, ranks, tmpdir, tmp_path, timeout_s=20)
