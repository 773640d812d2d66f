#!/usr/bin/env bash
# Run the test suite (installs first if this checkout has no environment yet).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run
exec .venv/bin/python -m pytest -q --durations=0 --durations-min=10 "$@"
