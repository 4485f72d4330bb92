#!/usr/bin/env bash
# Device call 44 (1 x H200): defer_last_update A/B after the gate fix (ab44.py), with a timeline, and the kernel tests.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r44; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 150 python3 .gpu/ab44.py $W/ab44.json $W/trace44.json > $W/ab44_log.txt 2>&1
gzip -f $W/trace44.json
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py -k adamw > $W/pytest_adamw.txt 2>&1
python3 benchmarks/_gpu_timeline.py $W/trace44.json.gz > $W/timeline44.txt 2>&1
cd /tmp && tar czf $OUT/run44.tgz r44
{ tail -2 $W/pytest_adamw.txt; cat $W/ab44_log.txt | grep -v Warn | tail -20; head -60 $W/timeline44.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
