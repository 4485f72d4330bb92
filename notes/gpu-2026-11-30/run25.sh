#!/usr/bin/env bash
# Device call 24 (1 x H200): gpu_throughput.py with interleaved rounds and time-based warm-up, the wheel too.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r24; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 420 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 200 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
cd /tmp && tar czf $OUT/run24.tgz r24
sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -45 > $OUT/summary.txt
cat $OUT/summary.txt
