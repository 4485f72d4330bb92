#!/usr/bin/env bash
# Device call 20 (1 x H200): engine tests (fp32/bf16 weight-gradient variants), memory and depth scaling at the
# current engine, throughput with the wheel, a kernel profile of cifar10-medium-3 at B=4096.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r20; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py > $W/pytest_engine.txt 2>&1
cd benchmarks
timeout 100 python3 gpu_memory.py --out $W/gpu_memory.json > $W/memory_log.txt 2>&1
timeout 100 python3 gpu_scaling.py --out $W/gpu_scaling.json > $W/scaling_log.txt 2>&1; cp results/gpu_scaling.png $W/ 2>/dev/null
timeout 170 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 120 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
timeout 60 python3 _gpu_profile.py cifar10-medium-3 4096 > $W/profile-cifar10-medium-3-4096.json 2> $W/profile_err.txt
date > $W/end.txt; cd /tmp && tar czf $OUT/run20.tgz r20
{ grep -E "passed|failed|FAILED|ERROR" $W/pytest_engine.txt | tail -4; tail -12 $W/memory_log.txt; tail -14 $W/scaling_log.txt
  sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -45; } > $OUT/summary.txt
cat $OUT/summary.txt
