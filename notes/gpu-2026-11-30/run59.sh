#!/usr/bin/env bash
# Device call 59 (1 x H200): the test command at the Philox head-sample draws, the A/B against the
# generator draws, then gpu_throughput.py with the wheel.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r59; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
START=$SECONDS
timeout 230 python3 -m pytest -q -p no:cacheprovider -rf --durations=5 tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
echo "pytest rc $? in $((SECONDS-START)) s" >> $W/pytest_gpu.txt
cd benchmarks
timeout 100 python3 $ROOT/.gpu/ab59.py $W/ab59.json > $W/ab59_log.txt 2>&1
echo "ab rc $?" >> $W/ab59_log.txt
timeout 230 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 150 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
cd /tmp && tar czf $OUT/run59.tgz r59
{ tail -4 $W/pytest_gpu.txt; grep -v Warning $W/ab59_log.txt | tail -14; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -40; } > $OUT/summary.txt
cat $OUT/summary.txt
