#!/usr/bin/env bash
# Everything the H200 run needs in one command: the GPU tests, then the GPU benchmarks and a
# kernel profile. Writes under $OUT (default ./out): pytest_gpu.txt, gpu_*.json, gpu_scaling.png,
# profile.json, bench.log. Usage: OUT=/tmp/out bash scripts/gpu_batch.sh [tests|throughput|memory|scaling|profile|wheel]...
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH=$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export GIT_DIR=/nonexistent  # the copy has no .git of its own: _common.environment() then reads GIT_COMMIT
export GIT_COMMIT=${GIT_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
stages=${*:-tests throughput memory scaling profile wheel}
log=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >>"$log" 2>&1
for s in $stages; do
  echo "=== $s $(date -u +%T)" | tee -a "$log"
  case $s in
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_backend.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -4 ;;
    throughput) (cd benchmarks && timeout 200 python3 gpu_throughput.py --out "$OUT/gpu_throughput.json") >>"$log" 2>&1 ;;
    memory) (cd benchmarks && timeout 120 python3 gpu_memory.py --out "$OUT/gpu_memory.json") >>"$log" 2>&1 ;;
    scaling) (cd benchmarks && timeout 120 python3 gpu_scaling.py --out "$OUT/gpu_scaling.json" && cp results/gpu_scaling.png "$OUT/") >>"$log" 2>&1 ;;
    profile) (cd benchmarks && timeout 60 python3 _gpu_profile.py ${PROFILE:-mnist-medium-3 1024} > "$OUT/profile.json") >>"$log" 2>&1 ;;
    wheel) (cd benchmarks && timeout 200 python3 -c "
import json, sys
sys.argv = ['x']
from gpu_throughput import run_wheel
rows = run_wheel('${WHEEL:-$ROOT/.whl/torch_dad-2026.5.24-py3-none-any.whl}',
                 [(t, b) for t in ('mnist-medium-3', 'fmnist-wide-2', 'cifar10-medium-3', 'deep-8x1024') for b in (1024, 4096)], 180)
json.dump(rows, open('$OUT/wheel.json', 'w'), indent=1)
print(rows)") >>"$log" 2>&1 ;;
  esac
done
tail -60 "$log"
