"""The ``torch-dad`` command. ``torch-dad demo`` trains the README's quickstart model on real MNIST."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch


def _demo(args: argparse.Namespace) -> int:
    from . import DADLinear, DADModel, DADTrainer, data

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        (xtr, ytr), (xte, yte) = data.mnist()
    except (FileNotFoundError, ImportError) as err:
        print(f"torch-dad demo: {err}", file=sys.stderr)
        return 2
    if args.limit:
        xtr, ytr = xtr[: args.limit], ytr[: args.limit]
    print(f"torch-dad demo: real MNIST, {len(xtr):,} train / {len(xte):,} test, device {device}, "
          f"torch {torch.__version__}, batch {args.batch_size}, {args.epochs} epochs")

    class DADClassifier(DADModel):
        def __init__(self, in_features: int, num_classes: int = 10) -> None:
            super().__init__()
            self.layer1 = DADLinear(in_features, 1024, num_classes=num_classes)
            self.layer2 = DADLinear(1024, 512, num_classes=num_classes)
            self.layer3 = DADLinear(512, 256, num_classes=num_classes)
            self.classifier = torch.nn.Linear(256, num_classes)

    torch.manual_seed(args.seed)
    model = DADClassifier(784)
    trainer = DADTrainer(model, device=device, lr=args.lr)
    xtr_d, ytr_d = xtr.to(device), ytr.to(device)
    test = (xte.to(device), yte.to(device))
    history = trainer.fit((xtr_d, ytr_d), epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    dad_s = sum(r["train_s"] for r in history)
    local = trainer.evaluate(test, use_local_head=True)["accuracy"]
    solved = trainer.solve_head()
    streamed = trainer.evaluate(test)["accuracy"]
    trainer.solve_head(loader=data.batches(xtr_d, ytr_d, 2048, shuffle=False))
    one_pass = trainer.evaluate(test)["accuracy"]

    bp_acc, bp_s = _train_backprop(args, device, (xtr_d, ytr_d), test)
    n = len(xtr) * args.epochs
    print()
    print(f"{'system':44s} {'test acc':>9s} {'img/s':>10s}")
    print(f"{'DAD, last local head':44s} {local:9.2%} {n / dad_s:10,.0f}")
    print(f"{'DAD, solve_head() (sample of inputs seen)':44s} {streamed:9.2%} {'':>10s}")
    print(f"{'DAD, solve_head(loader=train) one pass':44s} {one_pass:9.2%} {'':>10s}")
    print(f"{'backprop + AdamW, same MLP':44s} {bp_acc:9.2%} {n / bp_s:10,.0f}")
    print(f"(ridge lambda chosen by GCV: {solved.lambda_reg:.3g})")
    if args.json:
        _write_json(args, {
            "train_images": len(xtr), "test_acc_local_head": local, "test_acc_solve_head": streamed,
            "test_acc_solve_head_loader": one_pass, "test_acc_backprop_adamw": bp_acc,
            "dad_img_per_s": n / dad_s, "backprop_img_per_s": n / bp_s,
        }, device)
    return 0


def _train_backprop(
    args: argparse.Namespace, device: torch.device, train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
) -> tuple[float, float]:
    """Backprop + AdamW on the same MLP, same batches, same epochs: ``(test accuracy, train seconds)``."""
    torch.manual_seed(args.seed)
    layers: list[torch.nn.Module] = []
    for a, b in ((784, 1024), (1024, 512), (512, 256)):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    xtr_d, ytr_d = train
    start = time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(len(xtr_d), generator=generator).to(device)
        for i in range(0, len(order), args.batch_size):
            idx = order[i : i + args.batch_size]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(xtr_d[idx]), ytr_d[idx]).backward()
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (net(test[0]).argmax(1) == test[1]).float().mean().item()
    return accuracy, seconds


def _write_json(args: argparse.Namespace, results: dict[str, float], device: torch.device) -> None:
    """The demo's record, with the device, torch version, commit and date."""
    import json
    import platform
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    record = {
        "dataset": "mnist", "topology": "784-1024-512-256-10", "epochs": args.epochs, "batch": args.batch_size,
        "lr": args.lr, "seed": args.seed, **results,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"),
    }
    with open(args.json, "w") as handle:
        json.dump(record, handle, indent=2)
    print(f"wrote {args.json}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torch-dad`` console script."""
    parser = argparse.ArgumentParser(prog="torch-dad", description="Decoupled Analytical Dense target propagation")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the quickstart model on real MNIST and compare with backprop")
    demo.add_argument("--epochs", type=int, default=3)
    demo.add_argument("--batch-size", type=int, default=256)
    demo.add_argument("--lr", type=float, default=1e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    demo.add_argument("--limit", type=int, default=0, help="use only the first N training images")
    demo.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
