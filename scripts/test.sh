#!/usr/bin/env bash
# Sets up .venv with the test extras, then runs lint, the type check, benchmark smoke modes and pytest,
# then the kernel tests under triton's CPU interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,dev
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
for script in benchmarks/*.py; do
  case "$(basename "$script")" in _*) continue ;; esac
  (cd benchmarks && ../.venv/bin/python "$(basename "$script")" --smoke >/dev/null)
done
.venv/bin/python -m pytest -q -x
# every Triton kernel and the fused engine against their float64 references, on CPU through
# triton's interpreter (bf16 swapped for fp16, which the interpreter handles); about 2 minutes
if .venv/bin/python -c "import triton" 2>/dev/null; then
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -x tests/gpu tests/test_autograd_fast_path.py
fi
