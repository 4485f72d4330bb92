#!/usr/bin/env bash
# Device call 61 (1 x H200): the reservoir and head-sample tests after the state_dict seed entry.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r61; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py tests/gpu/test_kernels.py -k "sample or reservoir" \
  tests/test_trainer.py > $W/pytest.txt 2>&1
echo "pytest rc $?" >> $W/pytest.txt
cd /tmp && tar czf $OUT/run61.tgz r61
tail -6 $W/pytest.txt > $OUT/summary.txt; cat $OUT/summary.txt
