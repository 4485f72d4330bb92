"""The README's autograd drop-in block, run as written, against the same model trained by backprop.

The block (README, "The autograd drop-in") converts a 784-512-256-10 ReLU MLP with ``td.to_dad`` and trains it
with an unchanged PyTorch loop: batch 64, Adam lr 1e-3, one epoch. Three variants of the same block on the same
data and batch order:

- ``dad``: the block as written (hidden layers' local loss label-smoothed by 0.1, the default);
- ``dad-no-smoothing``: ``td.to_dad(model, num_classes=10, label_smoothing=0.0)``;
- ``backprop``: the ``to_dad`` line removed, so the MLP trains by backprop.

Seed ``s`` draws the training subset (``torch.randperm`` of the 60k images), the initial weights and the batch
order. One CPU thread. Writes ``results/dropin_mnist.json``; ``--smoke`` runs on synthetic data of MNIST's shape.

    python benchmarks/dropin_mnist.py                   # 60k images x seeds 0, 1; 10k x seeds 0-3 (a few minutes)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from _common import run_config, write_run
from torch_dad import DADAutogradLinear, data

README = Path(__file__).resolve().parents[1] / "README.md"
CONVERT_LINE = "td.to_dad(model, num_classes=10)"
VARIANTS = {"dad": CONVERT_LINE, "dad-no-smoothing": "td.to_dad(model, num_classes=10, label_smoothing=0.0)",
            "backprop": "model"}


def readme_drop_in_block() -> str:
    """The Python block of the README's "The autograd drop-in" section."""
    match = re.search(r"## The autograd drop-in.*?```python\n(.*?)```", README.read_text(), re.S)
    if match is None or CONVERT_LINE not in match.group(1):
        raise ValueError(f"README's drop-in block not found, or it lost the line {CONVERT_LINE!r}")
    return match.group(1)


def readme_accuracy(
    train_size: int, seed: int = 0, variant: str = "dad", splits: tuple[Any, Any] | None = None
) -> float:
    """Test accuracy after the README block trains ``variant`` for one epoch on ``train_size`` images of
    ``splits`` (default: real MNIST) drawn with ``seed``."""
    (xtr, ytr), (xte, yte) = splits or data.mnist()
    subset = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(seed))[:train_size]
    block = readme_drop_in_block().replace(CONVERT_LINE, VARIANTS[variant])
    torch.manual_seed(seed)
    namespace: dict[str, Any] = {"loader": data.batches(xtr[subset], ytr[subset], 64, seed=seed)}
    exec(compile(block, "README-drop-in", "exec"), namespace)
    model = namespace["model"].eval()
    converted = sum(isinstance(m, DADAutogradLinear) for m in model.modules())
    if converted != (0 if variant == "backprop" else 3):
        raise AssertionError(f"{variant}: {converted} DADAutogradLinear layers after the block")
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="synthetic data of MNIST's shape, seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        splits = data.synthetic(num_train=640, num_test=256, num_features=784, num_classes=10)
        plan = {640: [0]}
    else:
        splits = data.mnist()
        plan = {60_000: [0, 1], 10_000: [0, 1, 2, 3]}
    records = []
    for size, seeds in plan.items():
        for seed in seeds:
            for variant in VARIANTS:
                accuracy = readme_accuracy(size, seed, variant, splits)
                records.append({"train_images": size, "seed": seed, "system": variant, "test_accuracy": accuracy,
                                "epochs": 1, "batch": 64})
                print(f"{size:>6} images  seed {seed}  {variant:18s} {accuracy:.4f}", flush=True)
    print("wrote", write_run("dropin_mnist", records, config=run_config(args, parser), smoke=args.smoke))


if __name__ == "__main__":
    main()
