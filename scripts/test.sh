#!/usr/bin/env bash
# Sets up .venv with the test extras (again only when pyproject.toml or scripts/setup.sh changed since), then
# runs lint, the type check, benchmark smoke modes and every test: the CPU pass, then the kernel tests under
# triton's CPU interpreter. CONTRIBUTING.md has the quick loop and what each stage costs.
set -euo pipefail
cd "$(dirname "$0")/.."
# one thread: on a busy 2-core machine two OpenMP threads per process spin against each other
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
stamp="$(cat pyproject.toml scripts/setup.sh | sha256sum) test,dev"
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.setup-stamp 2>/dev/null)" != "$stamp" ]; then
  bash scripts/setup.sh test,dev
  printf '%s\n' "$stamp" >.venv/.setup-stamp
fi
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
# the smoke modes two at a time, one thread each (72 s instead of 156 s on a 2-core machine)
find benchmarks -maxdepth 1 -name '[!_]*.py' -print0 | sort -z |
  xargs -0 -P 2 -I{} sh -c 'cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python "$(basename "$1")" --smoke >/dev/null' _ {}
# every test, slow ones included, on two workers (one per core)
.venv/bin/python -m pytest -q -x -n 2
# every Triton kernel and the fused engine against their float64 references, on CPU through triton's
# interpreter (bf16 swapped for fp16, which the interpreter handles); the tests marked no_kernel ran above
if .venv/bin/python -c "import triton" 2>/dev/null; then
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -x -n 2 -m "not no_kernel" tests/gpu tests/test_autograd_fast_path.py
fi
