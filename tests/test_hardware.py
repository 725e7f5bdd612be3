"""Hardware specs: presets load, bad specs name the field, the CLI lists and shows them."""

import pytest
import yaml
from click.testing import CliRunner

from ficco_select.cli.main import main
from ficco_select.hardware import HardwareError, load_hardware, preset_names, presets_dir


def test_presets_load_and_cover_the_required_machines():
    names = preset_names()
    assert len(names) >= 6
    for required in ("mi300x-8", "h100-nvswitch", "h200-nvswitch", "a100-nvswitch", "mi250x-8", "l40s-pcie-8"):
        assert required in names
    for name in names:
        spec = load_hardware(name)
        assert spec.name == name and spec.peak_tflops["float32"] > 0
    assert load_hardware("mi300x-8").topology == "fully_connected"
    assert "dma" in load_hardware("h100-nvswitch").engines


def write_spec(tmp_path, **changes):
    spec = yaml.safe_load((presets_dir() / "mi300x-8.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            spec.pop(key)
        else:
            spec[key] = value
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_user_spec_file_loads(tmp_path):
    assert load_hardware(write_spec(tmp_path, name="mine")).name == "mine"


@pytest.mark.parametrize("changes,needle", [
    (dict(mem_bw_gbps=None), "field 'mem_bw_gbps' is missing"),
    (dict(mem_bw_gbps=-1), "field 'mem_bw_gbps'"),
    (dict(compute_units=0), "field 'compute_units'"),
    (dict(gemm_efficiency=1.5), "field 'gemm_efficiency'"),
    (dict(topology="torus"), "field 'topology'"),
    (dict(sm_comm_units=1.0), "field 'sm_comm_units'"),
    (dict(peak_tflops={"bfloat16": 10}), "field 'peak_tflops'"),
    (dict(warp_size=32), "unknown field 'warp_size'"),
])
def test_bad_specs_name_the_field(tmp_path, changes, needle):
    with pytest.raises(HardwareError, match=needle):
        load_hardware(write_spec(tmp_path, **changes))


def test_unknown_preset():
    with pytest.raises(HardwareError, match="unknown hardware 'tpu'"):
        load_hardware("tpu")


def test_cli_list_and_show():
    runner = CliRunner()
    listed = runner.invoke(main, ["hardware", "list"])
    assert listed.exit_code == 0 and "mi300x-8" in listed.output.split()
    shown = runner.invoke(main, ["hardware", "show", "h200-nvswitch"])
    assert shown.exit_code == 0 and "4800" in shown.output
    bad = runner.invoke(main, ["hardware", "show", "nope"])
    assert bad.exit_code != 0 and "unknown hardware" in bad.output
