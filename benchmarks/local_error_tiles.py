"""Launch configurations of the local-error kernel, timed per call inside a CUDA graph.

For each layer-output shape (rows M x width N, C classes) and dtype, every candidate ``Tiles`` of
``torch_dad.kernels.local_error`` (row tiles, row split, one-pass or two kernels) is checked against the
default configuration's result and then timed: 20 calls captured in one CUDA graph, replayed after a
warm-up, median of 5 replays, per call. Its purpose is to choose ``default_tiles``; a record says which
candidate was fastest and how the default compares. Adds a run to ``results/local_error_tiles.json`` and draws the
record's last timed run into ``results/local_error_tiles.png`` (``--plot-only`` redraws it from the JSON).

    python benchmarks/local_error_tiles.py                                       # H200: M 128/256, fp32 and bf16
    python benchmarks/local_error_tiles.py --shapes 128x1024 --dtypes fp32 --tf32
    python benchmarks/local_error_tiles.py --smoke   # CPU: lists the candidates per shape, launches nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, environment, pyplot, run_config, run_title, save_figure, write_run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


ROW_BM, ROW_BN, SPLITS, STAGES = (16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (3, 4)


def candidates(
    element_size: int, row_bm: tuple[int, ...] = ROW_BM, row_bn: tuple[int, ...] = ROW_BN,
    splits: tuple[int, ...] = SPLITS, stages: tuple[int, ...] = STAGES,
) -> list[Any]:
    """The configurations swept: two-kernel row tiles x row split x stages, and one-pass row tiles; the
    column kernel keeps the default's tiles. 512-wide fp32 row tiles do not fit in an H200's shared memory."""
    from torch_dad.kernels.local_error import Tiles

    cols = {"cols_bm": 32, "cols_bn": 128, "cols_warps": 8, "cols_stages": 2, "cols_programs_per_sm": 2}
    out = []
    for bm, bn, split, stage in itertools.product(row_bm, row_bn, splits, stages):
        if bn * element_size <= 1024:
            out.append(Tiles(rows_bm=bm, rows_bn=bn, rows_warps=4, rows_stages=stage, rows_split=split, **cols))
    for bm, bn in itertools.product((16, 32), (64, 128)):
        out.append(Tiles(rows_bm=bm, rows_bn=bn, rows_warps=4, rows_stages=3, one_pass=True, **cols))
    return out


def _inputs(m: int, n: int, c: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(m, n, generator=g).relu().to(device, dtype)
    return h, torch.randn(c, n, generator=g).to(device) * 0.05, torch.zeros(c, device=device), torch.randint(
        0, c, (m,), generator=g
    ).to(device)


def _close(got: tuple[Any, ...], want: tuple[Any, ...], dtype: torch.dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return all(
        a is None and b is None or float((a.float() - b.float()).norm()) <= tol * max(1e-6, float(b.float().norm()))
        for a, b in zip(got, want)
    )


def time_call(call: Any, device: torch.device, calls: int = 20, replays: int = 5) -> float:
    """Median seconds per call: ``calls`` calls in one CUDA graph, ``replays`` replays after a warm-up."""
    from _gpu_common import capture

    replay = capture(lambda: [call() for _ in range(calls)])
    replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def sweep_shape(
    m: int, n: int, c: int, dtype: torch.dtype, device: torch.device, swept: list[Any]
) -> dict[str, Any]:
    """Every candidate of ``swept`` on one shape: checked against the default configuration, then timed (CUDA)."""
    from torch_dad.kernels.local_error import default_tiles, launch_local_error

    h, w, b, y = _inputs(m, n, c, dtype, device)
    default = default_tiles(m, n, max(16, 1 << (c - 1).bit_length()), h.element_size())
    want = launch_local_error(h, w, b, y, "relu", True, default)
    rows = []
    for tiles in [*swept, default]:
        call = lambda t=tiles: launch_local_error(h, w, b, y, "relu", True, t)  # noqa: E731
        row: dict[str, Any] = {"tiles": dataclasses.asdict(tiles), "default": tiles == default}
        row["matches_default"] = _close(call(), want, dtype)
        if row["matches_default"]:
            row["us_per_call"] = 1e6 * time_call(call, device)
        rows.append(row)
    timed = [r for r in rows if "us_per_call" in r]
    best = min(timed, key=lambda r: r["us_per_call"]) if timed else None
    default_us = next((r["us_per_call"] for r in timed if r["default"]), None)
    return {
        "M": m, "N": n, "classes": c, "dtype": str(dtype).removeprefix("torch."),
        "tf32": torch.backends.cuda.matmul.allow_tf32, "candidates": rows,
        "best": best["tiles"] if best else None, "best_us": best["us_per_call"] if best else None,
        "default_us": default_us, "all_match": all(r["matches_default"] for r in rows),
    }


def _swept(args: argparse.Namespace, dtype: torch.dtype) -> list[Any]:
    size = torch.empty((), dtype=dtype).element_size()
    return candidates(size, tuple(args.row_bm), tuple(args.row_bn), tuple(args.splits), tuple(args.stages))


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """One panel per dtype of the record's last timed run: every candidate's microseconds per call on each shape,
    coloured by row split (one-pass kernels grey), the default configuration and the fastest marked."""
    plt = pyplot()
    run = next((run for run in reversed(runs) if any(isinstance(r.get("candidates"), list) for r in run["results"])),
               None)
    if plt is None or run is None:
        return False
    rows = [r for r in run["results"] if isinstance(r.get("candidates"), list)]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    splits = sorted({c["tiles"]["rows_split"] for r in rows for c in r["candidates"] if not c["tiles"]["one_pass"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4.4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        cells = [r for r in rows if r["dtype"] == dtype]
        for i, row in enumerate(cells):
            _candidate_dots(ax, i, row, splits)
        ax.set_xticks(range(len(cells)), [f"{r['M']} x {r['N']}" for r in cells])
        ax.set_xlabel(f"layer output, rows x width ({cells[0]['classes']} classes)")
        ax.set_ylabel("µs per call")
        ax.set_ylim(bottom=0)
        ax.set_title(dtype + (", TF32" if cells[0].get("tf32") else ""), fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handle_of = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    order = [f"two kernels, row split {split}" for split in splits] + ["one pass", "default", "fastest"]
    labels = [label for label in order if label in handle_of]
    fig.legend([handle_of[label] for label in labels], labels, loc="lower center", ncol=len(labels), fontsize=8)
    return save_figure(fig, f"local-error kernel launch configurations, in a CUDA graph: {run_title(run)}", path,
                       rect=(0, 0.4 / fig.get_figheight(), 1, 1))


def _candidate_dots(ax: Any, x: int, row: dict[str, Any], splits: list[int]) -> None:
    """One shape's timed candidates, spread around ``x``; the default as a red diamond, the fastest ringed."""
    timed = [c for c in row["candidates"] if "us_per_call" in c and not c["default"]]
    for j, c in enumerate(timed):
        dx = 0.6 * (j / max(1, len(timed) - 1) - 0.5)
        one_pass = c["tiles"]["one_pass"]
        color = "grey" if one_pass else f"C{splits.index(c['tiles']['rows_split'])}"
        label = "one pass" if one_pass else f"two kernels, row split {c['tiles']['rows_split']}"
        ax.plot(x + dx, c["us_per_call"], "o", color=color, ms=4, label=label)
        if c["tiles"] == row.get("best"):
            ax.plot(x + dx, c["us_per_call"], "o", mfc="none", mec="black", ms=11, label="fastest")
    if row.get("default_us") is not None:
        ax.plot(x, row["default_us"], "D", color="red", mec="black", ms=7, label="default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds on CPU under triton's interpreter, no timing")
    parser.add_argument("--shapes", nargs="+", default=["128x1024", "256x1024", "128x4096", "256x4096"],
                        help="MxN layer outputs")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--tf32", action="store_true", help="fp32 products in TF32 (the kernel follows torch's flag)")
    parser.add_argument("--row-bm", type=int, nargs="+", default=list(ROW_BM), help="row-kernel row tiles swept")
    parser.add_argument("--row-bn", type=int, nargs="+", default=list(ROW_BN), help="row-kernel column tiles swept")
    parser.add_argument("--splits", type=int, nargs="+", default=list(SPLITS), help="row splits swept")
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="pipeline stages swept")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/local_error_tiles.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("local_error_tiles", plot))
        return
    if args.smoke or not torch.cuda.is_available():
        # the kernels need CUDA (the kernel tests run them under triton's interpreter)
        counts = {name: len(_swept(args, DTYPES[name])) for name in args.dtypes}
        print(f"no timing without CUDA; candidates per shape: {counts}")
        config = run_config(args, parser, exclude=["plot_only"])
        write_run("local_error_tiles", [{"candidates": counts}], config=config, smoke=True)
        return
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    except ValueError:
        parser.error(f"--shapes {args.shapes}: write each as MxN, e.g. 128x1024")
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or args.classes < 2:
        parser.error("--shapes need positive MxN and --classes at least 2")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    device = torch.device("cuda")
    env = environment()
    records = []
    for (m, n), name in itertools.product(shapes, args.dtypes):
        record = {**sweep_shape(m, n, args.classes, DTYPES[name], device, _swept(args, DTYPES[name])), **env}
        records.append(record)
        print(f"{m}x{n} {name}: default {record['default_us']} us, best {record['best_us']} us {record['best']}, "
              f"all match: {record['all_match']}", flush=True)
    config = run_config(args, parser, exclude=["plot_only"])
    print(f"wrote {write_run('local_error_tiles', records, config=config, smoke=args.smoke, env=env)}")
    if not args.smoke:
        print("plot:", draw_record("local_error_tiles", plot))


if __name__ == "__main__":
    main()
