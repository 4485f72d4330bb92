#!/usr/bin/env bash
# Device call 51 (1 x H200): A/B of this commit's local-error changes (ab51.py), gpu_throughput.py with the
# wheel, the kernel/engine test command, gpu_scaling.py.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r51; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
cd benchmarks
timeout 70 python3 $ROOT/.gpu/ab51.py $W/ab51.json > $W/ab51_log.txt 2>&1; echo "ab rc $?" >> $W/ab51_log.txt
timeout 250 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 150 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
cd $ROOT
timeout 195 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 75 python3 gpu_scaling.py --out $W/gpu_scaling.json > $W/scaling_log.txt 2>&1; cp results/gpu_scaling.png $W/ 2>/dev/null
cd /tmp && tar czf $OUT/run51.tgz r51
{ cat $W/ab51_log.txt | tail -12; tail -3 $W/pytest_gpu.txt; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -40; tail -3 $W/scaling_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
