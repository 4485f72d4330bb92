#!/usr/bin/env bash
# Device call 37 (1 x H200): the kernel/engine test command with the fused-update kernel, and the A/B of its default.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r37; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 260 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 250 python3 $ROOT/.gpu/ab37.py $W/ab37.json > $W/ab37_log.txt 2>&1
cd /tmp && tar czf $OUT/run37.tgz r37
{ tail -4 $W/pytest_gpu.txt; cat $W/ab37_log.txt | tail -20; } > $OUT/summary.txt
cat $OUT/summary.txt
