"""Overhead of a ``DADAutogradLinear`` head against ``nn.Linear`` + AdamW on the same frozen backbone.

One training step = the user's loop: ``zero_grad``, forward (frozen backbone, then the head),
``F.cross_entropy``, ``backward``, ``optimizer.step()``. Systems, all from the same initial
head weights and the same batch:

* ``linear+adamw``: ``nn.Linear`` + ``torch.optim.AdamW`` (defaults: foreach);
* ``linear+adamw-fused``: ``nn.Linear`` + ``AdamW(fused=True)``, the tuned baseline;
* ``dad-inplace``: ``DADAutogradLinear`` (head role), its own fused AdamW in backward;
* ``dad-grad``: ``DADAutogradLinear(update="grad")`` + ``AdamW(fused=True)``;
* ``dad-inplace-late``: ``dad-inplace`` with ``early_gradients=False`` (keeps x and the logits
  for backward instead of forming the gradient in forward);
* ``dad-inplace-triton`` (``hidden`` workload on CUDA with triton only): ``dad-inplace`` with
  ``backend="triton"``, the hidden layer's local error in the fused kernel (``dad-inplace`` there
  is ``backend="eager"``).

The logits go out of scope before ``backward`` (as in HF ``Trainer.compute_loss``), so what a
head keeps for its backward shows in the peak.

Workloads: ``seqcls``, a frozen 2-layer transformer encoder (d=128) mean-pooled into a
2-class head (the HF head-tuning case; the backbone forward dominates); ``lmhead``, frozen
token features (B, T, D) into a vocab-sized head with 10% of the labels ``-100`` (the head is
the whole step); ``hidden``, the same kind of token features through a hidden ReLU layer of
``width`` units into a small head (``nn.Linear`` + ReLU + ``nn.Linear`` with backprop against a
hidden ``DADAutogradLinear`` with its own local head + a ``DADAutogradLinear`` head).

Time: median over 3 interleaved rounds (so drift on a shared machine hits every system alike)
of the median of ``repeats`` steps, after a warm-up; CUDA steps are synchronised.
Peak memory of one step above what is allocated before it (after the warm-up, so AdamW's
lazily created moments count as static state): on CPU from the allocator events that
``torch.profiler`` records (``profile_memory=True``), summed in time order; on CUDA
``max_memory_allocated()`` minus ``memory_allocated()`` before the step. Static state
(parameters, optimizer moments) is reported separately. A real run also draws the record into
``results/autograd_overhead.png`` (``--plot-only`` redraws it from the JSON).

    python benchmarks/autograd_overhead.py                 # CPU, about 2 minutes on 1 thread
    python benchmarks/autograd_overhead.py --device cuda   # GPU, fp32 + bf16 autocast
    python benchmarks/autograd_overhead.py --smoke         # seconds, for CI
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torch_dad as td
from _common import draw_record, environment, median_time, pyplot, run_config, run_title, save_figure, write_run

SYSTEMS = ("linear+adamw", "linear+adamw-fused", "dad-inplace", "dad-grad", "dad-inplace-late")
TRITON_SYSTEM = "dad-inplace-triton"
WORKLOADS: dict[str, dict[str, int]] = {
    "seqcls": {"batch": 32, "seq": 64, "dim": 128, "classes": 2, "layers": 2},
    "lmhead": {"batch": 4, "seq": 256, "dim": 256, "classes": 8192},
    "hidden": {"batch": 4, "seq": 256, "dim": 256, "classes": 10, "width": 1024},
}
GPU_WORKLOADS: dict[str, dict[str, int]] = {  # the baseline's LM-head probe size: 8192 tokens, vocab 49152
    "seqcls": {"batch": 256, "seq": 128, "dim": 384, "classes": 2, "layers": 6},
    "lmhead": {"batch": 8, "seq": 1024, "dim": 576, "classes": 49152},
    "hidden": {"batch": 8, "seq": 1024, "dim": 1024, "classes": 10, "width": 4096},
}
SMOKE: dict[str, dict[str, int]] = {
    "seqcls": {"batch": 4, "seq": 8, "dim": 16, "classes": 2, "layers": 1},
    "lmhead": {"batch": 2, "seq": 8, "dim": 16, "classes": 64},
    "hidden": {"batch": 2, "seq": 8, "dim": 16, "classes": 10, "width": 32},
}


def systems(workload: str, device: torch.device) -> tuple[str, ...]:
    """The systems measured on ``workload``: the Triton one only where its kernel runs."""
    if workload == "hidden" and device.type == "cuda":
        from torch_dad.kernels import triton_available

        if triton_available():
            return (*SYSTEMS, TRITON_SYSTEM)
    return SYSTEMS


def cpu_step_peak(step: Any) -> int:
    """Peak bytes allocated during ``step()`` above the start, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def cuda_step_peak(step: Any) -> int:
    """``max_memory_allocated`` during ``step()`` minus the allocation before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def build(workload: str, shape: dict[str, int], device: torch.device) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(features_fn, inputs, labels)``: a frozen backbone and one fixed batch."""
    torch.manual_seed(0)
    b, t, d = shape["batch"], shape["seq"], shape["dim"]
    if workload == "seqcls":
        layer = torch.nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        encoder = torch.nn.TransformerEncoder(layer, shape["layers"], enable_nested_tensor=False)
        embed = torch.nn.Embedding(1000, d)
        backbone = torch.nn.ModuleDict({"embed": embed, "encoder": encoder}).to(device).requires_grad_(False)
        inputs = torch.randint(0, 1000, (b, t), device=device)
        labels = torch.randint(0, shape["classes"], (b,), device=device)

        def features(ids: torch.Tensor) -> torch.Tensor:
            return backbone["encoder"](backbone["embed"](ids)).mean(1)

        return features, inputs, labels
    inputs = torch.randn(b, t, d, device=device)
    labels = torch.randint(0, shape["classes"], (b, t), device=device)
    labels[torch.rand(b, t, device=device) < 0.1] = -100
    return (lambda x: x), inputs, labels


