#!/usr/bin/env bash
# Device call 60 (1 x H200): gpu_memory.py and gpu_scaling.py at the final engine (Philox head-sample draws).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r60; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 110 python3 gpu_memory.py --out $W/gpu_memory.json > $W/memory_log.txt 2>&1; echo "memory rc $?" >> $W/memory_log.txt
timeout 110 python3 gpu_scaling.py --out $W/gpu_scaling.json > $W/scaling_log.txt 2>&1; echo "scaling rc $?" >> $W/scaling_log.txt
cp results/gpu_scaling.png $W/ 2>/dev/null
cd /tmp && tar czf $OUT/run60.tgz r60
{ tail -12 $W/memory_log.txt; tail -12 $W/scaling_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
