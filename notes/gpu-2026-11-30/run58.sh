#!/usr/bin/env bash
# Device call 58 (1 x H200): dad vs dad-no-head-stats at cifar10-medium-3 and mnist-medium-3 B=1024, timelines.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r58; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 400 python3 $ROOT/.gpu/trace58.py $W/trace58.json $W > $W/trace58_log.txt 2>&1
echo "trace rc $?" >> $W/trace58_log.txt
for f in $W/trace-*.json; do python3 _gpu_timeline.py $f > ${f%.json}-timeline.txt 2>&1; gzip $f; done
cd /tmp && tar czf $OUT/run58.tgz r58
grep -v Warning $W/trace58_log.txt | tail -60 > $OUT/summary.txt
cat $OUT/summary.txt