def make_step(
    system: str,
    features: Any,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    classes: int,
    dim: int,
    device: torch.device,
    amp: torch.dtype | None,
    width: int | None = None,
) -> tuple[Any, Any, int]:
    """``(step, last_loss, static_bytes)`` for one system; every head starts from the same init.

    With ``width`` the trained part is a hidden ReLU layer of ``width`` units and then the head.
    """
    torch.manual_seed(1)
    hidden = torch.nn.Linear(dim, width, device=device) if width else None
    linear = torch.nn.Linear(width or dim, classes, device=device)
    head: torch.nn.Module = linear if hidden is None else torch.nn.Sequential(hidden, torch.nn.ReLU(), linear)
    fused = system != "linear+adamw"
    inplace = system in ("dad-inplace", "dad-inplace-late", TRITON_SYSTEM)
    if system.startswith("dad"):
        update = "inplace" if inplace else "grad"
        dad = td.DADAutogradLinear.from_linear(linear, classes, update=update)
        dad.early_gradients = False if system == "dad-inplace-late" else None
        head = dad
        if hidden is not None:
            backend = "triton" if system == TRITON_SYSTEM else "torch"
            local = td.DADAutogradLinear.from_linear(hidden, classes, activation="relu", update=update, backend=backend)
            local.early_gradients = dad.early_gradients
            head = torch.nn.Sequential(local, dad)
    opt = None if inplace else torch.optim.AdamW(head.parameters(), lr=1e-3, fused=fused)
    losses: list[torch.Tensor] = []

    def compute_loss() -> torch.Tensor:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            logits = head(features(inputs))
            return F.cross_entropy(logits.float().reshape(-1, classes), labels.reshape(-1))

    def step() -> None:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for module in head.modules():
            if isinstance(module, td.DADAutogradLinear):
                module.set_y_context(labels)
        loss = compute_loss()
        loss.backward()
        if opt is not None:
            opt.step()
        losses[:] = [loss.detach()]

    def static_bytes() -> int:
        tensors = [*head.parameters(), *head.buffers()]
        if opt is not None:
            tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    return step, (lambda: float(losses[0])), static_bytes


