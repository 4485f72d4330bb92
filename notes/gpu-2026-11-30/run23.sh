#!/usr/bin/env bash
# Device call 23 (1 x H200): A/B of stream priorities and update overlap in the captured step; engine tests.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r23; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
cd benchmarks
timeout 150 python3 $ROOT/.gpu/ab23.py $W/ab23.json > $W/ab23_log.txt 2>&1
cd $ROOT
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py > $W/pytest_engine.txt 2>&1
cd /tmp && tar czf $OUT/run23.tgz r23
{ cat $W/ab23_log.txt | tail -30; grep -E "passed|failed|FAILED|ERROR" $W/pytest_engine.txt | tail -4; } > $OUT/summary.txt
cat $OUT/summary.txt
