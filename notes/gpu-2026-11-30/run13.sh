#!/usr/bin/env bash
# Device call 13 (1 x H200): local-error strategies (in-kernel vs cuBLAS logits, tuned tiles) per shape.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
timeout 400 python3 .gpu/sweep2.py $OUT/sweep2.json > $OUT/sweep2_log.txt 2>&1
cat $OUT/sweep2_log.txt | tail -30
