"""Throughput and peak memory against depth: ``dad`` vs ``backprop-graphed``.

MLPs of 2, 4, 8, 16, 32 hidden layers of 1024, B=4096, bf16, AdamW, fp32 inputs on the GPU;
CUDA events, 20 warm-up steps, median of 5 repeats of 30 steps. Adds a run to
``results/gpu_scaling.json`` and, with matplotlib, draws its last run into ``results/gpu_scaling.png``
(``--plot-only`` redraws the PNG from the JSON). ``--smoke``: CPU, tiny.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, environment, pyplot, run_config, run_title, save_figure, write_run
from _gpu_common import backprop_graphed, cuda_sync, dad_system, make_data, time_steps


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels of the record's last run: img/s and peak MiB against depth, one line per system. ``False``
    without matplotlib."""
    plt = pyplot()
    if plt is None or not runs:
        return False
    run = runs[-1]
    records = run["results"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system in sorted({r["system"] for r in records}):
        rows = sorted((r for r in records if r["system"] == system), key=lambda r: r["depth"])
        depths = [r["depth"] for r in rows]
        axes[0].plot(depths, [r["img_per_s"] for r in rows], marker="o", label=system)
        axes[1].plot(depths, [r["peak_mib"] for r in rows], marker="o", label=system)
    for ax, label in zip(axes, ("img/s", "peak MiB (whole process)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("hidden layers of 1024")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    return save_figure(fig, f"B={records[0]['batch']}, bf16, {run_title(run)}", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--out", default=None, help="record path (default results/gpu_scaling.json)")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("gpu_scaling", plot, out=args.out))
        return
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    env = environment()
    depths, width, batch = ([2, 4, 8, 16, 32], 1024, 4096) if cuda else ([1, 2], 32, 16)
    amp = torch.bfloat16 if cuda else None
    steps, repeats, warmup = (30, 5, 20) if cuda else (2, 1, 1)
    records = []
    for depth in depths:
        x, y = make_data(width, 10, batch, 4, device)
        for system in ["dad"] + (["backprop-graphed"] if cuda else []):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if system == "dad":
                _, fn = dad_system(width, [width] * depth, 10, device, "auto" if cuda else "fused", amp)
            else:
                fn = backprop_graphed(width, [width] * depth, 10, device, amp, batch)

            def step(i: int, fn=fn, x=x, y=y, batch=batch) -> None:  # type: ignore[no-untyped-def]
                j = i % 4
                fn(x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch])

            sec = time_steps(step, steps, repeats, warmup)
            cuda_sync()
            records.append({"system": system, "depth": depth, "width": width, "batch": batch, "img_per_s": batch / sec,
                            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"), **env})
            print(json.dumps(records[-1]), flush=True)
            del fn
    path = write_run("gpu_scaling", records, config=run_config(args, parser, exclude=["plot_only"]), smoke=args.smoke,
                     out=args.out, env=env)
    if not args.smoke:  # a CPU smoke run has no memory figures to draw
        print("plot:", draw_record("gpu_scaling", plot, out=args.out))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
