"""Training throughput on one GPU: the DAD step against tuned backprop and the published wheel.

Systems, measured in one run on the same synthetic data (fp32 inputs resident on the GPU,
rotated over 8 batches), bf16 compute, fp32 master weights, AdamW:

- ``dad``: ``DADTrainer(backend="auto")`` with its defaults, i.e. the fused step captured in a
  CUDA graph, plus the ``classifier_sample_size=4096`` reservoir of input rows for ``solve_head()``
  (a few copies outside the graph);
- ``dad-gram-stats``: instead of the sample, the streamed Gram statistics of the classifier's
  input (``accumulate_classifier_statistics=True, classifier_sample_size=0``; the default in earlier versions);
- ``dad-no-head-stats``: neither, i.e. the training step alone;
- ``backprop-graphed``: forward, backward and fused AdamW (``capturable=True``) in one CUDA graph;
- ``backprop-eager``: the same, op by op;
- ``wheel-2026.5.24``: the published wheel's compiled ``DADTrainer.step`` (``--wheel PATH``).

``--recipes SPEC ...`` times each training recipe (activation, normalisation, label smoothing, dropout; e.g.
``act=leaky_relu,norm=batchnorm,ls=0.1,dropout=0.1``) with ``dad``, ``backprop-eager`` and ``backprop-graphed``
given the same recipe (backprop's label smoothing in its loss, its dropout from torch's graph-safe generator).

``--deterministic`` runs everything under ``torch.use_deterministic_algorithms(True)`` (``CUBLAS_WORKSPACE_CONFIG``
``:4096:8`` unless set; ``warn_only``, so an op without a deterministic version still runs): against the same
run without it, what the mode costs (the local-error kernel then adds every sum once, without atomics).

Timing: CUDA events around 50 steps, median of 5 repeats, in 3 interleaved rounds (median of rounds),
each preceded by 20 steps and 0.3 s of warm-up (the graph is
captured during warm-up). Adds a run (its options are its configuration) to ``results/gpu_throughput.json`` and
draws the record's plain comparison into ``results/gpu_throughput.png`` (``--plot-only`` redraws it from the JSON).
``--smoke``: CPU, tiny sizes.

Run: python benchmarks/gpu_throughput.py [--wheel .whl/torch_dad-2026.5.24-py3-none-any.whl]
     python benchmarks/gpu_throughput.py --topologies localloss-3x1024 --batches 128,256 \
         --recipes "" "act=leaky_relu,norm=batchnorm,dropout=0.1" "norm=batchnorm,ls=0.1" --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, environment, pyplot, run_config, run_title, save_figure, write_run
from _gpu_common import (
    TOPOLOGIES,
    Recipe,
    backprop_eager,
    backprop_graphed,
    cuda_sync,
    dad_system,
    flop_ratio,
    make_data,
    recipe_from_spec,
    recipe_name,
    time_steps,
)

# beside the four throughput topologies: the MLP of the local-loss papers' MNIST recipe (3 x 1024)
# and the accuracy study's 20 Newsgroups MLP (4096 TF-IDF features, 20 classes)
EXTRA_TOPOLOGIES = {"localloss-3x1024": (784, [1024, 1024, 1024], 10), "20ng-mlp-2": (4096, [1024, 512], 20)}


def run_wheel(wheel: str, jobs: list[tuple[str, int]], timeout: float) -> list[dict]:
    """Time the wheel in a subprocess whose only ``torch_dad`` is the extracted wheel."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        env = {**os.environ, "PYTHONPATH": tmp}
        script = Path(__file__).with_name("_wheel_throughput.py")
        try:
            proc = subprocess.run([sys.executable, str(script), json.dumps(jobs)], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=timeout)
            out, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = f"timeout after {timeout} s"
        for line in out.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
        if len(rows) < len(jobs):
            print(f"wheel: {len(rows)}/{len(jobs)} measured; stderr tail: {err[-800:]}", file=sys.stderr)
    return rows


