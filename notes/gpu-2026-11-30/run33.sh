#!/usr/bin/env bash
# Device call 33 (1 x H200): sweep of the row-block update (chunks, threshold) on the wide and deep topologies.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r33; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 400 python3 $ROOT/.gpu/ab33.py $W/ab33.json > $W/ab33_log.txt 2>&1
cd /tmp && tar czf $OUT/run33.tgz r33
tail -20 $W/ab33_log.txt > $OUT/summary.txt
cat $OUT/summary.txt
