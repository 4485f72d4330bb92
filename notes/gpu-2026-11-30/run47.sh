#!/usr/bin/env bash
# Device call 47 (1 x H200): gpu_memory.py at the final engine (last run: call 21, commit 9786614).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r47; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 200 python3 gpu_memory.py --out $W/gpu_memory.json > $W/memory_log.txt 2>&1
cd /tmp && tar czf $OUT/run47.tgz r47
tail -25 $W/memory_log.txt > $OUT/summary.txt
cat $OUT/summary.txt
