"""Multi-GPU DAD throughput: ``single`` GPU vs ``data-parallel`` vs ``pipeline`` (torch.distributed).

Model (``deep-16x4096``): a CIFAR-shaped input (3072) into 16 DAD layers of width 4096 and
a 4096->10 classifier, bf16 compute, AdamW, the trainers' defaults. Why this one: every layer
is the same 4096x4096 GEMM pair (0.55 TFLOP per layer at B=16384, compute-bound on an
H200), so both GPUs are busy with real work, 16 layers split into 2 pipeline stages of
near-equal cost, and each layer's gradient (64 MiB fp32) is small next to its compute,
which is what data parallelism needs.

Rows of a run in ``results/distributed.json``: ``{mode, gpus, topology, batch, img_per_s, ...}``;
``batch`` is rows per optimizer step (data-parallel: the global batch, ``per_gpu_batch``
rows on each GPU). Speed-ups compare with ``single`` at the per-GPU batch. Timing: warm-up,
then the median of ``--repeats`` windows of ``--steps`` steps, each ended by a CUDA sync
(pipeline: CUDA events on the last stage, steady state; ``img_per_s_end_to_end`` includes
filling and draining the pipe once).

    # 2 GPUs, one process each (NVLink multicast stays off):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/distributed.py
    python benchmarks/distributed.py --smoke   # CPU, gloo, world size 1, seconds

``--net vgg``: the VGG-style conv net of ``benchmarks/conv.py`` instead (local-loss' ``vgg8b`` widths, 6
``DADConv2d`` + 1 ``DADLinear`` on 1 x 28 x 28 inputs; default ``--batch 256 1024`` rows per GPU).

A real run also draws the record into ``results/distributed.png`` (``--plot-only`` redraws it from the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torch_dad as td
from _common import (
    DADMLP,
    Timer,
    draw_record,
    environment,
    pyplot,
    record_path,
    run_config,
    run_title,
    save_figure,
    write_run,
)
from conv import DADVGG
from torch_dad.training import Batch, DataParallelTrainer, Pipeline
from torch_dad.training.pipeline import partition_layers


def gpu_link() -> str:
    """How GPU 0 reaches GPU 1 (the ``nvidia-smi topo -m`` cell), or why unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"unknown ({type(err).__name__})"
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] == "GPU0" and len(cells) > 2:
            return cells[2]
    return "unknown"


