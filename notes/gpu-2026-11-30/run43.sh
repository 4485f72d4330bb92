#!/usr/bin/env bash
# Device call 43 (1 x H200): gpu_throughput.py (with the wheel, and the new dad-deferred system) then the issue test command.

set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r43; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
cd benchmarks
timeout 350 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 200 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
cd $ROOT
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernels.py tests/gpu/test_engine.py \
  tests/test_autograd_fast_path.py tests/test_backend.py > $W/pytest_gpu.txt 2>&1
cd /tmp && tar czf $OUT/run43.tgz r43
{ tail -3 $W/pytest_gpu.txt; sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -45; } > $OUT/summary.txt
cat $OUT/summary.txt
