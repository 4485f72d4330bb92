"""What checkpointing costs a distributed ``fit``: ``DataParallelTrainer`` at world size 1 and a ``Pipeline`` of
one stage, with ``checkpoint_every=500`` (plus the save at the end of ``fit``) against no checkpoints.

Model: the quickstart MNIST net (784-1024-512-256-10, the trainers' defaults), MNIST-shaped synthetic rows
(60,000 per epoch, batch 256: 235 steps an epoch), ``--steps`` steps per ``fit``. Each mode runs in a fresh
process (NCCL on a GPU, gloo on CPU, one rank), where fits without and with checkpoints alternate, so that a
difference between processes does not count as cost; the time is ``fit``'s wall time from call to return, so it
includes every save's work on the training thread and the wait for the last one. The cost is the median over
``--pairs`` pairs of ``(with - without) / without``.

The record also compares one save of the same state written the two ways a user could pick: this
library's shard (safetensors + JSON, on the calling thread) and ``torch.distributed.checkpoint.save``.
A real run also draws its last run into ``results/checkpoint_cost.png`` (``--plot-only`` redraws it from the JSON).

    PYTHONPATH=src python benchmarks/checkpoint_cost.py          # on the GPU machine
    python benchmarks/checkpoint_cost.py --smoke                 # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torch_dad as td
from _common import DADMLP, draw_record, fresh_process_json, pyplot, run_config, run_title, save_figure, write_run
from torch_dad.training import DataParallelTrainer, Pipeline, checkpoint

ROWS_PER_EPOCH = 60_000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init(device: torch.device) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_mode(mode: str, every: int, steps: int, rows: int, pairs: int) -> dict[str, Any]:
    """``pairs`` fits of ``steps`` steps without and with checkpoints, alternating (the order flips every
    pair), in this process after a 10-step warm-up ``fit``, each starting from an empty history: each fit's
    seconds, and the cost per pair."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    _init(device)
    torch.manual_seed(0)
    x = torch.randn(rows, 784, device=device)
    y = torch.randint(0, 10, (rows,), device=device)
    epochs = -(-steps // -(-rows // 256))
    model = DADMLP([784, 1024, 512, 256])
    trainer = DataParallelTrainer(model, device) if mode == "data-parallel" else td.DADTrainer(model, device)
    runner: Any = trainer if mode == "data-parallel" else Pipeline(trainer)
    runner.fit((x[:2560], y[:2560]), progress=False)  # warm-up: kernels, allocator, collectives
    seconds: dict[int, list[float]] = {0: [], every: []}
    for pair in range(pairs):
        for interval in (0, every) if pair % 2 == 0 else (every, 0):
            with tempfile.TemporaryDirectory() as folder:
                options = dict(checkpoint_dir=folder, checkpoint_every=interval) if interval else {}
                # each fit saves the history of one run of its length, not of every fit before it
                trainer.history.clear()
                _sync(device)
                start, first = time.perf_counter(), trainer.step_count
                runner.fit((x, y), epochs=epochs, progress=False, **options)
                _sync(device)
                seconds[interval].append(time.perf_counter() - start)
    dist.destroy_process_group()
    costs = [(w - o) / o for o, w in zip(seconds[0], seconds[every])]
    return {"mode": mode, "steps": trainer.step_count - first, "seconds_without": statistics.median(seconds[0]),
            "seconds_with": statistics.median(seconds[every]), "cost_percent": round(100 * statistics.median(costs), 2),
            "pairs": [[round(o, 4), round(w, 4)] for o, w in zip(seconds[0], seconds[every])]}


def _training_speed_during(save: Any) -> float:
    """Small host-bound ops per second on this thread while ``save()`` runs 5 times on another, as a
    fraction of the rate without it: how much a background save holds the GIL."""
    x = torch.zeros(8)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < 0.3:
        x.add_(1.0)
        count += 1
    alone = count / (time.perf_counter() - start)
    thread = threading.Thread(target=lambda: [save() for _ in range(5)])
    start, count = time.perf_counter(), 0
    thread.start()
    while thread.is_alive():
        x.add_(1.0)
        count += 1
    return round(count / (time.perf_counter() - start) / alone, 3)


_PROCESS_WRITE = """
import hashlib, os, sys
data = open(sys.argv[1], "rb").read()
hashlib.sha256(data).hexdigest()
with open(sys.argv[1] + ".copy", "wb") as handle:
    handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())
"""


def _write_in_a_process(path: Path) -> None:
    """Hash and write ``path``'s bytes in a child process (this thread only waits)."""
    subprocess.run([sys.executable, "-c", _PROCESS_WRITE, str(path)], check=True)


def save_formats(rows: int) -> dict[str, Any]:
    """One synchronous save of the quickstart trainer's state, shard file vs ``dcp.save`` (ms), and the
    training thread's speed while a background thread serializes with ``safetensors.torch.save`` (the
    whole file built in memory), writes the shard's chunks (what a distributed save does), waits for a child
    process that hashes and writes the same bytes, or sleeps (the measurement's own cost)."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = td.DADTrainer(DADMLP([784, 1024, 512, 256]), device)
    trainer.fit((torch.randn(rows, 784, device=device), torch.randint(0, 10, (rows,), device=device)),
                progress=False)
    state = trainer.state_dict()
    tensors = checkpoint.flatten(state)[1]
    timings: dict[str, list[float]] = {"shard": [], "dcp": []}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(4):
            start = time.perf_counter()
            checkpoint.write(Path(folder) / f"s{repeat}.safetensors", {"trainer": state})
            timings["shard"].append(time.perf_counter() - start)
            start = time.perf_counter()
            dcp.save(tensors, checkpoint_id=str(Path(folder) / f"d{repeat}"), no_dist=True)
            timings["dcp"].append(time.perf_counter() - start)
        target = Path(folder) / "background.safetensors"
        metadata = {"sha256": "-"}
        speeds = {
            "speed_during_safetensors_save": _training_speed_during(
                lambda: checkpoint.atomic_write(target, safetensors.torch.save(tensors, metadata=metadata))),
            "speed_during_chunked_write": _training_speed_during(
                lambda: checkpoint.write_flat(target, {}, tensors)),
            # the same bytes hashed and written by another process: what the GIL, not the machine, costs
            "speed_during_process_write": _training_speed_during(lambda: _write_in_a_process(target)),
            "speed_during_sleep": _training_speed_during(lambda: time.sleep(0.05)),
        }
    megabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    return {"state_mib": round(megabytes, 1), **{f"{k}_ms": round(1e3 * statistics.median(v[1:]), 2)
                                                 for k, v in timings.items()}, **speeds}


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Three panels of the record's last run: per mode the fit time without and with checkpoints, pair by pair;
    each pair's cost in percent; one synchronous save, shard file against ``dcp.save``."""
    plt = pyplot()
    modes = [r for r in runs[-1]["results"] if "pairs" in r] if runs else []
    if plt is None or not modes:
        return False
    run = runs[-1]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5), gridspec_kw={"width_ratios": [2, 2, 1.2]})
    _pair_panels(axes[0], axes[1], modes)
    _save_panel(axes[2], next((r for r in run["results"] if "shard_ms" in r), None))
    return save_figure(fig, f"checkpoints in fit, {modes[0]['steps']} steps per fit: {run_title(run)}", path)


