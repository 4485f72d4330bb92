#!/usr/bin/env bash
# Device call 57 (1 x H200): the step against a floor of its unavoidable kernels, and the wheel in 3 processes.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r57; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
cd benchmarks
timeout 500 python3 $ROOT/.gpu/floor57.py $W/floor57.json $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl > $W/floor57_log.txt 2>&1
echo "floor rc $?" >> $W/floor57_log.txt
cd /tmp && tar czf $OUT/run57.tgz r57
grep -v Warning $W/floor57_log.txt | tail -30 > $OUT/summary.txt
cat $OUT/summary.txt
