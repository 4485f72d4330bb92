#!/usr/bin/env bash
# Device call 5 (1 x H200): engine tests, throughput, time to 97.5% after the head-sample stream change.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r5; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site TORCH_DAD_MNIST=$ROOT/.gpu/data/mnist.npz
timeout 45 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py > $W/pytest_gpu.txt 2>&1
cd benchmarks
timeout 75 python3 gpu_throughput.py --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
timeout 60 python3 accuracy.py --fmnist-dir $ROOT/.gpu/data/fmnist --datasets mnist --systems dad backprop --tf32 \
  --time-to-target --resume $ROOT/.gpu/acc_run2.json --out $W/accuracy.json > $W/accuracy_log.txt 2>&1
cd /tmp && tar czf $OUT/run5.tgz r5
{ grep -E "passed|failed|FAILED" $W/pytest_gpu.txt | tail -4; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -40
  grep -E "time-to|resume" $W/accuracy_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