def _pair_panels(times: Any, costs: Any, modes: list[dict[str, Any]]) -> None:
    """Fit seconds without (open, dashed) and with checkpoints per pair; each pair's cost as bars, the median
    cost dashed."""
    width = 0.8 / len(modes)
    for k, (row, color) in enumerate(zip(modes, ("tab:blue", "tab:orange", "tab:green"))):
        index = list(range(1, len(row["pairs"]) + 1))
        without, with_ = zip(*row["pairs"])
        times.plot(index, without, "o--", color=color, mfc="none", label=f"{row['mode']}, without")
        times.plot(index, with_, "o-", color=color, label=f"{row['mode']}, with")
        cost = [100 * (w - o) / o for o, w in row["pairs"]]
        costs.bar([i + (k - (len(modes) - 1) / 2) * width for i in index], cost, width, color=color,
                  label=f"{row['mode']} (median {row['cost_percent']:+.1f}%)")
        costs.axhline(row["cost_percent"], color=color, ls="--", lw=1)
    costs.axhline(0, color="black", lw=0.8)
    times.set_title("fit time without and with checkpoints", fontsize=10)
    costs.set_title("cost of checkpoints", fontsize=10)
    for ax, label in ((times, "fit wall time (s)"), (costs, "(with - without) / without (%)")):
        ax.set_xlabel("pair (fits alternate without / with)")
        ax.set_ylabel(label)
        ax.set_xticks(index)
        ax.margins(y=0.2)  # room above the lines for the legend
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=2, loc="upper center")


def _save_panel(ax: Any, row: dict[str, Any] | None) -> None:
    """One synchronous save of the trainer's state: the shard file and ``dcp.save``, in ms."""
    if row is None:
        ax.axis("off")
        return
    ax.bar(["shard\n(safetensors + JSON)", "dcp.save"], [row["shard_ms"], row["dcp_ms"]],
           color=["tab:blue", "tab:gray"])
    ax.set_ylabel("one save (ms)")
    ax.set_title(f"one save of {row['state_mib']} MiB", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000, help="steps per fit")
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=3, help="fits without and with checkpoints, alternating")
    parser.add_argument("--modes", nargs="+", choices=("data-parallel", "pipeline"), default=["data-parallel", "pipeline"])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot-only", action="store_true", help="redraw results/checkpoint_cost.png from the record")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one mode, JSON on stdout
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("checkpoint_cost", plot, out=args.out))
        return
    rows = 2560 if args.smoke else ROWS_PER_EPOCH
    steps, pairs, every = (25, 1, 10) if args.smoke else (args.steps, args.pairs, args.every)
    if args.one:  # one mode in this (fresh) process
        print(json.dumps(one_mode(args.one, every, steps, rows, pairs)))
        return
    results = []
    for mode in args.modes:
        command = [sys.executable, __file__, "--one", mode, "--steps", str(steps), "--pairs", str(pairs),
                   "--every", str(every), *(["--smoke"] if args.smoke else [])]
        results.append(fresh_process_json(command))
        print(json.dumps(results[-1]))
    formats = save_formats(rows)
    print(json.dumps(formats))
    results.append({"mode": "one save, synchronous", **formats})
    write_run("checkpoint_cost", results, config=run_config(args, parser, exclude=("one", "plot_only")),
              smoke=args.smoke, out=args.out)
    if not args.smoke:
        print("plot:", draw_record("checkpoint_cost", plot, out=args.out))


if __name__ == "__main__":
    main()
