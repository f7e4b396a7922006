#!/usr/bin/env bash
# The `gpu` suite (issue 28) on a machine with an NVIDIA GPU: one prepared run, under
# 10 minutes, no network needed, bubblewrap optional (its test skips without it).
#
#   OUT=/some/dir PY=/path/to/python3 bash scripts/gpu_suite.sh
#
# PY: a Python with the project's dependencies (numpy, cryptography, tinygrad 0.14,
# pytest; the GPU kit's clean venv, see ../shared/gpu-machine-kit). Never DEV=NV there.
# WHEELS=dir: where pytest's wheels are (pytest, pluggy, iniconfig, packaging; all
# py3-none-any) if PY lacks pytest: installed from there, never from the network.
# Steps, each under its own timeout, never past TOTAL_S (default 540 s):
#   info     GPU, driver, toolkit, what is installed
#   verify   the signed CUDA demo verified for this GPU (its architecture, its driver)
#   selftest modeld's self-test on it outside a sandbox: refused if NVRTC is visible
#   gpu      pytest -m gpu tests/test_cuda_gpu.py: load through the driver alone, golden,
#            outputs vs the CPU artifact, receipts, refusal with NVRTC visible, a control
#            sandbox with and without the GPU's nodes, CPU vs CUDA p50/p99, a build here
#   cpu      the CPU-side CUDA tests (format, refusals, sandbox view) on this machine
# Results in $OUT: log.txt, steps.tsv, and the JSON files the gpu tests write
# (load, compare, latency, refusal_nvrtc, sandbox, build_here), summary.txt at the end.
# Started as `sh scripts/gpu_suite.sh` (dash on Debian) it said 'Bad substitution' and
# went on with its steps from the wrong root. Plain POSIX sh up to the re-run under bash.
if [ -z "${BASH_VERSION:-}" ]; then
    if command -v bash >/dev/null 2>&1 && [ -f "$0" ]; then exec bash "$0" "$@"; fi
    echo "scripts/gpu_suite.sh: needs bash: bash $0" >&2
    exit 2
fi
set -u
T0=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/gpu-suite-out}"
TOTAL_S="${TOTAL_S:-540}"
if [ -z "${PY:-}" ]; then PY=$(command -v python3); fi
export PY
mkdir -p "$OUT"
LOG="$OUT/log.txt"; STEPS="$OUT/steps.tsv"
: > "$LOG"; printf 'step\trc\tseconds\n' > "$STEPS"
export PYTHONPATH="$ROOT" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TRIO_GPU_OUT="$OUT"
export TRIO_STATE_DIR="${TRIO_STATE_DIR:-/tmp/trio-state-gpu-suite}"
mkdir -p "$TRIO_STATE_DIR"
unset DEV CUDA NV
cd "$ROOT" || exit 2

left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
say() { echo "$*" | tee -a "$LOG"; }

# step NAME MAX_S -- CMD...: run under timeout (at most what is left), log it.
step() {
    local name=$1 max=$2; shift 3
    local t; t=$(left); [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt 10 ]; then
        say "=== $name: skipped, budget spent"; printf '%s\tnobudget\t0\n' "$name" >> "$STEPS"
        return 0
    fi
    say ""; say "=== [$(( $(date +%s) - T0 ))s] $name (timeout ${t}s)"
    local s=$(date +%s)
    if [ "$(type -t "$1")" = function ]; then
        # a shell function: timeout runs a child bash that has it (it can be signalled)
        timeout -k 5 "$t" bash -c "$(declare -f "$1"); $*" 2>&1 | tee -a "$LOG"
    else
        timeout -k 5 "$t" "$@" 2>&1 | tee -a "$LOG"
    fi
    local rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$rc" $(( $(date +%s) - s )) >> "$STEPS"
    say "=== $name: rc $rc"
}

info() {
    nvidia-smi --query-gpu=name,uuid,driver_version,compute_cap,memory.total --format=csv 2>&1 || true
    head -1 /proc/driver/nvidia/version 2>&1 || true
    ls -l /dev/nvidia* 2>&1 || true
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, shutil, sys
print("python", sys.version.split()[0], platform.machine())
for d in ("numpy", "tinygrad", "cryptography", "pytest"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
print("clang", shutil.which("clang"), "bwrap", shutil.which("bwrap"))
from supervisor.model.cuda_runtime import visible_compilers
print("device-code compilers visible here:", visible_compilers()[:6])
EOF
}

verify() {
    "$PY" - <<'EOF'
import json, sys
from supervisor.model import ArtifactError, load_verified
from supervisor.model.cuda_runtime import Driver, probe_device
try:
    info, _ = probe_device(Driver())
except ArtifactError as e:
    sys.exit(f"no GPU: {type(e).__name__}: {e}")
print("device:", info)
with load_verified("models/demo/lane-offset-cuda", "models/demo/demo_ed25519.pub",
                   device_arch=info.arch, driver_version=info.driver) as v:
    print("chosen architecture:", v.cuda.arch)
    print("manifest runtime:", json.dumps(v.manifest["runtime"], sort_keys=True))
EOF
}

if ! "$PY" -c "import pytest" 2>/dev/null; then
    if [ -n "${WHEELS:-}" ]; then
        say "pytest missing: installing it from $WHEELS (no index)"
        "$PY" -m pip install --no-index --find-links "$WHEELS" pytest 2>&1 | tail -2 | tee -a "$LOG"
    fi
    "$PY" -c "import pytest" 2>/dev/null || { say "gpu_suite: $PY has no pytest (set WHEELS=dir with its wheels)"; exit 2; }
fi

step info 60 -- info
step verify 60 -- verify
# modeld's own self-test, as the worker loads (refuse_compilers: a control process): with
# the toolkit's NVRTC visible and no sandbox it must refuse in one line (CompilerVisible).
step selftest 60 -- "$PY" -m workers.modeld.selftest --artifact models/demo/lane-offset-cuda \
    --pubkey models/demo/demo_ed25519.pub --frames 2 --width 1928 --height 1208
step gpu 400 -- "$PY" -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_cuda_gpu.py
step cpu 90 -- "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_cuda_artifact.py tests/test_cuda_runtime.py

{
    echo "steps:"; cat "$STEPS"
    for f in load compare latency refusal_nvrtc sandbox build_here; do
        [ -f "$OUT/$f.json" ] && { echo "--- $f.json"; head -c 6000 "$OUT/$f.json"; echo; }
    done
    echo "total $(( $(date +%s) - T0 )) s"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
