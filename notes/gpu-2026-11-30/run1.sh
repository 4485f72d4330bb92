#!/usr/bin/env bash
# Device call 1 (2 x H200): GPU0 = issue 7 accuracy grid + time to 97.5%; GPU1 = issue 6 engine batch.
# From the repo root: bash .gpu/run1.sh <commit>. Writes $OUT/run1.tgz + $OUT/summary.txt.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r1; mkdir -p $W/engine
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl \
  .gpu/whl/liger_kernel-*.whl .gpu/whl/cut_cross_entropy-*.whl > $W/pip.txt 2>&1
{ nproc; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $W/env.txt 2>&1
N=$(nproc); HALF=$((N * 5 / 8))
( export CUDA_VISIBLE_DEVICES=0 TORCH_DAD_MNIST=$ROOT/.gpu/data/mnist.npz PYTHONPATH=$ROOT/src:/tmp/site
  cd $ROOT/benchmarks && taskset -c 0-$((HALF - 1)) timeout 520 python3 accuracy.py --fmnist-dir $ROOT/.gpu/data/fmnist \
    --wheel-dir $ROOT/.gpu/wheel --workers 14 --tf32 --budget-s 420 --time-to-target --out $W/accuracy.json \
    > $W/accuracy_log.txt 2>&1; echo "accuracy rc=$?" >> $W/accuracy_log.txt ) &
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site WHEEL=$ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl OUT=$W/engine
  taskset -c $HALF-$((N - 1)) bash scripts/gpu_batch.sh tests throughput memory scaling wheel > $W/engine_stdout.txt 2>&1 ) &
wait
cd /tmp && tar czf $OUT/run1.tgz r1
{ cat $W/env.txt; tail -3 $W/engine/pytest_gpu.txt; grep -E "^\S+ +[0-9]+ +(dad|backprop)" $W/engine/bench.log | tail -45
  grep -E "SUMMARY|time-to|budget|rc=" $W/accuracy_log.txt | tail -80; } > $OUT/summary.txt
cat $OUT/summary.txt
