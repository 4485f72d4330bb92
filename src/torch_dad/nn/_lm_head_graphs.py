"""CUDA graphs of :class:`~torch_dad.nn.lm_head.DADLMHead`'s recomputing sweep (``cuda_graphs=True``).

Eager, ``sweep="recompute"`` issues a cast, a GEMM and the row kernel per vocabulary slice in forward and a cast,
two or three GEMMs, a softmax kernel and an AdamW kernel per slice in backward. At a small head (the SmolLM2 head's
49152 x 576, 12 slices) the host takes longer to issue them than the GPU to run them. Here each direction is captured
once per input signature and then replayed with one launch.

Per signature (the caller's key: batch shape, dtypes, options, addresses of the weight and optimizer state):

- the first step runs eagerly: it compiles the Triton kernels and warms cuBLAS, and its backward marks the
  signature warm (:meth:`RecomputeGraphs.mark_warm`). Eager steps and captures, forward and backward, run on
  one worker thread and the capture stream (:meth:`RecomputeGraphs.eager`, :func:`~torch_dad.ops.cuda_graphs.
  on_capture_thread`), so they hold one cuBLAS workspace between them, not one per thread;
- the next forward is captured, then the next backward, into graphs that share one memory pool (the backward's
  buffers reuse the forward's);
- from then on both replay. Inputs are copied into the graphs' buffers; what autograd receives is copied out.
  The forward graph takes the labels as given: their shift, range check and count run in it (the head's
  ``fused_loss``), so the host issues two copies and one replay before the forward's kernels start.

A forward while an earlier graphed forward still awaits its backward runs eagerly: the buffers are taken.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..ops.cuda_graphs import capture, capture_stream, on_capture_thread

T = TypeVar("T")

#: signatures remembered as warm before the set is cleared (batch shapes that vary every step never capture)
MAX_WARM = 64


class Pending:
    """Held by a graphed forward's autograd context: while it lives, the graphs' buffers hold that step."""


@dataclass
class GraphedStep:
    """One signature's graphs and their buffers: inputs ``hidden`` (compute dtype), ``labels``, ``lr`` (0-dim
    float32, read by the AdamW kernel), ``scale`` (0-dim float32, the gradient's ``1 / scored tokens``);
    ``outputs`` of the forward run; ``grad_hidden`` of the backward run."""

    hidden: Tensor
    labels: Tensor
    lr: Tensor
    scale: Tensor
    forward: torch.cuda.CUDAGraph
    outputs: Any
    backward: torch.cuda.CUDAGraph | None = None
    grad_hidden: Tensor | None = None
    filled: tuple[float, float] | None = None  # (lr, scale) last written to ``lr`` and ``scale``


class RecomputeGraphs:
    """Forward and backward graphs of one head, keyed by signature, at most ``max_signatures`` (oldest dropped)."""

    def __init__(self, max_signatures: int = 4) -> None:
        self.max_signatures = max_signatures
        self._pool: Any = None
        self._steps: OrderedDict[Hashable, GraphedStep] = OrderedDict()
        self._warm: set[Hashable] = set()
        self._pending: weakref.ref[Pending] | None = None

    def __reduce__(self) -> tuple[type, tuple[int]]:
        # graphs belong to one process and device: a copied or pickled head starts without any
        return (RecomputeGraphs, (self.max_signatures,))

    @property
    def num_graphs(self) -> int:
        """Graphs captured and kept (a forward and a backward count as two)."""
        return sum(1 + (step.backward is not None) for step in self._steps.values())

    def busy(self) -> bool:
        """Whether a graphed forward still awaits its backward."""
        return self._pending is not None and self._pending() is not None

    def eager(self, device: torch.device, run: Callable[[], T]) -> T:
        """``run()``, an eager step of this head, where its graphs are captured (:func:`on_capture_thread`)."""
        return on_capture_thread(device, run)

    def knows(self, key: Hashable) -> bool:
        """Whether ``key`` is captured or warm."""
        return key in self._steps or key in self._warm

    def mark_warm(self, key: Hashable) -> None:
        """An eager step of ``key`` ran forward and backward: the next one may be captured."""
        if len(self._warm) >= MAX_WARM:
            self._warm.clear()
        self._warm.add(key)

    def forward(self, key: Hashable, hidden: Tensor, labels: Tensor, dtype: torch.dtype,
                run: Callable[[Tensor, Tensor], Any]) -> tuple[GraphedStep, Pending] | None:
        """Replay (capturing first if needed) ``run(hidden.to(dtype), labels)``; ``None`` where the step must run
        eagerly (``key`` not warm yet, or the buffers are taken). Keep the returned :class:`Pending` until the
        backward: it marks the buffers taken."""
        # a captured key is warm: the usual replay hashes the key once
        step = self._steps.get(key)
        if (step is None and key not in self._warm) or self.busy():
            return None
        if step is None:
            step = self._capture_forward(key, hidden, labels, dtype, run)
        step.hidden.copy_(hidden)
        step.labels.copy_(labels)
        step.forward.replay()
        pending = Pending()
        self._pending = weakref.ref(pending)
        return step, pending

    def backward(self, step: GraphedStep, lr: float, scale: float,
                 run: Callable[[GraphedStep], Tensor | None]) -> Tensor | None:
        """Replay (capturing first if needed) ``run(step)``, the backward of the forward ``step`` just replayed, with
        ``lr`` in ``step.lr`` and ``scale`` in ``step.scale``; returns ``step.grad_hidden`` (the graph's buffer:
        overwritten by the next replay)."""
        # a fill is a launch on the host's path from the forward's replay to this one: skipped when unchanged
        if step.filled != (lr, scale):
            step.lr.fill_(lr)
            step.scale.fill_(scale)
            step.filled = (lr, scale)
        if step.backward is None:
            device = step.hidden.device
            step.backward, step.grad_hidden = on_capture_thread(
                device, lambda: capture(lambda: run(step), self._pool_for(device), capture_stream(device)))
        step.backward.replay()
        self._pending = None
        return step.grad_hidden

    def _pool_for(self, device: torch.device) -> Any:
        if self._pool is None:
            with torch.cuda.device(device):
                self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _capture_forward(self, key: Hashable, hidden: Tensor, labels: Tensor, dtype: torch.dtype,
                         run: Callable[[Tensor, Tensor], Any]) -> GraphedStep:
        if len(self._steps) >= self.max_signatures:
            self._steps.popitem(last=False)
        static_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        static_labels = torch.empty_like(labels)
        lr, scale = (torch.zeros((), dtype=torch.float32, device=hidden.device) for _ in range(2))
        device = hidden.device
        graph, outputs = on_capture_thread(
            device, lambda: capture(lambda: run(static_hidden, static_labels), self._pool_for(device),
                                    capture_stream(device)))
        step = GraphedStep(static_hidden, static_labels, lr, scale, graph, outputs)
        self._steps[key] = step
        return step
