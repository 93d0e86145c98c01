#!/usr/bin/env bash
# Set up and run the test suite (CPU). GPU tests live in tests/gpu and run via scripts/gpu/test.sh on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The interpreter setup.sh installed into: $PYTHON, else the active virtual environment's, else .venv's.
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
# Test files run in parallel over the machine's cores (pytest-xdist; PYTEST_WORKERS=0 runs them in one process),
# each worker on one torch thread (tests/conftest.py sets OMP_NUM_THREADS=1 off a GPU: two workers' default thread
# pools on the same cores made some tests 10-20x slower). --dist loadfile keeps each file's tests (and its
# module-scoped fixtures: checkpoints, servers) in one worker, so no file should take more than a few minutes.
WORKERS=${PYTEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
if [ "$WORKERS" -gt 1 ]; then
  exec "$PY" -m pytest -q -n "$WORKERS" --dist loadfile --ignore=tests/gpu "$@"
fi
exec "$PY" -m pytest -q --ignore=tests/gpu "$@"
