"""Every number of a spec YAML file set to what no machine has: 0, negative, NaN, inf, 1e308, a
word (and, for the counts, an integer past any machine). Each case is a one-line error naming
the file and the field, or one of the documented acceptances below (``ACCEPTED``), which then
simulates to finite, positive times."""

import math

import pytest
import yaml
from helpers.cli import refused

from ficco_select.data.simulate import simulate_rows
from ficco_select.hardware import fields_of, load_hardware, presets_dir
from ficco_select.scenario import Scenario

BASE = "h100-nvswitch"  # has copy engines and every dtype's peak: every field is in play
BASE_SPEC = yaml.safe_load((presets_dir() / f"{BASE}.yaml").read_text())

FIELDS = [*fields_of("count", "rate", "latency", "fraction", "ceiling"),
          *(f"peak_tflops.{dtype}" for dtype in BASE_SPEC["peak_tflops"])]
BAD = {"zero": 0, "negative": -1, "nan": math.nan, "inf": math.inf, "1e308": 1e308, "word": "fast"}
HUGE_COUNT = 10 ** 30
"""An integer: YAML keeps it exact, past any machine's count."""

ACCEPTED = {
    ("sm_comm_units", "zero"): "a fraction in [0, 1): a transfer that occupies no compute units",
    ("dma_mem_contention", "zero"): "a fraction in [0, 1]: copies that do not slow the GEMM",
    ("copy_engines", "zero"): "a machine without copy engines: no dma schedules",
    ("sm_bw_gbps", "zero"): "a ceiling of 0 is off: the link's rate",
    ("coll_latency_us", "zero"): "a model term left out (default 0): off",
    ("coll_bw_gbps", "zero"): "off: the baseline's collective is modelled by sm transfers",
    ("step_sync_us", "zero"): "a model term left out (default 0): off",
    ("overlap_call_us", "zero"): "a model term left out (default 0): off",
    ("switch_latency_us", "zero"): "a model term left out (default 0): off",
}
"""(field, value) a spec may hold, and why (``ficco_select.hardware.HardwareSpec``'s field docs)."""

CASES = [(field, name) for field in FIELDS for name in BAD] + [(f, "huge integer") for f in fields_of("count")]


def spec_file(tmp_path, field: str, value):
    spec = {**BASE_SPEC, "name": "fuzzed", "peak_tflops": dict(BASE_SPEC["peak_tflops"])}
    if field.startswith("peak_tflops."):
        spec["peak_tflops"][field.split(".", 1)[1]] = value
    else:
        spec[field] = value
    path = tmp_path / "fuzzed.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("field, value_name", CASES, ids=[f"{f}={v}" for f, v in CASES])
def test_a_spec_number_no_machine_has_is_refused_naming_the_file_and_field(tmp_path, field, value_name):
    path = spec_file(tmp_path, field, HUGE_COUNT if value_name == "huge integer" else BAD[value_name])
    if (field, value_name) in ACCEPTED:
        spec = load_hardware(path)
        rows = simulate_rows([Scenario(group="fuzz", op=op, m=4096, n=8192, k=8192, dtype="bfloat16",
                                       world_size=8, hardware=spec.name) for op in ("ag_gemm", "gemm_rs")], spec)
        times = rows["time_s"].to_numpy()
        assert len(times) and all(math.isfinite(t) and t > 0 for t in times), rows
        return
    refused(["hardware", "show", path], "fuzzed.yaml", f"field '{field}'")


@pytest.mark.parametrize("kind", ["tpu", 0, None, ["gpu"]])
def test_a_kind_other_than_gpu_or_cpu_is_refused_naming_the_file_and_field(tmp_path, kind):
    path = tmp_path / "fuzzed.yaml"
    path.write_text(yaml.safe_dump({**BASE_SPEC, "name": "fuzzed", "kind": kind}))
    refused(["hardware", "show", path], "fuzzed.yaml", "field 'kind'")


def test_a_spec_that_leaves_its_kind_out_is_a_gpu_only_with_copy_engines(tmp_path):
    path = tmp_path / "fuzzed.yaml"
    for copy_engines, kind in ((3, "gpu"), (0, "cpu")):
        fields = {f: v for f, v in BASE_SPEC.items() if f != "kind"}
        path.write_text(yaml.safe_dump({**fields, "name": "fuzzed", "copy_engines": copy_engines}))
        assert load_hardware(path).kind == kind
