"""Hardware specs and the simulator's fit to them: `ficco hardware ...` and `ficco sim ...`.

Each command parses its options, calls one function of its stage, and prints the result.
Heavy imports stay inside the commands: `ficco --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import click

from ficco_select.cli.output import json_option, refuse_existing_out, reported, show


@click.group()
def hardware() -> None:
    """Hardware specs: the presets shipped with ficco-select, or your own YAML file."""


@hardware.command("list")
def hardware_list() -> None:
    """Print the preset names, then the data-sheet machines (never trained on)."""
    from ficco_select.hardware import datasheet_names, preset_names

    click.echo("\n".join(preset_names() + [f"{name}  (data sheet)" for name in datasheet_names()]))


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
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Spec YAML to write (.yaml); an existing file is refused.")
@click.option("--name", default=None, help="The new spec's name (default: <base>-profiled).")
@json_option("Print the overrides as JSON.")
def hardware_from_profile(profile_path, base, out, name, as_json) -> None:
    """Turn a measured GPU profile (scripts/gpu_check.sh) into a hardware spec the simulator loads."""
    from ficco_select.data.gpu_profile.read import ProfileError, write_profiled_spec
    from ficco_select.hardware import HardwareError

    if Path(out).suffix not in (".yaml", ".yml"):
        raise click.ClickException(f"--out {out!r}: a spec file name ends in .yaml")
    refuse_existing_out(out, {"PROFILE": [profile_path], "--base": [base]})
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
@click.option("--dataset", "dataset_path", type=click.Path(dir_okay=False), default=None,
              help="A measured dataset (cpu or cuda backend).")
@click.option("--published", "published_path", type=click.Path(dir_okay=False), default=None,
              help="A table of published GPU measurements (data/published/gpu-calibration.csv): each point "
                   "predicted on the preset of its device.")
@click.option("--hardware", "overrides", multiple=True, metavar="PRESET=SPEC.yaml",
              help="With --published: predict PRESET's points on this spec file instead (repeatable).")
@click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None,
              help="With --published: the exported selector whose calls are judged (default: the exported "
                   "champion, else the heuristic alone).")
@click.option("--fallback", type=click.Choice(["heuristic", "cost_model", "baseline"]), default=None,
              help="With --published: judge what this fallback alone picks at each point, under the "
                   "selector's GPU do-no-harm rule, instead of the selector's own calls.")
@click.option("--devices", type=int, default=None,
              help="Devices of the measured machine (the cpu backend: its cores). Default: its spec's.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the scenario split.")
@json_option()
def sim_validate(dataset_path, published_path, overrides, model_dir, fallback, devices, seed, as_json) -> None:
    """The simulator against measurements: a measured dataset (calibrate on half the
    scenarios, predict the other half) or published GPU points (each predicted on its preset,
    and the selector's pick there judged against what was measured)."""
    if (dataset_path is None) == (published_path is None):
        raise click.UsageError("give one of --dataset or --published")
    if published_path is not None:
        return _validate_published(published_path, overrides, model_dir, fallback, as_json)
    if model_dir is not None or fallback is not None:
        raise click.UsageError("--model and --fallback go with --published (the selector's calls on published points)")
    from ficco_select.data.calibrate import measured_rows, validate_simulator
    from ficco_select.data.dataset import DatasetError, dataset_machines, read_dataset
    from ficco_select.hardware import machines

    with reported(DatasetError, ValueError):
        df = read_dataset(dataset_path)
        with machines(dataset_machines(dataset_path)):
            report = validate_simulator(measured_rows(df), devices=devices, seed=seed)
    show(as_json, report, lambda: [
        *(f"{key}: {value}" for key, value in report.items() if key not in ("spec", "largest_errors")),
        "largest errors:", *(f"  {row}" for row in report["largest_errors"])])


def _validate_published(path, overrides, model_dir, fallback, as_json) -> None:
    from ficco_select.data.published import compare, read_published
    from ficco_select.data.no_harm import best_gain_summary, residuals
    from ficco_select.data.published_calls import judge_calls
    from ficco_select.hardware import HardwareError
    from ficco_select.runtime.selector import Selector

    selector = Selector.load(model_dir)
    if model_dir is not None and selector.model is None:
        raise click.ClickException(f"--model {model_dir}: no usable exported selector there (the warning above "
                                   "says why)")
    with reported(HardwareError, ValueError):
        specs = _override_specs(overrides)
        report = compare(read_published(path), specs)
        report["best_gain"] = best_gain_summary(residuals(path, specs))
        report["calls"] = judge_calls(path, selector, fallback=fallback)
    show(as_json, report, lambda: _published_lines(report) + _call_lines(report["calls"]))


def _override_specs(overrides) -> dict:
    """``PRESET=SPEC.yaml`` options -> {preset: spec}; the file's own name may differ."""
    import yaml

    from ficco_select.hardware import HardwareError, spec_from_dict

    specs = {}
    for item in overrides:
        preset, sep, file = item.partition("=")
        if not sep or not preset or not file:
            raise click.UsageError(f"--hardware {item!r}: expected PRESET=SPEC.yaml")
        try:
            data = yaml.safe_load(Path(file).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as e:
            raise click.ClickException(f"{file}: cannot read the spec ({type(e).__name__})") from None
        with reported(HardwareError):
            specs[preset] = spec_from_dict({**data, "name": preset} if isinstance(data, dict) else data, file)
    return specs


def _published_lines(report: dict) -> list[str]:
    lines = [f"{'row':>4} {'kind':<17} {'hardware':<14} {'point':<24} {'measured':>10} {'predicted':>10} {'APE':>6}  "
             "speedup measured / predicted (APE), wins as measured"]
    for r in report["points"]:
        point = (f"{r['op']} {r['m']}x{r['n']}x{r['k']}" if r["kind"] in ("overlap", "baseline", "gemm")
                 else f"{r['op']} {r.get('message_mib', 0):g} MiB" if r["kind"] in ("collective", "switch_collective")
                 else f"{r['op']} x{r['shots']} {r['message_mib']:g} MiB" if r["kind"] == "sm_collective" else r["op"])
        unit = "GB/s" if r["kind"] == "bandwidth" else "us"
        measured = r.get("measured_gbps", r.get("measured_us"))
        predicted = r.get("predicted_gbps", r.get("predicted_us"))
        line = (f"{r['row']:>4} {r['kind']:<17} {r['hardware']:<14} {point:<24} {measured:>8.1f}{unit:>2} "
                f"{predicted:>8.1f}{unit:>2} {r['ape']:>6.1%}")
        if r["kind"] == "overlap":
            line += (f"  {r['schedule']} {r['speedup']:.3f} / {r['predicted_speedup']:.3f} ({r['speedup_ape']:.1%}), "
                     f"{'yes' if r['agrees'] else 'NO'}")
        lines.append(line)
    for preset, s in report["presets"].items():
        parts = []
        if s["baselines"]:
            parts.append(f"serial baseline APE {s['baseline_ape_median']:.1%} ({s['baselines']} points)")
        if s["overlap_points"]:
            parts.append(f"overlap speedup APE {s['speedup_ape_median']:.1%}, wins or loses as measured "
                         f"{s['wins_as_measured']}/{s['overlap_points']}")
        for kind in ("collective", "sm_collective", "switch_collective", "gemm", "bandwidth"):
            if s[f"{kind}s"]:
                parts.append(f"{kind} APE {s[f'{kind}_ape_median']:.1%} ({s[f'{kind}s']})")
        lines.append(f"{preset}: median " + "; ".join(parts))
    if report["unmatched"]:
        lines.append(f"not compared (no preset is their device): rows {', '.join(map(str, report['unmatched']))}")
    best = report.get("best_gain", {})
    if best.get("points"):
        lines.append(f"the simulator's best overlap gain over the best measured method's, on {best['points']} "
                     f"collective + GEMM points: median x{best['median_ratio']:.3f}; overlap wins or loses as "
                     f"the best measured method: {best['wins_as_measured']}/{best['points']}")
    return lines


def _call_lines(calls: dict) -> list[str]:
    """The selector's calls (``ficco_select.data.published_calls``): a line per point, then the counts."""
    chosen = {"model": "an exported model", "heuristic": "the heuristic alone: no exported model"}.get(
        calls["selector"], f"the {calls['selector']} alone")
    lines = ["", f"the selector's calls on the collective + GEMM points, by {chosen} (right: its pick paid, or "
                 "the baseline where every measured method lost)"]
    for c in calls["points"]:
        rows = ",".join(map(str, c["rows"]))
        measured = ", ".join(f"{m['label']} {m['speedup']:.3f}" for m in c["measured"]) or "none timed"
        lines.append(f"  rows {rows:<8} {c['hardware']} {c['op']} {c['m']}x{c['n']}x{c['k']} {c['dtype']} "
                     f"P={c['world_size']}: pick {c['pick']} ({c['decided_by']}); measured {measured} "
                     f"-> {c['verdict'].upper()}: {c['why']}")
    s = calls["summary"]
    lines.append(f"calls on {s['points']} points: right {s['right']}, wrong {s['wrong']} (twin loses by more than "
                 f"10%: {s['twin_loses_over_10pct']}), unverifiable {s['unverifiable']} (every measured method "
                 f"loses: {s['unverifiable_all_lose']}); decided by "
                 + ", ".join(f"{who} {n}" for who, n in s["decided_by"].items()))
    if calls["not_compared"]:
        rows = ", ".join(map(str, calls["not_compared"]))
        lines.append(f"calls not compared (no preset is their device): rows {rows}")
    return lines


@sim.command("fit")
@click.option("--published", "published_path", type=click.Path(dir_okay=False), required=True,
              help="A table of published GPU measurements (data/published/gpu-calibration.csv).")
@click.option("--hardware", "name", required=True, help="The preset whose points to fit to.")
@click.option("--fields", default=None, help="Comma-separated spec fields to fit (default: ficco_select.data.published.FITTED).")
@click.option("--kinds", default=None,
              help="Comma-separated kinds of point to fit to (default: overlap,collective).")
@click.option("--rows", "row_range", default=None, metavar="FIRST-LAST",
              help="Only the table's rows FIRST to LAST (1-based, header excluded), e.g. 49-54.")
@click.option("--set", "settings", multiple=True, metavar="FIELD=VALUE",
              help="Set a spec number before fitting (a cited figure, e.g. dma_bw_gbps=396.4; repeatable).")
@json_option()
def sim_fit(published_path, name, fields, kinds, row_range, settings, as_json) -> None:
    """Fit a preset's model terms to the published points of its device; prints the fitted
    numbers, the rows they were fitted to, and the agreement before and after."""
    from ficco_select.data.published import FIT_KINDS, FITTED, fit, read_published
    from ficco_select.hardware import HardwareError, load_hardware

    with reported(HardwareError, ValueError):
        spec, changes = _set_numbers(load_hardware(name), settings)
        points = read_published(published_path)
        if row_range:
            first, sep, last = row_range.partition("-")
            if not (sep and first.isdigit() and last.isdigit() and int(first) <= int(last)):
                raise ValueError(f"--rows {row_range!r}: expected FIRST-LAST, e.g. 49-54")
            points = [p for p in points if int(first) <= p.row <= int(last)]
        _, report = fit(points, spec,
                        fields=tuple(fields.split(",")) if fields else FITTED,
                        kinds=tuple(kinds.split(",")) if kinds else FIT_KINDS)
    report["set"] = changes
    show(as_json, report, lambda: [
        f"{name}: fitted to rows {', '.join(map(str, report['rows']))} of {published_path}",
        *(f"  {field:<20} {value:g}" for field, value in {**changes, **report["fields"]}.items()),
        "  median APE before -> after: " + ", ".join(
            f"{key.removesuffix('_ape_median')} {report['before'][key]:.1%} -> {report['after'][key]:.1%}"
            for key in report["after"] if key.endswith("_ape_median") and report["after"][key] is not None)])


def _set_numbers(spec, settings) -> tuple:
    """`spec` with each ``--set FIELD=VALUE`` applied in turn, checked as a spec file's numbers
    are (HardwareError naming the setting and the field); and the numbers set."""
    from ficco_select.hardware import fields_of, spec_as_dict, spec_from_dict

    numbers = fields_of("count", "rate", "latency", "fraction", "ceiling")
    fields, changes = spec_as_dict(spec), {}
    for item in settings:
        field, sep, text = item.partition("=")
        if not sep or field not in numbers:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with a number of the spec ({', '.join(numbers)})")
        changes[field] = _number_of(text.strip())
        spec = spec_from_dict({**fields, **changes}, f"--set {item}")
    return spec, changes


def _number_of(text: str):
    """An integer, a float, or the text itself (which the spec's check then names)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@sim.command("map")
@click.option("--hardware", "name", required=True, help="A preset or spec file: its GPU catalog is simulated on it.")
@click.option("--dtype", default=None, help="Only this dtype's scenarios (default: the machine's mix).")
@json_option()
def sim_map(name, dtype, as_json) -> None:
    """Where overlap pays on a machine: the full catalog simulated on it (noise-free), the share
    of scenarios whose best schedule beats the serial baseline by more than 2%, by op, dtype
    and band of m, with the best schedule's granularity; and the share whose best gain exceeds
    the GPU do-no-harm rule's margin (``no harm``: where a GPU selector ships the overlap)."""
    import dataclasses

    from ficco_select.data.catalog import catalog
    from ficco_select.data.no_harm import fit_no_harm
    from ficco_select.data.simulate import overlap_map, simulate_rows
    from ficco_select.hardware import HardwareError, load_hardware
    from ficco_select.scenario import Scenario

    with reported(HardwareError, ValueError):
        hw = load_hardware(name)
        base = hw.name.split("~")[0]
        records = catalog("full", hardware=base if base in _preset_names() else None, dtype=dtype)
        scenarios = [dataclasses.replace(Scenario.from_record(r), hardware=hw.name) for r in records]
        table = overlap_map(simulate_rows(scenarios, hw), no_harm=fit_no_harm() if hw.copy_engines else None)
    rows = table.to_dict("records")
    harm = "beyond_error" in table.columns
    show(as_json, rows, lambda: [f"{hw.name}: share of scenarios where overlap pays (> 2% over the serial baseline)",
                                 f"{'op':<9} {'dtype':<14} {'m':<12} {'scenarios':>9} {'pays':>6} {'shard':>6} {'ficco':>6}"
                                 + (f" {'no harm':>8}" if harm else ""),
                                 *(f"{r['op']:<9} {r['dtype']:<14} {r['m_band']:<12} {r['scenarios']:>9} "
                                   f"{r['overlap_pays']:>6.0%} {r['shard']:>6.0%} {r['ficco']:>6.0%}"
                                   + (f" {r['beyond_error']:>8.0%}" if harm else "") for r in rows)])


def _preset_names() -> set[str]:
    from ficco_select.hardware import shipped_names

    return shipped_names()


@sim.command("calibrate")
@click.option("--dataset", "dataset_paths", type=click.Path(dir_okay=False), required=True, multiple=True,
              help="A measured dataset; repeat it for independent sweeps of the same machine (their times are "
                   "pooled: the geometric mean per scenario and schedule).")
@click.option("--name", required=True, help="Name of the spec (and preset).")
@click.option("--devices", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="YAML spec file to write; an existing file is refused.")
def sim_calibrate(dataset_paths, name, devices, out) -> None:
    """Fit a hardware spec's primitive costs to a measured dataset."""
    from ficco_select.data.calibrate import calibrate, pool_sweeps, write_spec
    from ficco_select.data.dataset import DatasetError, dataset_machines, read_dataset
    from ficco_select.hardware import machines

    refuse_existing_out(out, {"--dataset": dataset_paths})
    sources = " and ".join(dataset_paths)
    datasets = " ".join(f"--dataset {p}" for p in dataset_paths)
    with reported(DatasetError, ValueError):
        sweeps = [read_dataset(p) for p in dataset_paths]
        with machines([known for p in dataset_paths for known in dataset_machines(p)]):
            spec = calibrate(pool_sweeps(sweeps), name=name, devices=devices, description=f"calibrated from {sources}")
        write_spec(spec, out, f"ficco sim calibrate {datasets} --name {name} --devices {devices} --out {out}")
    click.echo(f"{name} -> {out}")


COMMANDS = [hardware, sim]
