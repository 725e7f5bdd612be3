"""The import graph follows the data (each package's README says what it must not import).

vocabulary (``ficco_select``) <- executor (``ficco_select.executor``) <- runtime
(``ficco_select.runtime``). The ``features`` stage (``ficco_select.features``) imports only
the vocabulary; the runtime selector imports it: the one arrow from the runtime to a stage
(checked below, file by file, so that it never closes a circle). ``data`` (measurement,
datasets, simulator), ``train`` and the command (``ficco_select.cli``) use them. Each case
imports in a fresh interpreter and lists what got loaded.
"""

import subprocess
import sys

FEATURES = "ficco_select.features"
OFFLINE = {"pandas", "sklearn", "mlflow", "xgboost", "ficco_select.data", "ficco_select.train", "ficco_select.cli"}


def loaded_after(code: str) -> set[str]:
    code = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_vocabulary_imports_no_torch_and_nothing_downstream():
    mods = loaded_after("import ficco_select, ficco_select.costs, ficco_select.heuristic, ficco_select.signatures")
    assert "torch" not in mods
    assert not mods & (OFFLINE | {FEATURES, "ficco_select.executor", "ficco_select.runtime"})


def test_the_executor_imports_torch_and_no_runtime_or_offline_tool():
    mods = loaded_after("import ficco_select.executor.operators, ficco_select.executor.peer")
    assert "torch" in mods
    assert not mods & (OFFLINE | {FEATURES, "ficco_select.runtime"})


def test_features_stay_light():
    mods = loaded_after("import ficco_select.features")
    assert not mods & (OFFLINE | {"torch", "ficco_select.executor", "ficco_select.runtime"})
    assert {FEATURES, "ficco_select.features.extract", "ficco_select.costs"} <= mods


def test_the_runtime_imports_features_from_the_policy_and_the_export_s_readers_only():
    # The one arrow up: which files of the runtime package import the features, read from
    # their source (the command, ficco_select/cli, is a stage's user like train).
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    importers = set()
    for path in sorted((root / "ficco_select").rglob("*.py")):
        if "cli" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == FEATURES or n.startswith(FEATURES + ".") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers <= {"ficco_select/runtime/policy.py", "ficco_select/runtime/loading.py",
                         "ficco_select/runtime/scope.py"}
    assert "ficco_select/runtime/policy.py" in importers
    # And features never reaches back into the runtime, data or train (no circle of files).
    for path in sorted((root / "features").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                assert node.module.split(".")[:2] not in (["ficco_select", part] for part in (
                    "runtime", "executor", "data", "train", "cli")), (path, node.module)


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
    from helpers.exports import RECORD, write_selector

    folder = write_selector(tmp_path / "sel")
    mods = loaded_after(
        "from ficco_select.runtime.selector import Selector\n"
        f"d = Selector.load({str(folder)!r}).select({RECORD!r})\n"
        "assert d.source == 'model', d")
    assert not mods & OFFLINE


def test_measuring_loads_no_feature_or_training_code():
    mods = loaded_after("import ficco_select.data.measure.sweep, ficco_select.data.gpu_profile.run")
    assert "torch" in mods
    assert not mods & {FEATURES, "ficco_select.train", "ficco_select.cli", "sklearn", "mlflow", "xgboost",
                       "ficco_select.runtime"}


def test_reading_and_simulating_datasets_loads_no_torch():
    # Training reads Parquet and simulates; only measuring needs the executor.
    mods = loaded_after("import ficco_select.data.dataset, ficco_select.data.simulate, ficco_select.data.calibrate, "
                        "ficco_select.data.machines, ficco_select.data.telemetry, ficco_select.data.catalog, "
                        "ficco_select.data.scenarios, ficco_select.train.training_data")
    assert not mods & {"torch", "ficco_select.executor", "ficco_select.data.measure.harness", "ficco_select.runtime.selector"}


def test_nothing_but_ficco_select_is_imported_at_the_top_level():
    # The stages and the command load as ficco_select.*: no generic top-level name (data,
    # features, train) that a user's own folder of that name could shadow or be shadowed by.
    mods = loaded_after("import ficco_select.cli.main, ficco_select.train.pipeline, ficco_select.data.measure.sweep")
    assert not {m.split(".")[0] for m in mods} & {"data", "features", "train", "ficco_cli"}


def test_no_test_module_imports_from_another():
    # What tests share lives in tests/helpers/ and conftest.py, where a newcomer looks for it.
    import ast
    import pathlib

    tests = pathlib.Path(__file__).resolve().parent
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.startswith("test_")], (path.name, names)
