#!/usr/bin/env bash
# Sets up .venv with the test extras, then runs lint, the type check, benchmark smoke modes and pytest,
# then the kernel tests under triton's CPU interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,dev
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
# the smoke modes two at a time, one thread each (72 s instead of 156 s on a 2-core machine)
find benchmarks -maxdepth 1 -name '[!_]*.py' -print0 | sort -z |
  xargs -0 -P 2 -I{} sh -c 'cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python "$(basename "$1")" --smoke >/dev/null' _ {}
.venv/bin/python -m pytest -q -x
# every Triton kernel and the fused engine against their float64 references, on CPU through
# triton's interpreter (bf16 swapped for fp16, which the interpreter handles); about 2 minutes
if .venv/bin/python -c "import triton" 2>/dev/null; then
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -x tests/gpu tests/test_autograd_fast_path.py
fi
