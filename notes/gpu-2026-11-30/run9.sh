#!/usr/bin/env bash
# Device call 9 (2 x H200, quiet): GPU0 alone: throughput with the wheel in the same run; then the
# fixed autograd tests on GPU0 and the NCCL tests on both. bash .gpu/run9.sh <commit> -> $OUT/run9.tgz + summary.txt
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/r9; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > $W/gpu.txt 2>&1
( export CUDA_VISIBLE_DEVICES=0; cd benchmarks
  timeout 330 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
    --wheel-timeout 240 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1 )
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_autograd_fast_path.py > $W/pytest_autograd.txt 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider -rf -s tests/test_parallel.py -k nccl > $W/nccl_tests.txt 2>&1
cd /tmp && tar czf $OUT/run9.tgz r9
{ grep -E "passed|failed|FAILED|ERROR" $W/pytest_autograd.txt | tail -6; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -45
  grep -E "passed|failed|FAILED|^E  |worst" $W/nccl_tests.txt | head -12; } > $OUT/summary.txt
cat $OUT/summary.txt
