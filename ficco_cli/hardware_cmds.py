"""Hardware specs and the simulator's fit to them: `ficco hardware ...` and `ficco sim ...`.

Each command parses its options, calls one function of its stage, and prints the result.
Heavy imports stay inside the commands: `ficco --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import click

from ficco_cli.output import json_option, reported, show


@click.group()
def hardware() -> None:
    """Hardware specs: the presets shipped with ficco-select, or your own YAML file."""


@hardware.command("list")
def hardware_list() -> None:
    """Print the preset names."""
    from ficco_select.hardware import preset_names

    click.echo("\n".join(preset_names()))


@hardware.command("show")
@click.argument("name")
@json_option()
def hardware_show(name, as_json) -> None:
    """Print one preset (or spec file), every field."""
    from ficco_select.hardware import HardwareError, load_hardware, spec_as_dict

    with reported(HardwareError):
        spec = spec_as_dict(load_hardware(name))
    width = max(map(len, spec))
    show(as_json, spec, lambda: [f"{key:<{width}}  {value}" for key, value in spec.items()])


@hardware.command("from-profile")
@click.argument("profile_path", metavar="PROFILE", type=click.Path(dir_okay=False))
@click.option("--base", default=None,
              help="Preset or spec file that keeps what one GPU cannot measure (links, topology, "
                   "devices). Default: the profile's 'preset'.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Spec YAML to write (.yaml).")
@click.option("--name", default=None, help="The new spec's name (default: <base>-profiled).")
@json_option("Print the overrides as JSON.")
def hardware_from_profile(profile_path, base, out, name, as_json) -> None:
    """Turn a measured GPU profile (scripts/gpu_check.sh) into a hardware spec the simulator loads."""
    from data.gpu_profile.read import ProfileError, write_profiled_spec
    from ficco_select.hardware import HardwareError

    if Path(out).suffix not in (".yaml", ".yml"):
        raise click.ClickException(f"--out {out!r}: a spec file name ends in .yaml")
    with reported(ProfileError, HardwareError):
        report, preset, base_name = write_profiled_spec(profile_path, base=base, out=out, name=name)
    show(as_json, report, lambda: _profiled_lines(report, preset, base_name))


def _profiled_lines(report: dict, preset: str | None, base_name: str) -> list[str]:
    lines = []
    if preset and preset != base_name:
        lines.append(f"note: the profile was measured against preset {preset!r}, the base is {base_name!r}")
    lines.append(f"{report['name']}: {base_name} with {len(report['overrides'])} fields measured on "
                 f"{report['device']}")
    lines += [f"  {field:<20} {v['base']} -> {v['profiled']}" for field, v in report["overrides"].items()]
    lines.append(f"  kept from {base_name}: {', '.join(report['kept'])}")
    if report["dil_median_abs_error"] is not None:
        lines.append(f"  DIL, measured vs simulated on {report['dil_rows']} rows: median |error| "
                     f"{report['dil_median_abs_error']:.3f}")
    return lines + [f"-> {report['out']}"]


@click.group()
def sim() -> None:
    """Calibrate the simulator from measurements and check it against them."""


@sim.command("validate")
@click.option("--dataset", "dataset_path", type=click.Path(dir_okay=False), required=True,
              help="A measured dataset (cpu or cuda backend).")
@click.option("--devices", type=int, default=None,
              help="Devices of the measured machine (the cpu backend: its cores). Default: its spec's.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the scenario split.")
@json_option()
def sim_validate(dataset_path, devices, seed, as_json) -> None:
    """Calibrate on half the scenarios, predict the other half, report the agreement."""
    from data.calibrate import measured_rows, validate_simulator
    from data.dataset import DatasetError, read_dataset

    with reported(DatasetError, ValueError):
        report = validate_simulator(measured_rows(read_dataset(dataset_path)), devices=devices, seed=seed)
    show(as_json, report, lambda: [
        *(f"{key}: {value}" for key, value in report.items() if key not in ("spec", "largest_errors")),
        "largest errors:", *(f"  {row}" for row in report["largest_errors"])])


@sim.command("calibrate")
@click.option("--dataset", "dataset_path", type=click.Path(dir_okay=False), required=True)
@click.option("--name", required=True, help="Name of the spec (and preset).")
@click.option("--devices", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="YAML spec file to write.")
def sim_calibrate(dataset_path, name, devices, out) -> None:
    """Fit a hardware spec's primitive costs to a measured dataset."""
    from data.calibrate import calibrate, write_spec
    from data.dataset import DatasetError, read_dataset

    with reported(DatasetError, ValueError):
        spec = calibrate(read_dataset(dataset_path), name=name, devices=devices,
                         description=f"calibrated from {dataset_path}")
    write_spec(spec, out, f"ficco sim calibrate --dataset {dataset_path} --devices {devices}")
    click.echo(f"{name} -> {out}")


COMMANDS = [hardware, sim]
