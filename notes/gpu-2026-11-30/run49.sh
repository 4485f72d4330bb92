#!/usr/bin/env bash
# Device call 49 (the H200 host's CPU, GPU hidden): cpu_throughput.py --isolated 24 at B=1024, 2 then 16 threads.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent CUDA_VISIBLE_DEVICES=
W=/tmp/r49; mkdir -p $W
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks
lscpu > $W/lscpu.txt 2>&1; nproc >> $W/lscpu.txt
cd benchmarks
START=$SECONDS
rm -f results/cpu_throughput_isolated.json; OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout 330 python3 cpu_throughput.py --isolated 24 --batch 1024 > $W/cpu_t2.log 2>&1
cp results/cpu_throughput_isolated.json $W/cpu_throughput_isolated_t2.json 2>/dev/null
echo "t2 took $((SECONDS-START)) s" >> $W/times.txt
LEFT=$((575 - SECONDS + START))
rm -f results/cpu_throughput_isolated.json; OMP_NUM_THREADS=16 MKL_NUM_THREADS=16 timeout $LEFT python3 cpu_throughput.py --isolated 24 --batch 1024 > $W/cpu_t16.log 2>&1
cp results/cpu_throughput_isolated.json $W/cpu_throughput_isolated_t16.json 2>/dev/null
echo "t16 total $((SECONDS-START)) s" >> $W/times.txt
cd /tmp && tar czf $OUT/run49.tgz r49
{ grep -i "model name" $W/lscpu.txt; cat $W/times.txt; grep -h "dad /" $W/cpu_t*.log; tail -3 $W/cpu_t2.log; tail -3 $W/cpu_t16.log; } > $OUT/summary.txt
cat $OUT/summary.txt
