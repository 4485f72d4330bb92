#!/usr/bin/env bash
# Device call 27 (1 x H200): the kernel/engine/backend tests on the session's final engine.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r27; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py tests/gpu/test_kernels.py \
  tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd /tmp && tar czf $OUT/run27.tgz r27
tail -5 $W/pytest_gpu.txt | tee $OUT/summary.txt
