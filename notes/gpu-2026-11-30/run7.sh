#!/usr/bin/env bash
# Device call 7 (2 x H200): autograd fast-path seeds, engine tests, distributed benchmark (input samples), NCCL tests.
# bash .gpu/run7.sh <commit> -> $OUT/run7.tgz + summary.txt
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/r7; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
nvidia-smi topo -m > $W/topo.txt 2>&1
# 1. the two call-6 autograd failures over 24 seeds
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 .gpu/autograd_seeds.py $W/autograd_seeds.json > $W/autograd_seeds.txt 2>&1
# 2. engine tests (the step body changed)
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
# 3. distributed benchmark
timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  benchmarks/distributed.py --batch 16384 65536 --budget-s 150 --out $W/distributed.json > $W/distributed_log.txt 2>&1
# 4. NCCL equivalence tests
timeout 90 python3 -m pytest -q -p no:cacheprovider -rf -s tests/test_parallel.py -k nccl > $W/nccl_tests.txt 2>&1
cd /tmp && tar czf $OUT/run7.tgz r7
{ cat $W/autograd_seeds.txt | head -24; grep -E "passed|failed|FAILED|ERROR" $W/pytest_gpu.txt | tail -6; grep -v -i warn $W/distributed_log.txt | tail -30
  grep -E "passed|failed|FAILED|^E  |worst" $W/nccl_tests.txt | head -20; } > $OUT/summary.txt
cat $OUT/summary.txt
