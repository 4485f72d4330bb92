#!/usr/bin/env bash
# 2-GPU run for issue 8, from the repo root on a machine with 2 CUDA GPUs (< 4 minutes):
#   1. benchmarks/distributed.py under torchrun (NCCL): single / data-parallel / pipeline img/s
#      -> $OUT/distributed.json (copy it to benchmarks/results/distributed.json)
#   2. tests/test_parallel.py -k nccl: the equivalence tests over NCCL on the 2 GPUs
# NVLink multicast stays off (the lent machines' notes: it can take the host's GPUs down).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src GIT_COMMIT="${GIT_COMMIT:-unknown}"
python3 -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)" || { echo "needs 2 CUDA GPUs"; exit 2; }
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/distributed-topo.txt" 2>&1 || true
timeout 420 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  benchmarks/distributed.py --budget-s 240 --out "$OUT/distributed.json" 2>&1 | tee "$OUT/distributed.log" | grep -v Warning
bench=${PIPESTATUS[0]}
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_parallel.py -k nccl 2>&1 | tail -15
tests=${PIPESTATUS[0]}
echo "benchmark exit $bench, nccl tests exit $tests"
exit $(( bench != 0 || tests != 0 ))
