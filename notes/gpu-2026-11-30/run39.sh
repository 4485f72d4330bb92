#!/usr/bin/env bash
# Device call 39 (1 x H200): stream priorities A/B, the engine tests that cover them, a timeline.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r39; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 90 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py -k "overlap" > $W/pytest_engine.txt 2>&1
cd benchmarks
timeout 240 python3 $ROOT/.gpu/ab39.py $W/ab39.json $W/trace39.json > $W/ab39_log.txt 2>&1
gzip -f $W/trace39.json
cd /tmp && tar czf $OUT/run39.tgz r39
{ tail -3 $W/pytest_engine.txt; tail -20 $W/ab39_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
