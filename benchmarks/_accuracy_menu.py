"""The like-for-like accuracy study behind ``accuracy.py --menu``: one recipe menu for every system.

Every system (DAD with each local rule, and backprop on the same MLP) searches the same menu
(lr, normalisation, label smoothing, dropout, schedule, activation; both heads scored from every run)
with the same strategy, on a held-out 10% of the training set; the selected recipe is then trained
with every seed and scored on the test set. See docs/benchmarks.md, "Learning quality".
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from _accuracy_common import (
    BATCH,
    TOPOLOGIES,
    WEIGHT_DECAY,
    accuracy_of,
    load_dataset,
    lr_schedule,
    ridge_head,
    timed_epoch,
)

# the search starts from the first value of each axis: the spec lists the plain recipe first
MENU_PRESETS = {
    "full": "lr=1e-3,3e-4,3e-3,1e-4;norm=none,layernorm,batchnorm;ls=0,0.1;dropout=0,0.1;schedule=constant,cosine,step;"
    "act=relu,leaky_relu;head=trained,ridge",
    "smoke": "lr=3e-3,1e-2;norm=none,layernorm;head=trained,ridge",
}
AXES = ("lr", "norm", "ls", "dropout", "schedule", "act")  # trained axes, in coordinate-search order
DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "norm": "none",
    "ls": 0.0,
    "dropout": 0.0,
    "schedule": "constant",
    "act": "relu",
    "head": "trained",
}
CHOICES = {
    "norm": ("none", "layernorm", "batchnorm"),
    "schedule": ("constant", "cosine", "step"),
    "act": ("relu", "gelu", "tanh", "leaky_relu"),
    "head": ("trained", "ridge"),
}
# system -> DAD local rule (None: backprop)
SYSTEMS: dict[str, str | None] = {"dad": "ce", "dad-predsim": "predsim", "dad-drtp": "drtp", "backprop": None}
# cell -> (dataset, epochs); the MLP of _accuracy_common.TOPOLOGIES for the dataset, or the conv net in VGG_CELLS
CELLS = {
    "mnist-3": ("mnist", 3),
    "mnist-20": ("mnist", 20),
    "fmnist-3": ("fmnist", 3),
    "fmnist-20": ("fmnist", 20),
    "20ng-10": ("20ng", 10),
    "mnist-vgg-3": ("mnist", 3),
    "fmnist-vgg-10": ("fmnist", 10),
    "synthetic-3": ("synthetic", 3),
    "synthetic-vgg-1": ("synthetic28", 1),
}
# conv cells -> the width divisor of conv.py's vgg8b-style net (topology "vgg8b/<divisor>"), on 1 x 28 x 28 images
VGG_CELLS = {"mnist-vgg-3": 4, "fmnist-vgg-10": 4, "synthetic-vgg-1": 32}
# what a conv cell's menu leaves out: DADConv2d normalises by batch norm only
VGG_EXCLUDED = {"norm": ("layernorm",)}
VAL_FRACTION = 0.1
VAL_SPLIT_SEED = 12345  # one fixed split for every system and seed


# ------------------------------------------------------------------------------------------ menu
def parse_menu(spec: str) -> dict[str, list[Any]]:
    """``"lr=1e-3,3e-3;norm=none,layernorm"`` (or a preset name) -> ``{axis: [values]}``; absent axes get
    their default alone. The first value of each axis is the coordinate search's starting point."""
    spec = MENU_PRESETS.get(spec, spec)
    menu: dict[str, list[Any]] = {key: [value] for key, value in DEFAULTS.items()}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        key, _, values = part.partition("=")
        key = key.strip()
        if key not in DEFAULTS or not values.strip():
            raise ValueError(f"menu entry {part!r}: write key=v1,v2 with key one of {', '.join(DEFAULTS)}")
        items = [v.strip() for v in values.split(",")]
        if key in CHOICES:
            bad = [v for v in items if v not in CHOICES[key]]
            if bad:
                raise ValueError(f"menu {key}={bad} not allowed; choose from {', '.join(CHOICES[key])}")
            menu[key] = items
        else:
            menu[key] = [_number(key, v) for v in items]
        if len(set(menu[key])) != len(menu[key]):
            raise ValueError(f"menu {key} lists a value twice: {values}")
    return menu


