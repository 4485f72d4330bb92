#!/usr/bin/env bash
# Device call 4 (2 x H200): re-check after the head-sample fix. GPU0: engine tests, throughput; GPU1: time to 97.5%.
# Then both: NCCL tests. bash .gpu/run4.sh <commit> -> $OUT/run4.tgz + summary.txt
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r4; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
N=$(nproc); HALF=$((N / 2))
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
  taskset -c 0-$((HALF - 1)) bash -c "
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
  cd benchmarks; timeout 75 python3 gpu_throughput.py --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1" ) &
( export CUDA_VISIBLE_DEVICES=1 TORCH_DAD_MNIST=$ROOT/.gpu/data/mnist.npz PYTHONPATH=$ROOT/src:$ROOT/benchmarks:/tmp/site
  cd $ROOT/benchmarks && taskset -c $HALF-$((N - 1)) timeout 130 python3 accuracy.py --fmnist-dir $ROOT/.gpu/data/fmnist \
    --tf32 --time-to-target --resume $ROOT/.gpu/acc_run2.json --out $W/accuracy.json > $W/accuracy_log.txt 2>&1 ) &
wait
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$ROOT/src:$ROOT:/tmp/site
timeout 45 python3 -m pytest -q -p no:cacheprovider -rf tests/test_parallel.py -k nccl > $W/nccl_tests.txt 2>&1
cd /tmp && tar czf $OUT/run4.tgz r4
{ grep -E "passed|failed|FAILED|ERROR" $W/pytest_gpu.txt | tail -6; sed -n '/x bp/,$p' $W/throughput_log.txt | tail -45
  grep -E "time-to|resume" $W/accuracy_log.txt; grep -E "passed|failed|FAILED|^E  " $W/nccl_tests.txt | head; } > $OUT/summary.txt
cat $OUT/summary.txt
