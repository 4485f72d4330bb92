"""The CPU speed ceiling of DAD over backprop: each step's matrix products and AdamW, timed alone.

For the quickstart MLP (784-1024-512-256-10) at a batch size, this times, with the same torch calls the
two steps make and preallocated outputs:

- ``dad-gemms``: per hidden layer the forward ``addmm``, the local logits ``addmm``, ``dL/dh = d_logits @ W_head``,
  the weight gradient ``d_z.T @ x`` and the local-head gradient ``d_logits.T @ h``; the classifier's forward and
  weight gradient;
- ``backprop-gemms``: per layer (classifier included) the forward ``addmm`` and the weight gradient, and the
  input gradient ``g @ W`` for every layer but the first;
- ``dad-adamw`` / ``backprop-adamw``: one ``torch._fused_adamw_`` over each step's parameters;

and, in the same interleaved rounds, the real ``DADTrainer.step`` and the eager backprop + AdamW step. The floor of
a step is its GEMMs + its AdamW; ``floor_ratio = backprop floor / DAD floor`` is the most DAD can gain when both
run their products equally well and everything else (activations, softmax, bias sums, autograd, Python) costs
nothing. ``measured_ratio`` is what the two real steps achieve. Writes ``results/cpu_floor.json`` and draws its
last run into ``results/cpu_floor.png`` (``--plot-only`` redraws the PNG from the JSON).

    python benchmarks/cpu_floor.py                # batch 1024 and 256, about 2 minutes on 2 cores
    python benchmarks/cpu_floor.py --smoke        # seconds, for CI
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import torch_dad as td
from _common import (
    DADMLP,
    backprop_mlp,
    draw_record,
    median_time,
    pyplot,
    run_config,
    run_title,
    save_figure,
    write_run,
)

WIDTHS = [784, 1024, 512, 256]
CLASSES = 10


def gemm_sets(widths: list[int], batch: int) -> dict[str, Callable[[], None]]:
    """Closures running exactly the matrix products of one DAD step and of one backprop step."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    pairs = list(zip(widths[:-1], widths[1:]))
    layers = [(rand(o, i), rand(o), rand(CLASSES, o), rand(CLASSES)) for i, o in pairs]
    acts = [rand(batch, w) for w in widths]  # layer inputs / outputs
    d_logits = rand(batch, CLASSES)
    classifier = (rand(CLASSES, widths[-1]), rand(CLASSES))
    out = {  # preallocated outputs, as the steps keep workspaces
        "z": [torch.empty(batch, o) for _, o in pairs],
        "gw": [torch.empty(o, i) for i, o in pairs],
        "gx": [torch.empty(batch, i) for i, _ in pairs],
        "dz": [torch.empty(batch, o) for _, o in pairs],
    }

    def dad() -> None:
        for k, (w, b, wh, bh) in enumerate(layers):
            a, h = acts[k], acts[k + 1]
            torch.addmm(b, a, w.T, out=out["z"][k])
            torch.addmm(bh, h, wh.T)
            torch.mm(d_logits, wh, out=out["dz"][k])
            torch.mm(out["dz"][k].T, a, out=out["gw"][k])
            _ = d_logits.T @ h
        torch.addmm(classifier[1], acts[-1], classifier[0].T)
        _ = d_logits.T @ acts[-1]

    def backprop() -> None:
        for k, (w, b, _wh, _bh) in enumerate(layers):
            torch.addmm(b, acts[k], w.T, out=out["z"][k])
        torch.addmm(classifier[1], acts[-1], classifier[0].T)
        _ = d_logits.T @ acts[-1]  # classifier weight gradient
        grad_h = d_logits @ classifier[0]  # into the last hidden layer
        for k in reversed(range(len(layers))):
            w = layers[k][0]
            torch.mm(grad_h.T, acts[k], out=out["gw"][k])  # grad_h stands for dL/dz (same shape)
            if k > 0:
                grad_h = torch.mm(grad_h, w, out=out["gx"][k])

    return {"dad-gemms": dad, "backprop-gemms": backprop}


def adamw_sets(trainer: td.DADTrainer, net: torch.nn.Module) -> dict[str, Callable[[], None]]:
    """One fused AdamW over each step's parameters (DAD: layers, local heads, classifier)."""

    def make(params: list[torch.Tensor]) -> Callable[[], None]:
        params = [p.detach().clone() for p in params]
        grads = [torch.randn_like(p) for p in params]
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        steps = [torch.ones(()) for _ in params]

        def run() -> None:
            torch._fused_adamw_(params, grads, m, v, [], steps, amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                                weight_decay=0.01, eps=1e-8, maximize=False)

        return run

    dad_params = [t for layer in trainer.model.dad_layers for t in layer.trained_tensors()]
    dad_params += list(trainer.model.classifier.parameters())
    return {"dad-adamw": make(dad_params), "backprop-adamw": make(list(net.parameters()))}