def _number(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"menu {key}={text!r} is not a number") from None
    upper = math.inf if key == "lr" else 1.0
    if not 0.0 <= value < upper or (key == "lr" and value == 0.0):
        raise ValueError(f"menu {key}={text!r} out of range ({'lr > 0' if key == 'lr' else '0 <= value < 1'})")
    return value


def recipe_name(recipe: dict[str, Any], head: str | None = None) -> str:
    """A compact label: the lr, then only what differs from the plain recipe, e.g. ``lr 1e-3, layernorm, ridge``."""
    parts = [f"lr {recipe['lr']:g}"]
    parts += [f"{recipe['norm']}"] if recipe["norm"] != "none" else []
    parts += [f"ls {recipe['ls']:g}"] if recipe["ls"] else []
    parts += [f"dropout {recipe['dropout']:g}"] if recipe["dropout"] else []
    parts += {"cosine": ["cosine"], "step": ["step decay"]}.get(recipe["schedule"], [])
    parts += [recipe["act"]] if recipe["act"] != "relu" else []
    return ", ".join(parts + ([f"{head} head"] if head else []))


# ------------------------------------------------------------------------------------------ one run
def _models(
    topology: str, recipe: dict[str, Any], widths: Sequence[int], num_classes: int, dad: bool
) -> torch.nn.Module:
    """The DAD model or its backprop twin for ``topology``: an MLP of ``widths``, or ``"vgg8b/<k>"``,
    conv.py's VGG-style net with every width divided by ``k``."""
    from _common import DADMLP, backprop_mlp

    normalize = None if recipe["norm"] == "none" else recipe["norm"]
    if topology.startswith("vgg8b/"):
        from conv import DADVGG, backprop_vgg

        scale = int(topology.split("/")[1])
        if dad:
            return DADVGG(1, 28, scale, num_classes, 4, recipe["ls"], recipe["act"], normalize)
        return backprop_vgg(1, 28, scale, num_classes, recipe["act"], normalize, recipe["dropout"])
    if dad:
        return DADMLP(widths, num_classes, recipe["act"], normalize=normalize, label_smoothing=recipe["ls"])
    return backprop_mlp(widths, num_classes, activation=recipe["act"], normalize=normalize, dropout=recipe["dropout"])


