#!/usr/bin/env bash
# Device call 55 (1 x H200): sweep of the tiled one-launch local error against the default, then the step A/B.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r55; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 480 python3 $ROOT/.gpu/sweep55.py $W/sweep55.json > $W/sweep55_log.txt 2>&1
echo "sweep rc $?" >> $W/sweep55_log.txt
cd /tmp && tar czf $OUT/run55.tgz r55
grep -v Warning $W/sweep55_log.txt | tail -40 > $OUT/summary.txt
cat $OUT/summary.txt
