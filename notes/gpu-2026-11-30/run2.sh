#!/usr/bin/env bash
# Device call 2 (2 x H200). Phase B in parallel: GPU0 = accuracy fill-in (--resume) + time to 97.5%, then the
# published wheel's throughput; GPU1 = GPU tests, engine throughput, LM head, autograd overhead. Phase A: both GPUs,
# distributed benchmark + NCCL tests. bash .gpu/run2.sh <commit>  ->  $OUT/run2.tgz + $OUT/summary.txt
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r2; mkdir -p $W/engine
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl \
  .gpu/whl/liger_kernel-*.whl .gpu/whl/cut_cross_entropy-*.whl > $W/pip.txt 2>&1
{ nproc; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $W/env.txt 2>&1
N=$(nproc); HALF=$((N * 5 / 8))
( export CUDA_VISIBLE_DEVICES=0 TORCH_DAD_MNIST=$ROOT/.gpu/data/mnist.npz PYTHONPATH=$ROOT/src:$ROOT/benchmarks:/tmp/site
  cd $ROOT/benchmarks && taskset -c 0-$((HALF - 1)) timeout 230 python3 accuracy.py --fmnist-dir $ROOT/.gpu/data/fmnist \
    --wheel-dir $ROOT/.gpu/wheel --workers 14 --tf32 --budget-s 190 --time-to-target --resume $ROOT/.gpu/acc_run1.json \
    --option-lrs best --out $W/accuracy.json > $W/accuracy_log.txt 2>&1; echo "accuracy rc=$?" >> $W/accuracy_log.txt
  timeout 80 python3 -c "
import json, sys
from gpu_throughput import run_wheel
rows = run_wheel('$ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl',
                 [(t, b) for t in ('mnist-medium-3', 'fmnist-wide-2', 'cifar10-medium-3', 'deep-8x1024') for b in (1024, 4096)], 75)
json.dump(rows, open('$W/wheel.json', 'w'), indent=1)" > $W/wheel_log.txt 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$ROOT/src:$ROOT/benchmarks:/tmp/site
  taskset -c $HALF-$((N - 1)) bash -c "
  timeout 140 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_backend.py tests/test_autograd_fast_path.py -rs > $W/pytest_gpu.txt 2>&1
  cd benchmarks
  timeout 50 python3 gpu_throughput.py --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
  timeout 70 python3 lm_head.py --out $W/lm_head.json > $W/lm_head_log.txt 2>&1
  timeout 30 python3 autograd_overhead.py --device cuda --workloads hidden > $W/autograd_log.txt 2>&1
  cp results/autograd_overhead_cuda.json $W/ 2>/dev/null" ) &
wait
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$ROOT/src:/tmp/site
timeout 170 python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/distributed.py --batch 16384 \
  --out $W/distributed.json > $W/distributed_log.txt 2>&1
timeout 50 python3 -m pytest -q -x -p no:cacheprovider tests/test_parallel.py -k nccl > $W/nccl_tests.txt 2>&1
cd /tmp && tar czf $OUT/run2.tgz r2
{ cat $W/env.txt; tail -4 $W/pytest_gpu.txt; grep -E "x bp|^\S+ +[0-9]+ +(dad|backprop)" $W/throughput_log.txt | tail -45
  tail -16 $W/lm_head_log.txt; tail -8 $W/autograd_log.txt; tail -3 $W/wheel_log.txt
  grep -E "SUMMARY .*(ep=20|ep= 3) +(dad|dad\+ridge|backprop|backprop\+ridge|wheel-2026.5.24) |time-to|budget|resume|rc=" $W/accuracy_log.txt
  grep -E '^\{' $W/distributed_log.txt; tail -3 $W/distributed_log.txt; tail -3 $W/nccl_tests.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
