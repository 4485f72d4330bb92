"""Peak GPU memory of one training step above the static footprint: DAD vs backprop.

Deep MLP ``depth x width`` (16 x 4096 at B=16384, bf16; repeated at depths 4 and 32), fp32
inputs, AdamW. "static" is ``memory_allocated()`` just before the measured step (parameters,
optimizer state, Gram statistics, data); "above static" is ``max_memory_allocated()`` during
the step minus that. Both systems run op by op (``DADTrainer(backend="fused")`` and autocast
backprop): inside a CUDA graph replay the allocator is not called, so peaks would not show.
Also records ``dad-graph-pool``, the default CUDA-graph step: ``graph_pool_mib`` is what its graph's private
pool holds beyond allocated blocks (replays write there), ``total_above_static_mib`` that plus its replay's peak
above static; ``reserved_growth_mib`` (every system) also counts state allocated at the first step, such as
the bf16 weight copies.
On a GPU each system at each depth runs in a fresh process (no allocator cache or graph pool of another counts).
Adds a run to ``results/gpu_memory.json`` and draws its last run into ``results/gpu_memory.png`` (``--plot-only``
redraws the PNG from the JSON). ``--smoke``: CPU, tiny, no memory numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torch_dad as td
from _common import (
    DADMLP,
    backprop_mlp,
    cuda_step_memory,
    draw_record,
    environment,
    fresh_process_json,
    graph_pool_slack,
    pyplot,
    run_config,
    run_title,
    save_figure,
    write_run,
)

MIB = 2**20


def dad_peak(depth: int, width: int, batch: int, device: torch.device, backend: str, amp: torch.dtype | None) -> dict:
    model = DADMLP([width] * (depth + 1), num_classes=10)
    # on_nonfinite='ignore' (the CUDA default) so that CPU smoke runs take the fused step too
    trainer = td.DADTrainer(model, device=device, amp_dtype=amp, backend=backend, on_nonfinite="ignore")
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if device.type == "cuda":
        # return blocks cached by earlier systems first: else the pool is measured against a
        # reserve that shrinks while it is captured (that gave negative pools at depths 16 and 32)
        gc.collect()
        torch.cuda.empty_cache()
    cuda = device.type == "cuda"
    reserved0, slack0 = (torch.cuda.memory_reserved(), graph_pool_slack()) if cuda else (0, 0)
    for _ in range(2 if backend != "cuda-graph" else 3):  # materialise state (and capture the graph)
        trainer.step(x, y)
    row = _measure(lambda: trainer.step(x, y), device)
    if not cuda:
        return {**row, "reserved_growth_mib": float("nan"), "graph_pool_mib": float("nan")}
    # the graph's pool: blocks its replays write while the allocator counts them free (zero op by op)
    pool = (graph_pool_slack() - slack0) / MIB
    return {**row, "reserved_growth_mib": (torch.cuda.memory_reserved() - reserved0) / MIB, "graph_pool_mib": pool,
            "total_above_static_mib": row["above_static_mib"] + pool}


def backprop_peak(depth: int, width: int, batch: int, device: torch.device, amp: torch.dtype | None) -> dict:
    model = backprop_mlp([width] * (depth + 1), 10).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    return _measure(step, device)


def _measure(step, device: torch.device) -> dict:  # type: ignore[no-untyped-def]
    if device.type != "cuda":
        step()
        return {"static_mib": float("nan"), "peak_mib": float("nan"), "above_static_mib": float("nan")}
    static, peak = cuda_step_memory(step)
    return {"static_mib": static / MIB, "peak_mib": peak / MIB, "above_static_mib": (peak - static) / MIB}


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels of the record's last run against depth, one line per system: the step's memory above the static
    footprint (with the graph pool where there is one), and static plus that."""
    plt = pyplot()
    run = runs[-1] if runs else None
    # a CPU run records NaN memory
    rows = [r for r in run["results"] if math.isfinite(r.get("static_mib", math.nan))] if run else []
    if plt is None or run is None or not rows:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in dict.fromkeys(r["system"] for r in rows):
        cells = sorted((r for r in rows if r["system"] == system), key=lambda r: r["depth"])
        above = [r.get("total_above_static_mib", r["above_static_mib"]) for r in cells]
        depths = [r["depth"] for r in cells]
        axes[0].plot(depths, above, marker="o", label=system)
        axes[1].plot(depths, [r["static_mib"] + a for r, a in zip(cells, above)], marker="o", label=system)
    titles = ("step memory above static (+ graph pool)", "static + above static")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(plt.LogFormatter(labelOnlyBase=False))  # plain numbers, not powers of ten
        ax.set_xticks(sorted({r["depth"] for r in rows}), [str(d) for d in sorted({r["depth"] for r in rows})])
        ax.set_xlabel(f"hidden layers of {rows[0]['width']}")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = (f"one training step, B={rows[0]['batch']}, bf16, AdamW (dad, backprop: op by op; dad-graph-pool: the "
             f"CUDA-graph step)\n{run_title(run)}")
    return save_figure(fig, title, path)


#: system -> ``DADTrainer`` backend (``None``: backprop)
BACKENDS = {"dad": "fused", "backprop": None, "dad-graph-pool": "cuda-graph"}
SYSTEMS = list(BACKENDS)


def one_system(system: str, depth: int, width: int, batch: int, *, cuda: bool) -> dict[str, Any]:
    """The row of ``system`` at one depth, measured in this process."""
    device, amp = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), None)
    backend = BACKENDS[system]
    if backend is None:
        return backprop_peak(depth, width, batch, device, amp)
    return dad_peak(depth, width, batch, device, backend, amp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="record path (default results/gpu_memory.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/gpu_memory.png from the record")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: [system, depth, width, batch]
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("gpu_memory", plot, out=args.out))
        return
    cuda = torch.cuda.is_available() and not args.smoke
    if args.one:
        print(json.dumps(one_system(*json.loads(args.one), cuda=cuda)))
        return
    env = environment()
    configs = [(4, 4096, 16384), (16, 4096, 16384), (32, 4096, 16384)] if not args.smoke else [(2, 32, 16)]
    records = []
    for depth, width, batch in configs:
        for system in SYSTEMS if cuda else SYSTEMS[:2]:
            job = [system, depth, width, batch]
            # on a GPU in a fresh process: no allocator cache or graph pool of another system counts
            row = fresh_process_json([sys.executable, __file__, "--one", json.dumps(job)]) if cuda else \
                one_system(*job, cuda=False)
            records.append({"system": system, "depth": depth, "width": width, "batch": batch, **row, **env})
            print(json.dumps(records[-1]), flush=True)
    config = run_config(args, parser, exclude=["plot_only"])
    path = write_run("gpu_memory", records, config=config, smoke=args.smoke, out=args.out, env=env)
    print(f"-> {path}")
    if not args.smoke:  # a CPU smoke run has no memory figures to draw
        print("plot:", draw_record("gpu_memory", plot, out=args.out))
    for r in records:
        above = r.get("total_above_static_mib", r["above_static_mib"])
        print(f"{r['system']:15} {r['depth']:>3}x{r['width']} B={r['batch']:<6} static {r['static_mib']:>9.0f} "
              f"above-static {above:>8.0f} MiB")


if __name__ == "__main__":
    main()
