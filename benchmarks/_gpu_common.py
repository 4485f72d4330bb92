"""Shared pieces of the GPU benchmarks: topologies, the tuned backprop baseline, CUDA-event timing."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import torch_dad as td
from _common import DADMLP, backprop_mlp

# name: (input width, hidden widths, classes); the four topologies of docs/benchmarks.md
TOPOLOGIES: dict[str, tuple[int, list[int], int]] = {
    "mnist-medium-3": (784, [1024, 512, 256], 10),
    "fmnist-wide-2": (784, [4096, 4096], 10),
    "cifar10-medium-3": (3072, [1024, 512, 256], 10),
    "deep-8x1024": (3072, [1024] * 8, 10),
}


#: a training recipe's options, the same for DAD and backprop (see ``recipe_from_spec``)
Recipe = dict[str, Any]
RECIPE_DEFAULTS: Recipe = {"act": "relu", "norm": None, "ls": 0.0, "dropout": 0.0}


def recipe_from_spec(spec: str) -> Recipe:
    """``"act=leaky_relu,norm=batchnorm,ls=0.1,dropout=0.1"`` -> a recipe (absent keys keep
    :data:`RECIPE_DEFAULTS`; ``norm=none`` is no normalisation)."""
    recipe = dict(RECIPE_DEFAULTS)
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in recipe:
            raise ValueError(f"recipe key {key!r} must be one of {', '.join(recipe)}")
        recipe[key] = float(value) if key in ("ls", "dropout") else (None if value == "none" else value)
    return recipe


def recipe_name(recipe: Recipe) -> str:
    """A short tag such as ``leaky_relu+batchnorm+ls0.1+do0.1`` (``plain`` for the defaults)."""
    parts = [recipe["act"]] if recipe["act"] != "relu" else []
    parts += [recipe["norm"]] if recipe["norm"] else []
    parts += [f"ls{recipe['ls']:g}"] if recipe["ls"] else []
    parts += [f"do{recipe['dropout']:g}"] if recipe["dropout"] else []
    return "+".join(parts) or "plain"


def flop_ratio(n_in: int, widths: Sequence[int], classes: int) -> float:
    """Backprop/DAD FLOPs per sample: backprop 3 GEMMs per layer minus dL/dx of the first; DAD 2
    per layer plus the local heads' forward, d_logits W_loc and g_W_loc (3 thin GEMMs each)."""
    dims = [n_in, *widths, classes]
    macs = [a * b for a, b in zip(dims[:-1], dims[1:])]
    backprop = 3 * sum(macs) - macs[0]
    dad = 2 * sum(macs) + 3 * sum(w * classes for w in widths)
    return backprop / dad


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(step: Callable[[int], Any], steps: int, seconds: float = 0.0) -> None:
    """``steps`` calls, then more until ``seconds`` of wall time have passed: the GPU's clocks sit
    low after idle or host-bound phases (compiles, captures), and a short warm-up timed the
    first system of a run at up to 1.3x its steady step (H200, mnist-medium-3 B=1024: 123.5 us
    measured first in its group vs 101-103 us for the same step measured later)."""
    import time

    for i in range(steps):
        step(i)
    cuda_sync()
    start, i = time.perf_counter(), steps
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            step(i)
            i += 1
        cuda_sync()


def time_steps(step: Callable[[int], Any], steps: int, repeats: int, warmup: int, warmup_s: float = 0.0) -> float:
    """Median seconds per step: CUDA events around ``steps`` calls, ``repeats`` times, after warm-up
    (``warmup`` calls and at least ``warmup_s`` seconds)."""
    warm_up(step, warmup, warmup_s)
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(steps):
                step(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / steps)
        else:
            import time

            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            samples.append((time.perf_counter() - t0) / steps)
    return statistics.median(samples)


