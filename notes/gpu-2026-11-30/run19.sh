#!/usr/bin/env bash
# Device call 19 (1 x H200): weight-gradient dtype A/B, tests, throughput with the wheel.
# throughput with the wheel in the same run, then a profile of deep-8x1024 at B=4096.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r19; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 120 python3 $ROOT/.gpu/ab19.py $W/ab19.json > $W/ab19_log.txt 2>&1
timeout 200 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 120 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
date > $W/end.txt; cd /tmp && tar czf $OUT/run19.tgz r19
{ cat $W/ab19_log.txt | tail -16; grep -E "passed|failed|FAILED|ERROR" $W/pytest_gpu.txt | tail -8; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -45
  } > $OUT/summary.txt
cat $OUT/summary.txt
