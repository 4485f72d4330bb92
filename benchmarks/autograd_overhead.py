"""Overhead of a ``DADAutogradLinear`` head against ``nn.Linear`` + AdamW on the same frozen backbone.

One training step = the user's loop: ``zero_grad``, forward (frozen backbone, then the head),
``F.cross_entropy``, ``backward``, ``optimizer.step()``. Systems, all from the same initial
head weights and the same batch:

* ``linear+adamw``: ``nn.Linear`` + ``torch.optim.AdamW`` (defaults: foreach);
* ``linear+adamw-fused``: ``nn.Linear`` + ``AdamW(fused=True)``, the tuned baseline;
* ``dad-inplace``: ``DADAutogradLinear`` (head role), its own fused AdamW in backward;
* ``dad-grad``: ``DADAutogradLinear(update="grad")`` + ``AdamW(fused=True)``.

Workloads: ``seqcls``, a frozen 2-layer transformer encoder (d=128) mean-pooled into a
2-class head (the HF head-tuning case; the backbone forward dominates); ``lmhead``, frozen
token features (B, T, D) into a vocab-sized head with 10% of the labels ``-100`` (the head is
the whole step). Each system runs in its own subprocess so the memory peaks do not mix
(``--smoke`` runs them in-process: its memory figures mean nothing):
peak = highest RSS during the timed steps (Linux ``VmHWM`` after a reset through
``/proc/self/clear_refs``) minus RSS before them, on CPU; ``max_memory_allocated`` minus
allocated before, on CUDA. Both are measured after the warm-up, so AdamW's lazily created
moments count as static state, not as peak. Time: median over interleaved rounds of the
median of ``repeats`` steps after a warm-up (CUDA: synchronised).

    python benchmarks/autograd_overhead.py                 # CPU, about 2 minutes on 1 thread
    python benchmarks/autograd_overhead.py --device cuda   # GPU, fp32 and bf16 autocast
    python benchmarks/autograd_overhead.py --smoke         # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torch_dad as td
from _common import environment, median_time, write_records

SYSTEMS = ("linear+adamw", "linear+adamw-fused", "dad-inplace", "dad-grad")
WORKLOADS: dict[str, dict[str, int]] = {
    "seqcls": {"batch": 32, "seq": 64, "dim": 128, "classes": 2, "layers": 2},
    "lmhead": {"batch": 8, "seq": 256, "dim": 256, "classes": 16384},
}
SMOKE: dict[str, dict[str, int]] = {
    "seqcls": {"batch": 4, "seq": 8, "dim": 16, "classes": 2, "layers": 1},
    "lmhead": {"batch": 2, "seq": 8, "dim": 16, "classes": 64},
}


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


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


def make_step(system: str, features: Any, inputs: torch.Tensor, labels: torch.Tensor, classes: int,
              dim: int, device: torch.device, amp: torch.dtype | None) -> tuple[Any, Any]:
    """``(step, last_loss)`` closures for one system; the head starts from the same init for all."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(dim, classes, device=device)
    head: torch.nn.Module = linear
    fused = system != "linear+adamw"
    if system.startswith("dad"):
        update = "inplace" if system == "dad-inplace" else "grad"
        head = td.DADAutogradLinear.from_linear(linear, classes, update=update)
    opt = None if system == "dad-inplace" else torch.optim.AdamW(head.parameters(), lr=1e-3, fused=fused)
    losses: list[torch.Tensor] = []

    def step() -> None:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        if isinstance(head, td.DADAutogradLinear):
            head.set_y_context(labels)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            logits = head(features(inputs))
            loss = F.cross_entropy(logits.float().reshape(-1, classes), labels.reshape(-1))
        loss.backward()
        if opt is not None:
            opt.step()
        losses[:] = [loss.detach()]

    return step, (lambda: float(losses[0]))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time and measure one (workload, system, dtype) in this process."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    shapes = SMOKE if args.smoke else WORKLOADS
    shape = shapes[args.workload]
    amp = {"fp32": None, "bf16": torch.bfloat16}[args.dtype]
    features, inputs, labels = build(args.workload, shape, device)
    step, last_loss = make_step(args.system, features, inputs, labels, shape["classes"], shape["dim"], device, amp)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    warmup, repeats, rounds = (1, 2, 1) if args.smoke else (5, args.repeats, 3)
    for _ in range(warmup):
        step()
    if sync:
        sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        reset = True
    else:
        reset = _reset_peak_rss()
        before = (_rss_kib("VmRSS") or 0) * 1024
    samples = [median_time(step, warmup=0, repeats=repeats, sync=sync) for _ in range(rounds)]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = (_rss_kib("VmHWM") or 0) * 1024 - before if reset else None
    return {"step_ms": statistics.median(samples) * 1e3, "peak_extra_bytes": peak,
            "final_loss": last_loss(), "steps": warmup + repeats * rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: the shared 2-core box)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for but CUDA is not available")
    dtypes = ["fp32", "bf16"] if device.type == "cuda" and not args.smoke else ["fp32"]
    env = {**environment(), "threads": args.threads if device.type == "cpu" else None}
    if device.type == "cpu":
        env["load_average"] = os.getloadavg()[0]
    shapes = SMOKE if args.smoke else WORKLOADS
    records = []
    for workload, shape in shapes.items():
        for dtype in dtypes:
            base = None
            for system in SYSTEMS:
                if args.smoke:  # in-process: a fresh interpreter per system costs ~15 s of imports here
                    result = measure(argparse.Namespace(**{**vars(args), "workload": workload, "system": system,
                                                           "dtype": dtype}))
                else:
                    cmd = [sys.executable, __file__, "--worker", "--workload", workload, "--system", system,
                           "--dtype", dtype, "--device", args.device, "--threads", str(args.threads),
                           "--repeats", str(args.repeats)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
                    result = json.loads(out.splitlines()[-1])
                record = {"workload": workload, **shape, "dtype": dtype, "system": system, **result, **env}
                if system == "linear+adamw-fused":
                    base = record
                records.append(record)
            for record in records[-len(SYSTEMS):]:
                assert base is not None
                record["time_vs_fused_adamw"] = record["step_ms"] / base["step_ms"]
                peak = record["peak_extra_bytes"]
                mib = "n/a" if peak is None else f"{peak / 2**20:8.2f} MiB"
                print(f"{workload:7s} {dtype} {record['system']:20s} {record['step_ms']:8.3f} ms/step "
                      f"(x{record['time_vs_fused_adamw']:.2f})  peak +{mib}  loss {record['final_loss']:.4f}")
    print("wrote", write_records("autograd_overhead", records, args.smoke))


if __name__ == "__main__":
    main()
