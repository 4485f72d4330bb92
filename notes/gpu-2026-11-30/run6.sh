#!/usr/bin/env bash
# Device call 6 (2 x H200): Gram update cost, engine tests, distributed benchmark, NCCL tests.
# bash .gpu/run6.sh <commit> -> $OUT/run6.tgz + summary.txt
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 GIT_COMMIT=$1 GIT_DIR=/nonexistent
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/r6; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/pytest-*.whl .gpu/whl/iniconfig-*.whl .gpu/whl/pluggy-*.whl .gpu/whl/pygments-*.whl > $W/pip.txt 2>&1
export PYTHONPATH=$ROOT/src:$ROOT:$ROOT/benchmarks:/tmp/site
nvidia-smi topo -m > $W/topo.txt 2>&1
# 1. the classifier's Gram update at B=16384, d=4096, bf16: GramAccumulator.update vs gram_update_
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 - > $W/gram.txt 2>&1 <<'PY'
import json, torch
from torch_dad.ridge import GramAccumulator
from torch_dad.kernels.gram import gram_update_
h = torch.randn(16384, 4096, device="cuda").relu().bfloat16(); y = torch.randint(0, 10, (16384,), device="cuda")
out = {}
for name, fn in [("GramAccumulator.update", lambda a: a.update(h, y)), ("gram_update_", lambda a: gram_update_(a, h, y))]:
    acc = GramAccumulator(4096, 10, device="cuda")
    for _ in range(3): fn(acc)
    ts = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record(); fn(acc); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    out[name] = sorted(ts)[3]
a, b = GramAccumulator(4096, 10, device="cuda"), GramAccumulator(4096, 10, device="cuda")
a.update(h, y); gram_update_(b, h, y)
out["max_rel_diff_gram"] = float(((a.gram - b.gram).abs().max() / a.gram.abs().max()))
print(json.dumps({"B": 16384, "d": 4096, "dtype": "bf16", "median_ms": out}))
PY
# 2. engine tests (the step body changed)
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine.py tests/gpu/test_kernels.py tests/test_backend.py tests/test_autograd_fast_path.py > $W/pytest_gpu.txt 2>&1
# 3. distributed benchmark
timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  benchmarks/distributed.py --batch 16384 65536 --budget-s 150 --out $W/distributed.json > $W/distributed_log.txt 2>&1
# 4. NCCL equivalence tests
timeout 90 python3 -m pytest -q -p no:cacheprovider -rf -s tests/test_parallel.py -k nccl > $W/nccl_tests.txt 2>&1
cd /tmp && tar czf $OUT/run6.tgz r6
{ cat $W/gram.txt; grep -E "passed|failed|FAILED|ERROR" $W/pytest_gpu.txt | tail -6; grep -v -i warn $W/distributed_log.txt | tail -30
  grep -E "passed|failed|FAILED|^E  |worst" $W/nccl_tests.txt | head -20; } > $OUT/summary.txt
cat $OUT/summary.txt
