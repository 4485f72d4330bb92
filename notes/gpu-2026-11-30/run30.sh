#!/usr/bin/env bash
# Device call 30 (1 x H200): repeat the local-error-stream A/B at B=1024 (5 rounds), and depth scaling at 8f0daff.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r30; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 200 python3 $ROOT/.gpu/ab30.py $W/ab30.json > $W/ab30_log.txt 2>&1
timeout 150 python3 gpu_scaling.py --out $W/gpu_scaling.json > $W/scaling_log.txt 2>&1; cp results/gpu_scaling.png $W/ 2>/dev/null
cd /tmp && tar czf $OUT/run30.tgz r30
{ tail -12 $W/ab30_log.txt; tail -14 $W/scaling_log.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
