#!/usr/bin/env bash
# Device call 35 (1 x H200): the fused weight-gradient + AdamW kernel: kernel and engine tests, sweep, in-step A/B, trace.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r35; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf -x tests/gpu/test_kernels.py -k weight_grad > $W/pytest_kernel.txt 2>&1
cd benchmarks
timeout 330 python3 $ROOT/.gpu/ab35.py $W/ab35.json $W/trace35.json > $W/ab35_log.txt 2>&1
gzip -f $W/trace35.json
cd $ROOT
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py tests/test_backend.py > $W/pytest_engine.txt 2>&1
cd /tmp && tar czf $OUT/run35.tgz r35
{ tail -3 $W/pytest_kernel.txt; grep -E "unfused|us/step" $W/ab35_log.txt; tail -3 $W/ab35_log.txt; tail -3 $W/pytest_engine.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
