"""The runtime package stays light: no pandas, scikit-learn, mlflow or downstream stages."""

import subprocess
import sys

FORBIDDEN = ["pandas", "sklearn", "mlflow", "xgboost", "data", "features", "train", "ficco_cli"]


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_vocabulary_imports_no_torch_and_nothing_downstream():
    mods = loaded_after("import ficco_select")
    assert "torch" not in mods
    assert not mods & set(FORBIDDEN)


def test_executor_imports_nothing_downstream():
    mods = loaded_after("import ficco_select.executor.cpu")
    assert "torch" in mods
    assert not mods & set(FORBIDDEN)


def test_features_and_heuristic_stay_light():
    mods = loaded_after("import features, ficco_select.heuristic, ficco_select.hardware")
    assert not mods & {"pandas", "sklearn", "mlflow", "xgboost", "torch", "data", "train"}


def test_framework_hooks_stay_light():
    # What a training job imports: the ops, the hooks, the selector with a decision made.
    mods = loaded_after("import ficco_select.tp, ficco_select.torch_ops; from ficco_select.selector import Selector; "
                        "from ficco_select import Scenario; Selector().select(Scenario(group='g', op='ag_gemm', "
                        "m=64, n=64, k=64, dtype='bfloat16', world_size=8, hardware='mi300x-8'))")
    assert not mods & {"pandas", "sklearn", "mlflow", "xgboost", "data", "train", "ficco_cli"}


def test_reading_and_simulating_datasets_loads_no_torch():
    # Training reads Parquet and simulates; only measuring needs the executor.
    mods = loaded_after("import data.dataset, data.simulate, data.machines, train.training_data")
    assert "torch" not in mods and "ficco_select.executor" not in mods