TIME_BARS = (  # (row key, label, color, hatch) of the time panel's bars
    ("floor_dad_ms", "DAD floor (GEMMs + AdamW)", "C0", "//"),
    ("dad-step_ms", "DAD step", "C0", None),
    ("floor_backprop_ms", "backprop floor (GEMMs + AdamW)", "C1", "//"),
    ("backprop-step_ms", "backprop step", "C1", None),
)


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels of the record's last run, per batch size: the floor (GEMMs + AdamW) and the measured step of
    DAD and backprop in ms, and the backprop / DAD ratio of the floors and of the steps."""
    plt = pyplot()
    if plt is None or not runs or not runs[-1]["results"]:
        return False
    run = runs[-1]
    rows = run["results"]
    index = range(len(rows))
    fig, (times, ratios) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for k, (key, label, color, hatch) in enumerate(TIME_BARS):
        times.bar([i + (k - 1.5) * 0.2 for i in index], [r[key] for r in rows], 0.2, label=label, color=color,
                  hatch=hatch, edgecolor="white")
    for k, (key, label) in enumerate((("floor_ratio", "floors"), ("measured_ratio", "measured steps"))):
        # bars from 1 (equal speed): up where DAD is faster, down where it is slower
        ratios.bar([i + (k - 0.5) * 0.35 for i in index], [r[key] - 1 for r in rows], 0.35, bottom=1.0,
                   label=label, color="C2", alpha=1.0 if k else 0.5)
    ratios.axhline(1.0, color="black", lw=0.8)
    times.set_title("floor and measured step", fontsize=10)
    ratios.set_title("DAD's speed-up over backprop", fontsize=10)
    for ax, label in ((times, "ms per step"), (ratios, "backprop time / DAD time (1: equal)")):
        ax.set_xticks(list(index), [f"B={r['batch']}" for r in rows])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, f"CPU floor of a step, {rows[0]['topology']}: {run_title(run)}", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plot-only", action="store_true", help="redraw results/cpu_floor.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("cpu_floor", plot))
        return
    widths = [64, 48, 32] if args.smoke else WIDTHS
    batches = [64] if args.smoke else args.batch
    repeats, warmup, rounds = (3, 1, 1) if args.smoke else (args.repeats, 5, args.rounds)
    records = []
    for batch in batches:
        torch.manual_seed(0)
        x = torch.randn(batch, widths[0])
        y = torch.randint(0, CLASSES, (batch,))
        trainer = td.DADTrainer(DADMLP(widths), device="cpu")
        net = backprop_mlp(widths)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

        def bp_step(net: torch.nn.Module = net, opt: torch.optim.Optimizer = opt, x: torch.Tensor = x,
                    y: torch.Tensor = y) -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

        def dad_step(trainer: td.DADTrainer = trainer, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            trainer.step(x, y)

        systems: dict[str, Callable[[], None]] = {"dad-step": dad_step, "backprop-step": bp_step}
        systems |= gemm_sets(widths, batch) | adamw_sets(trainer, net)
        times: dict[str, list[float]] = {k: [] for k in systems}
        for _ in range(rounds):  # interleaved, so drift hits every part alike
            for label, fn in systems.items():
                times[label].append(median_time(fn, warmup=warmup, repeats=repeats))
        ms = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        floor_dad = ms["dad-gemms"] + ms["dad-adamw"]
        floor_bp = ms["backprop-gemms"] + ms["backprop-adamw"]
        record = {"topology": "mnist-medium-3" if not args.smoke else "smoke", "batch": batch,
                  **{f"{k}_ms": v for k, v in ms.items()},
                  "floor_dad_ms": floor_dad, "floor_backprop_ms": floor_bp, "floor_ratio": floor_bp / floor_dad,
                  "measured_ratio": ms["backprop-step"] / ms["dad-step"],
                  "dad_step_over_floor": ms["dad-step"] / floor_dad,
                  "backprop_step_over_floor": ms["backprop-step"] / floor_bp}
        records.append(record)
        print(f"B={batch}: floors DAD {floor_dad:.2f} ms, backprop {floor_bp:.2f} ms -> ratio {record['floor_ratio']:.3f}; "
              f"steps DAD {ms['dad-step']:.2f} ms, backprop {ms['backprop-step']:.2f} ms -> ratio "
              f"{record['measured_ratio']:.3f}; GEMMs {ms['dad-gemms']:.2f} / {ms['backprop-gemms']:.2f} ms, "
              f"AdamW {ms['dad-adamw']:.2f} / {ms['backprop-adamw']:.2f} ms", flush=True)
    path = write_run("cpu_floor", records, config=run_config(args, parser, exclude=["plot_only"]), smoke=args.smoke)
    print("wrote", path)
    if not args.smoke:
        print("plot:", draw_record("cpu_floor", plot))


if __name__ == "__main__":
    main()
