"""What the accuracy grid (``accuracy.py``) and the menu study (``_accuracy_menu.py``) share: the datasets and
MLP topologies, batch and weight decay, the timed epoch, accuracy, the ridge head and the lr schedules."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

TOPOLOGIES = {
    "mnist": ("mnist-medium-3", [784, 1024, 512, 256]),
    "fmnist": ("fmnist-wide-2", [784, 4096, 4096]),
    "cifar10": ("cifar10-medium-3", [3072, 1024, 512, 256]),
    "20ng": ("20ng-mlp-2", [4096, 1024, 512]),
}
WEIGHT_DECAY = 0.01  # DADTrainer's and torch.optim.AdamW's default: the shared recipe
BATCH = 256


# ------------------------------------------------------------------------------------------ data
def load_dataset(name: str, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_test, y_test)``: float32 standardised features, int64 labels."""
    from torch_dad import data

    if name == "mnist":
        (xtr, ytr), (xte, yte) = data.mnist(path=args.mnist_npz)
    elif name == "fmnist":
        (xtr, ytr), (xte, yte) = data.fashion_mnist(args.fmnist_dir)
    elif name == "cifar10":
        (xtr, ytr), (xte, yte) = data.cifar10(args.cifar)
    elif name == "20ng":
        # hashed TF-IDF as wide as the topology's input layer
        (xtr, ytr), (xte, yte) = data.twenty_newsgroups(args.ng_root, features=TOPOLOGIES["20ng"][1][0])
    elif name == "synthetic":
        (xtr, ytr), (xte, yte) = data.synthetic(num_train=4096, num_test=1024, num_features=24, num_classes=10)
    elif name == "synthetic28":  # 28 x 28 "images" for the conv cells' smoke run
        (xtr, ytr), (xte, yte) = data.synthetic(num_train=512, num_test=256, num_features=784, num_classes=10)
    else:
        raise ValueError(f"unknown dataset {name!r}")
    return xtr, ytr, xte, yte


def epoch_order(n: int, seed: int, epoch: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=generator).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_epoch(
    step: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor, y: torch.Tensor, seed: int, epoch: int,
    device: torch.device,
) -> float:
    """Wall seconds of ``step(x[idx], y[idx])`` over every batch of the epoch's seeded order (synchronised)."""
    order = epoch_order(x.shape[0], seed, epoch, device)
    sync(device)
    start = time.perf_counter()
    for i in range(0, x.shape[0], BATCH):
        idx = order[i : i + BATCH]
        step(x[idx], y[idx])
    sync(device)
    return time.perf_counter() - start


@torch.no_grad()
def accuracy_of(logits_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    correct = 0
    for start in range(0, x.shape[0], 4096):
        correct += int((logits_fn(x[start : start + 4096]).argmax(1) == y[start : start + 4096]).sum())
    return correct / x.shape[0]


@torch.no_grad()
def ridge_head(
    features: Callable[[torch.Tensor], torch.Tensor], num_features: int, num_classes: int, x: torch.Tensor,
    y: torch.Tensor,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> features(x) @ W.T + b``: the closed-form ridge head (GCV lambda) fitted on ``features(x)``.

    What ``solve_head("auto", loader=(x, y))`` would give, without changing the model, so a run's
    own trajectory (its trained classifier) goes on.
    """
    from torch_dad.ridge import GramAccumulator

    stats = GramAccumulator(num_features, num_classes, device=x.device)
    for i in range(0, x.shape[0], 4096):
        stats.update(features(x[i : i + 4096]), y[i : i + 4096])
    solution = stats.solve("auto")
    weight, bias = solution.weight.float(), solution.bias.float()
    return lambda inputs: features(inputs).float() @ weight.T + bias


def ridge_accuracy(
    features: Callable[[torch.Tensor], torch.Tensor], num_features: int, data: tuple[torch.Tensor, ...]
) -> float:
    """Test accuracy of :func:`ridge_head` fitted on the training set's ``features``."""
    xtr, ytr, xte, yte = data
    return accuracy_of(ridge_head(features, num_features, 10, xtr, ytr), xte, yte)


#: the step schedule: lr x0.25 at these fractions of training, local-loss' milestones 50/75/89/94 of 100 epochs
STEP_FRACTIONS, STEP_GAMMA = (0.5, 0.75, 0.89, 0.94), 0.25


def lr_schedule(opts: dict[str, Any], lr: float, steps: int) -> Callable[[int], float] | None:
    """The per-step lr of ``opts`` ``"cosine"`` or ``"step"`` (``True``) over ``steps`` steps; None: constant."""
    from torch_dad.training.schedules import multistep, warmup_cosine

    if opts.get("step"):
        return multistep(lr, [round(f * steps) for f in STEP_FRACTIONS], gamma=STEP_GAMMA)
    if not opts.get("cosine"):
        return None
    # warm-up = 1/20 of training: the first Adam steps run on uncalibrated moments
    return warmup_cosine(lr, total_steps=steps, warmup_steps=max(1, steps // 20))
