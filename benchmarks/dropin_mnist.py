"""The README's autograd drop-in block, run as written, against the same model trained by backprop.

The block (README, "The autograd drop-in") converts a 784-512-256-10 ReLU MLP with ``td.to_dad`` and trains it
with an unchanged PyTorch loop: batch 64, Adam lr 1e-3, one epoch. Three variants of the same block on the same
data and batch order:

- ``dad``: the block as written (hidden layers' local loss label-smoothed by 0.1, the default);
- ``dad-no-smoothing``: ``td.to_dad(model, num_classes=10, label_smoothing=0.0)``;
- ``backprop``: the ``to_dad`` line removed, so the MLP trains by backprop.

Seed ``s`` draws the training subset (``torch.randperm`` of the 60k images), the initial weights and the batch
order. One CPU thread. Writes ``results/dropin_mnist.json``; ``--smoke`` runs on synthetic data of MNIST's shape.
A real run also draws its last run into ``results/dropin_mnist.png`` (``--plot-only`` redraws it from the JSON).

    python benchmarks/dropin_mnist.py                   # 60k images x seeds 0, 1; 10k x seeds 0-3 (a few minutes)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, pyplot, run_config, run_title, save_figure, write_run
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


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """One panel per training-set size of the record's last run: each variant's test accuracy, the mean over
    seeds as a line and every seed as a dot."""
    plt = pyplot()
    if plt is None or not runs or not runs[-1]["results"]:
        return False
    run = runs[-1]
    rows = run["results"]
    sizes = sorted({r["train_images"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        cell = [r for r in rows if r["train_images"] == size]
        for i, variant in enumerate(VARIANTS):
            scores = [100 * r["test_accuracy"] for r in cell if r["system"] == variant]
            if scores:
                ax.hlines(sum(scores) / len(scores), i - 0.3, i + 0.3, color=f"C{i}", lw=2.5)
                ax.plot([i] * len(scores), scores, "o", color=f"C{i}", mec="black", ms=5)
        ax.margins(x=0.15, y=0.2)
        ax.set_xticks(range(len(VARIANTS)), list(VARIANTS))
        ax.set_ylabel("MNIST test accuracy (%)")
        ax.set_title(f"{size} training images, {len({r['seed'] for r in cell})} seeds", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    title = f"README drop-in block, one epoch (line: mean over seeds, dots: seeds): {run_title(run)}"
    return save_figure(fig, title, path, fontsize=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="synthetic data of MNIST's shape, seconds")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/dropin_mnist.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("dropin_mnist", plot))
        return
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
    config = run_config(args, parser, exclude=["plot_only"])
    print("wrote", write_run("dropin_mnist", records, config=config, smoke=args.smoke))
    if not args.smoke:
        print("plot:", draw_record("dropin_mnist", plot))


if __name__ == "__main__":
    main()
