#!/usr/bin/env bash
# Device call 52 (1 x H200): the kernel/engine test command at the final engine (call 51 cut it at
# 195 s, one test short), then gpu_memory.py.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r52; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
START=$SECONDS
timeout 330 python3 -m pytest -q -p no:cacheprovider -rf --durations=5 tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
echo "pytest rc $? in $((SECONDS-START)) s" >> $W/pytest_gpu.txt
cd benchmarks
timeout 90 python3 gpu_memory.py --out $W/gpu_memory.json > $W/memory_log.txt 2>&1
cd /tmp && tar czf $OUT/run52.tgz r52
{ tail -12 $W/pytest_gpu.txt; tail -12 $W/memory_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
