#!/usr/bin/env bash
# A Ray cluster for serving one model over several GPU nodes.
#   bash scripts/ray_cluster.sh head                 # on the head node (port 6379)
#   bash scripts/ray_cluster.sh worker HEAD_IP:6379  # on every other node
#   bash scripts/ray_cluster.sh stop                 # on any node
# NODE_IP overrides the address this node announces (default: its first IP);
# every node needs the same vLLM, vllm-selfspec and model path: check with
# scripts/check_nodes.py, then start the server with scripts/serve_tp.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY=ray
[ -x .venv/bin/ray ] && RAY=.venv/bin/ray
NODE_IP=${NODE_IP:-$(hostname -I | awk '{print $1}')}
case "${1:-}" in
    head)
        exec "$RAY" start --head --node-ip-address="$NODE_IP" --port="${PORT:-6379}" \
            --disable-usage-stats ;;
    worker)
        [ -n "${2:-}" ] || { echo "usage: $0 worker HEAD_IP:PORT" >&2; exit 2; }
        exec "$RAY" start --address="$2" --node-ip-address="$NODE_IP" ;;
    stop)
        exec "$RAY" stop ;;
    *)
        echo "usage: $0 head | worker HEAD_IP:PORT | stop" >&2; exit 2 ;;
esac