def measure(
    workload: str, shape: dict[str, int], dtype: str, device: torch.device, smoke: bool, repeats: int
) -> list[dict[str, Any]]:
    """Time and measure every system on one workload; one record per system."""
    amp = {"fp32": None, "bf16": torch.bfloat16}[dtype]
    features, inputs, labels = build(workload, shape, device)
    names = systems(workload, device)
    steps = {
        s: make_step(s, features, inputs, labels, shape["classes"], shape["dim"], device, amp, shape.get("width"))
        for s in names
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    warmup, repeats, rounds = (1, 2, 1) if smoke else (3, repeats, 3)
    times: dict[str, list[float]] = {s: [] for s in names}
    for _ in range(rounds):
        for system, (step, _, _) in steps.items():
            times[system].append(median_time(step, warmup=warmup, repeats=repeats, sync=sync))
    records = []
    for system, (step, last_loss, static_bytes) in steps.items():
        peak = cuda_step_peak(step) if device.type == "cuda" else cpu_step_peak(step)
        records.append(
            {
                "workload": workload,
                **shape,
                "dtype": dtype,
                "system": system,
                "step_ms": statistics.median(times[system]) * 1e3,
                "peak_step_bytes": peak,
                "static_bytes": static_bytes(),
                "final_loss": last_loss(),
                "steps": rounds * (warmup + repeats) + 1,
            }
        )
    return records


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Two panels over every run's workloads and dtypes: each system's step time and step peak memory as a
    multiple of ``linear+adamw-fused`` (the line at 1)."""
    plt = pyplot()
    cells = _cells(runs)
    if plt is None or not cells:
        return False
    names = [s for s in (*SYSTEMS, TRITON_SYSTEM) if s != "linear+adamw-fused"]
    drawn = [s for s in names if any(s in cell for _, cell in cells)]
    width = 0.8 / len(drawn)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.3 * len(cells)), 7), sharex=True)
    for k, system in enumerate(drawn):
        index = [i for i, (_, cell) in enumerate(cells) if system in cell]
        for ax, key in zip(axes, ("time_vs_fused_adamw", "peak_vs_fused_adamw")):
            ax.bar([i + (k - (len(drawn) - 1) / 2) * width for i in index], [cells[i][1][system][key] for i in index],
                   width, label=system, color="tab:gray" if system == "linear+adamw" else f"C{names.index(system)}")
    for ax, label in zip(axes, ("step time (x baseline)", "step peak memory (x baseline)")):
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=len(drawn), loc="upper left")
    axes[0].margins(y=0.15)  # room for the legend
    axes[1].set_xticks(range(len(cells)), [label for label, _ in cells], fontsize=8)
    titles = "; ".join(dict.fromkeys(run_title(run) for run in runs))
    title = f"DADAutogradLinear against nn.Linear + fused AdamW (baseline, dashed at 1)\n{titles}"
    return save_figure(fig, title, path, fontsize=10)


def _cells(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """``(label, {system: row})`` per run, workload and dtype, the label naming the device."""
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        device = run["environment"].get("device", "?")
        device = "CPU" if device.startswith("cpu") else device.removeprefix("NVIDIA ")
        for row in run["results"]:
            cells.setdefault(f"{row['workload']}\n{row['dtype']}\n{device}", {})[row["system"]] = row
    return list(cells.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: the shared 2-core box)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--plot-only", action="store_true", help="redraw results/autograd_overhead.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("autograd_overhead", plot))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for but CUDA is not available")
    dtypes = ["fp32", "bf16"] if device.type == "cuda" and not args.smoke else ["fp32"]
    env = {**environment(), "threads": args.threads if device.type == "cpu" else None}
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
        env["load_average"] = os.getloadavg()[0]
    table = SMOKE if args.smoke else GPU_WORKLOADS if device.type == "cuda" else WORKLOADS
    shapes = {k: v for k, v in table.items() if k in args.workloads}
    records = []
    for workload, shape in shapes.items():
        for dtype in dtypes:
            rows = measure(workload, shape, dtype, device, args.smoke, args.repeats)
            base = next(r for r in rows if r["system"] == "linear+adamw-fused")
            for r in rows:
                r["time_vs_fused_adamw"] = r["step_ms"] / base["step_ms"]
                r["peak_vs_fused_adamw"] = r["peak_step_bytes"] / max(base["peak_step_bytes"], 1)
                print(
                    f"{workload:7s} {dtype} {r['system']:20s} {r['step_ms']:9.3f} ms/step (x{r['time_vs_fused_adamw']:.2f})"
                    f"  step peak {r['peak_step_bytes'] / 2**20:8.2f} MiB (x{r['peak_vs_fused_adamw']:.2f})"
                    f"  static {r['static_bytes'] / 2**20:7.2f} MiB  loss {r['final_loss']:.4f}"
                )
            records += rows
    config = run_config(args, parser, exclude=["plot_only"])
    print("wrote", write_run("autograd_overhead", records, config=config, smoke=args.smoke, env=env))
    if not args.smoke:
        print("plot:", draw_record("autograd_overhead", plot))


if __name__ == "__main__":
    main()
