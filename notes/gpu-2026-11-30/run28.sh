#!/usr/bin/env bash
# Device call 28 (1 x H200): engine tests + A/B of local errors off the main stream.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r28; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 200 python3 $ROOT/.gpu/ab28.py $W/ab28.json > $W/ab28_log.txt 2>&1
cd /tmp && tar czf $OUT/run28.tgz r28
(tail -5 $W/pytest_gpu.txt; tail -30 $W/ab28_log.txt) | tee $OUT/summary.txt
