"""The recomputing vocabulary sweep's softmax in a GEMM epilogue (Triton ``tl.dot`` tiles) against cuBLAS.

At the SmolLM2 head (vocab 49152, hidden 576, 8192 tokens, bf16) times, per tile configuration
``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``: ``lse_partials_kernel`` (the log-sum-exp pass, no logits
written) and ``logit_grad_kernel`` (``exp(x - lse) - onehot`` written by the GEMM), beside cuBLAS's bare logits GEMM
``h @ W.T``; each kernel's error against the float32 math of the same bf16 inputs. Median of CUDA-event timed calls
after warm-up. Writes ``results/lm_head_tiles.json``.

    python benchmarks/lm_head_tiles.py           # CUDA
    python benchmarks/lm_head_tiles.py --smoke   # CPU under TRITON_INTERPRET=1, tiny shapes (or skips without triton)
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from _common import environment, write_records
from lm_head import measure

CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
           (128, 256, 32, 8, 4), (64, 256, 64, 4, 4), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median ms of ``fn`` after 3 warm-up calls (:func:`lm_head.measure`)."""
    return float(measure(fn, torch.device("cuda" if torch.cuda.is_available() else "cpu"), 3, repeats)["step_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from torch_dad.kernels.linear_cross_entropy import logit_grad_kernel, lse_partials_kernel
    except ImportError as exc:
        print(f"skip: {exc}")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, v, k = (40, 300, 48) if args.smoke else (8192, 49152, 576)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, k, generator=g).to(device, dtype)
    w = (torch.randn(v, k, generator=g) * 0.05).to(device, dtype)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    logits = (h @ w.T).float()
    lse = torch.logsumexp(logits, 1)
    want = torch.exp(logits - lse[:, None])
    want[torch.arange(n, device=device), y] -= 1
    out = torch.empty(n, v, device=device, dtype=dtype)
    records: list[dict[str, object]] = [{"system": "cublas-logits", "ms": timed(lambda: h @ w.T, 3 if args.smoke else 20)}]
    for block_m, block_n, block_k, warps, stages in CONFIGS[:1] if args.smoke else CONFIGS:
        tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
        blocks_v = -(-v // block_n)
        grid_lse, grid_grad = (-(-n // block_m) * blocks_v,), (-(-n // block_m) * blocks_v,)
        maxes, sums = torch.empty(blocks_v, n, device=device), torch.empty(blocks_v, n, device=device)
        target_logit = torch.zeros(n, device=device)

        def run_lse(grid=grid_lse, maxes=maxes, sums=sums, target_logit=target_logit, tile=tile) -> None:  # type: ignore[no-untyped-def]
            lse_partials_kernel[grid](h, w, w, y, maxes, sums, target_logit, n, v, h.stride(0), w.stride(0), K=k,
                                      HAS_BIAS=False, **tile)

        def run_grad(grid=grid_grad, tile=tile) -> None:  # type: ignore[no-untyped-def]
            logit_grad_kernel[grid](h, w, w, y, lse, out, n, v, h.stride(0), w.stride(0), out.stride(0), 0, -100,
                                    K=k, HAS_BIAS=False, **tile)

        run_lse()
        run_grad()
        top = maxes.amax(0)
        got_lse = top + torch.log((sums * torch.exp(maxes - top)).sum(0))
        records.append({
            "system": f"tiles-{block_m}x{block_n}x{block_k}-w{warps}-s{stages}",
            "lse_ms": timed(run_lse, 3 if args.smoke else 20), "grad_ms": timed(run_grad, 3 if args.smoke else 20),
            "lse_max_abs_err": float((got_lse - lse).abs().max()),
            "grad_rel_err": float((out.float() - want).norm() / want.norm()),
        })
        print(records[-1])
    env = environment()
    for r in records:
        r.update(env, tokens=n, vocab=v, hidden=k, dtype=str(dtype).removeprefix("torch."))
    print(f"wrote {write_records('lm_head_tiles', records, args.smoke)}")


if __name__ == "__main__":
    main()
