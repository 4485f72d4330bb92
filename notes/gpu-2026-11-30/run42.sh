#!/usr/bin/env bash
# Device call 42 (1 x H200): depth scaling (gpu_scaling.py) with the stream-priority default.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r42; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 150 python3 gpu_scaling.py --out $W/gpu_scaling.json > $W/scaling_log.txt 2>&1; cp results/gpu_scaling.png $W/ 2>/dev/null
cd /tmp && tar czf $OUT/run42.tgz r42
tail -14 $W/scaling_log.txt > $OUT/summary.txt
cat $OUT/summary.txt
