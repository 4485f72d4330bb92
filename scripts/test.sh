#!/usr/bin/env bash
# Sets up .venv with the test extras, then runs lint, the type check, benchmark smoke modes and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,dev
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
for script in benchmarks/*.py; do
  case "$(basename "$script")" in _*) continue ;; esac
  (cd benchmarks && ../.venv/bin/python "$(basename "$script")" --smoke >/dev/null)
done
.venv/bin/python -m pytest -q -x
