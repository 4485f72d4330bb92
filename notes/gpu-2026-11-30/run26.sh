#!/usr/bin/env bash
# Device call 26 (1 x H200): A/B of an SM carve-out for the weight-gradient GEMMs.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r26; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 200 python3 $ROOT/.gpu/ab26.py $W/ab26.json > $W/ab26_log.txt 2>&1
cd /tmp && tar czf $OUT/run26.tgz r26
tail -30 $W/ab26_log.txt | tee $OUT/summary.txt
