"""CPU training throughput: ``DADTrainer.step`` against backprop + AdamW on the same MLP.

Same synthetic batches for every system, warm-up, median of repeats. Systems:
``dad`` (fp32), ``backprop-eager`` (``torch.optim.AdamW`` defaults), ``backprop-eager-fused``
(``AdamW(fused=True)``). Two protocols:

- default: all systems in this process, interleaved in rounds, median round
  (one run of ``results/cpu_throughput.json``);
- ``--isolated N``: every measurement in a fresh process of its own (one system, one model,
  as a training script runs), N rounds with the order of the systems rotated each round, and
  the per-round ratio ``dad img/s / backprop img/s`` summarised by its median and quartiles
  (another run of it). In one process the systems share glibc's
  allocator, whose history changes backprop's page faults (0 to ~3,100 a step at B=1024).

A real run also draws the record into ``results/cpu_throughput.png`` (``--plot-only`` redraws it from the JSON).

    python benchmarks/cpu_throughput.py                  # in-process (about 2 minutes on 2 cores)
    python benchmarks/cpu_throughput.py --isolated 24 --batch 1024   # about 6 minutes
    python benchmarks/cpu_throughput.py --smoke          # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import torch_dad as td
from _common import (
    DADMLP,
    backprop_mlp,
    draw_record,
    environment,
    median_time,
    pyplot,
    run_config,
    run_title,
    save_figure,
    write_run,
)

TOPOLOGIES = {"mnist-medium-3": [784, 1024, 512, 256], "fmnist-wide-2": [784, 4096, 4096]}
SYSTEMS = ("dad", "backprop-eager", "backprop-eager-fused")


def make_step(system: str, widths: Sequence[int], batch: int) -> Callable[[], None]:
    """One training step of ``system`` on a fixed synthetic batch (seed 0)."""
    torch.manual_seed(0)
    x = torch.randn(batch, widths[0])
    y = torch.randint(0, 10, (batch,))
    if system == "dad":
        dad = td.DADTrainer(DADMLP(widths), device="cpu")

        def dad_step() -> None:
            dad.step(x, y)

        return dad_step
    if system not in SYSTEMS:
        raise ValueError(f"system={system!r} must be one of {', '.join(SYSTEMS)}")
    net = backprop_mlp(widths)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01, fused=True if system.endswith("fused") else None)

    def bp_step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    return bp_step


def in_process(topologies: dict[str, list[int]], batches: list[int], rounds: int, warmup: int, repeats: int) -> list[dict[str, Any]]:
    env = environment()
    records: list[dict[str, Any]] = []
    for name, widths in topologies.items():
        for batch in batches:
            systems = {label: make_step(label, widths, batch) for label in SYSTEMS}
            # interleave systems across rounds so drift on a shared machine hits all alike
            times: dict[str, list[float]] = {k: [] for k in systems}
            for _ in range(rounds):
                for label, fn in systems.items():
                    times[label].append(median_time(fn, warmup=warmup, repeats=repeats))
            for label, samples in times.items():
                seconds = sorted(samples)[len(samples) // 2]
                records.append({"topology": name, "batch": batch, "system": label,
                                "img_per_s": batch / seconds, "step_ms": seconds * 1e3, **env})
                print(f"{name:16s} B={batch:5d} {label:22s} {batch / seconds:10.0f} img/s")
            base = next(r for r in records if r["topology"] == name and r["batch"] == batch and r["system"] == "backprop-eager")
            ours = next(r for r in records if r["topology"] == name and r["batch"] == batch and r["system"] == "dad")
            print(f"  dad / backprop-eager = {ours['img_per_s'] / base['img_per_s']:.3f}")
    return records


def _run_worker(system: str, widths: Sequence[int], batch: int, warmup: int, repeats: int) -> float:
    """Median step seconds of ``system``, measured in a fresh Python process."""
    cmd = [sys.executable, __file__, "--worker", system, "--widths", *map(str, widths),
           "--batch", str(batch), "--warmup", str(warmup), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["step_s"])


def isolated(topologies: dict[str, list[int]], batches: list[int], rounds: int, warmup: int, repeats: int) -> list[dict[str, Any]]:
    env = environment()
    records: list[dict[str, Any]] = []
    for name, widths in topologies.items():
        for batch in batches:
            times: dict[str, list[float]] = {k: [] for k in SYSTEMS}
            for r in range(rounds):
                order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[: r % len(SYSTEMS)]
                if (r // len(SYSTEMS)) % 2:
                    order = order[::-1]
                for label in order:
                    times[label].append(_run_worker(label, widths, batch, warmup, repeats))
                print(f"{name} B={batch} round {r + 1}/{rounds}: " + "  ".join(f"{k} {times[k][-1] * 1e3:.1f} ms" for k in SYSTEMS),
                      flush=True)
            for label in SYSTEMS:
                seconds = statistics.median(times[label])
                record = {"topology": name, "batch": batch, "system": label, "protocol": "isolated",
                          "img_per_s": batch / seconds, "step_ms": seconds * 1e3,
                          "round_step_ms": [t * 1e3 for t in times[label]], **env}
                if label != "dad":
                    ratios = [b / d for b, d in zip(times[label], times["dad"])]
                    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                    record.update({"dad_over_this_per_round": ratios, "dad_over_this_median": statistics.median(ratios),
                                   "dad_over_this_q1": quartiles[0], "dad_over_this_q3": quartiles[2],
                                   "rounds_at_or_above_1_2": sum(x >= 1.2 for x in ratios)})
                    print(f"  dad / {label}: median {statistics.median(ratios):.3f}, quartiles "
                          f"{quartiles[0]:.3f}-{quartiles[2]:.3f}, {record['rounds_at_or_above_1_2']}/{rounds} rounds >= 1.2")
                records.append(record)
    return records


def _short_cpu(device: str) -> str:
    """``cpu (Intel(R) Xeon(R) Processor, AVX-512, 2 threads; note)`` -> ``Xeon, AVX-512, 2 threads``."""
    text = device.removeprefix("cpu (").split(";")[0].removesuffix(")")
    return text.replace("Intel(R) ", "").replace("(R)", "").replace(" Processor", "")


def _settings(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{label: {system: row}}`` per measured setting (protocol, batch, CPU): where a run pools several of
    its own runs, only the pooled rows; a later run replaces an earlier one of the same setting."""
    settings: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        for row in run["results"]:
            if row.get("run", "pooled") != "pooled":
                continue
            protocol = row.get("protocol", run["config"].get("protocol", "in-process"))
            cpu = _short_cpu(row.get("device", run["environment"].get("device", "?")))
            label = f"{protocol}, B={row['batch']}\n{cpu}"
            settings.setdefault(label, {})[row["system"]] = row
    return {label: rows for label, rows in settings.items() if "dad" in rows}


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels, one row per setting (protocol, batch, CPU) of the record: img/s of every system, and DAD's
    speed-up over each backprop system (isolated runs: median per-round ratio, quartiles as error bars)."""
    plt = pyplot()
    settings = _settings(runs)
    if plt is None or not settings:
        return False
    fig, (speed, ratio) = plt.subplots(1, 2, figsize=(12, 1.2 + 1.0 * len(settings)), sharey=True)
    rows = list(settings.values())
    for k, system in enumerate(SYSTEMS):
        ys = [i + (k - 1) * 0.27 for i, cell in enumerate(rows) if system in cell]
        speed.barh(ys, [cell[system]["img_per_s"] for cell in rows if system in cell], 0.27, label=system,
                   color=f"C{k}")
    for k, system in enumerate(SYSTEMS[1:], start=1):
        _ratio_points(ratio, rows, system, k)
    ratio.axvline(1.0, color="black", lw=0.8, ls="--")
    speed.set_title("throughput", fontsize=10)
    ratio.set_title("DAD's speed-up (isolated: median and quartiles of the rounds)", fontsize=10)
    speed.set_yticks(range(len(rows)), list(settings), fontsize=8)
    speed.invert_yaxis()
    for ax, label in ((speed, "img/s"), (ratio, "baseline step time / DAD step time")):
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    topology = ", ".join(sorted({r["topology"] for cell in rows for r in cell.values()}))
    titles = "\n".join(dict.fromkeys(run_title(run) for run in runs))
    return save_figure(fig, f"CPU training throughput, {topology}\n{titles}", path, fontsize=9)


def _ratio_points(ax: Any, rows: list[dict[str, dict[str, Any]]], system: str, k: int) -> None:
    """DAD's speed-up over ``system`` per setting: the median per-round ratio with its quartiles where the
    rounds are recorded, else the ratio of the medians."""
    ys, xs, low, high = [], [], [], []
    for i, cell in enumerate(rows):
        row = cell.get(system)
        if row is None:
            continue
        mid = row.get("dad_over_this_median", cell["dad"]["img_per_s"] / row["img_per_s"])
        ys.append(i + (k - 1) * 0.27)  # beside the system's bar in the img/s panel
        xs.append(mid)
        low.append(mid - row.get("dad_over_this_q1", mid))
        high.append(row.get("dad_over_this_q3", mid) - mid)
    ax.errorbar(xs, ys, xerr=[low, high], fmt="o", color=f"C{k}", capsize=3, label=f"over {system}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--isolated", type=int, default=0, metavar="ROUNDS",
                        help="measure each system in fresh processes, over this many rounds")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--widths", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--plot-only", action="store_true", help="redraw results/cpu_throughput.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("cpu_throughput", plot))
        return
    if args.worker:
        step = make_step(args.worker, args.widths, args.batch[0])
        print(json.dumps({"step_s": median_time(step, warmup=args.warmup, repeats=args.repeats)}))
        return
    topologies = {"smoke": [64, 48, 32]} if args.smoke else {"mnist-medium-3": TOPOLOGIES["mnist-medium-3"]}
    batches = [64] if args.smoke else args.batch
    warmup, repeats = (1, 3) if args.smoke else (args.warmup, args.repeats)
    if args.isolated or args.smoke:
        records = isolated(topologies, batches, max(1, args.isolated) if not args.smoke else 1, warmup, repeats)
        config = run_config(args, parser, exclude=["plot_only"]) | {"protocol": "isolated"}
        print("wrote", write_run("cpu_throughput", records, config=config, smoke=args.smoke))
    if not args.isolated:
        records = in_process(topologies, batches, 1 if args.smoke else args.rounds, warmup, repeats)
        config = run_config(args, parser, exclude=["plot_only"]) | {"protocol": "in-process"}
        print("wrote", write_run("cpu_throughput", records, config=config, smoke=args.smoke))
    if not args.smoke:
        print("plot:", draw_record("cpu_throughput", plot))


if __name__ == "__main__":
    main()
