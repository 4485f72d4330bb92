#!/usr/bin/env bash
# Device call 41 (1 x H200): the head sample's stream priority A/B.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r41; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 150 python3 $ROOT/.gpu/ab41.py $W/ab41.json > $W/ab41_log.txt 2>&1
cd /tmp && tar czf $OUT/run41.tgz r41
tail -20 $W/ab41_log.txt > $OUT/summary.txt
cat $OUT/summary.txt