def _build(
    system: str, recipe: dict[str, Any], job: dict[str, Any], device: torch.device
) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor], Callable[..., None], Callable[[], str]]:
    """``(model, features, step(x, y, lr), step_kind())`` for one system and recipe; ``features`` feeds the
    ridge head; ``step_kind()`` names what ran the steps (``"cuda-graph"``, ``"fused"`` or ``"eager"``)."""
    import torch_dad as td

    seed, num_classes = job["seed"], job["num_classes"]
    torch.manual_seed(seed)
    rule = SYSTEMS[system]
    if rule is not None:
        dad = _models(job["topology"], recipe, job["widths"], num_classes, dad=True)
        trainer = td.DADTrainer(
            dad,
            device=device,
            lr=recipe["lr"],
            weight_decay=WEIGHT_DECAY,
            local_loss=rule,
            dropout=recipe["dropout"],
            dropout_seed=seed,
            classifier_label_smoothing=recipe["ls"],
        )

        def dad_step(x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
            trainer.step(x, y, lr=lr)

        def dad_kind() -> str:
            # backend "auto" runs the eager loop where the engine cannot: the record says which one ran
            engine = trainer.engine if trainer.uses_engine else None
            return "eager" if engine is None else "cuda-graph" if engine.graphed else "fused"

        return dad, dad.features, dad_step, dad_kind
    from _gpu_common import GraphedBackprop

    shape = (1, 28, 28) if job["topology"].startswith("vgg8b/") else (job["widths"][0],)
    system = GraphedBackprop(
        _models(job["topology"], recipe, job["widths"], num_classes, dad=False), shape, BATCH, device,
        lr=recipe["lr"], weight_decay=WEIGHT_DECAY, smoothing=recipe["ls"],
    )
    return system.model, system.model[:-1], system.step, lambda: "eager" if system.replay is None else "cuda-graph"


def train_recipe(job: dict[str, Any], data: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """One run: per-epoch val/test accuracy of the trained head, and both heads' at the last epoch.

    The ridge head is ``torch_dad.ridge.GramAccumulator(...).solve("auto")`` on the last hidden
    features of the training part (what ``DADTrainer.solve_head("auto", loader=train)`` computes),
    for DAD and backprop alike; it is scored off the record, the trained head is left as it is.
    """
    recipe, widths, num_classes = job["recipe"], job["widths"], job["num_classes"]
    xtr, ytr = data["xtr"], data["ytr"]
    model, features, step, step_kind = _build(job["system"], recipe, job, device)
    steps_per_epoch = math.ceil(xtr.shape[0] / BATCH)
    schedule = lr_schedule({recipe["schedule"]: True}, recipe["lr"], steps_per_epoch * job["epochs"])
    count = itertools.count()

    def scheduled(x: torch.Tensor, y: torch.Tensor) -> None:
        step(x, y, recipe["lr"] if schedule is None else schedule(next(count)))

    curve: list[dict[str, Any]] = []
    elapsed = 0.0
    for epoch in range(job["epochs"]):
        model.train()
        elapsed += timed_epoch(scheduled, xtr, ytr, job["seed"], epoch, device)
        model.eval()
        curve.append(
            {
                "epoch": epoch + 1,
                "train_s": elapsed,
                "val_acc": accuracy_of(model, data["xval"], data["yval"]),
                "test_acc": accuracy_of(model, data["xte"], data["yte"]),
            }
        )
    ridge = ridge_head(features, widths[-1], num_classes, xtr, ytr)
    last = curve[-1]
    heads = {
        "trained": {"val_acc": last["val_acc"], "test_acc": last["test_acc"]},
        "ridge": {
            "val_acc": accuracy_of(ridge, data["xval"], data["yval"]),
            "test_acc": accuracy_of(ridge, data["xte"], data["yte"]),
        },
    }
    return {"train_s": elapsed, "curve": curve, "heads": heads, "step": step_kind()}


_LOADED: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def run_menu_job(job: dict[str, Any]) -> dict[str, Any]:
    """Worker entry: one (cell, system, recipe, seed) run; a failure is recorded, the study goes on."""
    device = torch.device(job["device"])
    torch.set_num_threads(max(1, job["threads"]))
    torch.backends.cuda.matmul.allow_tf32 = job["tf32"]
    key = (job["cache"], job["device"])
    if key not in _LOADED:  # each worker process loads a dataset once
        _LOADED[key] = {k: v.to(device) for k, v in torch.load(job["cache"]).items()}
    record = {k: v for k, v in job.items() if k not in ("cache", "device", "threads", "tf32", "widths")}
    try:
        return {**record, **train_recipe(job, _LOADED[key], device)}
    except Exception as err:
        return {**record, "error": f"{type(err).__name__}: {err}"}


# ------------------------------------------------------------------------------------------ search
class Runner:
    """Runs lists of jobs: in this process (``workers == 1``) or on a shared pool of spawned processes.

    Each finished run is appended to ``log`` (JSON lines) at once, so a study cut short keeps its
    runs; a run found in ``earlier`` (same cell, system, recipe and seed) is reused, not trained.
    """

    def __init__(self, workers: int, log: Path | None = None, earlier: Sequence[dict[str, Any]] = ()) -> None:
        self.pool = None
        if workers > 1:
            import multiprocessing as mp

            self.pool = mp.get_context("spawn").Pool(workers)
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.log = log
        self.earlier = {_run_key(r): r for r in earlier if r.get("kind") == "menu_run" and "heads" in r}

    def map(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        fresh = [job for job in jobs if _run_key(job) not in self.earlier]
        if self.pool is None:
            done = [run_menu_job(job) for job in fresh]
        else:
            done = [item.get() for item in [self.pool.apply_async(run_menu_job, (job,)) for job in fresh]]
        ran = iter(done)
        results = [self.earlier[_run_key(job)] if _run_key(job) in self.earlier else next(ran) for job in jobs]
        with self.lock:
            for r in results:
                self.records.append(r)
                score = " ".join(f"{h} val {100 * v['val_acc']:.2f}" for h, v in r.get("heads", {}).items())
                print(
                    f"{r['cell']:10} {r['system']:12} seed {r['seed']} {recipe_name(r['recipe']):40} "
                    f"{score or r.get('error')}" + (" (reused)" if r not in done else ""),
                    flush=True,
                )
            if self.log is not None:
                with self.log.open("a") as handle:
                    handle.writelines(json.dumps(r) + "\n" for r in done)
        return results

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def _key(recipe: dict[str, Any]) -> str:
    return json.dumps(recipe, sort_keys=True)


def _run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["cell"], run["topology"], run["system"], _key(run["recipe"]), run["seed"])


def load_records(path: Path) -> list[dict[str, Any]]:
    """The rows of a study: a record's last ``--menu`` run (``results/accuracy.json``), a list of rows, or a run
    log (one JSON object a line)."""
    from _common import read_runs

    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # a run log
        return [json.loads(line) for line in text.splitlines() if line]
    if isinstance(data, dict) and "runs" not in data:  # a run log of one line
        return [data]
    studies = [run for run in read_runs(path) if "menu" in run["config"] or not run["config"]]
    if not studies:
        raise ValueError(f"{path} holds no --menu run: pass a record with one, a list of rows or a run log")
    return [{**studies[-1]["environment"], **row} for row in studies[-1]["results"]]


def search(
    menu: dict[str, list[Any]], strategy: str, evaluate: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
) -> tuple[dict[str, Any], str]:
    """The best ``(recipe, head)`` by validation accuracy; ``evaluate`` trains recipes (memoised here).

    ``"grid"``: every combination of the menu. ``"coordinate"``: from the first value of every axis,
    sweep one axis at a time in the order of :data:`AXES`, then the lr once more, each sweep keeping
    the best so far (a strictly better validation accuracy replaces it). Both heads of every run are
    candidates. The same strategy, menu and start serve every system.
    """
    done: dict[str, dict[str, Any]] = {}
    best: tuple[float, dict[str, Any], str] = (-1.0, {}, "")

    def visit(recipes: list[dict[str, Any]]) -> None:
        nonlocal best
        fresh = [r for r in recipes if _key(r) not in done]
        for recipe, record in zip(fresh, evaluate(fresh)):
            done[_key(recipe)] = record
        for recipe in recipes:
            heads = done[_key(recipe)].get("heads", {})
            for head in menu["head"]:
                if head in heads and heads[head]["val_acc"] > best[0]:
                    best = (heads[head]["val_acc"], recipe, head)

    if strategy == "grid":
        visit([dict(zip(AXES, values)) for values in itertools.product(*(menu[a] for a in AXES))])
    else:
        current = {a: menu[a][0] for a in AXES}
        for axis in (*AXES, "lr"):
            visit([{**current, axis: value} for value in menu[axis]])
            current = best[1] or current
    if not best[1]:
        raise RuntimeError("every run of the search failed")
    return best[1], best[2]


def study_one(
    cell: dict[str, Any], system: str, menu: dict[str, list[Any]], args: Any, runner: Runner
) -> dict[str, Any]:
    """Search on the first seed, then the selected recipe on every seed: one summary entry."""
    base = {
        "kind": "menu_run",
        "cell": cell["name"],
        "dataset": cell["dataset"],
        "topology": cell["topology"],
        "widths": cell["widths"],
        "num_classes": cell["num_classes"],
        "epochs": cell["epochs"],
        "system": system,
        "batch": BATCH,
        "cache": cell["cache"],
        "device": args.device,
        "threads": args.threads,
        "tf32": args.tf32,
    }
    search_seed = args.seeds[0]

    def evaluate(recipes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return runner.map([{**base, "recipe": r, "seed": search_seed, "search": True} for r in recipes])

    recipe, head = search(menu, args.search, evaluate)
    runs = [
        r
        for r in runner.records
        if r["cell"] == cell["name"] and r["system"] == system and r["recipe"] == recipe and "heads" in r
    ]
    runs += runner.map([{**base, "recipe": recipe, "seed": s, "search": False} for s in args.seeds[1:]])
    runs = [r for r in runs if "heads" in r]
    test = [r["heads"][head]["test_acc"] for r in runs]
    val = [r["heads"][head]["val_acc"] for r in runs]
    return {
        "kind": "menu_summary",
        "cell": cell["name"],
        "dataset": cell["dataset"],
        "topology": cell["topology"],
        "epochs": cell["epochs"],
        "system": system,
        "recipe": recipe,
        "head": head,
        "label": recipe_name(recipe, head),
        "search": args.search,
        "menu": menu,
        "searched_runs": sum(
            1 for r in runner.records if r.get("search") and r["system"] == system and r["cell"] == cell["name"]
        ),
        "seeds": len(runs),
        "val_acc_search_seed": max(r["heads"][head]["val_acc"] for r in runs if r["seed"] == search_seed),
        "val_acc_mean": statistics.mean(val),
        "test_acc_mean": statistics.mean(test),
        "test_acc_std": statistics.stdev(test) if len(test) > 1 else 0.0,
        "train_s_mean": statistics.mean(r["train_s"] for r in runs),
    }


# ------------------------------------------------------------------------------------------ data
def _cache_split(dataset: str, images: bool, args: Any, folder: Path) -> tuple[Path, int, int, int, int] | None:
    """Split ``dataset`` into train / val / test (rows (N, 1, 28, 28) if ``images``), save it in ``folder``;
    ``(file, classes, n_train, n_val, n_test)``, or ``None`` if the dataset is not installed."""

    try:
        xtr, ytr, xte, yte = load_dataset(dataset, args)
    except (FileNotFoundError, ModuleNotFoundError):
        return None
    if images:
        xtr, xte = xtr.reshape(-1, 1, 28, 28), xte.reshape(-1, 1, 28, 28)
    order = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(VAL_SPLIT_SEED))
    n_val = round(VAL_FRACTION * xtr.shape[0])
    val, train = order[:n_val], order[n_val:]
    tensors = {"xtr": xtr[train], "ytr": ytr[train], "xval": xtr[val], "yval": ytr[val], "xte": xte, "yte": yte}
    path = folder / f"{dataset}{'_images' if images else ''}.pt"
    torch.save(tensors, path)
    return path, int(ytr.max()) + 1, len(train), n_val, xte.shape[0]


def cell_menu(menu: dict[str, list[Any]], cell: str) -> dict[str, list[Any]]:
    """``menu`` as a cell searches it: a conv cell leaves out what its layers lack (:data:`VGG_EXCLUDED`),
    for every system alike."""
    if cell not in VGG_CELLS:
        return menu
    return {axis: [v for v in values if v not in VGG_EXCLUDED.get(axis, ())] for axis, values in menu.items()}


def prepare_cells(names: list[str], args: Any, folder: Path) -> list[dict[str, Any]]:
    """Each cell's dataset split into train / val (a fixed 10% of the training set) / test, cached in
    ``folder`` for the workers. A dataset that is not installed is skipped with a message."""
    import conv

    cells: list[dict[str, Any]] = []
    caches: dict[tuple[str, bool], tuple[Path, int, int, int, int] | None] = {}
    for name in names:
        dataset, epochs = CELLS[name]
        topology, widths = TOPOLOGIES.get(dataset, ("smoke", [24, 32, 16]))
        images = name in VGG_CELLS
        if images:
            topology, widths = f"vgg8b/{VGG_CELLS[name]}", [784, conv.DENSE // VGG_CELLS[name]]
        key = (dataset, images)
        if key not in caches:
            caches[key] = _cache_split(dataset, images, args, folder)
            if caches[key] is None:
                print(f"{name}: skipped ({dataset} is not installed)", flush=True)
        if caches[key] is None:
            continue
        cache, num_classes, n_train, n_val, n_test = caches[key]
        cells.append(
            {
                "name": name,
                "dataset": dataset,
                "epochs": epochs,
                "topology": topology,
                "widths": widths,
                "num_classes": num_classes,
                "cache": str(cache),
                "n_train": n_train,
                "n_val": n_val,
                "n_test": n_test,
            }
        )
    return cells


# ------------------------------------------------------------------------------------------ report
def best_of_studies(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of several studies (``--merge``, or one study resumed with a larger menu) as one: each
    run once (same cell, topology, system, recipe and seed), and per (cell, system) the selection with
    the best validation accuracy on the search seed. A coordinate search's result depends on its path,
    so a search over a larger menu can settle lower than one over a part of it; every recipe either
    search trained belongs to the larger menu, and the best of them is the best of that menu found."""
    runs: dict[tuple[Any, ...], dict[str, Any]] = {}
    best: dict[tuple[str, str], dict[str, Any]] = {}
    other = []
    for r in records:
        if r.get("kind") == "menu_run":
            runs.setdefault(_run_key(r), r)
        elif r.get("kind") == "menu_summary":
            key = (r["cell"], r["system"])
            if key not in best or r["val_acc_search_seed"] > best[key]["val_acc_search_seed"]:
                best[key] = r
        else:
            other.append(r)
    return [*other, *runs.values(), *best.values()]


def tables(records: list[dict[str, Any]]) -> str:
    """A markdown table per cell: system, selected recipe, val and test accuracy, DAD - backprop."""
    summaries = [r for r in records if r.get("kind") == "menu_summary"]
    out = []
    for cell in dict.fromkeys(s["cell"] for s in summaries):
        rows = [s for s in summaries if s["cell"] == cell]
        bp = next((s["test_acc_mean"] for s in rows if s["system"] == "backprop"), None)
        out += [
            f"\n{cell} ({rows[0]['topology']}, {rows[0]['epochs']} epochs)\n",
            "| system | selected recipe | val acc (seed mean) | test acc | DAD − backprop |",
            "|---|---|---|---|---|",
        ]
        for s in rows:
            delta = "" if bp is None or s["system"] == "backprop" else f"{100 * (s['test_acc_mean'] - bp):+.2f}"
            out.append(
                f"| `{s['system']}` | {s['label']} | {100 * s['val_acc_mean']:.2f} | "
                f"{100 * s['test_acc_mean']:.2f} ± {100 * s['test_acc_std']:.2f} (n={s['seeds']}) | {delta} |"
            )
    return "\n".join(out)


def plot(records: list[dict[str, Any]], out: Path) -> list[Path]:
    """Test accuracy of each system's selected recipe (mean over seeds) against epoch (top row) and wall time
    (bottom row), one column per cell; the selected ridge head is a marker at the last epoch. Draws ``out``'s .png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: plots skipped")
        return []
    summaries = [r for r in records if r.get("kind") == "menu_summary"]
    cells = list(dict.fromkeys(s["cell"] for s in summaries))
    if not cells:
        return []
    fig, axes = plt.subplots(2, len(cells), figsize=(5.5 * len(cells), 8.4), squeeze=False)
    for row, axis in enumerate(("epoch", "train_s")):
        for ax, cell in zip(axes[row], cells):
            for s in (s for s in summaries if s["cell"] == cell):
                runs = [
                    r
                    for r in records
                    if r.get("kind") == "menu_run"
                    and r["cell"] == cell
                    and r["system"] == s["system"]
                    and r["recipe"] == s["recipe"]
                    and "curve" in r
                ]
                xs = [statistics.mean(r["curve"][i][axis] for r in runs) for i in range(s["epochs"])]
                ys = [100 * statistics.mean(r["curve"][i]["test_acc"] for r in runs) for i in range(s["epochs"])]
                (line,) = ax.plot(xs, ys, marker=".", label=f"{s['system']}: {s['label']}")
                if s["head"] == "ridge":
                    ax.plot(xs[-1:], [100 * s["test_acc_mean"]], marker="*", markersize=11, color=line.get_color())
            ax.set_title(f"{cell} ({s['topology']}), mean over seeds", fontsize=9)
            ax.set_xlabel("epoch" if axis == "epoch" else "training wall time [s]")
            ax.set_ylabel("test accuracy [%] (star: ridge head)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
            ax.set_ylim(bottom=max(ax.get_ylim()[0], ax.get_ylim()[1] - 10))
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ------------------------------------------------------------------------------------------ main
def _study(
    cells: list[dict[str, Any]],
    systems: list[str],
    menu: dict[str, list[Any]],
    args: Any,
    log: Path | None = None,
    earlier: Sequence[dict[str, Any]] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(runs, summaries)``: one search per (cell, system), in parallel threads over one worker pool."""
    runner = Runner(args.workers, log, earlier)

    def one(pair: tuple[dict[str, Any], str]) -> dict[str, Any]:
        cell, system = pair
        try:
            return study_one(cell, system, cell_menu(menu, cell["name"]), args, runner)
        except RuntimeError as err:
            return {"kind": "menu_summary_failed", "cell": cell["name"], "system": system, "error": str(err)}

    # DADConv2d trains by the local cross-entropy only: a conv cell has no predsim / drtp system
    pairs = [(c, s) for c in cells for s in systems if c["name"] not in VGG_CELLS or SYSTEMS[s] in (None, "ce")]
    try:
        if args.workers > 1:
            with ThreadPoolExecutor(len(pairs)) as threads:
                summaries = list(threads.map(one, pairs))
        else:
            summaries = [one(pair) for pair in pairs]
    finally:
        runner.close()
    return runner.records, summaries


def menu_main(args: Any) -> Path:
    """Run (or with ``--plot-only`` re-report, with ``--merge`` combine) the study; adds it as a run to the record
    (``results/accuracy.json`` or ``--out``), prints the tables, plots. Runs are logged to ``<out>.runs.jsonl`` as
    they finish; ``--resume`` reuses them. ``args.config`` (default ``{"menu": args.menu}``) is the run's
    configuration."""
    import tempfile

    from _common import environment, record_path, write_run

    menu = parse_menu(args.menu)
    smoke = args.smoke
    config = getattr(args, "config", None) or {"menu": args.menu}
    out = record_path("accuracy", smoke=smoke, out=args.out)
    if args.plot_only or args.merge:
        records = best_of_studies([r for path in args.merge or [out] for r in load_records(Path(path))])
        if args.merge:
            env = environment()
            write_run("accuracy", records, config=config, out=out, env=env)
        print(tables(records))
        print("\n".join(str(p) for p in plot(records, out)))
        return out
    systems = args.systems or (["dad", "backprop"] if smoke else list(SYSTEMS))
    names = args.cells or (["synthetic-3", "synthetic-vgg-1"] if smoke else [c for c in CELLS if not c.startswith("synthetic")])
    started = time.perf_counter()
    if args.workers == 1:  # runs in this process: the environment record names their thread count
        torch.set_num_threads(max(1, args.threads))
    env = environment()
    earlier = load_records(Path(args.resume)) if args.resume else []
    log = out.with_suffix(".runs.jsonl")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    cells = prepare_cells(names, args, Path(tempfile.mkdtemp(prefix="dad_accuracy_menu_")))
    runs, summaries = _study(cells, systems, menu, args, log, [{**env, **r} for r in earlier])
    header = {
        "kind": "menu_study",
        "menu": menu,
        "search": args.search,
        "seeds": args.seeds,
        "systems": systems,
        "val_fraction": VAL_FRACTION,
        "val_split_seed": VAL_SPLIT_SEED,
        "batch": BATCH,
        "weight_decay": WEIGHT_DECAY,
        "workers": args.workers,
        "threads": args.threads,
        "tf32": args.tf32,
        "cells": [{k: v for k, v in c.items() if k != "cache"} for c in cells],
        "wall_s": time.perf_counter() - started,
    }
    records = [{**header, **env}, *({**env, **r} for r in runs), *({**s, **env} for s in summaries)]
    write_run("accuracy", records, config=config, out=out, env=env)
    log.unlink()
    print(tables(records))
    if not smoke:
        print("\n".join(str(p) for p in plot(records, out)))
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s")
    return out
