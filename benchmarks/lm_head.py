"""LM-head training step at LLM scale: the DAD fused head against the unfused HF head, Liger-Kernel and
cut-cross-entropy, each a whole training step with float32 master weights and fused AdamW (peak memory, step time,
loss agreement), beside a measured floor.

Shapes (``--shapes``): ``smollm2`` (vocab 49152, hidden 576, 8192 tokens) and ``llama3-8b`` (128256 x 4096 x 8192);
bf16 compute. Systems per shape, each without and with ``dL/dhidden`` (``+dh``, what LoRA or a trained trunk needs):

- ``hf-adamw``: ``logits = h @ W.T`` under bf16 autocast, ``F.cross_entropy(logits.float(), y)``, ``backward``,
  ``torch.optim.AdamW(fused=True)``;
- ``liger-adamw``: ``LigerFusedLinearCrossEntropyLoss`` on a bf16 copy of ``W`` (its gradient flows back into the
  float32 master), then fused AdamW; Liger always computes ``dL/dhidden``, so its two rows do the same work;
- ``cce-adamw``: cut-cross-entropy's ``linear_cross_entropy`` the same way;
- ``hf-adamw-graphs`` (``--peer-graphs``): the unfused step captured whole (forward, backward, AdamW with
  ``capturable=True``) as one CUDA graph and replayed, the tuned backprop baseline. Liger-Kernel's and
  cut-cross-entropy's steps cannot be captured: each reads the count of scored labels on the host (liger-kernel
  0.8.5: ``target_mask.sum().item()`` in ``fused_linear_cross_entropy_forward``; cut-cross-entropy 25.1.1:
  ``(targets != ignore_index).nonzero()`` in ``_build_flat_valids``), which a capturing stream refuses, so eager is
  their best setting;
- ``dad-fused``: ``DADLMHead`` with its defaults (backend and sweep ``auto``, ``cuda_graphs=None``): fused loss,
  update in backward, no full logits;
- ``floor``: the bare bf16 GEMMs of the step (logits, ``dL/dW``, and ``dL/dh`` for ``+dh``) and one fused AdamW
  over the ``V x D`` float32 weight, each timed alone; their sum bounds any implementation of the step.

``--sweep`` adds ``dad-fused-<backend>[-c<rows>][-w<rows>][+dh]`` for each available backend, chunk size and
``--weight-chunks`` size (first shape only); ``--sweeps tokens vocab recompute`` adds ``dad-fused-<order>[-w<rows>][+dh]``,
the head with ``sweep=<order>`` (each row records the ``sweep`` that ran); ``recompute-graphs`` is ``sweep="recompute"``
with ``cuda_graphs=True``.
On a GPU each system (and each floor) runs in a fresh process, so no allocator cache, CUDA-graph pool or cuBLAS
workspace of another system counts in its memory or slows its step.
``peak_mib`` = ``torch.cuda.max_memory_allocated`` during one step after warm-up (static weights, moments and data
included) plus ``graph_pool_slack_mib``, the CUDA-graph pools' reserved but unallocated memory (replays write
there); ``step_ms`` = median of CUDA-event timed steps after warm-up (p20/p80 too); ``host_ms`` = median host time of
a step started on an idle GPU (a step with ``host_ms`` near ``step_ms`` is bound by its launches).
``loss_30``: every system starts from the same weights and trains ``--loss-steps`` steps over the same 4 cycled
batches; the loss of the last step. ``--profile`` adds ``kernels_ms``: each system's CUDA kernel time per step by
category (GEMMs, cross-entropy, AdamW, casts and copies, reductions and fills, other; ``torch.profiler``). Adds a
run to ``results/lm_head.json`` (or ``--out``) and draws it into ``results/lm_head.png`` (:func:`plot_tradeoff`).

    python benchmarks/lm_head.py                 # H200, both shapes
    python benchmarks/lm_head.py --plot          # redraw results/lm_head.png from the record's last run
    python benchmarks/lm_head.py --smoke         # CPU, seconds, tiny shapes (CI): the CUDA-only peers are skipped
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from _common import (
    RESULTS,
    cuda_step_memory,
    environment,
    fresh_process_json,
    graph_pool_slack,
    kernel_ms_by_kind,
    read_runs,
    run_config,
    write_run,
)
from torch_dad.nn.lm_head import DADLMHead
from torch_dad.ops.linear_cross_entropy import resolve_backend


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(step: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """Peak memory of one step after warm-up and the median step time (CUDA events on GPU)."""
    for _ in range(warmup):
        step()
    peak = base = slack = None
    if device.type == "cuda":
        base, peak = cuda_step_memory(step)
        slack = graph_pool_slack()
        peak += slack
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
    host = []
    for _ in range(5 if device.type == "cuda" else 0):
        # the host's own time per step: from an idle device to step() returning (CPU work and launches;
        # the step's label check then waits for nothing)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "host_ms": statistics.median(host) if host else None,
        "peak_mib": None if peak is None else peak / 2**20,
        "base_mib": None if base is None else base / 2**20,
        "graph_pool_slack_mib": None if slack is None else slack / 2**20,
        "step_ms": statistics.median(samples),
        "step_ms_p20": _percentile(samples, 0.2),
        "step_ms_p80": _percentile(samples, 0.8),
        "repeats": repeats,
    }


SHAPES = {"smollm2": (49152, 576, 8192), "llama3-8b": (128256, 4096, 8192)}
Step = Callable[[], Any]


class Data:
    """The step's input buffers ``h`` (tokens, hidden) and ``y`` (tokens,), refilled in place from ``batches``
    (every system's step reads these same tensors, so one ``load(k)`` switches all of them)."""

    def __init__(self, vocab: int, hidden: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.batches = [
            (torch.randn(tokens, hidden, generator=g).to(device, dtype), torch.randint(0, vocab, (tokens,), generator=g).to(device))
            for _ in range(4)
        ]
        self.h, self.y = (t.clone() for t in self.batches[0])
        self.init = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device)

    def load(self, k: int) -> None:
        h, y = self.batches[k % len(self.batches)]
        self.h.copy_(h)
        self.y.copy_(y)


def _master(data: Data, capturable: bool = False) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """A float32 master copy of the shared initial weights and its fused AdamW (``capturable``: its step
    counter on the device, so that a CUDA graph of the step can replay it)."""
    weight = torch.nn.Parameter(data.init.clone())
    return weight, torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01, fused=data.init.is_cuda,
                                     capturable=capturable)


