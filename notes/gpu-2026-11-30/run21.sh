#!/usr/bin/env bash
# Device call 21 (1 x H200): gpu_memory.py again, with the cache emptied before each graph-pool measurement.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r21; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 150 python3 gpu_memory.py --out $W/gpu_memory.json > $W/memory_log.txt 2>&1
cd /tmp && tar czf $OUT/run21.tgz r21
tail -12 $W/memory_log.txt | tee $OUT/summary.txt
