#!/usr/bin/env bash
# Device call 32 (1 x H200): fmnist-wide-2 floors vs 5x the wheel (floor32.py), and the kernel profile of the current engine.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
W=/tmp/r32; mkdir -p $W
mkdir -p /tmp/wheel && cd /tmp/wheel && python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('.')" $ROOT/.gpu/whl/torch_dad-2026.5.24-py3-none-any.whl
export WHEEL_SITE=/tmp/wheel
cd $ROOT/benchmarks
export PYTHONPATH=$ROOT/src:$ROOT/benchmarks
RES=$W/floor32.json timeout 420 python3 $ROOT/.gpu/floor32.py > $W/floor_log.txt 2>&1
timeout 60 python3 _gpu_profile.py fmnist-wide-2 1024 > $W/profile-fmnist-wide-2-1024.txt 2>&1
timeout 60 python3 _gpu_profile.py fmnist-wide-2 4096 > $W/profile-fmnist-wide-2-4096.txt 2>&1
cd /tmp && tar czf $OUT/run32.tgz r32
{ grep -v '^ ' $W/floor_log.txt | tail -30; for f in $W/profile-*.txt; do tail -1 $f | cut -c1-1500; done; } > $OUT/summary.txt
cat $OUT/summary.txt
