"""The 2 x 2 max pool of ``DADConv2d(pool="max")``: torch's aten pair against the Triton pair, on CUDA.

What is timed, per pooled layer of ``benchmarks/conv.py``'s full-width ``vgg8b`` (bf16; the pools act
on (B, 256, 28, 28), (B, 512, 14, 14), (B, 512, 7, 7) and (B, 512, 3, 3), derived here from
``conv.layout``) at batch 256 and 1024:

* ``aten``: ``max_pool2d_with_indices`` (int64 flat indices) and ``max_pool2d_with_indices_backward``;
* ``triton``: ``torch_dad.ops.pooling.max_pool2x2`` (a uint8 code 0..3) and ``max_pool2x2_backward``.

Forward alone, backward alone (from a stored argmax) and the two together, each as ``--calls`` calls
captured in one CUDA graph (no launch overhead, as in the DAD step's graph), replayed after a warm-up;
the median over ``--replays`` replays timed with CUDA events, per call. Before timing, both pairs'
``out`` and ``d_h`` are checked to be bit-equal. Adds a run to ``results/max_pool.json`` and draws the record's
last timed run into ``results/max_pool.png`` (``--plot-only`` redraws it from the JSON).

    python benchmarks/max_pool.py                     # CUDA (H200): batch 256 and 1024, bf16
    python benchmarks/max_pool.py --batches 1024 --replays 50
    python benchmarks/max_pool.py --smoke             # seconds, CPU: tiny shapes, the PyTorch twin, no timing
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, pyplot, run_config, run_title, save_figure, write_run
from _gpu_common import capture, time_steps
from conv import layout
from torch_dad.ops.pooling import max_pool2x2, max_pool2x2_backward

SIZE = 28  # the MNIST / Fashion-MNIST images of conv.py


def pool_shapes(batch: int, scale: int) -> list[tuple[int, int, int, int]]:
    """The (B, C, H, W) inputs of the net's max pools: each pooled convolution's output (padding 1)."""
    shapes, size = [], SIZE
    for channels, pooled in layout(scale):
        if pooled:
            shapes.append((batch, channels, size, size))
            size //= 2
    return shapes


def aten_pair(h: torch.Tensor, d_out: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Forward, backward (from stored indices) and both, by torch's own kernels."""
    _, indices = torch.ops.aten.max_pool2d_with_indices(h, [2, 2], [2, 2])

    def forward() -> Any:
        return torch.ops.aten.max_pool2d_with_indices(h, [2, 2], [2, 2])

    def backward(idx: torch.Tensor = indices) -> torch.Tensor:
        return torch.ops.aten.max_pool2d_with_indices_backward(d_out, h, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)

    return {"forward": forward, "backward": backward, "forward_backward": lambda: backward(forward()[1])}


def triton_pair(h: torch.Tensor, d_out: torch.Tensor, backend: str) -> dict[str, Callable[[], Any]]:
    """The same three calls by ``max_pool2x2`` and ``max_pool2x2_backward``."""
    _, code = max_pool2x2(h, backend=backend)

    def forward() -> Any:
        return max_pool2x2(h, backend=backend)

    def backward(arg: torch.Tensor = code) -> torch.Tensor:
        return max_pool2x2_backward(d_out, arg, h.shape, backend=backend)

    return {"forward": forward, "backward": backward, "forward_backward": lambda: backward(forward()[1])}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bit patterns (NaN and the sign of zero included)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def graph_us(call: Callable[[], Any], calls: int, replays: int) -> float:
    """Median microseconds per call: ``calls`` calls in one CUDA graph, ``replays`` timed replays after a warm-up.
    The calls' results are dropped inside the capture, so its memory pool reuses their blocks."""

    def body() -> None:
        for _ in range(calls):
            call()

    replay = capture(body)
    return 1e6 * time_steps(lambda _: replay(), steps=1, repeats=replays, warmup=3, warmup_s=0.5) / calls


