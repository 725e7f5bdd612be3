"""`ficco adapt` from start to registration: every variant of --start, --register, --fabric,
the backend and a resume ends with a registered model or a one-line refusal before anything
is measured; the run's MLflow status says how it ended; the adapted spec is the measured
machine's; a folder resumes only on the machine it was made with (its numbers, not its name).

The runs here use the pipeline's debug slice and tiny models (``--debug``): they check
that the flow holds together, not how well it adapts."""

import dataclasses
import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from ficco_select.hardware import load_hardware, spec_as_dict
from ficco_select.train import adapt as A
from helpers.cli import FICCO, refused

SMALL = dict(backend="sim", budget=0.01, rounds=1, debug=True)
"""A run of seconds: 1% of the grid in one round, the debug slice and tiny models."""
SMALL_ARGS = ["--budget", "0.01", "--rounds", "1", "--debug"]


def spec_file(folder, file_name: str, name: str, preset: str = "l40s-pcie-8", **fields):
    """A spec file of `preset`'s numbers under `name`, with `fields` changed."""
    spec = {**spec_as_dict(load_hardware(preset)), "name": name, "description": f"{name}, a test machine", **fields}
    path = folder / file_name
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tracking store and registry of the module's own (MLflow's artifacts in its folder)."""
    root = tmp_path_factory.mktemp("adapt-flow")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def four_gpus(store):
    """`my-machine.yaml`: a 4-GPU machine (l40s-pcie-8's numbers, its link 20% slower),
    adapted from the l40s-pcie-8 preset in one round, tracked, not registered."""
    path = spec_file(store, "my-machine.yaml", "my-machine", devices=4, link_bw_gbps=20.0)
    out = store / "adapt"
    summary = A.run_adapt(hardware=str(path), start="l40s-pcie-8", out_dir=out, **SMALL)
    return path, out, summary


def adapt_runs(status: str | None = None) -> pd.DataFrame:
    import mlflow

    experiment = mlflow.get_experiment_by_name(A.EXPERIMENT)
    runs = mlflow.search_runs([experiment.experiment_id]) if experiment else pd.DataFrame(columns=["status"])
    return runs if status is None else runs[runs["status"] == status]


def test_the_adapted_spec_carries_the_measured_machine_s_devices_not_the_start_s(four_gpus):
    path, out, summary = four_gpus
    adapted = yaml.safe_load((out / "spec.yaml").read_text())
    assert adapted["devices"] == 4 and adapted["name"] == "my-machine"  # the machine's, not l40s-pcie-8's 8
    assert adapted["description"] == "my-machine, a test machine"
    rounds = json.loads((out / "rounds.json").read_text())["rounds"]
    assert {r["spec"]["devices"] for r in rounds} == {4}  # every round believed a 4-GPU machine


@pytest.mark.slow  # two registrations: about 2 minutes here beside other work
def test_a_spec_file_started_from_a_preset_registers_when_resumed_with_register(four_gpus, tmp_path):
    # The documented flow: adapt, then the same command with --register (measures nothing
    # again). The adapted spec (l40s-pcie-8's numbers, recalibrated) is named as the spec file's
    # machine; registering must not take it for a second machine under that name.
    path, out, first = four_gpus
    measured = pd.read_parquet(out / "measured.parquet")
    summary = A.run_adapt(hardware=str(path), start="l40s-pcie-8", out_dir=out, register=True,
                          export_to=tmp_path / "selector", **SMALL)
    assert summary["registered"]["version"]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "measured.parquet"), measured)  # nothing measured again
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert summary["machine"] == "my-machine" and summary["rounds"][-1]["measured"] == first["rounds"][-1]["measured"]
    # A rerun of the same command registers again.
    again = A.run_adapt(hardware=str(path), start="l40s-pcie-8", out_dir=out, register=True,
                        export_to=tmp_path / "selector", **SMALL)
    assert int(again["registered"]["version"]) == int(summary["registered"]["version"]) + 1
    finished = adapt_runs("FINISHED")
    assert {summary["mlflow_run_id"], again["mlflow_run_id"]} <= set(finished["run_id"])


def test_a_run_that_fails_marks_its_mlflow_run_failed_and_writes_no_summary(store):
    # A failure after the run was opened (here the progress callback: its stdout was closed)
    # leaves the run FAILED, not FINISHED, and no summary.json to take for done.
    out = store / "adapt-failed"

    def stdout_closed(_round):
        raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError):
        A.run_adapt(hardware="mi300x-8", out_dir=out, on_round=stdout_closed, **SMALL)
    failed = adapt_runs("FAILED")
    assert len(failed) == 1 and failed["tags.mlflow.runName"].iloc[0] == "adapt-mi300x-8-adapted"
    assert not (out / "summary.json").exists()


def test_a_run_killed_outright_is_marked_killed_by_the_next_run_in_its_folder(store):
    # SIGKILL leaves no exception to end a run: its MLflow run stays RUNNING, recorded in the
    # folder (made here by hand, as the killed process left it); the next run there ends it.
    import mlflow

    from ficco_select.data.locks import write_json_atomic

    out = store / "adapt-killed"
    first = A.run_adapt(hardware="mi300x-8", out_dir=out, **SMALL)
    client = mlflow.MlflowClient()
    killed = client.create_run(mlflow.get_experiment_by_name(A.EXPERIMENT).experiment_id).info.run_id
    write_json_atomic(out / "mlflow_run.json", {"run_id": killed})
    again = A.run_adapt(hardware="mi300x-8", out_dir=out, **SMALL)  # resumed: nothing left to measure
    assert client.get_run(killed).info.status == "KILLED"
    assert {client.get_run(r).info.status for r in (first["mlflow_run_id"], again["mlflow_run_id"])} == {"FINISHED"}


def test_a_resume_with_another_spec_file_under_the_same_name_is_refused_naming_both(four_gpus, store):
    path, out, _ = four_gpus
    recorded = json.loads((out / "options.json").read_text())
    assert recorded["specs"]["hardware"]["numbers"]["link_bw_gbps"] == 20.0  # the numbers, not only the name
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    other = spec_file(store, "other-machine.yaml", "my-machine", devices=4, link_bw_gbps=3.1)
    error = refused(["adapt", "--hardware", other, "--start", "l40s-pcie-8", "--out", out, "--no-track", *SMALL_ARGS],
                    str(other), str(path), "link_bw_gbps", "my-machine")
    assert "devices" not in error  # only the fields that differ
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing measured or written


def test_a_folder_that_does_not_record_its_machine_s_numbers_is_refused(tmp_path):
    # Made by an older ficco adapt, which recorded the machine's name only: what it measured
    # cannot be told from another machine under that name.
    options = dict(hardware="my-machine", backend="sim", start="my-machine", budget=0.01, rounds=1)
    A.check_state(tmp_path / "adapt", options)
    spec = load_hardware("mi300x-8")
    numbers = {"from": "my-machine.yaml", "numbers": spec_as_dict(spec)}
    with pytest.raises(ValueError, match="options.json: field 'specs' does not record the numbers of --hardware"):
        A.verify_state(tmp_path / "adapt", {**options, "specs": {"hardware": numbers, "start": numbers}})


def test_a_start_spec_file_is_read_as_given_whatever_its_name(store):
    # --start names a file: its numbers are the start; its name is not a machine this run
    # must find again by name (nor one the measured machine's file may not also use).
    start = spec_file(store, "sheet.yaml", "my-sheet", devices=4, link_bw_gbps=30.0)
    same_name = spec_file(store, "same-name.yaml", "my-sheet", devices=4, mem_bw_gbps=700.0)
    for hardware, folder in (("mi300x-8", "from-a-sheet"), (same_name, "sheet-of-the-same-name")):
        summary = A.run_adapt(hardware=str(hardware), start=str(start), out_dir=store / folder, track=False, **SMALL)
        assert summary["rounds"][-1]["measured"] > 0
    adapted = yaml.safe_load((store / "sheet-of-the-same-name" / "spec.yaml").read_text())
    assert adapted["name"] == "my-sheet" and adapted["devices"] == 4


@pytest.mark.parametrize("args, needles", [
    (["--hardware", "cpu", "--backend", "cpu", "--start", "h100-nvswitch"], ["--start h100-nvswitch", "gpu", "cpu"]),
    (["--hardware", "h100-nvswitch", "--start", "cpu"], ["--start cpu", "cpu", "gpu"]),
    (["--hardware", "h100-nvswitch", "--start", "a100-nvswitch"], ["--start a100-nvswitch", "float8_e4m3fn"]),
    (["--hardware", "mi300x-8", "--budget", "0.0001"], ["--budget 0.0001", "no scenario"]),
])
def test_what_cannot_be_adapted_or_registered_is_refused_before_any_measuring(tmp_path, args, needles):
    out = tmp_path / "adapt"
    refused(["adapt", *args, "--rounds", "1", "--debug", "--register", "--out", out, "--no-track"], *needles,
            written=out)


def test_a_fabric_adapt_does_not_take_a_start_spec():
    with pytest.raises(ValueError, match="--start cpu: a fabric starts from its own profile"):
        A.run_adapt(hardware="cpu", backend="cpu", fabric="500mbit", start="cpu", budget=0.01, rounds=1)


def test_an_adapted_machine_is_named_apart_from_every_machine_the_training_data_names():
    # Its rows join the training data when registered: a name the data already means with
    # other numbers (a preset, a data-sheet machine, a committed fabric sweep's) would be two
    # machines under one name in that job.
    from ficco_select.train.adapt.machines import load_target

    taken = {"cpu-500mbit"}
    assert load_target("mi300x-8", "sim", None, taken=taken)[1] == "mi300x-8-adapted"
    assert load_target("b200-nvswitch", "sim", None, taken=taken)[1] == "b200-nvswitch-adapted"  # a data sheet's
    assert load_target("cpu", "cpu", None, taken=taken)[1] == "cpu-adapted"


def test_a_fabric_machine_s_rows_are_known_beside_its_committed_sweep(tmp_path):
    # `ficco adapt --fabric 500mbit`: its start is a fresh profile of the fabric (kept in the
    # folder; written here as the committed one's with a link 5% faster), the committed sweep
    # of cpu-500mbit is training data: the adapted machine takes its own name, so that its
    # measured rows and the committed sweep are known in one job (the register step's).
    from ficco_select.data.dataset import write_parquet_atomic
    from ficco_select.data.measure.fabric import parse_fabric
    from ficco_select.data.measure.fabric_profile import profile_path
    from ficco_select.hardware import machines
    from ficco_select.train.adapt.machines import fabric_machine
    from ficco_select.train.training_data import training_machines

    fabric = parse_fabric("500mbit")
    with machines(training_machines(sampled_per_preset=1)):
        committed = load_hardware("cpu-500mbit")
    fresh = dataclasses.replace(committed, link_bw_gbps=committed.link_bw_gbps * 1.05, description="a fresh profile")
    profile_path(tmp_path / "harness.parquet").write_text(json.dumps(
        {"fabric": "500mbit", "profile": {"link_bw_gbps": fresh.link_bw_gbps}, "spec": spec_as_dict(fresh)}))
    machine = fabric_machine(fabric, tmp_path, name="cpu-500mbit-adapted", progress=False)
    assert machine.name == machine.spec.name == "cpu-500mbit-adapted"
    assert machine.spec.link_bw_gbps == fresh.link_bw_gbps
    assert {s.hardware for s in machine.grid} == {"cpu-500mbit-adapted"}
    assert set(machine.truth["hardware"]) == {"cpu-500mbit-adapted"}  # the committed sweep, scored under its name
    assert set(machine.truth["scenario_id"]) == {s.scenario_id for s in machine.grid}
    # Its rows (the truth's, for the test) written as a run writes them, then known beside the training data.
    with machines(training_machines(sampled_per_preset=1)), machine.known():
        write_parquet_atomic(machine.truth.head(20), tmp_path / "measured.parquet")
    with machines(training_machines([tmp_path / "measured.parquet"], default=True, sampled_per_preset=1)):
        assert load_hardware("cpu-500mbit") == committed
        assert load_hardware("cpu-500mbit-adapted").link_bw_gbps == fresh.link_bw_gbps


@pytest.mark.slow
@pytest.mark.gloo
def test_a_fabric_adapt_registers_beside_the_fabric_s_committed_sweep(tmp_path):
    # The whole command, as a user runs it: it re-runs itself inside the fabric's namespace,
    # profiles the fabric, measures a few scenarios for real, and registers.
    from ficco_select.data.measure.fabric import FabricError, check_permitted

    try:
        check_permitted()
    except FabricError as e:
        pytest.skip(str(e))
    out = tmp_path / "adapt-500mbit"
    env = {**__import__("os").environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    done = subprocess.run([*FICCO, "adapt", "--hardware", "cpu", "--backend", "cpu", "--fabric", "500mbit",
                           "--budget", "0.02", "--rounds", "1", "--register", "--debug", "--out", str(out),
                           "--export-to", str(tmp_path / "selector"), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"] == "cpu-500mbit-adapted" and summary["registered"]["version"]
    assert summary["rounds"][-1]["measured"] > 0
