#!/usr/bin/env bash
# Device call 54 (1 x H200): the test command and the LM-head GPU tests at the refactored code
# (357971b kernels module, 3d72b43 lm_head), then gpu_throughput.py with the wheel.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r54; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
START=$SECONDS
timeout 230 python3 -m pytest -q -p no:cacheprovider -rf --durations=5 tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
echo "pytest rc $? in $((SECONDS-START)) s" >> $W/pytest_gpu.txt
START=$SECONDS
timeout 90 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_lm_head_triton.py tests/gpu/test_lm_head_gpu.py > $W/pytest_lm.txt 2>&1
echo "pytest rc $? in $((SECONDS-START)) s" >> $W/pytest_lm.txt
cd benchmarks
timeout 240 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 150 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
cd /tmp && tar czf $OUT/run54.tgz r54
{ tail -4 $W/pytest_gpu.txt; tail -4 $W/pytest_lm.txt; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -40; } > $OUT/summary.txt
cat $OUT/summary.txt
