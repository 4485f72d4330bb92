"""The ``torch-dad`` command. ``torch-dad demo`` trains the README's quickstart model on real MNIST
(or, without the MNIST package, on a synthetic task of the same shape)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

import torch


def _load_data(source: str) -> tuple[str, tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    """``(name, ((x_train, y_train), (x_test, y_test)))`` for ``--data``: real MNIST, or with
    ``"auto"`` and no MNIST package, a synthetic task of MNIST's shape (784 features, 10 classes)."""
    from . import data

    if source != "synthetic":
        try:
            return "real MNIST", data.mnist()
        except (FileNotFoundError, ImportError) as err:
            if source == "mnist":
                raise
            print(f"torch-dad demo: notice: real MNIST is not installed ({err}).\n"
                  "torch-dad demo: notice: running on a synthetic 10-class task of MNIST's shape instead; its "
                  "accuracies say nothing about MNIST (--data mnist makes a missing MNIST an error)", file=sys.stderr)
    return "synthetic (784 features, 10 classes)", data.synthetic(
        num_train=10_000, num_test=2_000, num_features=784, num_classes=10, noise=8.0
    )


def _demo(args: argparse.Namespace) -> int:
    from . import DADLinear, DADModel, DADTrainer, data
    from ._checks import check_device

    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        name, ((xtr, ytr), (xte, yte)) = _load_data(args.data)
    except (FileNotFoundError, ImportError) as err:
        print(f"torch-dad demo: {err}", file=sys.stderr)
        return 2
    if args.limit:
        xtr, ytr = xtr[: args.limit], ytr[: args.limit]
    print(f"torch-dad demo: {name}, {len(xtr):,} train / {len(xte):,} test, device {device}, "
          f"torch {torch.__version__}, batch {args.batch_size}, {_count(args.epochs, 'epoch')}", flush=True)

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
    dad_s = 0.0
    for epoch, batches in enumerate(_epochs(xtr_d, ytr_d, args), 1):
        [record] = trainer.fit(_progress(batches, f"DAD epoch {epoch}/{args.epochs}"), progress=False)
        dad_s += record["train_s"]
        print(f"DAD epoch {epoch}/{args.epochs}: train loss {record['loss']:.4f} ({record['train_s']:.1f} s)",
              flush=True)
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
        _write_json(args, name, {
            "train_images": len(xtr), "test_acc_local_head": local, "test_acc_solve_head": streamed,
            "test_acc_solve_head_loader": one_pass, "test_acc_backprop_adamw": bp_acc,
            "dad_img_per_s": n / dad_s, "backprop_img_per_s": n / bp_s,
        }, device)
    return 0


def _epochs(
    x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace
) -> Iterator[Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """Each epoch's ``(x, y)`` batches, as ``fit`` draws them from a tensor pair with ``seed``: one
    generator, one permutation per epoch. DAD and backprop both train on these."""
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.epochs):
        order = torch.randperm(len(x), generator=generator).to(x.device)
        yield ((x[idx], y[idx]) for idx in order.split(args.batch_size))


def _progress(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], desc: str) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` behind a tqdm bar when tqdm is installed (and stderr is a terminal), else as they are."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return batches
    return tqdm(batches, desc=desc, leave=False, disable=None)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


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
    seconds = 0.0
    for epoch, batches in enumerate(_epochs(*train, args), 1):
        start, loss_sum, steps = time.perf_counter(), torch.zeros((), device=device), 0
        for x, y in _progress(batches, f"backprop epoch {epoch}/{args.epochs}"):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            steps += 1
        mean_loss = float(loss_sum) / steps  # the epoch's one host sync
        epoch_s = time.perf_counter() - start
        seconds += epoch_s
        print(f"backprop + AdamW epoch {epoch}/{args.epochs}: train loss {mean_loss:.4f} ({epoch_s:.1f} s)",
              flush=True)
    with torch.no_grad():
        accuracy = (net(test[0]).argmax(1) == test[1]).float().mean().item()
    return accuracy, seconds


def _write_json(args: argparse.Namespace, dataset: str, results: dict[str, float], device: torch.device) -> None:
    """The demo's record, with the device, torch version, commit and date."""
    import json
    import platform
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    record = {
        "dataset": "mnist" if dataset == "real MNIST" else "synthetic", "topology": "784-1024-512-256-10", "epochs": args.epochs, "batch": args.batch_size,
        "lr": args.lr, "seed": args.seed, **results,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"),
    }
    with open(args.json, "w") as handle:
        json.dump(record, handle, indent=2)
    print(f"wrote {args.json}")


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer (>= 1)")
    return value


def _non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 0")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``torch-dad`` parser and its ``demo`` subparser."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="torch-dad", description="Decoupled Analytical Dense target propagation")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the quickstart model on real MNIST and compare with backprop",
                          description="Train the quickstart MLP (784-1024-512-256-10) with DAD, then the same MLP "
                          "with backprop + AdamW on the same batches, and print their test accuracies and speeds.")
    demo.add_argument("--epochs", type=_positive_int, default=3,
                      help="passes over the training images, for DAD and for backprop (default: %(default)s)")
    demo.add_argument("--batch-size", type=_positive_int, default=256,
                      help="training images per step (default: %(default)s)")
    demo.add_argument("--lr", type=_positive_float, default=1e-3,
                      help="AdamW learning rate of both trainings (default: %(default)s)")
    demo.add_argument("--seed", type=_non_negative_int, default=0,
                      help="seed of the initial weights and of the data order (default: %(default)s)")
    demo.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    demo.add_argument("--data", choices=("auto", "mnist", "synthetic"), default="auto",
                      help="auto (default): real MNIST if installed, else a synthetic task with a notice")
    demo.add_argument("--limit", type=_non_negative_int, default=0, help="use only the first N training images (0: all)")
    demo.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser, demo


def _json_path_problem(path: str) -> str | None:
    """Why the demo could not write its record to ``path`` (checked before training), or ``None``."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder; pass a file path such as {os.path.join(path, 'mnist_demo.json')}"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; create it first or pass a path in an existing folder"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torch-dad`` console script."""
    from ._checks import check_device

    parser, demo = _parsers()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.device is not None:
            try:
                check_device(args.device)
            except ValueError as err:
                demo.error(f"argument --device: {err}")
        if args.json is not None and (problem := _json_path_problem(args.json)):
            demo.error(f"argument --json: {problem}")
        return _demo(args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
