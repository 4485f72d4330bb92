#!/usr/bin/env bash
# The contributor loop: lint, type check, import layers, then the tests not marked slow, on CPU and (with
# triton installed) the kernel tests under triton's CPU interpreter. Needs the .venv of scripts/setup.sh
# and never reinstalls it. Extra arguments go to both pytest runs, e.g. `bash scripts/quick.sh -k conv`.
set -euo pipefail
cd "$(dirname "$0")/.."
# one thread: on a busy 2-core machine two OpenMP threads per process spin against each other
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -x -n 2 -m "not slow" "$@"
if .venv/bin/python -c "import triton" 2>/dev/null; then
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -x -n 2 -m "not slow and not no_kernel" tests/gpu tests/test_autograd_fast_path.py "$@"
fi
