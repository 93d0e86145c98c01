#!/usr/bin/env bash
# Set up and run the test suite (CPU). GPU tests live in tests/gpu and run via scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q --ignore=tests/gpu "$@"
