"""The recomputing sweep's slice gradient: one Triton kernel against cuBLAS's logits + the row kernel.

``vocab_slice_backward`` recomputes ``d[:, s] = exp(h @ W[s].T - lse) - onehot(y)[:, s]`` for each vocabulary
slice ``s``. Per shape (8192 tokens, bf16) this times, in one process:

- ``cublas-logits``: the slice's logits GEMM alone (``torch.mm(out=)``), a bound for any fused kernel;
- ``cublas+row-kernel``: that GEMM then ``logit_grad_from_lse_`` (the path without the fused kernel);
- ``fused-<tiles>``: ``torch_dad.kernels.logits.logit_grad`` at each candidate tile (``BMxBNxBK, warps, stages``),
  the library's default marked; each checked against the float32 product first (``max_abs_error``);
- ``vocab_slice_backward`` whole (``dL/dh`` included) with and without the fused kernel, and their ``dL/dh``'s
  relative difference.

Times are medians of ``triton.testing.do_bench``. Adds a run to ``results/lm_head_slice_kernel.json``.

    python benchmarks/lm_head_slice_kernel.py            # H200: SmolLM2 and Llama-3 8B heads
    python benchmarks/lm_head_slice_kernel.py --smoke    # CPU: lists the candidate tiles, launches nothing
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from _common import environment, run_config, write_run

SHAPES = {"smollm2": (49152, 576), "llama3-8b": (128256, 4096)}
TOKENS = 8192
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); 128 x 256 x 64 with 4 stages needs more shared memory than an H200 has
CANDIDATES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3),
              (128, 256, 32, 8, 4), (64, 256, 64, 4, 4))


def _bench(fn: Any, rep: int) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=20, rep=rep, return_mode="median"))


def _with_tiles(kernels: Any, tiles: tuple[int, int, int, int, int]) -> None:
    kernels.BLOCK_M, kernels.BLOCK_N, kernels.BLOCK_K, kernels.WARPS, kernels.STAGES = tiles


def slice_rows(vocab: int, hidden: int) -> int:
    """The slice the head's backward recomputes at this shape (``default_slice_rows``)."""
    from torch_dad.ops.linear_cross_entropy import default_slice_rows

    return min(default_slice_rows(hidden, TOKENS, 2), vocab)


def one_slice(vocab: int, hidden: int, rep: int) -> list[dict[str, Any]]:
    """The three ways to one slice's gradient, each its own row."""
    from torch_dad.kernels import logits as kernels
    from torch_dad.ops.cross_entropy import logit_grad_from_lse_

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = slice_rows(vocab, hidden)
    h = torch.randn(TOKENS, hidden, device="cuda", generator=g).mul_(hidden**-0.5).bfloat16()
    w = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    y = torch.randint(0, vocab, (TOKENS,), device="cuda", generator=g)
    logits = h.float() @ w.float().T
    lse = torch.logsumexp(logits, 1) + 1.0  # the rest of the vocabulary's share
    expected = torch.exp(logits - lse[:, None])
    inside = y < rows
    expected[inside.nonzero()[:, 0], y[inside]] -= 1.0
    del logits
    out = torch.empty(TOKENS, rows, device="cuda", dtype=torch.bfloat16)
    records = [
        {"system": "cublas-logits", "ms": _bench(lambda: torch.mm(h, w.T, out=out), rep)},
        {"system": "cublas+row-kernel", "ms": _bench(
            lambda: logit_grad_from_lse_(torch.mm(h, w.T, out=out), y, lse, col_offset=0, ignore_index=-100), rep)},
    ]
    default = (kernels.BLOCK_M, kernels.BLOCK_N, kernels.BLOCK_K, kernels.WARPS, kernels.STAGES)
    try:
        for tiles in CANDIDATES:
            _with_tiles(kernels, tiles)
            kernels.logit_grad(h, w, None, y, lse, out, 0, -100)
            error = float((out.float() - expected).abs().max())
            name = "fused-{}x{}x{}-w{}-s{}".format(*tiles)
            records.append({"system": name, "default": tiles == default, "max_abs_error": error,
                            "ms": _bench(lambda: kernels.logit_grad(h, w, None, y, lse, out, 0, -100), rep)})
    finally:
        _with_tiles(kernels, default)
    return [{**r, "slice_rows": rows} for r in records]


def whole_backward(vocab: int, hidden: int, rep: int) -> list[dict[str, Any]]:
    """``vocab_slice_backward`` over the whole vocabulary, with ``dL/dh``, with and without the fused kernel."""
    from torch_dad.ops import linear_cross_entropy as lce

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(TOKENS, hidden, device="cuda", generator=g).mul_(hidden**-0.5).bfloat16()
    w = torch.randn(vocab, hidden, device="cuda", generator=g).mul_(0.02)
    y = torch.randint(0, vocab, (TOKENS,), device="cuda", generator=g)
    lse = lce.linear_cross_entropy(h, w, y, grad_weight=False, grad_input=False, log_sum_exp=True,
                                   compute_dtype=torch.bfloat16).log_sum_exp

    def run(backend: str) -> torch.Tensor | None:
        return lce.vocab_slice_backward(h, w, lambda *_: None, log_sum_exp=lse, target=y, grad_input=True,
                                        weight_scale=1.0 / TOKENS, backend=backend)

    # backend="torch" would also move the row kernel to its twin: the pair without the fused kernel is forced by
    # hiding the kernel module's TMA check
    from torch_dad.kernels import logits as kernels

    fused_dh = run("auto")
    check = kernels.tma_compatible
    kernels.tma_compatible = lambda _t: False  # type: ignore[assignment]
    try:
        pair_ms = _bench(lambda: run("auto"), rep)
        pair_dh = run("auto")
    finally:
        kernels.tma_compatible = check  # type: ignore[assignment]
    assert fused_dh is not None and pair_dh is not None
    difference = float((fused_dh - pair_dh).norm() / pair_dh.norm())
    return [
        {"system": "vocab_slice_backward-fused", "ms": _bench(lambda: run("auto"), rep),
         "grad_input_rel_difference": difference},
        {"system": "vocab_slice_backward-cublas+row-kernel", "ms": pair_ms},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--smoke", action="store_true", help="list the candidates (CPU), launch nothing")
    args = parser.parse_args()
    if args.smoke or not torch.cuda.is_available():
        for tiles in CANDIDATES:
            print("candidate BMxBNxBK-warps-stages: {}x{}x{}-w{}-s{}".format(*tiles))
        return
    env = environment()
    records = []
    for shape in args.shapes:
        vocab, hidden = SHAPES[shape]
        rep = 300 if hidden < 1024 else 1000
        for record in one_slice(vocab, hidden, rep) + whole_backward(vocab, hidden, rep):
            record.update(shape=shape, tokens=TOKENS, vocab=vocab, hidden=hidden, dtype="bfloat16", **env)
            print({k: v for k, v in record.items() if k not in env})
            records.append(record)
    print(f"wrote {write_run('lm_head_slice_kernel', records, config=run_config(args, parser), env=env)}")


if __name__ == "__main__":
    main()
