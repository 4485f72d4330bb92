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
``--memory`` (CUDA only) measures one training step of the full-width net at batch 256 and 1024:
median time of 20 steps and peak memory (``torch.cuda.max_memory_allocated``) for DAD
(``backend="auto"``: the CUDA graph) and for backprop.

    python benchmarks/conv.py --smoke                                # seconds, CPU, synthetic data
    python benchmarks/conv.py --grids 1 2 4 --width-scale 16 --train-limit 20000 --threads 1
    python benchmarks/conv.py --dataset fmnist --systems dad backprop --epochs 10   # GPU
    python benchmarks/conv.py --memory                               # GPU: time and peak memory
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

import torch_dad as td
from _common import environment, median_time, write_records

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
    def __init__(self, channels: int, size: int, scale: int, classes: int, grid: int, smoothing: float) -> None:
        super().__init__()
        convs, c_in = layout(scale), channels
        self.convs = torch.nn.ModuleList()
        for c_out, pooled in convs:
            self.convs.append(
                td.DADConv2d(
                    c_in,
                    c_out,
                    3,
                    padding=1,
                    num_classes=classes,
                    pool="max" if pooled else None,
                    local_head_grid=grid,
                    label_smoothing=smoothing,
                )
            )
            c_in = c_out
        flat = c_in * _spatial(size, convs) ** 2
        self.dense = td.DADLinear(flat, DENSE // scale, num_classes=classes, label_smoothing=smoothing)
        self.classifier = torch.nn.Linear(DENSE // scale, classes)


def backprop_vgg(channels: int, size: int, scale: int, classes: int) -> torch.nn.Sequential:
    """The same net as :class:`DADVGG` for end-to-end backprop."""
    convs, c_in, mods = layout(scale), channels, []
    for c_out, pooled in convs:
        mods += [torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.ReLU()]
        if pooled:
            mods.append(torch.nn.MaxPool2d(2))
        c_in = c_out
    flat = c_in * _spatial(size, convs) ** 2
    mods += [torch.nn.Flatten(), torch.nn.Linear(flat, DENSE // scale), torch.nn.ReLU()]
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


def memory_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time per step and peak memory of the full-width net, DAD and backprop, batch 256 and 1024."""
    if not torch.cuda.is_available():
        print("--memory measures CUDA memory; no GPU here, skipped")
        return []
    records = []
    for batch in (256, 1024):
        x = torch.randn(batch, 1, 28, 28, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        records.append(_measure("dad", batch, _dad_step(x, y)))
        records.append(_measure("backprop", batch, _backprop_step(x, y)))
    return records


def _dad_step(x: torch.Tensor, y: torch.Tensor) -> Any:
    torch.manual_seed(0)
    trainer = td.DADTrainer(DADVGG(1, 28, 1, 10, 4, 0.0), "cuda", lr=1e-3)
    return lambda: trainer.step(x, y)


def _backprop_step(x: torch.Tensor, y: torch.Tensor) -> Any:
    torch.manual_seed(0)
    model = backprop_vgg(1, 28, 1, 10).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _measure(system: str, batch: int, step: Any) -> dict[str, Any]:
    seconds = median_time(step, warmup=5, repeats=20, sync=torch.cuda.synchronize)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    record = {
        "system": system,
        "batch": batch,
        "step_ms": seconds * 1e3,
        "img_per_s": batch / seconds,
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
    }
    print(record)
    return record


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
    parser.add_argument("--memory", action="store_true", help="CUDA: step time and peak memory at batch 256/1024")
    parser.add_argument("--smoke", action="store_true", help="seconds on synthetic data, for CI")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.width_scale, args.epochs, args.batch, args.device = 32, 1, 64, "cpu"
        args.systems, args.grids = ["dad", "dad+cosine", "backprop"], [1, 2]
    if args.memory:
        write_records("conv_memory", [{"environment": environment()}, *memory_mode(args)], args.smoke)
        return
    train, test = load(args)
    records: list[dict[str, Any]] = [{"environment": environment(), "args": vars(args)}]
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
    print(write_records("conv", records, args.smoke))


if __name__ == "__main__":
    main()
