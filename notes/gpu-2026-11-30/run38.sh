#!/usr/bin/env bash
# Device call 38 (1 x H200): the kernel/engine test command at the final code, and a timeline of the default step.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r38; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 280 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 60 python3 $ROOT/.gpu/trace38.py $W/trace38.json > $W/trace38_log.txt 2>&1
gzip -f $W/trace38.json
cd /tmp && tar czf $OUT/run38.tgz r38
{ tail -4 $W/pytest_gpu.txt; tail -3 $W/trace38_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
