"""The import graph follows the data (each package's README says what it must not import).

vocabulary (``ficco_select``) <- executor (``ficco_select.executor``) <- runtime
(``ficco_select.runtime``). The top-level ``features`` stage imports only the vocabulary;
the runtime selector imports it: the one arrow from ``ficco_select`` to a stage above the
vocabulary (checked below, file by file, so that it never closes a circle).
``data`` (measurement, datasets, simulator) and ``train`` use them. Each case imports in a
fresh interpreter and lists what got loaded.
"""

import subprocess
import sys

OFFLINE = {"pandas", "sklearn", "mlflow", "xgboost", "data", "train", "ficco_cli"}


def loaded_after(code: str) -> set[str]:
    code = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_vocabulary_imports_no_torch_and_nothing_downstream():
    mods = loaded_after("import ficco_select, ficco_select.costs, ficco_select.heuristic, ficco_select.signatures")
    assert "torch" not in mods
    assert not mods & (OFFLINE | {"features", "ficco_select.executor", "ficco_select.runtime"})


def test_the_executor_imports_torch_and_no_runtime_or_offline_tool():
    mods = loaded_after("import ficco_select.executor.operators, ficco_select.executor.peer")
    assert "torch" in mods
    assert not mods & (OFFLINE | {"features", "ficco_select.runtime"})


def test_features_stay_light():
    mods = loaded_after("import features")
    assert not mods & (OFFLINE | {"torch", "ficco_select.executor", "ficco_select.runtime"})
    assert {"features", "features.extract", "ficco_select.costs"} <= mods


def test_the_runtime_imports_features_from_the_selector_only():
    # The one arrow up: which runtime files import `features`, read from their source.
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    importers = set()
    for path in sorted((root / "ficco_select").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "features" or n.startswith("features.") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers == {"ficco_select/runtime/selector.py"}
    # And features never reaches back into the runtime, data or train (no circle of files).
    for path in sorted((root / "features").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top = node.module.split(".")
                assert top[0] not in {"data", "train", "ficco_cli"}, (path, node.module)
                assert node.module.split(".")[:2] not in (["ficco_select", "runtime"], ["ficco_select", "executor"]), \
                    (path, node.module)


def test_the_runtime_on_the_heuristic_path_stays_light():
    # What a training job imports: the ops (registered too), the hooks, the DTensor styles, the
    # compile pass, the scheduler's estimates, the selector with a decision made.
    mods = loaded_after(
        "import ficco_select.runtime.tp, ficco_select.runtime.torch_ops, ficco_select.runtime.library\n"
        "import ficco_select.runtime.dtensor, ficco_select.runtime.compile, ficco_select.runtime.estimate\n"
        "from ficco_select.runtime.selector import Selector\n"
        "from ficco_select import Scenario\n"
        "d = Selector.load('/nonexistent').select(Scenario(group='g', op='ag_gemm', m=64, n=64, k=64,"
        " dtype='bfloat16', world_size=8, hardware='mi300x-8'))\n"
        "assert d.source == 'heuristic', d")
    assert not mods & OFFLINE


def test_the_runtime_on_the_model_path_stays_light(tmp_path):
    from test_selector_runtime import RECORD, write_selector

    folder = write_selector(tmp_path / "sel")
    mods = loaded_after(
        "from ficco_select.runtime.selector import Selector\n"
        f"d = Selector.load({str(folder)!r}).select({RECORD!r})\n"
        "assert d.source == 'model', d")
    assert not mods & OFFLINE


def test_measuring_loads_no_feature_or_training_code():
    mods = loaded_after("import data.measure.sweep, data.gpu_profile.run")
    assert "torch" in mods
    assert not mods & {"features", "train", "ficco_cli", "sklearn", "mlflow", "xgboost", "ficco_select.runtime"}


def test_reading_and_simulating_datasets_loads_no_torch():
    # Training reads Parquet and simulates; only measuring needs the executor.
    mods = loaded_after("import data.dataset, data.simulate, data.calibrate, data.machines, data.telemetry, "
                        "data.catalog, data.scenarios, train.training_data")
    assert not mods & {"torch", "ficco_select.executor", "data.measure.harness", "ficco_select.runtime.selector"}
