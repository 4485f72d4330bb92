#!/usr/bin/env bash
# GPU batch for issue 5 (LM head). The bundle folder (here .gpu_lm/) holds this script as run.sh beside
# copies of src/, tests/, benchmarks/, a COMMIT file and wheels/ (liger-kernel, cut-cross-entropy wheels).
# From the repo root, with carry [".gpu_lm"]:  bash .gpu_lm/run.sh
# Runs tests/gpu/test_lm_head_gpu.py and tests/gpu/test_lm_head_triton.py (our Triton CE kernel on CUDA),
# then benchmarks/lm_head.py. Writes under $OUT: env.txt, pytest_lm_head_gpu.txt, lm_head.json,
# lm_head_bench.txt.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/gpu_lm_out}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-index --target site wheels/*.whl > "$OUT/pip.txt" 2>&1
export PYTHONPATH=$PWD/src:$PWD/site
# record the lmhead branch commit these files come from, not the enclosing checkout's
export GIT_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown) GIT_DIR=/nonexistent
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python -c "import liger_kernel.ops.fused_linear_cross_entropy; print('liger ok')" 2>&1 | tail -1
  python -c "import cut_cross_entropy; print('cce ok')" 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
timeout 220 python -m pytest -q -p no:cacheprovider tests/gpu/test_lm_head_gpu.py tests/gpu/test_lm_head_triton.py -rs \
  2>&1 | tail -40 > "$OUT/pytest_lm_head_gpu.txt"
cd benchmarks && timeout 300 python lm_head.py --out "$OUT/lm_head.json" > "$OUT/lm_head_bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/lm_head_bench.txt"
tail -30 "$OUT/lm_head_bench.txt"; tail -3 "$OUT/pytest_lm_head_gpu.txt"
