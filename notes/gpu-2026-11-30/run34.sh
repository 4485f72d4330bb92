#!/usr/bin/env bash
# Device call 34 (1 x H200): the kernel/engine test command at the batch-dependent update_chunks default, and its A/B.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r34; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 200 python3 $ROOT/.gpu/ab34.py $W/ab34.json > $W/ab34_log.txt 2>&1
cd /tmp && tar czf $OUT/run34.tgz r34
{ tail -3 $W/pytest_gpu.txt; tail -6 $W/ab34_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
