#!/usr/bin/env bash
# Characterize one GPU for ficco-select, in under 8 minutes, writing as it goes.
#
#   scripts/gpu_check.sh [OUT_DIR]        # OUT_DIR: $OUT if set, else gpu_check_out/
#
# What it leaves in OUT_DIR (profile.json is documented in data/profiles/README.md):
#   env.txt           nvidia-smi, the Python and torch that ran
#   profile.json      GEMM peak and DIL curve, copy-engine / SM copy latency and bandwidth,
#                     CIL (GEMM beside a dma / sm copy), loopback correctness of every
#                     schedule and realized fraction of ideal speedup; rewritten after every
#                     section, so a timeout still leaves what was measured
#   gpu_profile.log   progress of the sections
#   spec.yaml         a hardware spec calibrated from profile.json (ficco hardware from-profile)
#   cuda_tests.log    the test suite's CUDA tests (pytest -m cuda): loopback on this GPU, and
#                     node mode (a process per GPU) where the machine has two or more
#
# Environment: PYTHON (interpreter with a CUDA build of torch; default: the first of
# .venv/bin/python, python3, python that sees a GPU), FICCO_GPU_BUDGET_S (seconds for the
# measurements, default 300), FICCO_GPU_TESTS_S (seconds kept for the CUDA tests, default
# 90; 0 skips them), FICCO_BASE_PRESET (spec the profile refines; default: the
# preset gpu_profile matched to the device name, else h200-nvswitch), FICCO_GPU_TOTAL_S
# (hard bound for the whole script, default 465 s: under 8 min).
# Time: the measurements get the budget, cut so that they (stopped by TERM 30 s after the
# budget, KILL 10 s later), the spec step (<= 40 s) and the tests end within the total.
set -uo pipefail

OUT_DIR="${OUT:-${1:-gpu_check_out}}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"  # absolute: relative to the caller's folder
cd "$(dirname "$0")/.."
BUDGET_S="${FICCO_GPU_BUDGET_S:-300}"
TESTS_S="${FICCO_GPU_TESTS_S:-90}"
BUDGET_S="${BUDGET_S%.*}"
TOTAL_S="${FICCO_GPU_TOTAL_S:-465}"
started=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - started ))s] $*"; }

pick_python() {
    local candidates=() c
    [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
    [ -x .venv/bin/python ] && candidates+=(.venv/bin/python)
    candidates+=(python3 python)
    for c in "${candidates[@]}"; do
        if timeout 30 "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    for c in "${candidates[@]}"; do  # none sees a GPU: the first with torch reports why
        if timeout 30 "$c" -c "import torch" 2>/dev/null; then echo "$c"; return 0; fi
    done
    return 1
}

PY=$(pick_python) || { say "no Python with torch found (set PYTHON)"; exit 2; }
say "python: $PY; out: $OUT_DIR; budget: ${BUDGET_S}s"

{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    echo "# python: $PY"
    timeout 20 "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
    echo "# nvidia-smi"
    timeout 10 nvidia-smi 2>&1 || echo "(nvidia-smi not available)"
    timeout 10 nvidia-smi topo -m 2>&1 || true
} > "$OUT_DIR/env.txt"

left=$(( TOTAL_S - ($(date +%s) - started) - 50 - TESTS_S ))  # 10 s KILL grace + 40 s spec step
limit=$(( BUDGET_S + 30 < left ? BUDGET_S + 30 : left ))
BUDGET_S=$(( limit - 30 ))
if [ "$BUDGET_S" -lt 30 ]; then say "only ${left}s left of ${TOTAL_S}s: not measuring"; exit 2; fi
say "measuring for up to ${BUDGET_S}s (profile.json is rewritten as sections finish)"
timeout -k 10 "$limit" "$PY" -m ficco_select.data.gpu_profile.run \
    --out "$OUT_DIR" --budget-s "$BUDGET_S" 2>&1 | tee "$OUT_DIR/gpu_profile.log"
rc=${PIPESTATUS[0]}
case $rc in
    0) say "measurements done" ;;
    2) say "gpu_profile could not run (see above); nothing measured"; exit 2 ;;
    3) say "a section hung and was abandoned; profile.json has the rest" ;;
    124|137|143) say "measurements stopped by the time limit (rc $rc); profile.json has what finished" ;;
    *) say "gpu_profile exited with rc $rc; profile.json has what finished" ;;
esac

if [ -f "$OUT_DIR/profile.json" ]; then
    base="${FICCO_BASE_PRESET:-$(timeout 5 "$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('preset') or 'h200-nvswitch')" "$OUT_DIR/profile.json" 2>/dev/null || echo h200-nvswitch)}"
    say "spec from profile (base $base)"
    rm -f "$OUT_DIR/spec.yaml"  # an earlier run's, of the profile just rewritten (from-profile keeps any --out)
    timeout 30 "$PY" -m ficco_select.cli.main hardware from-profile "$OUT_DIR/profile.json" \
        --base "$base" --out "$OUT_DIR/spec.yaml" 2>&1 | tee "$OUT_DIR/spec.log" \
        || say "could not write spec.yaml (see spec.log); run 'ficco hardware from-profile' later"
    timeout 5 "$PY" - "$OUT_DIR/profile.json" <<'EOF' || true
import json, sys
p = json.load(open(sys.argv[1]))
print("sections:", ", ".join(f"{k}={v['status']}" for k, v in p.get("sections", {}).items()))
print("fitted:", json.dumps(p.get("fitted", {}), sort_keys=True))
lb = p.get("loopback", {})
if "correctness_summary" in lb:
    print("loopback correctness:", lb["correctness_summary"])
for r in lb.get("realized", []):
    s = r["scenario"]
    print(f"realized {s['op']} m={s['m']} n={s['n']} k={s['k']} P={s['world_size']}: "
          f"best {r.get('best')} fraction {r.get('best_realized_fraction')} {r.get('error', '')}")
    for engine, b in sorted(r.get("best_by_engine", {}).items()):
        print(f"    best {engine}: {b['schedule']} fraction {b['realized_fraction']} speedup {b['realized_speedup']}")
EOF
fi
left=$(( TOTAL_S - ($(date +%s) - started) - 5 ))
if [ "$TESTS_S" -gt 0 ] && [ "$left" -gt 20 ]; then
    if timeout 20 "$PY" -c "import pytest" 2>/dev/null; then
        say "CUDA tests (pytest -m cuda) for up to ${left}s -> cuda_tests.log"
        # Only the files that hold CUDA tests: the others import mlflow and xgboost, which a
        # GPU image may lack, and a collection error would stop every test. Quickest first
        # (the dma protocol on symmetric memory, a sweep), the long loopback matrix last.
        timeout -k 5 "$left" "$PY" -m pytest -v -rs -m cuda -p no:cacheprovider \
            tests/test_node.py tests/test_measure_loopback.py tests/test_loopback.py tests/test_telemetry.py \
            > "$OUT_DIR/cuda_tests.log" 2>&1
        trc=$?
        tail -n 15 "$OUT_DIR/cuda_tests.log"
        say "CUDA tests: rc $trc (0 = all passed; 124 = cut by the time limit)"
    else
        say "pytest is not installed for $PY: CUDA tests not run (pip install pytest hypothesis)"
    fi
fi
say "done; results in $OUT_DIR"
[ "$rc" -eq 0 ] || exit "$rc"