def whole_step_graph(step: Step, weight: torch.nn.Parameter, opt: torch.optim.Optimizer, data: Data) -> Step:
    """``step`` captured whole (forward, backward, AdamW) as one CUDA graph and replayed: the tuned backprop
    baseline. Warm-up steps on a side stream (torch's recipe for capturing a whole network), then weights and
    optimizer state are put back to their initial values in place, so the replayed steps train from the same
    start as every other system."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    with torch.no_grad():
        weight.copy_(data.init)
        for state in opt.state.values():
            for value in state.values():
                value.zero_()

    def replay() -> torch.Tensor:
        graph.replay()
        return loss

    return replay


def _input(data: Data, grad_hidden: bool) -> torch.Tensor:
    """``h`` as the step's input: a view of the shared buffer that asks for ``dL/dh`` if ``grad_hidden``."""
    return data.h.detach().requires_grad_(grad_hidden)


def _adamw_step(loss: Callable[[], torch.Tensor], x: torch.Tensor, weight: torch.nn.Parameter,
                opt: torch.optim.Optimizer, data: Data, graphs: bool) -> Step:
    """A peer's training step: ``loss().backward()``, the optimizer's step, gradients cleared; returns the loss.
    ``graphs``: the whole step replayed from one CUDA graph (:func:`whole_step_graph`)."""

    def step() -> torch.Tensor:
        value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        x.grad = None
        return value.detach()

    return whole_step_graph(step, weight, opt, data) if graphs else step


def hf_adamw(data: Data, dtype: torch.dtype, grad_hidden: bool, graphs: bool = False) -> tuple[Step, None]:
    """The unfused HF step: full logits, float32 CE, backprop, fused AdamW."""
    weight, opt = _master(data, capturable=graphs)
    x = _input(data, grad_hidden)

    def loss() -> torch.Tensor:
        # no cast cache: the cached bf16 weight would outlive a graph capture's memory pool
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=False):
            logits = x @ weight.t()
        return torch.nn.functional.cross_entropy(logits.float(), data.y)

    return _adamw_step(loss, x, weight, opt, data, graphs), None


