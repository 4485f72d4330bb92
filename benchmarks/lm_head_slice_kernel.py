"""The recomputing sweep's slice gradient: one Triton kernel against cuBLAS's logits + the row kernel.

``vocab_slice_backward`` recomputes ``d[:, s] = exp(h @ W[s].T - lse) - onehot(y)[:, s]`` for each vocabulary
slice ``s``. Per shape (8192 tokens, bf16) this times, in one process:

- ``cublas-logits``: the slice's logits GEMM alone (``torch.mm(out=)``), a bound for any fused kernel;
- ``cublas+row-kernel``: that GEMM then ``logit_grad_from_lse_`` (the path without the fused kernel);
- ``fused-<tiles>``: ``torch_dad.kernels.logits.logit_grad`` at each candidate tile (``BMxBNxBK, warps, stages``),
  the library's default marked; each checked against the float32 product first (``max_abs_error``);
- ``vocab_slice_backward`` whole (``dL/dh`` included) with and without the fused kernel, and their ``dL/dh``'s
  relative difference.

Times are medians of ``triton.testing.do_bench``. Adds a run to ``results/lm_head_slice_kernel.json`` and, with
matplotlib, draws it into ``results/lm_head_slice_kernel.png`` (``--plot-only`` redraws the PNG from the record).

    python benchmarks/lm_head_slice_kernel.py            # H200: SmolLM2 and Llama-3 8B heads
    python benchmarks/lm_head_slice_kernel.py --smoke    # CPU: lists the candidate tiles, launches nothing
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, environment, pyplot, run_config, run_title, save_figure, write_run

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


def _slice_colour(row: dict[str, Any]) -> str:
    if row["system"] == "cublas-logits":
        return "tab:gray"
    if not row["system"].startswith("fused-"):
        return "tab:orange"
    return "tab:blue" if row.get("default") else "lightsteelblue"


def _draw_slice(ax: Any, rows: list[dict[str, Any]], shape: str) -> None:
    """One slice's gradient at ``shape``: a bar per way, the library's default tile marked."""
    rows = [r for r in rows if not r["system"].startswith("vocab_slice_backward")][::-1]
    labels = [r["system"].replace("fused-", "fused ") + (" (default)" if r.get("default") else "") for r in rows]
    bars = ax.barh(range(len(rows)), [r["ms"] for r in rows], color=[_slice_colour(r) for r in rows])
    ax.bar_label(bars, [f"{r['ms']:.3f}" for r in rows], padding=2, fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlim(0, max(r["ms"] for r in rows) * 1.2)  # room for the labels
    ax.set_xlabel("ms per slice (median)")
    ax.set_title(f"{shape}: one slice of {rows[0].get('slice_rows', '?')} rows, {rows[0]['tokens']} tokens",
                 fontsize=9)


def _draw_whole(ax: Any, by_shape: dict[str, list[dict[str, Any]]]) -> None:
    """The whole ``vocab_slice_backward`` per shape, with and without the fused kernel (log scale)."""
    for k, (system, colour) in enumerate((("vocab_slice_backward-cublas+row-kernel", "tab:orange"),
                                          ("vocab_slice_backward-fused", "tab:blue"))):
        ms = [next((r["ms"] for r in rows if r["system"] == system), 0.0) for rows in by_shape.values()]
        bars = ax.bar([i + 0.4 * k for i in range(len(ms))], ms, 0.4, color=colour,
                      label=system.removeprefix("vocab_slice_backward-"))
        ax.bar_label(bars, [f"{v:.2f}" for v in ms], fontsize=7)
    ax.set_xticks([i + 0.2 for i in range(len(by_shape))], list(by_shape))
    ax.set_yscale("log")
    longest = max(r["ms"] for rows in by_shape.values() for r in rows)
    ax.set_ylim(min(1.0, longest / 10), 10 ** math.ceil(math.log10(2 * longest)))  # room for the bar labels
    ax.yaxis.set_major_formatter("{x:g}")
    ax.set_ylabel("ms per backward (median, log scale)")
    ax.set_title("whole vocab_slice_backward (with dL/dh)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """The record's last run: per shape, one slice's gradient time for cuBLAS's logits alone, cuBLAS + the row
    kernel and each fused tile; then the whole backward with and without the fused kernel."""
    plt = pyplot()
    if plt is None or not runs or not runs[-1]["results"]:
        return False
    run = runs[-1]
    by_shape: dict[str, list[dict[str, Any]]] = {}
    for row in run["results"]:
        by_shape.setdefault(row["shape"], []).append(row)
    fig, axes = plt.subplots(1, len(by_shape) + 1, figsize=(5 * (len(by_shape) + 1), 4))
    for ax, (shape, rows) in zip(axes, by_shape.items()):
        _draw_slice(ax, rows, shape)
    _draw_whole(axes[-1], by_shape)
    title = (f"Slice gradient: fused Triton kernel (blue) vs cuBLAS (gray: logits alone, orange: + row kernel), "
             f"bf16\n{run_title(run)}")
    return save_figure(fig, title, path, fontsize=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--smoke", action="store_true", help="list the candidates (CPU), launch nothing")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/lm_head_slice_kernel.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("lm_head_slice_kernel", plot))
        return
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
    config = run_config(args, parser, exclude=["plot_only"])
    print(f"wrote {write_run('lm_head_slice_kernel', records, config=config, env=env)}")
    print("plot:", draw_record("lm_head_slice_kernel", plot))


if __name__ == "__main__":
    main()
