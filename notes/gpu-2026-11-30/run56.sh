#!/usr/bin/env bash
# Device call 56 (1 x H200): local-error diagnostics, then step timelines (deep-8x1024 B=4096, fmnist-wide-2 B=1024).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r56; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 400 python3 $ROOT/.gpu/diag56.py $W/diag56.json $W > $W/diag56_log.txt 2>&1
echo "diag rc $?" >> $W/diag56_log.txt
for f in $W/trace-*.json; do python3 _gpu_timeline.py $f > ${f%.json}-timeline.txt 2>&1; gzip $f; done
cd /tmp && tar czf $OUT/run56.tgz r56
grep -v Warning $W/diag56_log.txt | tail -60 > $OUT/summary.txt
cat $OUT/summary.txt
