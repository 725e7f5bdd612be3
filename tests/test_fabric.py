"""Shaped fabrics: the rate parser, the permission probe, and a real token bucket measured by
the fabric profile inside a private network namespace (skipped, with the probe's reason,
where namespaces or tc are not permitted)."""

import json
import subprocess
import sys

import pytest
from helpers.cli import DECOY, decoy_folder

from ficco_select.data.measure.fabric import FabricError, check_permitted, parse_fabric


def _permitted() -> str | None:
    try:
        check_permitted()
    except FabricError as e:
        return str(e)
    return None


NOT_PERMITTED = _permitted()
needs_namespaces = pytest.mark.skipif(NOT_PERMITTED is not None, reason=NOT_PERMITTED or "")


@pytest.mark.parametrize("text, rate, bits", [("500mbit", "500mbit", 5e8), ("2gbit", "2gbit", 2e9),
                                              (" 1.5GBIT ", "1.5gbit", 1.5e9), ("5000kbit", "5000kbit", 5e6)])
def test_a_rate_as_tc_writes_it_names_the_machine(text, rate, bits):
    fabric = parse_fabric(text)
    assert (fabric.rate, fabric.name, fabric.bits_per_s) == (rate, f"cpu-{rate}", bits)


@pytest.mark.parametrize("text, needle", [("fast", "expected a rate"), ("500", "expected a rate"),
                                          ("500mbps", "expected a rate"), ("-5mbit", "expected a rate"),
                                          ("800kbit", "outside 1 Mbit/s"), ("200gbit", "outside 1 Mbit/s")])
def test_a_bad_rate_is_refused_naming_the_option(text, needle):
    with pytest.raises(FabricError, match=needle) as e:
        parse_fabric(text)
    assert str(e.value).startswith(f"--fabric {text!r}")


