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


def _dataset_naming(path, spec: dict):
    """A one-row dataset file whose metadata describes machine `spec["name"]` as `spec`."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ficco_select.data.dataset import HARDWARE_KEY, METADATA_KEY, SCHEMA_VERSION

    table = pa.table({"hardware": [spec["name"]]})
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: str(SCHEMA_VERSION).encode(),
                                                  HARDWARE_KEY: json.dumps({spec["name"]: spec}).encode()}), path)
    return path


def test_reading_a_file_changes_what_no_name_means_and_a_job_says_which_machines_it_knows(tmp_path):
    from helpers.exports import spec_dict

    from ficco_select.data.dataset import dataset_machines, read_dataset
    from ficco_select.hardware import known_machines, machines

    first = _dataset_naming(tmp_path / "a.parquet", spec_dict("node-a", link_bw_gbps=100.0))
    other = _dataset_naming(tmp_path / "b.parquet", spec_dict("node-a", link_bw_gbps=400.0))
    assert read_dataset(first)["hardware"].tolist() == ["node-a"]
    assert known_machines() == {}
    with pytest.raises(HardwareError, match="unknown hardware 'node-a'"):
        load_hardware("node-a")  # reading made no name known
    with machines(dataset_machines(first)):
        assert load_hardware("node-a").link_bw_gbps == 100.0
        with pytest.raises(HardwareError, match=r"b\.parquet.*'node-a' is already known in this job from .*a\.parquet"
                                                r".*link_bw_gbps"):
            with machines(dataset_machines(other)):
                pass
        with machines(dataset_machines(first)):  # the same machine again: nothing to refuse
            assert load_hardware("node-a").link_bw_gbps == 100.0
        assert read_dataset(other)["hardware"].tolist() == ["node-a"]  # read for its times: nothing changes
        assert load_hardware("node-a").link_bw_gbps == 100.0
    with machines(dataset_machines(other)):  # another job: another machine under that name
        assert load_hardware("node-a").link_bw_gbps == 400.0
    assert known_machines() == {}


def test_each_thread_knows_the_machines_of_its_own_job(tmp_path):
    import threading

    from helpers.exports import spec_dict

    from ficco_select.hardware import machines, spec_from_dict

    seen, both_inside = {}, threading.Barrier(2)

    def job(link: float) -> None:
        with machines([spec_from_dict(spec_dict("node-a", link_bw_gbps=link), "a test")]):
            both_inside.wait(timeout=10)  # the two jobs' blocks are open at once
            seen[link] = load_hardware("node-a").link_bw_gbps

    threads = [threading.Thread(target=job, args=(link,)) for link in (100.0, 400.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {100.0: 100.0, 400.0: 400.0}


def test_a_spec_file_may_not_rename_a_preset_nor_redefine_a_known_machine(tmp_path):
    from ficco_select.hardware import machines

    mine = load_hardware(write_spec(tmp_path, name="mine", link_bw_gbps=10.0))
    assert mine.link_bw_gbps == 10.0
    with machines([mine], "mine.yaml"):
        with pytest.raises(HardwareError, match="'mine' is already known in this job from mine.yaml"):
            load_hardware(write_spec(tmp_path, name="mine", link_bw_gbps=20.0))
    with pytest.raises(HardwareError, match="name 'mi300x-8' is a preset's, with other numbers"):
        load_hardware(write_spec(tmp_path, link_bw_gbps=20.0))


def _in_a_thread(work):
    """What `work()` returns, or the error it raises, in a thread of its own started here."""
    import threading

    out = []

    def run():
        try:
            out.append(work())
        except Exception as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def test_a_thread_started_inside_a_job_knows_the_job_s_machines_for_the_job_s_duration():
    from helpers.exports import RECORD, spec_dict

    from ficco_select.hardware import known_machines, machines, spec_from_dict
    from ficco_select.runtime.selector import Selector

    spec = spec_from_dict(spec_dict("node-t", link_bw_gbps=123.0), "a test")
    record = {**RECORD, "hardware": "node-t"}
    with machines([spec], "node-t.yaml"):
        assert _in_a_thread(lambda: load_hardware("node-t")) == spec
        assert _in_a_thread(lambda: known_machines()) == {"node-t": (spec, "node-t.yaml")}
        decision = _in_a_thread(lambda: Selector().select(record))
        assert decision.source == "heuristic" and decision == Selector().select(record)
        with machines([]):  # a nested job of the thread's own: the outer job's machines too
            assert _in_a_thread(lambda: load_hardware("node-t")) == spec
    missing = _in_a_thread(lambda: load_hardware("node-t"))  # the job has ended
    assert isinstance(missing, HardwareError) and "unknown hardware 'node-t'" in str(missing)


def test_a_context_copied_inside_a_job_knows_its_machines_only_while_the_job_runs():
    import contextvars

    from helpers.exports import spec_dict

    from ficco_select.hardware import machines, spec_from_dict

    spec = spec_from_dict(spec_dict("node-c"), "a test")
    with machines([spec]):
        copied = contextvars.copy_context()
        assert copied.run(load_hardware, "node-c") == spec
    with pytest.raises(HardwareError, match="unknown hardware 'node-c'"):
        copied.run(load_hardware, "node-c")


def test_a_thread_of_no_job_asking_for_a_name_two_jobs_mean_differently_is_told_how_to_pass_its_job(tmp_path):
    import threading

    from helpers.exports import spec_dict

    from ficco_select.hardware import machines, spec_from_dict

    inside, done = threading.Barrier(3), threading.Event()

    def job(link: float) -> None:
        with machines([spec_from_dict(spec_dict("node-a", link_bw_gbps=link), f"job {link:g}")]):
            inside.wait(timeout=10)
            done.wait(timeout=10)

    jobs = [threading.Thread(target=job, args=(link,)) for link in (100.0, 400.0)]
    for t in jobs:
        t.start()
    inside.wait(timeout=10)
    try:
        error = _in_a_thread(lambda: load_hardware("node-a"))
    finally:
        done.set()
        for t in jobs:
            t.join()
    assert isinstance(error, HardwareError)
    assert "'node-a'" in str(error) and "contextvars.copy_context().run" in str(error), error
