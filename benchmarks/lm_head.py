"""LM-head training step: HF unfused ``lm_head`` + AdamW against the DAD fused head (peak memory, step time).

Shape of SmolLM2-135M's head: vocab 49152, hidden 576, 8192 tokens, bf16 compute, float32 master
weights and AdamW moments for both systems. Systems:

- ``hf-adamw``: ``logits = h @ W.T`` under bf16 autocast, ``F.cross_entropy(logits.float(), y)``,
  ``backward``, ``torch.optim.AdamW(fused=True)`` (5,773 MiB peak on the H200);
- ``dad-fused``: ``DADLMHead`` on backend ``auto``: chunked fused loss + update in backward, no full logits;
- ``dad-fused-<backend>[-c<rows>]``: each available backend (torch, triton, liger, cce), torch chunk sizes
  (``--chunks``) and triton chunk sizes (``--triton-chunks``: 512, 1024, 2048); on CPU (``--smoke``) the
  CUDA-only rows are skipped with the reason printed;
- ``dad-fused+dh``: ``dad-fused`` that also returns ``dL/dhidden`` (``backprop_gradients=True``), for LoRA.

``peak_mib`` = ``torch.cuda.max_memory_allocated`` during one step after warm-up (static weights,
moments and data included); ``step_ms`` = median of CUDA-event timed steps after
warm-up (p20/p80 too). Writes ``results/lm_head.json`` (or ``--out``).

    python benchmarks/lm_head.py                 # H200: about a minute
    python benchmarks/lm_head.py --smoke         # CPU, seconds, tiny shapes (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import cuda_step_memory, environment, write_records
from torch_dad.nn.lm_head import DADLMHead
from torch_dad.ops.linear_cross_entropy import CUDA_PREFERENCE, resolve_backend


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(step: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """Peak memory of one step after warm-up and the median step time (CUDA events on GPU)."""
    for _ in range(warmup):
        step()
    peak = base = None
    if device.type == "cuda":
        base, peak = cuda_step_memory(step)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
    return {
        "peak_mib": None if peak is None else peak / 2**20,
        "base_mib": None if base is None else base / 2**20,
        "step_ms": statistics.median(samples),
        "step_ms_p20": _percentile(samples, 0.2),
        "step_ms_p80": _percentile(samples, 0.8),
        "repeats": repeats,
    }


def hf_adamw(vocab: int, hidden: int, h: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> Callable[[], None]:
    """The unfused HF step: full logits, float32 CE, backprop, fused AdamW."""
    device = h.device
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, device=device) * 0.02)
    opt = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01, fused=True)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = h @ weight.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def dad_fused(vocab: int, hidden: int, h: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, backend: str,
              chunk: int | None = None, grad_hidden: bool = False) -> tuple[Callable[[], None], DADLMHead]:
    """One DAD head step: fused loss forward, in-place AdamW in backward; ``y`` is already shifted."""
    head = DADLMHead(hidden, vocab, lr=1e-3, weight_decay=0.01, backend=backend, chunk_size=chunk,
                     backprop_gradients=grad_hidden, compute_dtype=dtype, device=h.device)
    with torch.no_grad():
        head.weight.normal_(std=0.02)
    x = h.detach().requires_grad_(grad_hidden)

    def step() -> None:
        out = head.fused_loss(x, y, shift=False)
        out.loss.backward()
        if grad_hidden:
            x.grad = None

    return step, head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, seconds")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chunks", type=int, nargs="*", default=[128, 256, 512, 1024])
    parser.add_argument("--triton-chunks", type=int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/lm_head.json)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        vocab, hidden, tokens, dtype, warmup, repeats = 257, 24, 96, torch.float32, 1, 3
        chunks: list[int] = [32]
        triton_chunks: list[int] = [32]
    else:
        if device.type != "cuda":
            sys.exit("the full benchmark needs CUDA; use --smoke on CPU")
        vocab, hidden, tokens, dtype, warmup, repeats = args.vocab, args.hidden, args.tokens, torch.bfloat16, 3, args.repeats
        chunks = args.chunks
        triton_chunks = args.triton_chunks
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype)
    y = torch.randint(0, vocab, (tokens,), device=device)
    env = environment()
    auto = resolve_backend("auto", device)
    systems: list[tuple[str, str | None, Callable[[], Any]]] = [
        ("hf-adamw", None, lambda: (hf_adamw(vocab, hidden, h, y, dtype), None)),
        ("dad-fused", auto, lambda: dad_fused(vocab, hidden, h, y, dtype, "auto")),
        ("dad-fused+dh", auto, lambda: dad_fused(vocab, hidden, h, y, dtype, "auto", grad_hidden=True)),
    ]
    backends = ["torch", "triton"] + ([n for n in ("liger", "cce") if device.type == "cuda"])
    sizes = {"torch": chunks, "triton": triton_chunks}
    for backend in backends:
        try:
            resolve_backend(backend, device)
        except ValueError as exc:
            print(f"skip backend={backend}: {exc}")
            continue
        systems.append((f"dad-fused-{backend}", backend,
                        lambda backend=backend: dad_fused(vocab, hidden, h, y, dtype, backend)))
        for rows in sizes.get(backend, []):
            systems.append((f"dad-fused-{backend}-c{rows}", backend,
                            lambda backend=backend, rows=rows: dad_fused(vocab, hidden, h, y, dtype, backend, rows)))
    records = []
    for name, backend, build in systems:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            step, head = build()
            stats = measure(step, device, warmup, repeats)
            backend = backend if head is None else head.last_backend
        except Exception as exc:  # a library kernel failing on this machine must not hide the other rows
            print(f"{name:24s} FAILED: {type(exc).__name__}: {exc}")
            records.append({"system": name, "backend": backend, "error": f"{type(exc).__name__}: {exc}", **env})
            continue
        del step, head
        record = {"system": name, "backend": backend, "tokens": tokens, "vocab": vocab, "hidden": hidden,
                  "dtype": str(dtype).removeprefix("torch."), **stats, **env}
        records.append(record)
        peak = "n/a" if stats["peak_mib"] is None else f"{stats['peak_mib']:8.0f} MiB"
        print(f"{name:24s} backend={backend or '-':6s} peak {peak}  step {stats['step_ms']:8.3f} ms")
    hf = next(r for r in records if r["system"] == "hf-adamw")
    ours = next(r for r in records if r["system"] == "dad-fused")
    if "error" not in ours and hf.get("peak_mib"):
        print(f"dad-fused/hf-adamw: peak {ours['peak_mib'] / hf['peak_mib']:.3f} (1/6 = 0.167), "
              f"step {ours['step_ms'] / hf['step_ms']:.3f}; CUDA preference {CUDA_PREFERENCE}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(records, indent=2) + "\n")
        print("wrote", args.out)
    else:
        print("wrote", write_records("lm_head", records, args.smoke))


if __name__ == "__main__":
    main()