def peer_adamw(library: str, data: Data, dtype: torch.dtype, grad_hidden: bool) -> tuple[Step, None]:
    """Liger-Kernel's or cut-cross-entropy's fused linear cross-entropy on a ``dtype`` copy of the float32
    master weight (autograd carries ``dL/dW`` back through the cast), then fused AdamW."""
    if library == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()

        def loss_of(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return liger(w, x, data.y)
    else:
        from cut_cross_entropy import linear_cross_entropy

        def loss_of(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return linear_cross_entropy(x, w, data.y)

    weight, opt = _master(data)
    # Liger computes dL/dW only together with dL/dh: given an h that asks for no gradient it returns none for
    # W either (liger-kernel 0.8.5, ops/fused_linear_cross_entropy.py), and W never trains
    x = _input(data, grad_hidden or library == "liger")

    return _adamw_step(lambda: loss_of(x, weight.to(dtype)), x, weight, opt, data, graphs=False), None


def dad_fused(
    data: Data, dtype: torch.dtype, grad_hidden: bool, backend: str = "auto", chunk: int | None = None,
    weight_chunk: int | None = None, sweep: str = "auto", cuda_graphs: bool | None = None,
) -> tuple[Step, DADLMHead]:
    """One DAD head step: fused loss forward, in-place AdamW in backward; ``y`` is already shifted."""
    vocab, hidden = data.init.shape
    head = DADLMHead(hidden, vocab, lr=1e-3, weight_decay=0.01, backend=backend, chunk_size=chunk,
                     weight_chunk_size=weight_chunk, backprop_gradients=grad_hidden, compute_dtype=dtype,
                     device=data.h.device, sweep=sweep, cuda_graphs=cuda_graphs)
    with torch.no_grad():
        head.weight.copy_(data.init)
    x = _input(data, grad_hidden)

    def step() -> torch.Tensor:
        out = head.fused_loss(x, data.y, shift=False)
        out.loss.backward()
        x.grad = None
        return out.loss.detach()

    return step, head


def floor(data: Data, dtype: torch.dtype, grad_hidden: bool, warmup: int, repeats: int) -> dict[str, Any]:
    """Median times of the step's bare bf16 GEMMs and of one fused AdamW over the float32 weight; their sum."""
    vocab, hidden = data.init.shape
    a, w = data.h.to(dtype), data.init.to(dtype)
    grad_logits = torch.randn(a.shape[0], vocab, device=a.device, dtype=dtype)
    weight, opt = _master(data)
    weight.grad = torch.randn_like(weight)
    parts: dict[str, Step] = {"logits_gemm": lambda: a @ w.t(), "grad_weight_gemm": lambda: grad_logits.t() @ a}
    if grad_hidden:
        parts["grad_hidden_gemm"] = lambda: grad_logits @ w
    parts["adamw"] = opt.step
    times = {f"{name}_ms": measure(part, a.device, warmup, repeats)["step_ms"] for name, part in parts.items()}
    return {"step_ms": sum(times.values()), "peak_mib": None, **times}


def loss_after(step: Step, data: Data, steps: int) -> float:
    """The loss of the last of ``steps`` steps over the cycled batches (then the first batch is loaded back)."""
    loss = torch.zeros(())
    for k in range(steps):
        data.load(k)
        loss = step()
    data.load(0)
    return float(loss)


def systems_for(dtype: torch.dtype, device: torch.device, sweep: dict[str, list[int]],
                weight_chunks: Sequence[int] = (), orders: Sequence[str] = (),
                peer_graphs: bool = False) -> list[tuple[str, Callable[[Data], Any]]]:
    """``(name, build)`` of every system of one shape; ``build(data)`` returns ``(step, head or None)``.
    ``weight_chunks``: also the DAD head casting its weight that many rows at a time (``-w<rows>``),
    at the default chunk and at every chunk of the sweep. ``orders``: also the DAD head with
    ``sweep=<order>`` (``-<order>``), alone and with each of ``weight_chunks``. ``peer_graphs`` (CUDA): also
    the unfused step replayed whole from a CUDA graph (``hf-adamw-graphs``)."""
    systems: list[tuple[str, Callable[[Data], Any]]] = []
    for dh in (False, True):
        tag = "+dh" if dh else ""
        systems += [(f"hf-adamw{tag}", lambda data, dh=dh: hf_adamw(data, dtype, dh))]
        if peer_graphs and device.type == "cuda":
            systems += [(f"hf-adamw-graphs{tag}", lambda data, dh=dh: hf_adamw(data, dtype, dh, graphs=True))]
        for library in ("liger", "cce"):
            if device.type != "cuda":
                print(f"skip {library}-adamw{tag}: CUDA only")
                continue
            systems += [(f"{library}-adamw{tag}", lambda data, library=library, dh=dh: peer_adamw(library, data, dtype, dh))]
        systems += [(f"dad-fused{tag}", lambda data, dh=dh: dad_fused(data, dtype, dh))]
        systems += [(f"dad-fused-w{w}{tag}", lambda data, dh=dh, w=w: dad_fused(data, dtype, dh, weight_chunk=w))
                    for w in weight_chunks]
        for order in orders:
            # "recompute-graphs": sweep="recompute" with cuda_graphs=True
            options = {"sweep": order.removesuffix("-graphs"), "cuda_graphs": order.endswith("-graphs")}
            systems += [(f"dad-fused-{order}{tag}", lambda data, dh=dh, options=options: dad_fused(data, dtype, dh, **options))]
            systems += [(f"dad-fused-{order}-w{w}{tag}",
                         lambda data, dh=dh, w=w, options=options: dad_fused(data, dtype, dh, weight_chunk=w, **options))
                        for w in weight_chunks]
    for backend, chunks in sweep.items():
        for dh, tag in ((False, ""), (True, "+dh")):
            name = f"dad-fused-{backend}"
            try:  # a backend the library refuses here (CUDA only; cce's half-precision dL/dh) is no system
                resolve_backend(backend, device, grad_input=dh, dtype=dtype)
            except ValueError as exc:
                print(f"skip {name}{tag}: {exc}")
                continue
            systems.append((f"{name}{tag}", lambda data, backend=backend, dh=dh: dad_fused(data, dtype, dh, backend)))
            for rows in chunks:
                systems.append((f"{name}-c{rows}{tag}",
                                lambda data, backend=backend, rows=rows, dh=dh: dad_fused(data, dtype, dh, backend, rows)))
                systems += [(f"{name}-c{rows}-w{w}{tag}",
                             lambda data, backend=backend, rows=rows, w=w, dh=dh: dad_fused(data, dtype, dh, backend, rows, w))
                            for w in weight_chunks]
    return systems


# kernel-name fragments -> category of --profile (first match wins; the rest is "other")
KERNEL_CATEGORIES = (
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "sm80_")),
    ("cross_entropy", ("ce_rows", "cross_entropy", "log_softmax", "softmax", "nll_loss")),
    ("adamw", ("adamw", "adam")),
    ("cast_copy", ("copy", "convert", "to_copy", "cast")),
    ("reduce_fill", ("reduce", "fill", "zero")),
)


