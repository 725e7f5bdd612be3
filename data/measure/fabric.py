"""Shaped fabrics: the cpu backend's gloo ranks on a loopback whose rate ``tc`` limits.

A fabric is a machine of its own (``cpu-500mbit``): the same cores, a slower network. The
measuring process re-executes itself inside a private network namespace (``unshare
--net``), brings that namespace's loopback up and shapes it with a token bucket (``tc
qdisc replace dev lo root tbf rate RATE``); the ranks it spawns, their rendezvous and every
byte they exchange stay in it. The namespace lives exactly as long as the processes in it,
so no exit path (``kill -9`` of the measuring process included: its ranks die with it)
leaves a namespace or a qdisc behind, and the host's own loopback is never touched.

A quick profile of the fabric (``profile_fabric``: two gloo ranks sending messages of a
few sizes back and forth) measures what the token bucket really lets through, its link
bandwidth and per-message latency. The fabric's spec is the host's ``cpu`` spec (the same
cores) with those two numbers; ``ficco sim calibrate`` on the fabric's own rows refits it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from typing import NoReturn

FABRIC_ENV = "FICCO_FABRIC"
"""Set inside the namespace to the rate it was shaped to: the re-executed command knows it
is inside, and which fabric it measures."""
OUTER_ENV = "FICCO_FABRIC_OUTER_NAMESPACE"
"""The namespace the fabric was made from: a process still in it is not inside the fabric."""

BURST = "256kb"
"""Token bucket depth: a few TCP segments' worth at the shaped rate, so the rate holds over
milliseconds (a deeper bucket lets a whole small message through at loopback speed)."""
QUEUE_LATENCY = "50ms"
"""How long a packet may wait in the bucket's queue before tbf drops it (TCP resends)."""

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class FabricError(ValueError):
    """A fabric cannot be made here, or its rate is not one; says which and why, in one line."""


@dataclasses.dataclass(frozen=True)
class Fabric:
    rate: str
    """tc's spelling, lower case: ``500mbit``, ``2gbit``."""
    bits_per_s: float

    @property
    def name(self) -> str:
        """The machine's name in rows and specs."""
        return f"cpu-{self.rate}"

    @property
    def gbytes_per_s(self) -> float:
        return self.bits_per_s / 8e9

    def tc_command(self) -> list[str]:
        return ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", self.rate,
                "burst", BURST, "latency", QUEUE_LATENCY]

    def describe(self) -> str:
        return f"this host's cpu on a loopback shaped by tc tbf rate {self.rate} burst {BURST} latency {QUEUE_LATENCY}"


def parse_fabric(text: str) -> Fabric:
    """``500mbit`` / ``2gbit`` / ``800kbit`` -> Fabric; FabricError naming the option otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*", str(text).lower())
    if not match:
        raise FabricError(f"--fabric {text!r}: expected a rate as tc writes it, a number and kbit, mbit or gbit "
                          "(for example 500mbit or 2gbit)")
    number, unit = float(match.group(1)), match.group(2)
    bits = number * _UNITS[unit]
    if not 1e6 <= bits <= 1e11:
        raise FabricError(f"--fabric {text!r}: {bits / 1e6:g} Mbit/s is outside 1 Mbit/s .. 100 Gbit/s")
    rate = f"{number:g}{unit}"
    return Fabric(rate=rate, bits_per_s=bits)


def inside() -> Fabric | None:
    """The fabric this process was re-executed into, or None outside one (also where the
    variables were inherited or set by hand, but this is the namespace they came from)."""
    rate, outer = os.environ.get(FABRIC_ENV), os.environ.get(OUTER_ENV)
    return parse_fabric(rate) if rate and outer and _namespace() != outer else None


def check_permitted() -> None:
    """FabricError, in one line, unless this machine lets us make a shaped namespace: run the
    whole recipe once in a throwaway namespace (it is gone when the probe exits)."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise FabricError(f"--fabric: {', '.join(missing)} not found on PATH; shaped fabrics need "
                          "util-linux's unshare and iproute2's ip and tc")
    probe = _setup_script(parse_fabric("1gbit"))
    try:
        done = subprocess.run(["unshare", "--net", "--", "sh", "-c", probe], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FabricError(f"--fabric: a private network namespace could not be made here ({e})") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise FabricError(f"--fabric: a shaped network namespace is not permitted here (unshare --net, ip, tc): {why}")


def _setup_script(fabric: Fabric) -> str:
    return f"ip link set lo up && {' '.join(fabric.tc_command())}"


def exec_inside(fabric: Fabric, argv: list[str]) -> NoReturn:
    """Replace this process with `argv` run inside a new network namespace whose loopback is
    shaped to `fabric`. Same process id: whoever waits for or kills this process waits for or
    kills the measurement."""
    check_permitted()
    os.execvp("unshare", ["unshare", "--net", "--", sys.executable, "-m", "ficco_select.data.measure.fabric",
                          f"{INSIDE_FLAG}={_namespace()}", fabric.rate, "--", *argv])


INSIDE_FLAG = "--in-new-namespace"


def _enter(rate: str, outer: str, argv: list[str]) -> NoReturn:
    """Inside the fresh namespace: shape its loopback, then become `argv` with FABRIC_ENV set.
    Refuses to shape the namespace it was started from (`outer`): that loopback is everyone's."""
    fabric = parse_fabric(rate)
    if _namespace() == outer:
        sys.exit(f"Error: --fabric {rate}: not inside a private network namespace; "
                 f"run `python -m ficco_select.data.measure.fabric {rate} -- COMMAND` (it makes one)")
    done = subprocess.run(["sh", "-c", _setup_script(fabric)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"Error: --fabric {rate}: shaping the namespace's loopback failed: {done.stderr.strip()}")
    os.environ[FABRIC_ENV], os.environ[OUTER_ENV] = fabric.rate, outer
    os.execvp(argv[0], argv)


def _namespace() -> str:
    return os.readlink("/proc/self/ns/net")


def shaping() -> str:
    """What ``tc`` says of this namespace's loopback (one line): the provenance of a fabric's rows."""
    done = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    return " ".join(done.stdout.split())


def main(args: list[str]) -> NoReturn:
    """``python -m ficco_select.data.measure.fabric RATE -- COMMAND [ARGS...]``: COMMAND on that fabric."""
    inner = bool(args) and args[0].startswith(f"{INSIDE_FLAG}=")
    rest = args[1:] if inner else args
    if len(rest) < 3 or rest[1] != "--":
        sys.exit("usage: python -m ficco_select.data.measure.fabric RATE -- COMMAND [ARGS...]")
    try:
        if inner:
            _enter(rest[0], args[0].partition("=")[2], rest[2:])
        exec_inside(parse_fabric(rest[0]), rest[2:])
    except FabricError as e:
        sys.exit(f"Error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
