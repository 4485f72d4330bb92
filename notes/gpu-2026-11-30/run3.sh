#!/usr/bin/env bash
# Device call 3 (2 x H200). Phase 1 in parallel: GPU0 = engine throughput + the wheel's missing row; GPU1 = GPU tests.
# Phase 2: both GPUs, distributed benchmark + NCCL tests. bash .gpu/run3.sh <commit> -> $OUT/run3.tgz + summary.txt
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r3; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl \
  .gpu/whl/liger_kernel-*.whl .gpu/whl/cut_cross_entropy-*.whl > $W/pip.txt 2>&1
{ nproc; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $W/env.txt 2>&1
N=$(nproc); HALF=$((N / 2))
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$ROOT/src:$ROOT/benchmarks:/tmp/site
  cd $ROOT/benchmarks && taskset -c 0-$((HALF - 1)) bash -c "
  timeout 70 python3 gpu_throughput.py --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
  timeout 110 python3 -c \"
import json
from gpu_throughput import run_wheel
rows = run_wheel('$ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl', [('deep-8x1024', 4096)], 105)
json.dump(rows, open('$W/wheel.json', 'w'), indent=1)\" > $W/wheel_log.txt 2>&1" ) &
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$ROOT/src:$ROOT:/tmp/site
  taskset -c $HALF-$((N - 1)) timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu tests/test_backend.py \
    tests/test_autograd_fast_path.py > $W/pytest_gpu.txt 2>&1 ) &
wait
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$ROOT/src:$ROOT:/tmp/site
timeout 170 python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/distributed.py --batch 16384 65536 \
  --budget-s 100 --out $W/distributed.json > $W/distributed_log.txt 2>&1
timeout 45 python3 -m pytest -q -p no:cacheprovider -rf tests/test_parallel.py -k nccl > $W/nccl_tests.txt 2>&1
cd /tmp && tar czf $OUT/run3.tgz r3
{ cat $W/env.txt; grep -E "passed|failed|FAILED|ERROR" $W/pytest_gpu.txt | tail -12
  sed -n '/x bp/,$p' $W/throughput_log.txt | tail -45; tail -2 $W/wheel_log.txt; cat $W/wheel.json
  grep -E '^\{' $W/distributed_log.txt; tail -3 $W/distributed_log.txt; grep -E "passed|failed|FAILED" $W/nccl_tests.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
