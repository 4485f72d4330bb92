#!/usr/bin/env bash
# Device call 53 (1 x H200): a second gpu_throughput.py run with the wheel at the final engine (cf707fc's code).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r53; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 280 python3 gpu_throughput.py --wheel $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl \
  --wheel-timeout 150 --out $W/gpu_throughput.json > $W/throughput_log.txt 2>&1
cd /tmp && tar czf $OUT/run53.tgz r53
sed -n '/x bp/,$p' $W/throughput_log.txt | grep -v eager | tail -40 > $OUT/summary.txt
cat $OUT/summary.txt