def kernel_profile(step: Step, steps: int = 3) -> dict[str, float]:
    """CUDA kernel time per step by category (``KERNEL_CATEGORIES``), in ms, over ``steps`` steps
    under ``torch.profiler``; ``kernels_total`` is their sum (the step's busy time, launch gaps excluded)."""
    return kernel_ms_by_kind(step, KERNEL_CATEGORIES, steps, total="kernels_total")


def run_system(name: str, build: Callable[[Data], Any], data: Data, device: torch.device, warmup: int, repeats: int,
               loss_steps: int, profile: bool = False) -> dict[str, Any]:
    """Time one system, then retrain a fresh copy from the shared weights for the loss-agreement column
    (with ``profile``, also its kernel time by category on CUDA)."""
    gc.collect()  # the last system's head and graphs (autograd keeps reference cycles) before its memory is counted
    if device.type == "cuda":
        # cuBLAS keeps a workspace per stream for the process; a graph capture's stream gets its own (64 MiB on
        # the H200), which would otherwise count in the static memory of every later system
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    try:
        step, head = build(data)
        stats = measure(step, device, warmup, repeats)
        if profile and device.type == "cuda":
            stats["kernels_ms"] = kernel_profile(step)
        backend = None if head is None else head.last_backend
        order = None if head is None else head.last_sweep
        del step, head
        fresh, _ = build(data)
        stats["loss_30"] = loss_after(fresh, data, loss_steps)
        del fresh
    except Exception as exc:  # a library kernel failing on this machine must not hide the other rows
        print(f"{name:24s} FAILED: {type(exc).__name__}: {exc}")
        return {"system": name, "error": f"{type(exc).__name__}: {exc}"}
    return {"system": name, "backend": backend, "sweep": order, **stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, seconds")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--loss-steps", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="also every backend and chunk size (first shape)")
    parser.add_argument("--profile", action="store_true", help="CUDA kernel time per step by category, per system")
    parser.add_argument("--chunks", type=int, nargs="*", default=[128, 256, 512, 1024])
    parser.add_argument("--triton-chunks", type=int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--weight-chunks", type=int, nargs="*", default=[],
                        help="also the DAD head with weight_chunk_size=ROWS (no V x D copy in the compute dtype)")
    parser.add_argument("--sweeps", nargs="*", default=[], choices=["tokens", "vocab", "recompute", "recompute-graphs"],
                        help="also the DAD head with sweep=ORDER (the default is 'auto'; 'recompute-graphs': "
                        "sweep='recompute', cuda_graphs=True)")
    parser.add_argument("--peer-graphs", action="store_true",
                        help="also the unfused step (forward, backward, AdamW) replayed whole from a CUDA graph")
    parser.add_argument("--out", type=Path, default=None, help="record path (default results/lm_head.json)")
    parser.add_argument("--plot", type=Path, nargs="?", const=RESULTS / "lm_head.json", default=None, metavar="RECORD",
                        help="only draw the last run of RECORD (default results/lm_head.json): step time against "
                        "peak memory, into RECORD's .png")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: SHAPE:SYSTEM, JSON on stdout
    args = parser.parse_args()
    if args.plot is not None:
        print("wrote", plot_tradeoff(read_runs(args.plot)[-1]["results"], args.plot.with_suffix(".png")))
        return
    if args.one:
        print(json.dumps(one_system(args, *args.one.split(":", 1))))
        return
    setting = Setting.of(args)
    env = environment()
    records = []
    for shape in setting.shapes:
        # on a GPU each system in a fresh process: no allocator cache, graph pool or cuBLAS workspace of another
        rows = [in_fresh_process(shape, name) if setting.device.type == "cuda" else one_system(args, shape, name)
                for name in setting.system_names(shape)]
        for row in rows:
            vocab, hidden, tokens = setting.shapes[shape]
            row.update(shape=shape, tokens=tokens, vocab=vocab, hidden=hidden,
                       dtype=str(setting.dtype).removeprefix("torch."), **env)
            report(row)
        records += rows
    path = write_run("lm_head", records, config=run_config(args, parser, exclude=["plot", "one"]), smoke=args.smoke,
                     out=args.out, env=env)
    print("wrote", path)
    if not args.smoke and args.out is None:
        print("wrote", plot_tradeoff(records, path.with_suffix(".png")))


