#!/usr/bin/env bash
# Device call 48 (the H200 host's CPU, GPU hidden): cpu_throughput.py --isolated at B=1024 with 2 and 16 threads.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent CUDA_VISIBLE_DEVICES=
W=/tmp/r48; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
lscpu > $W/lscpu.txt 2>&1; nproc >> $W/lscpu.txt
cd benchmarks
for t in 2 16; do
  OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t timeout 200 python3 cpu_throughput.py --isolated 6 --batch 1024 > $W/cpu_t$t.log 2>&1
  cp results/cpu_throughput_isolated.json $W/cpu_throughput_isolated_t$t.json
done
cd /tmp && tar czf $OUT/run48.tgz r48
{ grep -i "model name" $W/lscpu.txt; grep -h "dad /" $W/cpu_t*.log; tail -2 $W/cpu_t16.log; } > $OUT/summary.txt
cat $OUT/summary.txt