def data_pool(batch: int, shape: tuple[int, ...], device: torch.device,
              count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded batches of ``batch`` inputs of ``shape`` and labels in [0, 10)."""
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, *shape, generator=gen).to(device), torch.randint(0, 10, (batch,), generator=gen).to(device))
        for _ in range(count)
    ]


def timed_windows(step: Callable[[int], Any], device: torch.device, warmup: int, steps: int, repeats: int,
                  group: Any = None) -> float:
    """Median seconds of ``steps`` calls over ``repeats`` windows (slowest rank per window when distributed)."""
    for i in range(warmup):
        step(i)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        samples.append(float(elapsed))
    return statistics.median(samples)


def layer_step_seconds(trainer: td.DADTrainer, x: torch.Tensor, y: torch.Tensor, repeats: int = 3) -> list[float]:
    """Measured seconds of each DAD layer's step, the last one with the classifier step and Gram
    update (``DADTrainer.train_layers`` one layer at a time): the costs the pipeline is balanced on."""
    timer_rows = []
    count = len(trainer.model.dad_layers)
    for _ in range(repeats + 1):
        batch = trainer.prepare_batch(x, y)
        timer = Timer(trainer.device)
        timer.mark()
        for i in range(count):
            out = trainer.train_layers(batch, span=(i, i + 1), with_classifier=i == count - 1)
            batch = Batch(out.features, batch.y, batch.lr, batch.compute_dtype)
            timer.mark()
        timer_rows.append(timer.seconds())
    rows = timer_rows[1:]  # the first pass is a warm-up
    return [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]


MODES = ("single", "data-parallel", "pipeline")


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """One panel per run (net and GPU count), the last three: img/s of every mode and backend at each per-GPU
    batch, with the speed-up over the default single-GPU step above each multi-GPU bar."""
    plt = pyplot()
    runs = [run for run in runs if run["results"]][-3:]
    if plt is None or not runs:
        return False
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.8), squeeze=False)
    for ax, run in zip(axes[0], runs):
        _throughput_panel(ax, run)
    handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=6, fontsize=8)
    title = "DAD training throughput; above a bar: its speed-up over the single-GPU step (default backend)"
    return save_figure(fig, title, path, fontsize=11, rect=(0, 0.06, 1, 1))


def _throughput_panel(ax: Any, run: dict[str, Any]) -> None:
    """Bars of img/s per (mode, backend), grouped by per-GPU batch, for one run."""
    rows = run["results"]
    batches = sorted({r["per_gpu_batch"] for r in rows})
    bars = [(mode, backend) for mode in MODES for backend in ("default", "eager")
            if any(r["mode"] == mode and r["backend"] == backend for r in rows)]
    width = 0.8 / len(bars)
    for k, (mode, backend) in enumerate(bars):
        cells = [(i, r) for i, b in enumerate(batches) for r in rows
                 if r["per_gpu_batch"] == b and r["mode"] == mode and r["backend"] == backend]
        xs = [i + (k - (len(bars) - 1) / 2) * width for i, _ in cells]
        drawn = ax.bar(xs, [r["img_per_s"] for _, r in cells], width, label=f"{mode} ({backend})",
                       color=f"C{MODES.index(mode)}", hatch="//" if backend == "eager" else None, edgecolor="white")
        speedups = [f"{r['speedup_vs_single_default']:.2f}x" if "speedup_vs_single_default" in r else ""
                    for _, r in cells]
        ax.bar_label(drawn, speedups, fontsize=7)
    ax.set_xticks(range(len(batches)), [f"{b} rows per GPU" for b in batches])
    ax.set_ylabel("img/s (all GPUs)")
    ax.margins(y=0.15)  # room for the speed-up labels
    ax.grid(True, axis="y", alpha=0.3)
    first, link = rows[0], run["environment"].get("gpu_link", "none")
    via = f", {link}" if link != "none" else ""
    ax.set_title(f"{first['topology']}, {first['gpus']} GPU(s){via}\n{run_title(run)}", fontsize=10)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (gloo, world size 1 unless torchrun)")
    parser.add_argument("--net", choices=("mlp", "vgg"), default="mlp", help="the deep MLP or the VGG-style conv net")
    parser.add_argument("--batch", type=int, nargs="+", default=None,
                        help="rows per GPU per step (default 16384 65536 for the MLP, 256 1024 for the conv net)")
    parser.add_argument("--budget-s", type=float, default=110.0,
                        help="start no new batch size after this many seconds (the whole run must stay < 4 min)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="record path (default results/distributed.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/distributed.png from the record")
    args = parser.parse_args()
    args.config = run_config(args, parser, exclude=["plot_only"])
    args.batch = args.batch or ([16384, 65536] if args.net == "mlp" else [256, 1024])
    if args.smoke:
        args.batch, args.width, args.depth, args.steps, args.repeats = [32], 24, 3, 3, 2
    if not args.smoke and not args.plot_only and not torch.cuda.is_available():
        raise SystemExit("the full benchmark needs CUDA GPUs (one per process); on CPU use --smoke")
    return args


def init_process_group(cuda: bool) -> torch.device:
    """This process's device, after joining the process group (NCCL on CUDA, else gloo); without
    torchrun, a group of one on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a crashed rank must not leave the others waiting for the lead's whole time slot
    timeout = datetime.timedelta(seconds=120)
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
        return device
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


class Bench:
    """One process's part of the run: every mode at one per-GPU batch (:meth:`measure`), records
    saved by rank 0 after every mode (a crash keeps the rest).

    Every mode runs twice: with the default backend (single GPU: the CUDA-graphed fused step; data
    parallel and pipeline: the same fused engine, uncaptured, with per-layer all-reduce or on the
    stage's span) and with ``backend="eager"`` (the per-layer reference path).
    ``speedup_vs_single_default`` compares with the default single-GPU step, the fastest one.
    """

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.d_in = 48 if args.smoke else 3072
        self.widths = [self.d_in] + [args.width] * args.depth
        # the conv net at a sixteenth of vgg8b's widths in the smoke run, at full width otherwise
        self.vgg_scale = 16 if args.smoke else 1
        self.input_shape: tuple[int, ...] = (self.d_in,) if args.net == "mlp" else (1, 28, 28)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cpu_group = dist.new_group(backend="gloo")  # barriers that never touch a GPU
        self.amp = torch.bfloat16 if self.cuda else None
        self.warmup = 3 if self.cuda else 1
        self.out = record_path("distributed", smoke=args.smoke, out=args.out)
        topology = (f"{'smoke' if args.smoke else 'cifar'}-{self.d_in}-{args.depth}x{args.width}" if args.net == "mlp"
                    else f"vgg8b/{self.vgg_scale}-28x28")
        self.env = {**environment(), "gpu_link": gpu_link() if self.cuda and self.world > 1 else "none"}
        self.common = {"gpus": self.world if self.cuda else 0, "topology": topology, "amp_dtype": str(self.amp)}
        self.records: list[dict[str, Any]] = []
        self.has_backend = "backend" in inspect.signature(td.DADTrainer.__init__).parameters
        self.eager: dict[str, Any] = {"backend": "eager"} if self.has_backend else {}

    def build(self, trainer_cls: Any = td.DADTrainer, **kw: Any) -> Any:
        torch.manual_seed(0)
        model = (DADMLP(self.widths) if self.args.net == "mlp"
                 else DADVGG(1, 28, self.vgg_scale, 10, grid=4, smoothing=0.0))
        return trainer_cls(model, device=self.device, lr=1e-3, amp_dtype=self.amp, **kw)

    def save(self, record: dict[str, Any]) -> None:
        record = {"backend": "eager", **record, **self.common}
        if record["mode"] != "single":
            for key, backend in (("speedup_vs_single", "eager"), ("speedup_vs_single_default", "default")):
                single = next((r for r in self.records if r["mode"] == "single" and r["backend"] == backend
                               and r["batch"] == record["per_gpu_batch"]), None)
                if single:
                    record[key] = record["img_per_s"] / single["img_per_s"]
        self.records.append(record)
        if self.rank == 0:
            keys = ("mode", "variant", "batch", "img_per_s", "speedup_vs_single", "speedup_vs_single_default")
            print(json.dumps({k: record[k] for k in keys if k in record}), flush=True)
            write_run("distributed", self.records, config=self.args.config, out=self.out, env=self.env)

    def _release(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def measure(self, batch: int) -> None:
        costs = self.single(batch)
        self.data_parallel(batch)
        for backend, kw in ([("default", {})] if self.has_backend else []) + [("eager", self.eager)]:
            self.pipeline(backend, kw, costs, batch)

    def single(self, batch: int) -> list[float]:
        """The single-GPU step on rank 0 (the others wait); returns its per-layer costs, for the pipeline's balance."""
        args, costs = self.args, []
        if self.rank == 0:
            for backend, kw in [("eager", self.eager)] + ([("default", {})] if self.has_backend else []):
                trainer = self.build(**kw)
                pool = data_pool(batch, self.input_shape, self.device)
                seconds = timed_windows(lambda i, t=trainer, p=pool: t.step(*p[i % len(p)]), self.device,
                                        self.warmup, args.steps, args.repeats)
                if backend == "eager":
                    costs = layer_step_seconds(trainer, *pool[0])
                self.save({"mode": "single", "variant": f"DADTrainer.step ({backend} backend)", "backend": backend,
                           "batch": batch, "per_gpu_batch": batch, "img_per_s": batch * args.steps / seconds,
                           "step_ms": seconds / args.steps * 1e3})
                del trainer, pool
                self._release()
        box = [self.records, costs]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        self.records[:] = box[0]
        return box[1]

    def data_parallel(self, batch: int) -> None:
        args, world = self.args, self.world
        variants = ([("default", {})] if self.has_backend else []) + [("eager", self.eager)]
        for backend, kw in variants:
            trainer = self.build(DataParallelTrainer, overlap=True, **kw)
            pool = data_pool(batch, self.input_shape, self.device)
            seconds = timed_windows(lambda i, t=trainer, p=pool: t.step(*p[i % len(p)]), self.device, self.warmup,
                                    args.steps, args.repeats, group=self.cpu_group)
            self.save({"mode": "data-parallel", "variant": f"overlapped all-reduce ({backend} backend)",
                       "backend": backend, "batch": batch * world, "per_gpu_batch": batch,
                       "img_per_s": batch * world * args.steps / seconds, "step_ms": seconds / args.steps * 1e3})
            del trainer, pool
            self._release()

    def pipeline(self, backend: str, kw: dict[str, Any], costs: list[float], batch: int) -> None:
        """The decoupled pipeline: stages balanced on ``costs``; steady-state windows timed on the last
        stage, end to end (fill and drain included) on every rank."""
        args, world = self.args, self.world
        trainer = self.build(**kw)
        balance = [b - a for a, b in partition_layers(costs, world)]
        pipe = Pipeline(trainer, balance=balance)
        pool = data_pool(batch, self.input_shape, self.device) if pipe.is_first else []
        total = self.warmup + args.steps * args.repeats
        timer = Timer(self.device)

        def on_batch(index: int, *_: Any) -> None:
            if pipe.is_last and index >= self.warmup - 1 and (index - self.warmup + 1) % args.steps == 0:
                timer.mark()

        stream = (pool[i % len(pool)] for i in range(total)) if pipe.is_first else None
        dist.barrier(group=self.cpu_group)
        start = time.perf_counter()
        pipe.run(stream, callback=on_batch)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        end_to_end = time.perf_counter() - start
        box = [timer.seconds() if pipe.is_last else []]
        dist.broadcast_object_list(box, src=world - 1, group=self.cpu_group)
        seconds = statistics.median(box[0])
        self.save({"mode": "pipeline", "variant": f"decoupled layer stages ({backend} backend)", "backend": backend,
                   "batch": batch, "per_gpu_batch": batch,
                   "img_per_s": batch * args.steps / seconds, "img_per_s_end_to_end": batch * total / end_to_end,
                   "step_ms": seconds / args.steps * 1e3, "balance": balance,
                   "stage_ms_measured_single": [sum(costs[a:b]) * 1e3 for a, b in pipe.bounds]})
        del trainer, pool
        self._release()


def main() -> None:
    args = parse_args()
    if args.plot_only:
        print("plot:", draw_record("distributed", plot, out=args.out))
        return
    device = init_process_group(torch.cuda.is_available() and not args.smoke)
    bench = Bench(args, device)
    begin = time.perf_counter()
    for batch in args.batch:
        spent = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
        dist.broadcast(spent, src=0, group=bench.cpu_group)  # every rank takes the same decision
        if float(spent) > args.budget_s:
            if bench.rank == 0:
                print(f"skipping batch {batch}: {float(spent):.0f} s spent of a {args.budget_s:.0f} s budget")
            break
        bench.measure(batch)
    if bench.rank == 0:
        print("wrote", bench.out)
        if not args.smoke:
            print("plot:", draw_record("distributed", plot, out=args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