def measure(shape: tuple[int, int, int, int], dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """One pool input shape: the check, then (on CUDA) each system's three timings."""
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    h = torch.randn(shape, device=device).relu().to(dtype)  # a ReLU output: windows of zeros tie
    out, _ = torch.ops.aten.max_pool2d_with_indices(h, [2, 2], [2, 2])
    d_out = torch.randn(out.shape, device=device).to(dtype)
    systems = {"aten": aten_pair(h, d_out), "triton": triton_pair(h, d_out, "triton" if cuda else "torch")}
    fwd = {name: calls["forward"]() for name, calls in systems.items()}
    bwd = {name: calls["forward_backward"]() for name, calls in systems.items()}
    record: dict[str, Any] = {
        "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
        "matches_aten": same_bits(fwd["triton"][0], fwd["aten"][0]) and same_bits(bwd["triton"], bwd["aten"]),
    }
    if cuda:
        for name, calls in systems.items():
            for part, call in calls.items():
                record[f"{name}_{part}_us"] = graph_us(call, args.calls, args.replays)
        record["speedup_forward_backward"] = record["aten_forward_backward_us"] / record["triton_forward_backward_us"]
    return record


def totals(batch: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The net's four pools together, per system and part."""
    total: dict[str, Any] = {"batch": batch, "shape": "all pools"}
    for key in [k for k in records[0] if k.endswith("_us")]:
        total[key] = sum(r[key] for r in records)
    if "triton_forward_backward_us" in total:
        total["speedup_forward_backward"] = total["aten_forward_backward_us"] / total["triton_forward_backward_us"]
    return total


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """One panel per batch of the record's last timed run: per pooled layer, aten's and Triton's forward and
    backward times stacked, and the forward + backward speed-up; the panel title holds the net's total."""
    plt = pyplot()
    run = next((run for run in reversed(runs) if any("aten_forward_us" in r for r in run["results"])), None)
    if plt is None or run is None:
        return False
    batches = list(dict.fromkeys(r["batch"] for r in run["results"] if "aten_forward_us" in r))
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = [r for r in run["results"] if r["batch"] == batch and "aten_forward_us" in r]
        _pool_panel(ax, [r for r in rows if r["shape"] != "all pools"])
        total = next((r for r in rows if r["shape"] == "all pools"), None)
        if total is not None:
            ax.set_title(f"batch {batch}; all pools: aten {total['aten_forward_backward_us']:.0f} µs, triton "
                         f"{total['triton_forward_backward_us']:.0f} µs (x{total['speedup_forward_backward']:.1f})",
                         fontsize=10)
    axes[0][0].legend(fontsize=8)
    title = "2 x 2 max pool of the vgg8b net, bf16, in a CUDA graph (xN: Triton's forward + backward speed-up)"
    return save_figure(fig, f"{title}\n{run_title(run)}", path)


def _pool_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Stacked forward (solid) and backward (hatched) microseconds per call, aten and Triton side by side per
    pool input, the measured forward + backward speed-up above each pair."""
    xs = range(len(rows))
    for k, name in enumerate(("aten", "triton")):
        at = [x + (k - 0.5) * 0.38 for x in xs]
        forward = [r[f"{name}_forward_us"] for r in rows]
        ax.bar(at, forward, 0.38, color=f"C{k}", label=f"{name} forward")
        ax.bar(at, [r[f"{name}_backward_us"] for r in rows], 0.38, bottom=forward, color=f"C{k}", alpha=0.55,
               hatch="///", edgecolor="black", lw=0.4, label=f"{name} backward")
    for x, r in zip(xs, rows):
        top = r["aten_forward_us"] + r["aten_backward_us"]
        ax.annotate(f"x{r['speedup_forward_backward']:.1f}", (x, top), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
    ax.set_xticks(list(xs), ["x".join(map(str, r["shape"][1:])) for r in rows])
    ax.set_xlabel("pool input (channels x height x width)")
    ax.set_ylabel("µs per call")
    ax.margins(y=0.12)  # room for the speed-ups
    ax.grid(True, axis="y", alpha=0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph")
    parser.add_argument("--replays", type=int, default=20, help="timed replays (median)")
    parser.add_argument("--smoke", action="store_true", help="seconds on CPU: tiny shapes, the PyTorch twin, no timing")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/max_pool.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("max_pool", plot))
        return
    if not args.smoke and not torch.cuda.is_available():
        parser.error("the A/B needs CUDA; use --smoke on CPU")
    scale, batches = (32, [2]) if args.smoke else (1, args.batches)
    records: list[dict[str, Any]] = []
    for batch in batches:
        per_shape = [{"batch": batch, **measure(s, torch.bfloat16, args)} for s in pool_shapes(batch, scale)]
        for record in per_shape + ([] if args.smoke else [totals(batch, per_shape)]):
            print(record, flush=True)
            records.append(record)
    if not all(r["matches_aten"] for r in records if "matches_aten" in r):
        raise SystemExit("the two pairs disagree: see the records above")
    print(write_run("max_pool", records, config=run_config(args, parser, exclude=["plot_only"]), smoke=args.smoke))
    if not args.smoke:  # a smoke run has no timings to draw
        print("plot:", draw_record("max_pool", plot))


if __name__ == "__main__":
    main()