def _tc_lo(*prefix: str) -> str:
    return subprocess.run([*prefix, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


PROFILE = """
import json
from ficco_select.data.measure.fabric import inside
from ficco_select.data.measure.fabric_profile import fabric_spec, profile_fabric
if __name__ == "__main__":
    fabric = inside()
    profile = profile_fabric(fabric)
    print(json.dumps({"profile": profile, "spec_bw": fabric_spec(fabric, profile).link_bw_gbps,
                      "name": fabric_spec(fabric, profile).name}))
"""


@needs_namespaces
def test_the_profile_inside_a_shaped_namespace_measures_the_token_bucket_and_the_host_is_untouched(tmp_path):
    script = tmp_path / "profile.py"
    script.write_text(PROFILE)
    host_before = _tc_lo()
    done = subprocess.run([sys.executable, "-m", "ficco_select.data.measure.fabric", "200mbit", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shaped, unshaped = result["profile"]["link_bw_gbps"], result["profile"]["unshaped"]["link_bw_gbps"]
    assert 0.6 * 0.025 < shaped < 1.2 * 0.025  # 200 Mbit/s = 0.025 GB/s: what tbf lets through, less what a busy host loses
    assert unshaped > 4 * shaped  # the namespace's own loopback, unshaped, is far faster
    assert "tbf" in result["profile"]["shaping"] and "200Mbit" in result["profile"]["shaping"]
    assert (result["name"], result["spec_bw"]) == ("cpu-200mbit", shaped)
    assert _tc_lo() == host_before  # the host's loopback was never shaped


def test_the_profile_refuses_to_run_outside_its_fabric():
    from ficco_select.data.measure.fabric_profile import profile_fabric

    with pytest.raises(FabricError, match="inside that fabric's namespace"):
        profile_fabric(parse_fabric("1gbit"))


def _scenario_table(tmp_path):
    path = tmp_path / "fabric.csv"
    path.write_text("group,op,m,n,k,dtype,world_size,hardware,imbalance\n"
                    "llama3,gemm_rs,16,512,1024,float32,2,cpu,1.0\n")
    return path


@pytest.mark.parametrize("args, needle", [(["--fabric", "fast"], "expected a rate"),
                                          (["--fabric", "1gbit", "--backend", "cuda"], "cpu backend"),
                                          (["--fabric", "1gbit"], "needs its command line")])
def test_measure_refuses_a_fabric_it_cannot_make_before_any_work(tmp_path, args, needle):
    from helpers.cli import refused

    out = tmp_path / "out.parquet"
    # In-process (CliRunner): the last case is refused because this is not ficco's own command line.
    refused(["measure", "--scenarios", _scenario_table(tmp_path), "--out", out, *args], needle, written=out)


@needs_namespaces
def test_measure_on_a_fabric_names_the_machine_keeps_its_profile_and_resumes_on_it(tmp_path):
    from ficco_select.data.dataset import read_dataset
    from ficco_select.data.measure.fabric_profile import profile_path

    out = tmp_path / "fab.parquet"
    command = [sys.executable, "-m", "ficco_select.cli.main", "measure", "--scenarios", str(_scenario_table(tmp_path)),
               "--out", str(out), "--reps", "5", "--min-rep-s", "0", "--no-progress", "--json"]
    host_before = _tc_lo()
    # From a folder with a user's generic top-level names: the re-executions inside the
    # namespace and the ranks, each started by module name, never import them.
    work = decoy_folder(tmp_path / "work")
    done = subprocess.run([*command, "--fabric", "1gbit"], capture_output=True, text=True, timeout=600, cwd=work)
    assert done.returncode == 0, done.stderr
    assert DECOY not in done.stdout + done.stderr
    df = read_dataset(out)
    assert set(df["hardware"]) == {"cpu-1gbit"} and df["verified"].all()
    assert set(df["hardware_fingerprint"]) == {f"{df['hardware_fingerprint'].iloc[0].rsplit('-fabric-', 1)[0]}"
                                               "-fabric-1gbit"}
    kept = json.loads(profile_path(out).read_text())
    assert kept["fabric"] == "1gbit" and "rate 1Gbit" in kept["profile"]["shaping"]
    assert 0.6 * 0.125 < kept["spec"]["link_bw_gbps"] < 1.2 * 0.125  # 1 Gbit/s = 0.125 GB/s
    # A rerun is a resume on the same machine: nothing re-measured, the profile untouched.
    again = subprocess.run([*command, "--fabric", "1gbit"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["skipped"] == 1 and json.loads(profile_path(out).read_text()) == kept
    # Another fabric into the same --out is another machine: refused, nothing touched.
    other = subprocess.run([*command, "--fabric", "2gbit"], capture_output=True, text=True, timeout=600)
    assert other.returncode != 0 and "one --out holds one fabric" in other.stderr
    assert read_dataset(out).equals(df)
    assert _tc_lo() == host_before


@pytest.mark.parametrize("args, needle", [(["--backend", "sim", "--hardware", "cpu", "--fabric", "1gbit"],
                                           "cpu backend"),
                                          (["--backend", "cpu", "--hardware", "cpu", "--fabric", "fast"],
                                           "expected a rate"),
                                          (["--backend", "cpu", "--hardware", "cpu", "--fabric", "1gbit"],
                                           "needs its command line")])
def test_adapt_refuses_a_fabric_it_cannot_adapt_to_before_any_work(tmp_path, args, needle):
    from helpers.cli import refused

    out = tmp_path / "adapt"
    refused(["adapt", *args, "--out", out, "--no-track"], needle, written=out)


def test_adapt_to_a_fabric_runs_inside_it_only_and_on_the_cpu_backend():
    from ficco_select.train.adapt.machines import load_target

    with pytest.raises(ValueError, match="not inside that fabric's network namespace"):
        load_target("cpu", "cpu", None, "1gbit")
    with pytest.raises(ValueError, match="--backend cpu --hardware cpu"):
        load_target("h100-nvswitch", "cpu", None, "1gbit")


def test_a_fabric_machine_explores_and_pins_only_the_cpu_backends_schedules():
    import dataclasses

    from ficco_select import Scenario
    from ficco_select.hardware import load_hardware, machines
    from ficco_select.runtime import dispatch
    from ficco_select.schedule import candidates

    s = Scenario(group="t", op="ag_gemm", m=64, n=64, k=64, dtype="float32", world_size=2, hardware="cpu-3gbit")
    with machines([dataclasses.replace(load_hardware("cpu"), name="cpu-3gbit", link_bw_gbps=0.37)], "a test"):
        assert dispatch._backend(s) == "cpu"  # by its spec (no copy engines), not by its name
        assert all(c.engine == "sm" for c in candidates(s, dispatch._backend(s)))
    assert dispatch._backend(dataclasses.replace(s, hardware="h100-nvswitch")) == "cuda"


def test_a_link_fit_whose_sizes_drown_in_noise_keeps_a_positive_bandwidth():
    from ficco_select.data.measure.fabric_profile import link_fit

    line = link_fit({1 << 10: 60e-6 + 2**10 / 1e9, 1 << 20: 60e-6 + 2**20 / 1e9, 1 << 24: 60e-6 + 2**24 / 1e9})
    assert line["link_bw_gbps"] == pytest.approx(1.0, rel=1e-6) and line["latency_us"] == pytest.approx(60, rel=1e-6)
    # An unshaped loopback's points, once: the larger message took less time than the smaller.
    noisy = link_fit({1 << 10: 80e-6, 1 << 20: 70e-6, 1 << 22: 65e-6})
    assert noisy["link_bw_gbps"] == pytest.approx((1 << 22) / 65e-6 / 1e9) and noisy["latency_us"] == 0.0
