#!/usr/bin/env bash
# Device call 12 (1 x H200): local-error launch-configuration sweep + fmnist-wide-2 B=1024 critical path.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 560 python3 .gpu/sweep.py $OUT/sweep.json > $OUT/sweep_log.txt 2>&1
tail -40 $OUT/sweep_log.txt
