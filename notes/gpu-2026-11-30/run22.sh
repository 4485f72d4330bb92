#!/usr/bin/env bash
# Device call 22 (1 x H200): two-kernel input sample. Kernel and engine tests, throughput with the wheel.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r22; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py tests/test_backend.py > $W/pytest_engine.txt 2>&1
cd benchmarks
timeout 170 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 120 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
timeout 60 python3 _gpu_profile.py cifar10-medium-3 4096 > $W/profile-cifar10-medium-3-4096.json 2> $W/profile_err.txt
date > $W/end.txt; cd /tmp && tar czf $OUT/run22.tgz r22
{ grep -E "passed|failed|FAILED|ERROR" $W/pytest_engine.txt | tail -4; 
  sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -45; } > $OUT/summary.txt
cat $OUT/summary.txt