def make_data(n_in: int, classes: int, batch: int, pool: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool`` batches of random fp32 inputs and labels resident on ``device`` (rotated, never zeros)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(pool * batch, n_in, generator=g).to(device)
    y = torch.randint(0, classes, (pool * batch,), generator=g).to(device)
    return x, y


def dad_system(n_in: int, widths: Sequence[int], classes: int, device: torch.device, backend: str,
               amp: torch.dtype | None, head: str = "sample", recipe: Recipe | None = None,
               ) -> tuple[td.DADTrainer, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """The quickstart MLP (DAD hidden layers + classifier) and its ``DADTrainer.step``.

    ``head`` says what ``step`` keeps for ``solve_head()``: ``"sample"`` (the default
    ``classifier_sample_size=4096`` reservoir of input rows), ``"gram"`` (the streamed Gram statistics
    ``H^T H``: a d x d x B GEMM that backprop never does, as large as a layer's GEMM when
    d = 4096) or ``"none"`` (the training step alone). ``recipe`` (activation, normalisation,
    label smoothing of the local losses and the classifier, dropout) defaults to plain relu."""
    if head not in ("sample", "gram", "none"):
        raise ValueError(f"head={head!r} must be 'sample', 'gram' or 'none'")
    r = recipe or RECIPE_DEFAULTS
    model = DADMLP([n_in, *widths], num_classes=classes, activation=r["act"], normalize=r["norm"],
                   label_smoothing=r["ls"])
    # on_nonfinite='ignore' (the CUDA default) so that CPU smoke runs take the fused step too
    trainer = td.DADTrainer(model, device=device, lr=1e-3, amp_dtype=amp, backend=backend, on_nonfinite="ignore",
                            accumulate_classifier_statistics=head == "gram",
                            classifier_sample_size=4096 if head == "sample" else 0,
                            dropout=r["dropout"], classifier_label_smoothing=r["ls"])
    return trainer, trainer.step


def _backprop_model(n_in: int, widths: Sequence[int], classes: int, recipe: Recipe | None) -> torch.nn.Module:
    r = recipe or RECIPE_DEFAULTS
    return backprop_mlp([n_in, *widths], classes, activation=r["act"], normalize=r["norm"], dropout=r["dropout"])


def backprop_eager(n_in: int, widths: Sequence[int], classes: int, device: torch.device,
                   amp: torch.dtype | None, recipe: Recipe | None = None) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The same MLP trained by backprop, autocast, fused AdamW, op by op."""
    model = _backprop_model(n_in, widths, classes, recipe).to(device)
    smoothing = (recipe or RECIPE_DEFAULTS)["ls"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = F.cross_entropy(model(xb), yb, label_smoothing=smoothing)
        loss.backward()
        opt.step()

    return step


def capture(body: Callable[[], None], warmup: int = 3) -> Callable[[], None]:
    """``body`` run ``warmup`` times on a side stream (allocations, fused-kernel selection, as CUDA
    graphs require; these runs do their work, e.g. train), then captured; returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


class GraphedBackprop:
    """A model trained end to end: ``cross_entropy(model(x), y, label_smoothing).backward()`` and AdamW
    (``weight_decay=0`` is Adam), under bf16 autocast with ``amp``. On CUDA the optimizer is fused and capturable
    with its lr a device tensor, and the step of a ``batch``-row batch is one CUDA graph; the capture's warm-up
    steps are undone (weights, buffers such as batch-norm statistics, optimizer state). Dropout then draws from
    torch's graph-safe generator. Other batch sizes, every step on CPU, and every step with ``graph=False`` (the
    eager baseline: fused AdamW, not capturable) run op by op. Inputs are ``(batch, *shape)`` of ``input_dtype``
    (``torch.int64`` for token ids)."""

    def __init__(
        self, model: torch.nn.Module, shape: Sequence[int], batch: int, device: torch.device, *, lr: float,
        weight_decay: float = 0.0, smoothing: float = 0.0, amp: torch.dtype | None = None,
        input_dtype: torch.dtype = torch.float32, graph: bool = True,
    ) -> None:
        self.model, self.amp, self.smoothing = model.to(device), amp, smoothing
        cuda = device.type == "cuda"
        graphed = cuda and graph
        # a tensor lr so that the captured step reads the schedule's value at every replay
        rate: float | torch.Tensor = torch.tensor(lr, device=device) if graphed else lr
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=rate, weight_decay=weight_decay, fused=cuda, capturable=graphed
        )
        self.lr = lr
        self.x = torch.zeros(batch, *shape, dtype=input_dtype, device=device)
        self.y = torch.zeros(batch, dtype=torch.long, device=device)
        self.replay = self._capture() if graphed else None

    def _body(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=False)
        # no autocast weight cache: a CUDA graph must recast the weights AdamW updated at every replay
        with torch.autocast(x.device.type, self.amp or torch.float32, enabled=self.amp is not None,
                            cache_enabled=False):
            loss = F.cross_entropy(self.model(x), y, label_smoothing=self.smoothing)
        loss.backward()
        self.opt.step()

    def _capture(self) -> Callable[[], None]:
        initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        replay = capture(lambda: self._body(self.x, self.y))
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(initial[k])
            for state in self.opt.state.values():
                for v in state.values():
                    v.zero_()
        return replay

    def set_lr(self, lr: float) -> None:
        """The lr of the next steps; on CUDA one ``fill_`` of the graph's lr tensor, only when it changes."""
        if lr == self.lr:
            return
        self.lr = lr
        group = self.opt.param_groups[0]
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
        """One step at ``lr`` on ``(x, y)``: the graph's replay for a full batch on CUDA."""
        self.set_lr(lr)
        if self.replay is not None and x.shape == self.x.shape:
            self.x.copy_(x)
            self.y.copy_(y)
            self.replay()
        else:
            self._body(x, y)

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Test accuracy in eval mode, 4096 rows at a time."""
        self.model.eval()
        correct = sum(
            int((self.model(x[i : i + 4096]).argmax(1) == y[i : i + 4096]).sum()) for i in range(0, len(x), 4096)
        )
        self.model.train()
        return correct / len(x)


def backprop_graphed(n_in: int, widths: Sequence[int], classes: int, device: torch.device,
                     amp: torch.dtype | None, batch: int, recipe: Recipe | None = None,
                     ) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """Tuned backprop: forward, backward and fused AdamW (capturable, lr 1e-3, weight decay 0.01) in one CUDA
    graph (:class:`GraphedBackprop`; dropout draws from torch's graph-safe generator)."""
    system = GraphedBackprop(
        _backprop_model(n_in, widths, classes, recipe), (n_in,), batch, device, lr=1e-3, weight_decay=0.01,
        smoothing=(recipe or RECIPE_DEFAULTS)["ls"], amp=amp,
    )
    return functools.partial(system.step, lr=1e-3)
