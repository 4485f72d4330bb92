"""DAD conv nets against backprop: a VGG-style net (after local-loss' ``vgg8b``) on MNIST / Fashion-MNIST.

The net: 3 x 3 convolutions (padding 1, ReLU) of widths ``128, 256, M, 256, 512, M, 512, M, 512, M``
(``M``: a 2 x 2 max pool, here the ``pool="max"`` of the convolution before it), then a dense
layer of 1024 and a linear classifier, as the ``vgg8b`` configuration of Nøkland & Eidnes'
local-loss code (their batch norm and dropout are left out); ``--width-scale`` divides every width
(CPU runs use 1/16). Systems, same net, same batches, AdamW (weight decay 0.01) for all:

* ``dad``: ``DADConv2d`` layers + ``DADLinear`` + classifier, each layer trained by its local head
  (adaptive average pool to ``grid x grid`` + Linear); accuracy of the model's output and after
  ``solve_head()`` (the closed-form classifier);
* ``dad+cosine`` / ``dad+ls0.1``: the cosine schedule / label smoothing 0.1 in every local head;
* ``backprop`` / ``backprop+cosine``: the same net as ``nn.Conv2d`` etc., trained end to end.

``--grids 1 2 4`` runs ``dad`` once per local-head grid (the comparison behind the default 4).
``--memory`` (CUDA) measures the training step, bf16 compute over fp32 weights: the full-width net at
batch 256 and 1024, and a stack of 8 / 16 / 32 residual blocks (``DADBlock`` around two 3 x 3
convolutions of 64 channels, batch 256). Each system runs in a fresh process with its default settings:
DAD's ``DADTrainer`` (its CUDA graph) against backprop with forward, backward and fused AdamW in one CUDA
graph. Time: the median of 5 windows of 20 steps run back to back. Memory is total: peak allocated plus what the graph pools hold beyond it
(and the allocator's peak reservation beside it).

    python benchmarks/conv.py --smoke                                # seconds, CPU, synthetic data
    python benchmarks/conv.py --grids 1 2 4 --width-scale 16 --train-limit 20000 --threads 1
    python benchmarks/conv.py --dataset fmnist --systems dad backprop --epochs 10   # GPU
    python benchmarks/conv.py --memory                               # GPU: time and peak memory
    python benchmarks/conv.py --memory --profile                     # GPU: and the kernel time by kind

A real ``--memory`` run also draws the record's last ``--memory`` run into ``results/conv.png`` (``--plot-only``
redraws it from the JSON).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

import torch_dad as td
from _common import (
    draw_record,
    fresh_process_json,
    graph_pool_slack,
    kernel_ms_by_kind,
    median_time,
    pyplot,
    run_config,
    run_title,
    save_figure,
    write_run,
)
from _gpu_common import capture
from torch_dad.training import EngineOptions

VGG8B: tuple[int | str, ...] = (128, 256, "M", 256, 512, "M", 512, "M", 512, "M")
DENSE = 1024
SYSTEMS = ("dad", "dad+cosine", "dad+ls0.1", "backprop", "backprop+cosine")
WEIGHT_DECAY = 0.01


def layout(scale: int) -> list[tuple[int, bool]]:
    """``(out_channels, pooled)`` per convolution of ``VGG8B`` with every width divided by ``scale``."""
    convs: list[tuple[int, bool]] = []
    for item in VGG8B:
        if item == "M":
            convs[-1] = (convs[-1][0], True)
        else:
            convs.append((max(1, int(item) // scale), False))
    return convs


def _spatial(size: int, convs: list[tuple[int, bool]]) -> int:
    for _, pooled in convs:
        size = size // 2 if pooled else size
    return size


class DADVGG(td.DADModel):
    """The VGG-style net of DAD layers: each convolution and the dense layer trained by its own local head
    (``activation`` and ``normalize`` in every layer, label smoothing ``smoothing`` in every local loss)."""

    def __init__(
        self, channels: int, size: int, scale: int, classes: int, grid: int, smoothing: float,
        activation: str = "relu", normalize: str | None = None,
    ) -> None:
        super().__init__()
        convs, c_in = layout(scale), channels
        self.convs = torch.nn.ModuleList()
        for c_out, pooled in convs:
            self.convs.append(
                td.DADConv2d(
                    c_in, c_out, 3, padding=1, num_classes=classes, activation=activation,
                    pool="max" if pooled else None, local_head_grid=grid, label_smoothing=smoothing,
                    normalize=normalize,
                )
            )
            c_in = c_out
        flat = c_in * _spatial(size, convs) ** 2
        self.dense = td.DADLinear(
            flat, DENSE // scale, num_classes=classes, activation=activation, label_smoothing=smoothing,
            normalize=normalize,
        )
        self.classifier = torch.nn.Linear(DENSE // scale, classes)


_ACTIVATIONS = {"relu": torch.nn.ReLU, "leaky_relu": torch.nn.LeakyReLU}  # LeakyReLU: slope 0.01, as DAD's


def backprop_vgg(
    channels: int, size: int, scale: int, classes: int, activation: str = "relu", normalize: str | None = None,
    dropout: float = 0.0,
) -> torch.nn.Sequential:
    """The same net as :class:`DADVGG` for end-to-end backprop: ``conv -> [BatchNorm2d] -> act -> [max pool]``
    blocks, then ``Linear -> [BatchNorm1d] -> act``, each followed by ``Dropout(dropout)`` if ``dropout`` (where
    ``DADTrainer(dropout=)`` drops each layer's output), then the classifier."""
    if normalize not in (None, "batchnorm"):
        raise ValueError(f"normalize={normalize!r}: the conv net takes None or 'batchnorm'")
    convs, c_in, mods = layout(scale), channels, []
    drop = [torch.nn.Dropout(dropout)] if dropout else []
    for c_out, pooled in convs:
        mods += [torch.nn.Conv2d(c_in, c_out, 3, padding=1)]
        mods += [torch.nn.BatchNorm2d(c_out)] if normalize else []
        mods += [_ACTIVATIONS[activation]()] + ([torch.nn.MaxPool2d(2)] if pooled else []) + drop
        c_in = c_out
    flat = c_in * _spatial(size, convs) ** 2
    mods += [torch.nn.Flatten(), torch.nn.Linear(flat, DENSE // scale)]
    mods += [torch.nn.BatchNorm1d(DENSE // scale)] if normalize else []
    mods += [_ACTIVATIONS[activation]()] + drop
    return torch.nn.Sequential(*mods, torch.nn.Linear(DENSE // scale, classes))


def load(args: argparse.Namespace) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((x, y), (x_test, y_test))`` as (N, 1, 28, 28) images."""
    if args.smoke or args.dataset == "synthetic":
        generator = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (192,), generator=generator)
        x = torch.randn(192, 1, 28, 28, generator=generator) * 0.5
        x[torch.arange(192), 0, (y * 2) % 28, :] += 2.0  # the class lights one image row
        return (x[:128], y[:128]), (x[128:], y[128:])
    from torch_dad import data

    (x, y), (xt, yt) = data.mnist() if args.dataset == "mnist" else data.fashion_mnist()
    if args.train_limit:
        x, y = x[: args.train_limit], y[: args.train_limit]
    return (x.reshape(-1, 1, 28, 28), y), (xt.reshape(-1, 1, 28, 28), yt)


def run_dad(system: str, seed: int, grid: int, args: argparse.Namespace, train: Any, test: Any) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = DADVGG(1, 28, args.width_scale, 10, grid, 0.1 if system == "dad+ls0.1" else 0.0)
    trainer = td.DADTrainer(model, args.device, lr=args.lr, weight_decay=WEIGHT_DECAY)
    steps = args.epochs * math.ceil(train[0].shape[0] / args.batch)
    schedule = td.schedules.warmup_cosine(args.lr, steps) if system == "dad+cosine" else None
    start = time.perf_counter()
    history = trainer.fit(
        train, epochs=args.epochs, batch_size=args.batch, seed=seed, progress=False, schedule=schedule
    )
    seconds = time.perf_counter() - start
    accuracy = trainer.evaluate(test)["accuracy"]
    local_head = trainer.evaluate(test, use_local_head=True)["accuracy"]
    trainer.solve_head()
    solved = trainer.evaluate(test)["accuracy"]
    return {
        "accuracy": accuracy,
        "accuracy_solved": solved,
        "accuracy_last_local_head": local_head,
        "train_loss": history[-1]["loss"],
        "train_s": seconds,
        "local_head_grid": grid,
    }


def run_backprop(system: str, seed: int, args: argparse.Namespace, train: Any, test: Any) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = backprop_vgg(1, 28, args.width_scale, 10).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    steps = args.epochs * math.ceil(train[0].shape[0] / args.batch)
    schedule = td.schedules.warmup_cosine(args.lr, steps) if system == "backprop+cosine" else None
    generator, x, y = torch.Generator().manual_seed(seed), *train
    start, step, loss = time.perf_counter(), 0, torch.zeros(())
    for _ in range(args.epochs):
        order = torch.randperm(x.shape[0], generator=generator)  # the order DADTrainer.fit draws
        for i in range(0, x.shape[0], args.batch):
            idx = order[i : i + args.batch]
            if schedule is not None:
                for group in optimizer.param_groups:
                    group["lr"] = schedule(step)
            loss = torch.nn.functional.cross_entropy(model(x[idx].to(args.device)), y[idx].to(args.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        xt, yt = test
        correct = sum(
            int((model(xt[i : i + 1024].to(args.device)).argmax(1).cpu() == yt[i : i + 1024]).sum())
            for i in range(0, xt.shape[0], 1024)
        )
    return {"accuracy": correct / xt.shape[0], "train_loss": float(loss.detach()), "train_s": seconds}


class Residual(torch.nn.Module):
    """``relu(x + conv(relu(conv(x))))``, two 3 x 3 convolutions of ``channels``: one block of the stack."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.b = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b(torch.relu(self.a(x))))


class DADResidualStack(td.DADModel):
    """A ``DADConv2d`` stem (1 -> ``channels``, 2 x 2 max pool), ``depth`` residual blocks each trained by
    its own local head (``DADBlock``), and a linear classifier on the flattened output."""

    def __init__(self, depth: int, channels: int, size: int, classes: int) -> None:
        super().__init__()
        self.stem = td.DADConv2d(1, channels, 3, padding=1, num_classes=classes, pool="max")
        self.blocks = torch.nn.ModuleList(
            td.DADBlock(Residual(channels), num_classes=classes, head_features=channels) for _ in range(depth)
        )
        self.classifier = torch.nn.Linear(channels * (size // 2) ** 2, classes)


def backprop_residual_stack(depth: int, channels: int, size: int, classes: int) -> torch.nn.Sequential:
    """The same stack as :class:`DADResidualStack` for end-to-end backprop."""
    stem = [torch.nn.Conv2d(1, channels, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
    blocks = [Residual(channels) for _ in range(depth)]
    head = [torch.nn.Flatten(), torch.nn.Linear(channels * (size // 2) ** 2, classes)]
    return torch.nn.Sequential(*stem, *blocks, *head)


MEMORY_BATCHES = (256, 1024)  # the VGG-style net
STACK_DEPTHS, STACK_CHANNELS, STACK_BATCH = (8, 16, 32), 64, 256
#: both memory layouts, since cuDNN's bf16 convolutions on Hopper run channels-last and convert other inputs
LAYOUTS = ("contiguous", "channels_last")
#: DAD at non-default engine options: ``dad-lean`` steps the local layers on the main stream, ``dad-4-streams``
#: on four side streams (the default is three)
DAD_OPTIONS = {"dad-lean": EngineOptions(local_streams=0), "dad-4-streams": EngineOptions(local_streams=4)}
MEMORY_SYSTEMS = ("dad", "dad-lean", "dad-4-streams", "backprop")
MEMORY_NETS = ("vgg8b", "residual")


def memory_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Step time and total memory, each system of ``MEMORY_SYSTEMS`` in a fresh process with its default
    settings (bf16 compute over fp32 weights): the full-width VGG-style net at batch 256 and 1024, and the
    residual stack at depths 8, 16 and 32 (64 channels, 14 x 14, batch 256); each in the memory layouts
    ``args.layouts`` (default: both of ``LAYOUTS``); ``args.nets`` and ``args.memory_systems`` pick a part."""
    cuda = torch.cuda.is_available() and not args.smoke
    batches = MEMORY_BATCHES if cuda else (8,)
    depths = STACK_DEPTHS if cuda else (1, 2)
    jobs = [("vgg8b", 0, b) for b in batches] + [("residual", d, STACK_BATCH if cuda else 8) for d in depths]
    jobs = [job for job in jobs if job[0] in args.nets]
    records = []
    for (net, depth, batch), layout, system in itertools.product(jobs, args.layouts, args.memory_systems):
        job = json.dumps([net, depth, batch, system, layout])
        if cuda:  # a fresh process: no allocator cache or graph pool of another system counts
            record = fresh_process_json([sys.executable, __file__, "--memory-job", job,
                                         *(["--profile"] if args.profile else [])])
        else:
            record = memory_job(json.loads(job), smoke=True)
        print(record, flush=True)
        records.append(record)
    return records


def memory_job(job: list[Any], smoke: bool = False, profile: bool = False) -> dict[str, Any]:
    """One system's step (DAD: ``DADTrainer`` defaults, its CUDA graph on a GPU; backprop: forward, backward
    and fused AdamW in one CUDA graph) on one net: ``step_ms`` (after warm-up, the median of 5 windows of 20
    steps run back to back, as a training loop runs them) and memory.

    ``total_mib``: peak allocated plus what CUDA-graph pools hold beyond it (:func:`graph_pool_slack`), the
    memory the step needs; ``reserved_mib``: the allocator's peak reservation; ``static_mib``: allocated
    between steps (weights, optimizer state, kept buffers). ``profile``: ``kernel_ms`` too, the step's GPU time
    split as :func:`kernel_ms` does."""
    net, depth, batch, system, layout = job
    device = torch.device("cpu" if smoke else "cuda")
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    scale, channels = (32, 4) if smoke else (1, STACK_CHANNELS)
    torch.manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, device=device).to(memory_format=memory_format)
    y = torch.randint(0, 10, (batch,), device=device)
    amp = None if smoke else torch.bfloat16
    if system.startswith("dad"):
        model = DADVGG(1, 28, scale, 10, 4, 0.0) if net == "vgg8b" else DADResidualStack(depth, channels, 28, 10)
        model = model.to(memory_format=memory_format)
        # engine options need the engine, which a CPU smoke run does not take
        options = {"engine_options": DAD_OPTIONS[system]} if system in DAD_OPTIONS and not smoke else {}
        trainer = td.DADTrainer(model, device, lr=1e-3, amp_dtype=amp, **options)
        step: Any = functools.partial(trainer.step, x, y)
    else:
        model = backprop_vgg(1, 28, scale, 10) if net == "vgg8b" else backprop_residual_stack(depth, channels, 28, 10)
        step = _backprop_step(model.to(device, memory_format=memory_format), x, y, amp)
    record: dict[str, Any] = {"system": system, "net": net, "depth": depth, "batch": batch, "layout": layout,
                              "amp": "bf16" if amp else None}
    if smoke:
        step()
        return record
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    record["step_ms"] = median_time(step, warmup=2, repeats=5, calls=20, sync=torch.cuda.synchronize) * 1e3
    peak = torch.cuda.max_memory_allocated()
    record.update(total_mib=(peak + graph_pool_slack()) / 2**20, reserved_mib=torch.cuda.max_memory_reserved() / 2**20,
                  static_mib=static / 2**20, above_static_mib=(peak - static) / 2**20)
    if profile:  # after the memory figures: the uncaptured step allocates its own
        if system.startswith("dad"):
            uncaptured: Any = functools.partial(td.DADTrainer(model, device, amp_dtype=amp, backend="triton").step, x, y)
        else:
            uncaptured = _backprop_step(model, x, y, amp, graphed=False)
        record["kernel_ms"] = kernel_ms(uncaptured)
    return record


#: kernel-name fragments of each share of a conv step's GPU time (cuDNN's and ATen's names), first match wins
KERNEL_SHARES = (("data gradient", ("dgrad",)), ("weight gradient", ("wgrad",)),
                 ("layout copies", ("nchwToNhwc", "nhwcToNchw")), ("convolution forward", ("fprop", "implicit_gemm")),
                 ("AdamW", ("adam", "multi_tensor_apply")))


def kernel_ms(step: Any, steps: int = 10) -> dict[str, float]:
    """GPU kernel time per step of ``step`` (uncaptured, so each kernel is seen), by :data:`KERNEL_SHARES`."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return kernel_ms_by_kind(step, KERNEL_SHARES, steps)


def _backprop_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None,
                   graphed: bool = True) -> Any:
    """Tuned backprop: forward, backward and fused AdamW, captured in one CUDA graph on a GPU (``graphed``)."""
    cuda = x.is_cuda
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda, capturable=cuda)

    def step() -> None:
        # no autocast weight cache: a graph replay must recast the weights AdamW updated
        with torch.autocast(x.device.type, amp or torch.float32, enabled=amp is not None, cache_enabled=False):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return capture(step) if cuda and graphed else step


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels of the record's last ``--memory`` run: each system's step time and total memory per net (the
    VGG-style net per batch, the residual stack per depth), a bar per system and memory layout."""
    plt = pyplot()
    run = next((run for run in reversed(runs) if run["config"].get("memory")), None)
    rows = [r for r in run["results"] if "step_ms" in r] if run else []
    if plt is None or run is None or not rows:
        return False
    cells = list(dict.fromkeys((r["net"], r["depth"], r["batch"]) for r in rows))
    systems = [s for s in MEMORY_SYSTEMS if any(r["system"] == s for r in rows)]
    bars = [(s, lay) for s in systems for lay in LAYOUTS if any(r["system"] == s and r["layout"] == lay for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, label in zip(axes, ("step_ms", "total_mib"), ("step time (ms)", "total memory (MiB)")):
        for k, (system, lay) in enumerate(bars):
            mine = [r for r in rows if (r["system"], r["layout"]) == (system, lay)]
            value = {(r["net"], r["depth"], r["batch"]): r[key] for r in mine}
            xs = [i + (k - (len(bars) - 1) / 2) * 0.8 / len(bars) for i, cell in enumerate(cells) if cell in value]
            ax.bar(xs, [value[cell] for cell in cells if cell in value], 0.8 / len(bars), label=f"{system}, {lay}",
                   color=f"C{systems.index(system)}", edgecolor="black", lw=0.4,
                   hatch="///" if lay == "contiguous" else None)
        ax.set_xticks(range(len(cells)), [_cell_label(*cell) for cell in cells])
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(plt.LogFormatter(labelOnlyBase=False))  # plain numbers, not powers of ten
        ax.set_ylabel(label)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    title = f"conv training step, bf16 (DAD: DADTrainer's CUDA graph; backprop: one CUDA graph): {run_title(run)}"
    return save_figure(fig, title, path)


def _cell_label(net: str, depth: int, batch: int) -> str:
    """An x tick: the VGG-style net or the residual stack of ``depth`` blocks, and the batch."""
    return f"vgg8b\nB={batch}" if net == "vgg8b" else f"residual x {depth}\nB={batch}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("mnist", "fmnist", "synthetic"), default="mnist")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["dad", "backprop"])
    parser.add_argument("--grids", nargs="+", type=int, default=[4], help="local-head grids for 'dad'")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width-scale", type=int, default=1, help="divide every width by this (16 on CPU)")
    parser.add_argument("--train-limit", type=int, default=0, help="train on the first N images (0: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--memory", action="store_true", help="CUDA: step time and total memory, fresh processes")
    parser.add_argument("--memory-job", default=None, help=argparse.SUPPRESS)  # internal: one system, JSON out
    parser.add_argument("--profile", action="store_true", help="with --memory: each step's GPU kernel time by kind")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="with --memory")
    parser.add_argument("--nets", nargs="+", choices=MEMORY_NETS, default=list(MEMORY_NETS), help="with --memory")
    parser.add_argument("--memory-systems", nargs="+", choices=MEMORY_SYSTEMS, default=list(MEMORY_SYSTEMS),
                        help="with --memory")
    parser.add_argument("--smoke", action="store_true", help="seconds on synthetic data, for CI")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/conv.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("conv", plot))
        return
    if args.memory_job:
        print(json.dumps(memory_job(json.loads(args.memory_job), profile=args.profile)))
        return
    config = run_config(args, parser, exclude=["plot_only"])
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.width_scale, args.epochs, args.batch, args.device = 32, 1, 64, "cpu"
        args.systems, args.grids = ["dad", "dad+cosine", "backprop"], [1, 2]
    if args.memory:
        print(write_run("conv", memory_mode(args), config=config, smoke=args.smoke))
        if not args.smoke:
            print("plot:", draw_record("conv", plot))
        return
    train, test = load(args)
    records: list[dict[str, Any]] = []
    for seed in args.seeds:
        for system in args.systems:
            grids = args.grids if system == "dad" else [4]
            for grid in grids:
                if system.startswith("dad"):
                    result = run_dad(system, seed, grid, args, train, test)
                else:
                    result = run_backprop(system, seed, args, train, test)
                record = {
                    "system": system,
                    "dataset": "synthetic" if args.smoke else args.dataset,
                    "seed": seed,
                    "lr": args.lr,
                    "epochs": args.epochs,
                    "width_scale": args.width_scale,
                    **result,
                }
                print(record)
                records.append(record)
    print(write_run("conv", records, config=config, smoke=args.smoke))


if __name__ == "__main__":
    main()
