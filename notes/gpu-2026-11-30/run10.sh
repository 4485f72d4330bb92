#!/usr/bin/env bash
# Device call 10 (1 x H200): kernel profiles of the three settings that miss 5x the wheel.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r10; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
for cfg in "fmnist-wide-2 1024" "deep-8x1024 4096" "fmnist-wide-2 4096"; do
  set -- $cfg
  timeout 100 python3 _gpu_profile.py $1 $2 > $W/profile-$1-$2.json 2> $W/profile-$1-$2.err
done
cd /tmp && tar czf $OUT/run10.tgz r10
for f in $W/*.json; do echo "== $f"; head -c 1500 $f; echo; done > $OUT/summary.txt
cat $OUT/summary.txt