@dataclass
class Setting:
    """What a run measures: its shapes (name -> vocab, hidden, tokens), dtype, device, warm-up and repeats, and the
    systems' options from the command line."""

    args: argparse.Namespace
    shapes: dict[str, tuple[int, int, int]]
    dtype: torch.dtype
    device: torch.device
    warmup: int
    repeats: int
    sweep: dict[str, list[int]]

    @classmethod
    def of(cls, args: argparse.Namespace) -> Setting:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        if args.smoke:
            return cls(args, {"smoke": (257, 24, 96)}, torch.float32, device, 1, 3, {"torch": [32], "triton": [32]})
        if device.type != "cuda":
            sys.exit("the full benchmark needs CUDA; use --smoke on CPU")
        sweep = {"torch": args.chunks, "triton": args.triton_chunks, "liger": [], "cce": []} if args.sweep else {}
        return cls(args, {k: SHAPES[k] for k in args.shapes}, torch.bfloat16, device, 3, args.repeats, sweep)

    def systems(self, shape: str) -> list[tuple[str, Callable[[Data], Any]]]:
        """The systems of ``shape`` (the backend and chunk sweep on the first shape only)."""
        first = shape == next(iter(self.shapes))
        args = self.args
        return systems_for(self.dtype, self.device, self.sweep if first else {}, args.weight_chunks, args.sweeps,
                           args.peer_graphs)

    def system_names(self, shape: str) -> list[str]:
        return [name for name, _ in self.systems(shape)] + ["floor", "floor+dh"]


def one_system(args: argparse.Namespace, shape: str, name: str) -> dict[str, Any]:
    """The row of system ``name`` at ``shape``, measured in this process."""
    setting = Setting.of(args)
    data = Data(*setting.shapes[shape], setting.dtype, setting.device)
    if name in ("floor", "floor+dh"):
        return {"system": name, **floor(data, setting.dtype, name.endswith("+dh"), setting.warmup, setting.repeats)}
    build = dict(setting.systems(shape))[name]
    return run_system(name, build, data, setting.device, setting.warmup, setting.repeats, args.loss_steps,
                      args.profile)


def in_fresh_process(shape: str, name: str) -> dict[str, Any]:
    """:func:`one_system` in a child process with this command's arguments."""
    try:
        return fresh_process_json([sys.executable, __file__, *sys.argv[1:], "--one", f"{shape}:{name}"])
    except RuntimeError as exc:  # a library failing on this machine must not hide the other rows
        print(exc, file=sys.stderr)
        return {"system": name, "error": str(exc)[-500:]}


