#!/usr/bin/env bash
# Serve one model over several devices with a self-speculative method.
#   bash scripts/serve_tp.sh MODEL_DIR TP_SIZE '{"method": "del", "heads": "..."}' [vllm serve args]
# Uses the Ray cluster this node belongs to (scripts/ray_cluster.sh): checks every
# node first (scripts/check_nodes.py), then runs
#   vllm serve MODEL_DIR --tensor-parallel-size TP_SIZE --distributed-executor-backend ray
#       --speculative-config SPEC ...
# BACKEND=mp serves from this node's devices without Ray. On a CPU-only machine
# the Ray path needs SELFSPEC_RAY_CPU=1 (vLLM's CPU platform has no Ray device key).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: $0 MODEL_DIR TP_SIZE SPEC_JSON [vllm serve args]" >&2; exit 2; }
MODEL=$1 TP=$2 SPEC=$3
shift 3
BIN=.venv/bin
[ -x "$BIN/vllm" ] || BIN=$(dirname "$(command -v vllm)")
BACKEND=${BACKEND:-ray}
if [ "$BACKEND" = ray ]; then
    export RAY_ADDRESS=${RAY_ADDRESS:-auto}
    DEVICES=$TP
    [ "${SELFSPEC_RAY_CPU:-}" = 1 ] && DEVICES=0  # CPU-only: no GPUs to count
    "$BIN/python" scripts/check_nodes.py --model "$MODEL" --devices "$DEVICES"
fi
exec "$BIN/vllm" serve "$MODEL" --tensor-parallel-size "$TP" \
    --distributed-executor-backend "$BACKEND" --speculative-config "$SPEC" "$@"
