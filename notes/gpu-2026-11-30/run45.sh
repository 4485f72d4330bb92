#!/usr/bin/env bash
# Device call 45 (1 x H200): ab45.py (AdamW on few programs, per-layer head updates, deferral), two timelines, kernel tests.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r45; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py -k adamw > $W/pytest_adamw.txt 2>&1
timeout 240 python3 .gpu/ab45.py $W/ab45.json $W/trace45-P66.json $W/trace45-deferred-P66.json > $W/ab45_log.txt 2>&1
gzip -f $W/trace45-*.json
for t in P66 deferred-P66; do python3 benchmarks/_gpu_timeline.py $W/trace45-$t.json.gz > $W/timeline45-$t.txt 2>&1; done
cd /tmp && tar czf $OUT/run45.tgz r45
{ tail -2 $W/pytest_adamw.txt; grep -v -i warn $W/ab45_log.txt | tail -60; tail -1 $W/timeline45-P66.txt; tail -1 $W/timeline45-deferred-P66.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