PEERS = ("liger-adamw", "cce-adamw")


def targets(rows: list[dict[str, Any]], tag: str) -> tuple[float, float] | None:
    """``(allowed ms, allowed MiB)`` of one cell: time at most max(0.85 x the fastest fused peer, 1.15 x the
    floor), peak at most the lowest fused peer's; ``None`` if a peer or the floor is missing."""
    by_name = {r["system"]: r for r in rows if "error" not in r}
    peers = [by_name[p + tag] for p in PEERS if p + tag in by_name]
    floor_row = by_name.get("floor" + tag)
    if not peers or floor_row is None:
        return None
    allowed_ms = max(0.85 * min(r["step_ms"] for r in peers), 1.15 * floor_row["step_ms"])
    return allowed_ms, min(r["peak_mib"] for r in peers)


def plot_tradeoff(records: list[dict[str, Any]], out: Path) -> Path | None:
    """Step time against peak memory, one panel per shape and ``dL/dh`` setting: every DAD setting of the
    record, the peers, and the region where both targets of :func:`targets` hold (shaded)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.patches
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: plot skipped")
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 5 * len(shapes)), squeeze=False)
    for ax, (shape, tag) in zip(axes.flat, [(shape, tag) for shape in shapes for tag in ("", "+dh")]):
        cell = [r for r in records if r["shape"] == shape]
        rows = [r for r in cell if r.get("peak_mib") is not None and "error" not in r
                and r["system"].endswith(tag) and (tag or not r["system"].endswith("+dh"))]
        _tradeoff_panel(ax, rows, tag, targets(cell, tag), matplotlib.patches.Rectangle)
        ax.set_title(f"{shape}{' with dL/dh' if tag else ''}", fontsize=9)
    fig.suptitle("DAD head settings (blue: sweep, c = rows per chunk, w = weight rows per cast) and peers (red); "
                 "green: both targets met", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _tradeoff_panel(ax: Any, rows: list[dict[str, Any]], tag: str, goal: tuple[float, float] | None,
                    rectangle: Any) -> None:
    """One panel of :func:`plot_tradeoff`: the DAD head on the Triton backend at each chunk / weight-slice
    setting, the fused peers, the targets' region; the unfused head (far to the right) and the other DAD
    backends are left out."""
    if goal is not None:
        allowed_ms, allowed_mib = goal
        ax.add_patch(rectangle((0, 0), allowed_mib, allowed_ms, color="tab:green", alpha=0.12))
        ax.axhline(allowed_ms, color="tab:green", lw=0.8, ls="--")
        ax.axvline(allowed_mib, color="tab:green", lw=0.8, ls="--")
    points = [(r, r["system"].removesuffix(tag)) for r in rows]
    points = [(r, name) for r, name in points if name in PEERS or name.startswith("dad-fused")
              and name not in ("dad-fused-triton", "dad-fused-torch", "dad-fused-liger", "dad-fused-cce")]
    for r, name in points:
        peer = name in PEERS
        ax.scatter(r["peak_mib"], r["step_ms"], s=18, color="tab:red" if peer else "tab:blue")
        label = name.removesuffix("-adamw") if peer else name.removeprefix("dad-fused").removeprefix("-triton")
        ax.annotate(label.lstrip("-") or "default", (r["peak_mib"], r["step_ms"]), fontsize=7,
                    xytext=(3, 2), textcoords="offset points")
    mib = [r["peak_mib"] for r, _ in points] + ([goal[1]] if goal else [])
    ms = [r["step_ms"] for r, _ in points] + ([goal[0]] if goal else [])
    ax.set_xlim(min(mib) - 0.04 * (max(mib) - min(mib)), max(mib) + 0.12 * (max(mib) - min(mib)))
    ax.set_yscale("log")
    ax.set_ylim(0.9 * min(ms), 1.1 * max(ms))
    ax.set_xlabel("peak MiB")
    ax.set_ylabel("step ms")


def report(row: dict[str, Any]) -> None:
    if "error" in row:
        return
    peak = "n/a" if row.get("peak_mib") is None else f"{row['peak_mib']:8.0f} MiB"
    loss = "" if row.get("loss_30") is None else f"  loss_30 {row['loss_30']:.4f}"
    print(f"{row['shape']:10s} {row['system']:24s} peak {peak}  step {row['step_ms']:8.3f} ms{loss}")


if __name__ == "__main__":
    main()
