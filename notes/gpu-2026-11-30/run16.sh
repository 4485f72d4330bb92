#!/usr/bin/env bash
# Device call 16 (1 x H200): row-kernel column split sweep, then the kernel tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > /dev/null 2>&1
timeout 200 python3 .gpu/sweep3.py $OUT/sweep3.json > $OUT/sweep3_log.txt 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py > $OUT/pytest_kernels.txt 2>&1
cat $OUT/sweep3_log.txt; tail -5 $OUT/pytest_kernels.txt