def build(system: str, topology: tuple[int, list[int], int], device: torch.device, amp: torch.dtype | None,
          batch: int, recipe: Recipe | None) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The step function of ``system`` on ``topology`` with ``recipe`` (``None``: plain)."""
    n_in, widths, classes = topology
    if system.startswith("dad"):
        head = {"dad": "sample", "dad-gram-stats": "gram"}.get(system, "none")
        backend = "auto" if device.type == "cuda" else "triton"
        return dad_system(n_in, widths, classes, device, backend, amp, head=head, recipe=recipe)[1]
    if system == "backprop-eager":
        return backprop_eager(n_in, widths, classes, device, amp, recipe)
    return backprop_graphed(n_in, widths, classes, device, amp, batch, recipe)


def time_systems(systems: list[str], topology: tuple[int, list[int], int], batch: int, device: torch.device,
                 amp: torch.dtype | None, recipe: Recipe | None, timing: tuple[int, int, int, float, int],
                 ) -> dict[str, tuple[float, float]]:
    """``system -> (seconds per step, peak MiB)``: each built and warmed (its peak taken then), then timed in
    interleaved rounds (median of rounds), each system warmed again first."""
    steps, repeats, warmup, warmup_s, rounds = timing
    cuda = device.type == "cuda"
    x, y = make_data(topology[0], topology[2], batch, 8, device)

    def batch_at(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i % 8
        return x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch]

    step_of, peak_of = {}, {}
    for system in systems:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        fn = build(system, topology, device, amp, batch, recipe)
        step_of[system] = lambda i, fn=fn: fn(*batch_at(i))
        time_steps(step_of[system], steps, 1, warmup)
        cuda_sync()
        peak_of[system] = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    seconds: dict[str, list[float]] = {system: [] for system in systems}
    for _ in range(rounds):
        for system in systems:
            seconds[system].append(time_steps(step_of[system], steps, repeats, warmup, warmup_s))
    return {system: (statistics.median(seconds[system]), peak_of[system]) for system in systems}


def _plain_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last run without recipes or deterministic mode, one of the default topologies if there is one."""
    plain = [run for run in runs if not run["config"].get("recipes") and not run["config"].get("deterministic")]
    default = [run for run in plain if "topologies" not in run["config"] and "batches" not in run["config"]]
    return (default or plain or [None])[-1]


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels of the record's last plain run (:func:`_plain_run`), one row per topology and batch: img/s of
    every system, and DAD's speed-up over each backprop system and the wheel."""
    plt = pyplot()
    run = _plain_run(runs)
    if plt is None or run is None or not run["results"]:
        return False
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for r in run["results"]:
        cells.setdefault((r["topology"], r["batch"]), {})[r["system"]] = r["img_per_s"]
    systems = list(dict.fromkeys(r["system"] for r in run["results"]))
    fig, (speed, ratio) = plt.subplots(1, 2, figsize=(13, 1.8 + 0.75 * len(cells)), sharey=True)
    height = 0.8 / len(systems)
    for k, system in enumerate(systems):
        ys = [i + (k - (len(systems) - 1) / 2) * height for i, cell in enumerate(cells.values()) if system in cell]
        speed.barh(ys, [cell[system] / 1e6 for cell in cells.values() if system in cell], height, color=f"C{k}",
                   label=system)
        if not system.startswith("dad"):
            both = [(i, cell["dad"] / cell[system]) for i, cell in enumerate(cells.values())
                    if {"dad", system} <= set(cell)]
            ratio.plot([x for _, x in both], [i for i, _ in both], "o", color=f"C{k}", label=f"dad over {system}")
    ratio.axvline(1.0, color="black", lw=0.8, ls="--")
    speed.set_yticks(range(len(cells)), [f"{topology}\nB={batch}" for topology, batch in cells], fontsize=8)
    speed.invert_yaxis()
    for ax, label in ((speed, "million img/s"), (ratio, "dad img/s / other system's img/s")):
        ax.set_xscale("log")
        for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis(plt.LogFormatter(labelOnlyBase=False))  # plain numbers, not powers of ten
        ax.set_xlabel(label)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    speed.set_title("training throughput", fontsize=10)
    ratio.set_title("DAD's speed-up", fontsize=10)
    handles = [h for ax in (speed, ratio) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8)
    return save_figure(fig, f"one GPU, bf16, AdamW, synthetic data: {run_title(run)}", path,
                       rect=(0, 0.5 / fig.get_figheight(), 1, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run, seconds")
    parser.add_argument("--wheel", default=None, help="path to torch_dad-2026.5.24-py3-none-any.whl")
    parser.add_argument("--wheel-timeout", type=float, default=240.0)
    parser.add_argument("--batches", default="1024,4096")
    parser.add_argument("--topologies", nargs="+", default=None, help="default: the four of docs/benchmarks.md")
    parser.add_argument("--recipes", nargs="+", default=None, help='recipe specs, e.g. "" "norm=batchnorm,ls=0.1"')
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True)")
    parser.add_argument("--out", default=None, help="record path (default results/gpu_throughput.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/gpu_throughput.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("gpu_throughput", plot, out=args.out))
        return
    if args.deterministic:
        # cuBLAS reads this when its first handle is made, so before any CUDA work
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    env = environment()
    known = {**TOPOLOGIES, **EXTRA_TOPOLOGIES}
    recipes = [recipe_from_spec(spec) for spec in args.recipes] if args.recipes is not None else [None]
    if args.smoke:
        topologies = {"smoke": (64, [48, 32], 10)}
        batches, amp, timing = [32], None, (3, 2, 2, 0.0, 1)
        recipes = recipes if args.recipes is not None else [None, recipe_from_spec("act=leaky_relu,norm=batchnorm,ls=0.1,dropout=0.1")]
    else:
        topologies = {name: known[name] for name in (args.topologies or TOPOLOGIES)}
        batches, amp, timing = [int(b) for b in args.batches.split(",")], torch.bfloat16, (50, 5, 20, 0.3, 3)
    records = []
    for name, topology in topologies.items():
        for batch in batches:
            for recipe in recipes:
                plain = recipe is None
                systems = (["dad", "dad-gram-stats", "dad-no-head-stats"] if plain else ["dad"]) + ["backprop-eager"]
                systems += ["backprop-graphed"] if cuda else []
                for system, (sec, peak) in time_systems(systems, topology, batch, device, amp, recipe, timing).items():
                    records.append({
                        "topology": name, "batch": batch, "system": system, "img_per_s": batch / sec, "peak_mib": peak,
                        "flop_ratio": flop_ratio(*topology), **({} if plain else {"recipe": recipe_name(recipe), **recipe}),
                        "deterministic": args.deterministic, **env,
                    })
                    print(json.dumps(records[-1]), flush=True)
    if args.wheel and cuda:
        jobs = [(name, b) for name in topologies for b in batches]
        for row in run_wheel(args.wheel, jobs, args.wheel_timeout):
            records.append({**row, "system": "wheel-2026.5.24", "flop_ratio": flop_ratio(*topologies[row["topology"]]), **env})
            print(json.dumps(records[-1]), flush=True)
    config = run_config(args, parser, exclude=["plot_only"])
    path = write_run("gpu_throughput", records, config=config, smoke=args.smoke, out=args.out, env=env)
    print(f"\n{env['device']}  torch {env['torch']}  -> {path}")
    print_table(records)
    if not args.smoke:
        print("plot:", draw_record("gpu_throughput", plot, out=args.out))


def print_table(records: list[dict[str, Any]]) -> None:
    """img/s of every row and its ratio to graphed backprop with the same topology, batch and recipe."""
    key = lambda r: (r["topology"], r["batch"], r.get("recipe", "plain"))  # noqa: E731
    graphed = {key(r): r["img_per_s"] for r in records if r["system"] == "backprop-graphed"}
    print(f"{'topology':18} {'B':>5} {'recipe':28} {'system':18} {'img/s':>12} {'x bp-graphed':>12}")
    for r in records:
        ref = graphed.get(key(r))
        ratio = r["img_per_s"] / ref if ref else float("nan")
        print(f"{r['topology']:18} {r['batch']:>5} {key(r)[2]:28} {r['system']:18} {r['img_per_s']:>12,.0f} {ratio:>12.2f}")


if __name__ == "__main__":
    main()
