#!/usr/bin/env bash
# Device call 36 (1 x H200): the fused-update kernel tests (fixed float64 reference) and the kernel's cost breakdown.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r36; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py -k weight_grad > $W/pytest_kernel.txt 2>&1
timeout 300 python3 $ROOT/.gpu/ab36.py $W/ab36.json > $W/ab36_log.txt 2>&1
cd /tmp && tar czf $OUT/run36.tgz r36
{ tail -3 $W/pytest_kernel.txt; cat $W/ab36_log.txt | tail -30; } > $OUT/summary.txt
cat $OUT/summary.txt
