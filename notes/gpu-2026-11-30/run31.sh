#!/usr/bin/env bash
# Device call 31 (1 x H200): every GPU test file at the session's final code.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r31; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 480 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu > $W/pytest_gpu_all.txt 2>&1
cd /tmp && tar czf $OUT/run31.tgz r31
tail -8 $W/pytest_gpu_all.txt | tee $OUT/summary.txt
