#!/usr/bin/env bash
# Device call 50: local-error launch strategies (sweep50.py), then the step A/B.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r50; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 500 python3 $ROOT/.gpu/sweep50.py $W/sweep50.json > $W/sweep50_log.txt 2>&1
echo "rc $?" >> $W/sweep50_log.txt
cd /tmp && tar czf $OUT/run50.tgz r50
grep -v "^ " $W/sweep50_log.txt | tail -40 > $OUT/summary.txt
cat $OUT/summary.txt
