"""The install puts one name on the import path, `ficco_select`, so it lives beside a user's
own `data/`, `features/` or `train.py`.

Both installs are checked from a folder of decoys that fail loudly when imported: the wheel
(built here, installed into a fresh venv that borrows this venv's dependencies) and the
editable install this suite runs in. The editable install's whole pipeline runs from such a
folder in the bring-up rehearsal (tests/test_bringup.py: every step, by `python -m`, which
puts the folder first on the import path), so here it runs the import, `--help` and `select`.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from helpers.cli import DECOY, decoy_folder

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"data": "ficco_select.data", "features": "ficco_select.features", "train": "ficco_select.train"}


def test_the_package_list_holds_every_folder_of_the_package_and_the_stages():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {v: k for k, v in STAGES.items()}  # the stages' folders, mapped into the namespace
    on_disk = set()
    for init in ROOT.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        if parts[0] in STAGES:
            on_disk.add(".".join((STAGES[parts[0]], *parts[1:])))
        elif parts[0] == "ficco_select":
            on_disk.add(".".join(parts))
    assert sorted(config["packages"]) == sorted(on_disk)


def _modules_the_wheel_holds() -> set[str]:
    """Every module and package the package list installs, from the files on disk."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = set()
    for package in config["packages"]:
        top = config["package-dir"].get(".".join(package.split(".")[:2]))
        folder = ROOT.joinpath(top, *package.split(".")[2:]) if top else ROOT.joinpath(*package.split("."))
        names.add(package)
        names.update(f"{package}.{f.stem}" for f in folder.glob("*.py") if f.stem != "__init__")
    return names - {"ficco_select"}


_WALK = ("import pkgutil, ficco_select; "
         "print('\\n'.join(sorted(m.name for m in pkgutil.walk_packages(ficco_select.__path__, 'ficco_select.'))))")


def test_the_checkout_maps_only_the_stages_into_the_package(tmp_path):
    # Not the checkout's root: the package, its tests, benchmarks or scripts are no submodules
    # of it (a second copy of the package would hold a second table of the job's machines).
    for name in ("ficco_select", "tests", "benchmarks", "examples", "scripts", "mlruns", "docs"):
        done = subprocess.run([sys.executable, "-c", f"import ficco_select.{name}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert "ModuleNotFoundError: No module named 'ficco_select." + name in done.stderr, (name, done.stderr[-500:])
    # What doc tools and `pytest --doctest-modules` walk: the wheel's modules, once each, and no deeper.
    walked = subprocess.run([sys.executable, "-c", _WALK], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, check=True).stdout.split()
    assert len(walked) == len(set(walked))
    assert set(walked) == _modules_the_wheel_holds()


def _run(python: Path, ficco: Path, cwd: Path, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    env.pop("PYTHONPATH", None)
    command = [str(ficco), *args] if args else [str(python), "-c",
                                                "from ficco_select.runtime.selector import Selector; Selector"]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    assert DECOY not in done.stdout + done.stderr
    return done.stdout


def _use_from_decoys(python: Path, ficco: Path, folder: Path) -> None:
    """Import the runtime, then `ficco --help` and `ficco select`."""
    scenarios = folder / "scenarios.csv"
    scenarios.write_text("group,op,m,n,k,dtype,world_size,hardware\n"
                         "llama3,ag_gemm,4096,4096,4096,bfloat16,8,h100-nvswitch\n")
    _run(python, ficco, folder)
    _run(python, ficco, folder, "--help")
    _run(python, ficco, folder, "select", "--scenarios", str(scenarios), "--heuristic-only")


@pytest.mark.slow
def test_the_wheel_runs_beside_a_users_generic_folders(tmp_path):
    source, wheels = tmp_path / "source", tmp_path / "wheels"  # a copy: setuptools leaves build/ behind
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "out", "build", "site", "mlruns", "*.egg-info",
                                                                "__pycache__", "mlflow.db"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("ficco_select-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    installed = sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth")))
    assert installed == ["ficco_select"], installed
    # The dependencies (torch, pandas, mlflow, ...) come from this venv, after the wheel's folder:
    # a path line in a .pth does not run that folder's own .pth files (this checkout's editable
    # finder stays out).
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    folder, ficco = decoy_folder(tmp_path / "work"), venv / "bin" / "ficco"
    _use_from_decoys(python, ficco, folder)
    walked = subprocess.run([str(python), "-c", _WALK], cwd=folder, capture_output=True, text=True, timeout=120,
                            check=True).stdout.split()
    assert set(walked) == _modules_the_wheel_holds()  # the checkout's walk is held to the same list
    # The debug pipeline runs every stage on its slice from the installed files alone (the
    # packaged scenario tables, measurements and presets): the evaluation of the pipeline's
    # selector kinds on every split, MLflow, the registry, the report (it never exports).
    summary = json.loads(_run(python, ficco, folder, "pipeline", "--debug", "--no-progress", "--json",
                              "--out", str(folder / "p"), timeout=600))
    assert set(summary["tables"]) >= {"family", "hardware", "topology"} and summary["version"] == "1"
    assert "shipped" in summary["tables"]["hardware"] and (folder / "p" / "report.html").exists()


def test_the_editable_install_runs_beside_a_users_generic_folders(tmp_path):
    _use_from_decoys(Path(sys.executable), Path(sys.executable).parent / "ficco", decoy_folder(tmp_path / "work"))
