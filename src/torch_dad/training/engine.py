"""The fused (and CUDA-graph-captured) training step: the eager step's math in far fewer launches.

Selected by ``DADTrainer(..., backend=...)``:

- ``"torch"``: the eager reference runner (:mod:`torch_dad.training.eager`, pure PyTorch, any setting);
- ``"triton"``: this module's step, run op by op. On CUDA its local error, AdamW and Gram
  updates are Triton kernels (:mod:`torch_dad.ops`); on CPU their PyTorch twins run;
- ``"cuda-graph"``: the fused step captured whole into one CUDA graph per input shape;
- ``"auto"``: ``"cuda-graph"`` on CUDA when the fused step supports the model and triton is
  installed, else ``"torch"``.

Per DAD layer the fused step launches: the forward ``addmm`` with bias and ReLU fused by
cuBLASLt, the local-error kernels, the ``d_z^T a`` GEMM (output in the compute dtype, as the
eager step rounds it), one AdamW kernel that updates weight and bias and rewrites their
bf16 copies (the copies the next forward reads, so no per-step casts), and one more for its
local head. At small batches an MLP step is bound by launches, not FLOPs. Under
``"cuda-graph"`` the weight GEMM and AdamW of layer ``i`` run on a side stream, beside the
forward of layer ``i + 1``: DAD allows it because layer ``i + 1`` never waits for a gradient
from above. The scheduling choices are :class:`EngineOptions`
(``docs/design-engine.md`` has the numbers and the commands).

A ``DADConv2d`` or ``DADBlock`` runs its own ``local_gradients`` in the step (torch ops, captured
with the rest), then one ``torch._fused_adamw_`` launch over its tensors; under ``"cuda-graph"`` both run
on a side stream beside the next layer's forward (``EngineOptions.local_streams``), otherwise its
AdamW is batched with its neighbours'. A :class:`DADLinear` after it reads its output flattened. Op by op
(``"triton"``), a :class:`DADLinear` whose output is large (:meth:`DADLinear.streams`) runs its own
``local_gradients`` in row blocks, writing its output over the step's previous activation.

Semantics match the eager step: outputs and losses come from the pre-update weights, every
layer's optimizer state and step counter advance as in :mod:`torch_dad.optim`, the classifier
is trained as an output head and its Gram statistics accumulate. What differs is rounding
(fp32 accumulation of the local head products) and, where rows are split across programs,
the fp32 summation order of the atomically added gradients.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from ..nn._local import DenseError, LocalLayer, kernel_applies
from ..nn.linear import DADLinear, DADModel
from ..ops.adamw import adamw_with_shadow_
from ..ops.cuda_graphs import no_garbage_collection
from ..ops.gram import mm_fp32
from ..optim import OptimizerConfig
from .classifier import OutputClassifier
from .options import STREAM_PRIORITIES, EngineOptions
from .step import Batch, Dropout, GradientReducer, LayerLoop, RunningLoss, StepOutput, StepPlan, input_dtype

__all__ = ["FusedStep", "unsupported_reason", "uses_local_error_kernel"]

#: gradients of local layers held for one batched AdamW launch before it runs mid-step: one launch per
#: layer costs small blocks more than their update; holding all of them grows with depth
HELD_GRADIENT_BYTES = 2 * 2**20
#: layers whose side-stream tensors a captured step holds before the main stream waits for their side work and
#: drops them: holding every layer's until the end of the step made the graph's pool grow with depth, and one
#: layer made the main stream wait for side work it could have run beside (4% of the deep MLP's step)
KEPT_LAYERS = 2


def unsupported_reason(model: DADModel, config: OptimizerConfig) -> str | None:
    """Why the fused step cannot train ``model`` with ``config``, or ``None`` if it can.

    Every local rule, activation, normalisation, label smoothing and ``dropout`` is supported: a
    layer the local-error kernel does not cover (see :func:`uses_local_error_kernel`), and every
    ``DADConv2d`` and ``DADBlock``, runs its own ``local_gradients`` (torch ops, capturable) inside
    the step.
    """
    if config.name != "adamw":
        return f"optimizer={config.name!r} (the fused step implements adamw)"
    for layer in model.local_layers:
        if layer.master_dtype != torch.float32:
            return f"master weights in {layer.master_dtype} (fused: float32)"
    return None


def uses_local_error_kernel(layer: LocalLayer) -> bool:
    """Whether the fused step computes ``layer``'s local error with :func:`local_error`: a
    :class:`~torch_dad.DADLinear` with relu, leaky relu, tanh or identity, the ``"ce"`` rule with
    or without label smoothing, any normalisation (one ATen kernel each way,
    :mod:`torch_dad.ops.normalization`); other layers run their own ``local_gradients`` in the step."""
    return isinstance(layer, DADLinear) and layer.local_loss == "ce" and kernel_applies(layer.activation, layer.num_classes)


def _tensor(value: object) -> Tensor:
    """A module attribute that is a registered buffer, typed as the tensor it is."""
    return cast(Tensor, value)


@dataclass
class _Update:
    """One AdamW launch: tensors updated in place, their gradients, moments, low-precision copies
    and step counter; ``work`` is the all-reduce to wait for first, if any."""

    params: list[Tensor]
    grads: list[Tensor]
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    shadow: list[Tensor | None]
    step: Tensor
    work: Any = None


class FusedStep:
    """The fused step on one model; :meth:`run` trains a span of its layers, captured as a CUDA
    graph when ``graphed`` and the whole model trains on one process."""

    def __init__(
        self, model: DADModel, device: torch.device, options: EngineOptions, graphed: bool, *,
        classifier: OutputClassifier | None, running_loss: RunningLoss,
    ) -> None:
        self.model, self.device, self.options, self.graphed = model, device, options, graphed
        # read once: the module walk behind model.local_layers costs host time every step
        self.layers: list[Any] = model.local_layers
        self.classifier = classifier
        self.running_loss = running_loss
        self.config = OptimizerConfig()
        self._shadows: dict[torch.dtype, list[tuple[Tensor | None, Tensor | None]]] = {}
        self.lr_tensor = torch.zeros((), device=device, dtype=torch.float32)
        self.lr_value = float("nan")
        self._graphs: dict[tuple[Any, ...], tuple[Any, Tensor, Tensor, Tensor, Tensor, Tensor]] = {}
        self._seen: set[tuple[Any, ...]] = set()
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._pool: Any = None
        self._tracked: list[Tensor] | None = None
        self.dropout = _Dropout(0.0, 0, torch.zeros((), device=device, dtype=torch.int64))
        self._dropout_step_mirror = 0

    # ------------------------------------------------------------------ state
    def shadows(self, dtype: torch.dtype) -> list[tuple[Tensor | None, Tensor | None]]:
        """bf16/fp16 copies of every :class:`DADLinear`'s (weight, bias), refreshed by the AdamW kernel;
        ``(None, None)`` for other layers, which cast their masters in ``local_gradients``."""
        layers = self.layers
        cached = self._shadows.get(dtype)
        if cached is None or len(cached) != len(layers):
            cached = [
                (layer.weight.detach().to(dtype), layer.bias.detach().to(dtype) if layer.bias is not None else None)
                if isinstance(layer, DADLinear) else (None, None)
                for layer in layers
            ]
            self._shadows[dtype] = cached
        return cached

    def refresh_shadows(self) -> None:
        """Re-copy the low-precision weights from the fp32 masters (after an outside edit)."""
        for pairs in self._shadows.values():
            for layer, (w, b) in zip(self.layers, pairs):
                if w is None:
                    continue
                w.copy_(layer.weight.detach())
                if b is not None and layer.bias is not None:
                    b.copy_(layer.bias.detach())

    def refresh(self) -> None:
        """:meth:`refresh_shadows` (the runner protocol's name)."""
        self.refresh_shadows()

    def _signature(self) -> tuple[int, ...]:
        """Storage addresses a captured graph baked in: a change forces a re-capture.

        The tensor list is gathered once (walking the modules costs host time every step); a tensor
        whose ``.data`` is replaced is caught by its address, a replaced Parameter object is
        not: call :meth:`reset` after swapping modules or parameters.
        """
        if self._tracked is None:
            tracked = list(self.model.parameters()) + list(self.model.buffers())
            if self.classifier is not None:
                tracked += self.classifier.buffers()
            tracked.append(self.running_loss.total)
            self._tracked = tracked
        return tuple(p.data_ptr() for p in self._tracked)

    def reset(self) -> None:
        """Drop captured graphs and low-precision copies (rebuilt from the masters next step)."""
        self._graphs.clear()
        self._seen.clear()
        self._shadows.clear()
        self._tracked = None

    @property
    def num_graphs(self) -> int:
        """How many captured graphs are kept (one per input shape, dtype and setting)."""
        return len(self._graphs)

    # ------------------------------------------------------------------ scheduling choices
    def stream(self, role: str) -> torch.cuda.Stream:
        """The side stream for ``role`` ("gemm", "background", "error", "sample", "capture", or "local-<i>" for
        ``i < EngineOptions.local_streams``),
        made once, at the priority ``STREAM_PRIORITIES`` gives its role when priorities are on."""
        if role not in self._streams:
            priority_role = "critical" if role in ("capture", "error") or role.startswith("local-") else role
            priority = STREAM_PRIORITIES[priority_role] if self.stream_priorities() else 0
            self._streams[role] = torch.cuda.Stream(device=self.device, priority=priority)
        return self._streams[role]

    def stream_priorities(self) -> bool:
        """``options.stream_priorities``, with ``None`` resolved by the largest DAD layer."""
        if self.options.stream_priorities is not None:
            return self.options.stream_priorities
        return all(layer.weight.numel() < self.options.update_chunk_numel for layer in self.layers if isinstance(layer, DADLinear))

    def local_error_off_main(self, layers: list[Any]) -> bool:
        """``options.local_error_off_main``, with ``None`` resolved by the widest of ``layers``."""
        if self.options.local_error_off_main is not None:
            return self.options.local_error_off_main
        return max(layer.out_features for layer in layers) <= self.options.local_error_max_width

    def update_chunks(self, batch: int) -> int:
        """``options.update_chunks``, with ``None`` resolved by the batch's rows."""
        if self.options.update_chunks is not None:
            return self.options.update_chunks
        return 4 if batch <= self.options.small_batch else 2

    # ------------------------------------------------------------------ kernels
    def weight_grad(self, d_z_t: Tensor, a: Tensor, exact: bool) -> Tensor:
        """``d_z.T @ a``, fp32-accumulated: in the compute dtype on CUDA (its AdamW widens it, and
        a 2-byte gradient saves 4 of the ~34 bytes a weight's update moves), in fp32 when ``exact``
        (an all-reduce sums it across processes) and on CPU (whose AdamW twin needs fp32)."""
        if exact or not d_z_t.is_cuda or d_z_t.dtype == torch.float32:
            return mm_fp32(d_z_t, a)
        return d_z_t @ a

    def adamw(self, update: _Update) -> None:
        """One AdamW launch (weight and bias, and their low-precision copies), after its all-reduce."""
        if update.work is not None:
            update.work.wait()
        config = self.config
        adamw_with_shadow_(
            update.params, update.grads, update.exp_avg, update.exp_avg_sq, update.shadow, update.step, self.lr_tensor,
            betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
        )

    def set_lr(self, lr: float) -> None:
        """The learning rate the next step uses (a device tensor the graphs read)."""
        if lr != self.lr_value:
            self.lr_value = lr
            self.lr_tensor.fill_(lr)

    # ------------------------------------------------------------------ entry point
    # nothing in the step needs autograd (a DADBlock turns it on inside itself): without this, a
    # batch-normalised layer's affine parameters made every later tensor of the step record a graph
    @torch.no_grad()
    def run(self, batch: Batch, plan: StepPlan, reducer: GradientReducer | None) -> StepOutput:
        """Train the plan's layers (then the classifier if it says so) on ``batch``.

        The whole model on one process replays a captured graph (``graphed``); a span (pipeline
        stage) or a ``reducer`` (data parallelism) runs uncaptured: large distributed batches
        are bound by GEMMs, not launches.
        """
        self.set_lr(batch.lr)
        self.config = plan.config
        self._sync_dropout(plan.dropout or Dropout(0.0, 0, 0))
        sample = self.classifier.sample if self.classifier is not None else None
        if plan.start == 0 and sample is not None:
            if batch.x.is_cuda:
                sample.count_rows(batch.x.shape[0])  # the step adds the rows on the device
            else:
                sample.add(batch.x, batch.y)
        whole = (plan.start, plan.stop) == (0, len(self.layers)) and plan.with_classifier == (self.classifier is not None)
        if not (self.graphed and whole and reducer is None and plan.count_loss):
            logits, loss, features = _Run(self, batch, plan, reducer, overlap=False).train()
            return StepOutput(logits, loss, features, plan.count_loss)
        statistics = self.classifier is not None and self.classifier.statistics is not None
        key = (
            tuple(batch.x.shape), batch.x.dtype, batch.compute_dtype, statistics, self._signature(),
            self.dropout.p, self.dropout.seed,
        )
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                # a shape seen twice is captured, so a ragged last batch costs no capture
                self._seen.add(key)
                return self._warm_up(batch, plan)
            entry = self._capture(key, batch, plan)
        graph, static_x, static_y, out_logits, out_loss, out_features = entry
        static_x.copy_(batch.x)
        static_y.copy_(batch.y)
        graph.replay()
        return StepOutput(out_logits.clone(), out_loss.clone(), out_features, True)

    def _sync_dropout(self, dropout: Dropout) -> None:
        """Take the step's dropout; set the device step counter the masks are drawn from to
        ``dropout.step`` (the step itself adds 1, so this writes only after a resume or an eager
        step). The counter is a device tensor: a captured graph reads it."""
        self.dropout = _Dropout(float(dropout.p), int(dropout.seed), self.dropout.step)
        if not dropout.p:
            return
        if dropout.step != self._dropout_step_mirror:
            self.dropout.step.fill_(dropout.step)
        self._dropout_step_mirror = dropout.step + 1

    def _warm_up(self, batch: Batch, plan: StepPlan) -> StepOutput:
        """The first step of a shape: uncaptured (it compiles the Triton kernels), on the streams its capture
        will use, since cuBLAS keeps a workspace per stream and those made here then serve the graph too."""
        current, stream = torch.cuda.current_stream(), self.stream("capture")
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            logits, loss, features = _Run(self, batch, plan, None, overlap=self.options.overlap).train()
        current.wait_stream(stream)
        for tensor in (logits, loss, features):
            tensor.record_stream(current)  # made on the capture stream, read and freed on this one
        return StepOutput(logits, loss, features, True)

    def _capture(self, key: tuple[Any, ...], batch: Batch, plan: StepPlan) -> tuple[Any, ...]:
        if len(self._graphs) >= self.options.max_graphs:
            self._graphs.clear()
        self.stream("gemm")
        capture_stream = self.stream("capture")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # the input buffer holds the dtype the first layer reads: its copy_ is also the cast
        static_x = torch.empty(batch.x.shape, device=self.device, dtype=input_dtype(batch.x, batch.compute_dtype))
        static_y = torch.empty_like(batch.y)
        static_x.copy_(batch.x)
        static_y.copy_(batch.y)
        static = Batch(static_x, static_y, batch.lr, batch.compute_dtype)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with no_garbage_collection(), torch.cuda.graph(graph, pool=self._pool, stream=capture_stream):
            out = _Run(self, static, plan, None, overlap=self.options.overlap).train()
        entry = (graph, static_x, static_y, *out)
        self._graphs[key] = entry
        return entry


class _Dropout(NamedTuple):
    """The step's dropout: probability, Philox seed and the device step counter of the masks."""

    p: float
    seed: int
    step: Tensor


class _Run(LayerLoop):
    """One pass of the fused step through :class:`~torch_dad.training.step.LayerLoop`: per layer its
    own forward and local error (:meth:`DADLinear.step_forward` / ``step_error``), then the weight
    gradient and AdamW placed on streams; then the classifier, the batched small updates and the
    stream joins. With ``overlap`` (a captured step and its warm-up) the updates run on side streams; ``keep``
    holds every tensor a side stream reads, so the allocator does not hand its memory to another
    stream while it is still read, until :meth:`_release_kept` has the main stream wait for that work."""

    def __init__(
        self, engine: FusedStep, batch: Batch, plan: StepPlan, reducer: GradientReducer | None, overlap: bool
    ) -> None:
        super().__init__(engine.layers, batch, plan, reducer, engine.running_loss)
        self.engine, self.overlap = engine, overlap
        self.dropout_step = engine.dropout.step
        compute = batch.compute_dtype
        low = compute is not None and compute != torch.float32
        self.shadows = engine.shadows(compute)[plan.start : plan.stop] if low and compute is not None else None
        self.main = torch.cuda.current_stream() if overlap else None
        # only kernel layers fork to the error stream; joining a stream that never forked from the
        # main one is an error under CUDA-graph capture
        kernel_layers = [layer for layer in self.layers if uses_local_error_kernel(layer)]
        off_main = overlap and bool(kernel_layers) and engine.local_error_off_main(kernel_layers)
        self.error_stream = engine.stream("error") if off_main else None
        #: the side streams ("gemm", "background") this step forked from the main one
        self.forked: set[str] = set()
        # under a reducer the local heads and the classifier update together, in one fused AdamW
        self.small_params: list[Tensor] = []
        self.small_grads: list[Tensor] = []
        self.small_exp_avg: list[Tensor] = []
        self.small_exp_avg_sq: list[Tensor] = []
        self.small_steps: list[Tensor] = []
        self.keep: list[Tensor] = []
        #: per earlier layer: events on the side streams after its work, and the tensors that work reads
        self.kept: deque[tuple[list[torch.cuda.Event], list[Tensor]]] = deque()
        #: the side streams this step forked (error stream included), for the events of :meth:`_release_kept`
        self.forked_streams: list[torch.cuda.Stream] = []
        self.sample_stream: torch.cuda.Stream | None = None
        #: local layers stepped so far under overlap: which of the ``local_streams`` side streams takes the next
        self.local_turn = 0

    def begin(self) -> None:
        steps = [_tensor(layer.optim_state.step) for layer in self.layers]
        classifier = self.engine.classifier
        if self.plan.with_classifier and classifier is not None:
            steps.append(_tensor(classifier.state.step))
        torch._foreach_add_(steps, 1.0)
        self.sample_stream = self._offer_sample()

    def first_input(self) -> Tensor:
        x = self.batch.x
        dtype = input_dtype(x, self.batch.compute_dtype)
        if x.dtype == dtype or (self.layers and self._streamed(self.layers[0], x)):
            return x  # a streamed first layer casts its rows block by block
        return x.to(dtype)

    def _streamed(self, layer: Any, a: Tensor) -> bool:
        """Whether ``layer`` runs its step in row blocks here: a large :class:`DADLinear` op by op (a captured
        step keeps the whole batch, whose weight gradient and AdamW run beside the next layer's forward)."""
        dtype = self.batch.compute_dtype or a.dtype
        return (not self.engine.graphed and isinstance(layer, DADLinear) and a.dtype.is_floating_point
                and layer.streams(a.shape[0], dtype))

    def _offer_sample(self) -> torch.cuda.Stream | None:
        """Add the rows to the classifier's input sample on the device (CUDA, first layer only)."""
        classifier, x, y = self.engine.classifier, self.batch.x, self.batch.y
        sample = classifier.sample if classifier is not None else None
        if sample is None or not x.is_cuda or self.plan.start != 0:
            return None
        if not self.overlap:
            sample.add_on_device(x, y)
            return None
        # on its own stream, beside the layers: its small kernels stay off the critical path
        stream = self.engine.stream("sample")
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sample.add_on_device(x, y)
        return stream

    def layer_step(self, index: int, layer: Any, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer ``index``: forward, local error, then its updates (on the side stream under overlap)."""
        self._release_kept()
        if not isinstance(layer, DADLinear):
            return self._local_layer(layer, a)
        if a.dim() > 2:  # a convolution's or block's output, read as rows
            a = a.flatten(1)
        if self.shadows is not None:
            w, b = self.shadows[index]
        else:
            w, b = layer.weight.detach(), (layer.bias.detach() if layer.bias is not None else None)
        streamed = self._streamed(layer, a)
        if not uses_local_error_kernel(layer) or streamed:
            # op by op, a later layer's input is this step's own activation: a streamed layer writes over it
            return self._rule_layer(layer, a, w, b, streamed=streamed, reuse_input=index > 0 and not self.overlap)
        assert w is not None
        z, h, saved = layer.step_forward(a, w, b)
        layer.update_running_statistics()  # batch norm: on the main stream, which made the statistics
        if self.error_stream is not None and self.main is not None:
            self.error_stream.wait_stream(self.main)
            self._fork("error", self.error_stream)
            self.keep += [h, *(saved or ())[1:]]
            with torch.cuda.stream(self.error_stream):
                err = layer.step_error(h, z, saved, self.batch.y, backend="triton")
        else:
            err = layer.step_error(h, z, saved, self.batch.y, backend="triton")
        side = self.engine.stream("gemm") if self.overlap and self.main is not None else None
        if side is not None and self.main is not None:
            side.wait_stream(self.main)
            self._fork("gemm", side)
            if self.error_stream is not None:
                side.wait_stream(self.error_stream)
            self.keep += [a, err.d_z, err.grad_bias, *err.head_grads]
        with torch.cuda.stream(side) if side is not None else nullcontext():
            self._update_layer(layer, a, err, w, b)
        # err's B x width temporaries go before the next forward allocates
        return h, err.logits, err.loss

    def _local_layer(self, layer: Any, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A ``DADConv2d``, ``DADBlock`` or other local layer: its own ``local_gradients`` (torch ops,
        capturable), then AdamW on all its trained tensors. Under overlap without a reducer (and with
        ``local_streams``) both run on a side stream beside the next layer (:meth:`_local_layer_beside`);
        otherwise on the main stream, the AdamW
        batched with the other small updates into one ``torch._fused_adamw_`` launch: at the end of the step
        (under data parallelism after their all-reduce), or earlier once the held gradients pass
        ``HELD_GRADIENT_BYTES``, so that what a step holds does not grow with depth."""
        if self.overlap and self.main is not None and self.reducer is None and self.engine.options.local_streams:
            return self._local_layer_beside(layer, a, self.main)
        result, grads = layer.local_gradients(a, self.batch.y, self.batch.compute_dtype, backend="triton")
        layer.update_running_statistics()
        self._collect_small(self._local_update(layer, grads))
        if self.reducer is None and sum(g.numel() * g.element_size() for g in self.small_grads) > HELD_GRADIENT_BYTES:
            self._apply_small()
        return result.output, result.logits.float(), result.loss.float()

    def _local_layer_beside(self, layer: Any, a: Tensor, main: torch.cuda.Stream) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_local_layer` under overlap: the layer's whole step and its AdamW on one of ``local_streams`` side streams,
        taken in turn; the main stream waits only for its output, so its gradients and update run beside the next
        layer's forward."""
        role = f"local-{self.local_turn % self.engine.options.local_streams}"
        self.local_turn += 1
        stream, ready = self.engine.stream(role), torch.cuda.Event()
        stream.wait_stream(main)
        self._fork(role, stream)
        self.keep.append(a)
        with torch.cuda.stream(stream):
            result, grads = layer.local_gradients(a, self.batch.y, self.batch.compute_dtype, backend="triton",
                                                  output_ready=ready.record)
            layer.update_running_statistics()
            update = self._local_update(layer, grads)
            self._fused_adamw(update.params, update.grads, update.exp_avg, update.exp_avg_sq, [update.step] * len(grads))
            logits, loss = result.logits.float(), result.loss.float()
        main.wait_event(ready)
        return result.output, logits, loss

    @staticmethod
    def _local_update(layer: Any, grads: list[Tensor]) -> _Update:
        """AdamW of a local layer's trained tensors with ``grads``."""
        params, state = layer.trained_tensors(), layer.optim_state
        moments = state.moments("exp_avg"), state.moments("exp_avg_sq")
        return _Update([p.data for p in params], grads, moments[0], moments[1], [None] * len(params), _tensor(state.step))

    def _rule_layer(self, layer: DADLinear, a: Tensor, w: Tensor | None, b: Tensor | None, *,
                    streamed: bool, reuse_input: bool) -> tuple[Tensor, Tensor, Tensor]:
        """A layer the local-error kernel does not cover, or a streamed one (:meth:`_streamed`): its own
        ``local_gradients`` (on the main stream; a streamed one reads the low-precision copies ``w``, ``b``), then AdamW on
        weight and bias (refreshing their copies) and on each further pair it trains (local head,
        batch-norm affine), and the batch norm's running statistics."""
        # a streamed layer reads the copies (no cast of the masters beside its activation); the others cast the
        # masters as the eager step does
        weights = (w, b) if streamed and self.shadows is not None and w is not None else None
        result, grads = layer.local_gradients(a, self.batch.y, self.batch.compute_dtype, backend="triton",
                                              reuse_input=reuse_input, weights=weights)
        layer.update_running_statistics()  # on the main stream, which made the batch statistics
        nb = 2 if layer.bias is not None else 1
        params, state = layer.trained_tensors(), layer.optim_state
        exp_avg, exp_avg_sq, step = state.moments("exp_avg"), state.moments("exp_avg_sq"), _tensor(state.step)
        shadow: list[Tensor | None] = [w, b][:nb] if self.shadows is not None else [None] * nb
        side = self.engine.stream("gemm") if self.overlap and self.main is not None else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            self._fork("gemm", side)
            self.keep += grads
        with torch.cuda.stream(side) if side is not None else nullcontext():
            self._launch_update(_Update([p.data for p in params[:nb]], grads[:nb], exp_avg[:nb], exp_avg_sq[:nb], shadow, step))
            for j in range(nb, len(params), 2):
                pair = slice(j, j + 2)
                update = _Update([p.data for p in params[pair]], grads[pair], exp_avg[pair], exp_avg_sq[pair], [None, None], step)
                if self.reducer is None:
                    self.engine.adamw(update)
                else:
                    self._collect_small(update)
        return result.output, result.logits.float(), result.loss.float()

    def _update_layer(self, layer: DADLinear, a: Tensor, err: DenseError, w: Tensor, b: Tensor | None) -> None:
        """The layer's weight gradient and AdamW (whole, in row blocks, or after an all-reduce),
        then one AdamW for its local head and its batch norm's affine."""
        engine, reducer = self.engine, self.reducer
        params = layer.trained_tensors()
        moments = layer.optim_state.moments("exp_avg"), layer.optim_state.moments("exp_avg_sq")
        step = _tensor(layer.optim_state.step)
        nb = 2 if layer.bias is not None else 1
        shadow: list[Tensor | None] = [w, b][:nb] if self.shadows is not None else [None] * nb
        targets = [p.data for p in params[:nb]]
        if reducer is None and layer.weight.numel() >= engine.options.update_chunk_numel:
            grad_w = self._chunked_update(err, a, _Update(targets, [], moments[0][:nb], moments[1][:nb], shadow, step))
        else:
            grad_w = engine.weight_grad(err.d_z.T, a, exact=reducer is not None)
            update = _Update(targets, [grad_w, err.grad_bias][:nb], moments[0][:nb], moments[1][:nb], shadow, step)
            self._launch_update(update)
        if self.overlap and grad_w is not None:
            self.keep.append(grad_w)
        head_grads = err.head_grads
        for j in range(0, len(head_grads), 2):  # the local head, then the batch norm's affine
            pair = slice(nb + j, nb + j + 2)
            update = _Update(params[pair], head_grads[j : j + 2], moments[0][pair], moments[1][pair], [None, None], step)
            if reducer is not None:
                self._collect_small(update)
                continue
            if self.overlap:
                self.keep += update.grads
            engine.adamw(update)

    def _launch_update(self, update: _Update) -> None:
        """AdamW now (on the background stream under priorities), or after the all-reduce it
        starts, one layer later, so the collective runs under the next layer's GEMMs."""
        engine, reducer = self.engine, self.reducer
        if reducer is not None:
            # launch() copies the gradients into its buffer at once; the update uses that buffer
            work, update.grads = reducer.launch(update.grads)
            self.held.push(work, partial(engine.adamw, update), hold=1)
        elif self.overlap and engine.stream_priorities():
            # at background priority, so it yields to the next forward
            stream = engine.stream("background")
            stream.wait_stream(torch.cuda.current_stream())
            self._fork("background", stream)
            self.keep += update.grads
            with torch.cuda.stream(stream):
                engine.adamw(update)
        else:
            engine.adamw(update)

    def _chunked_update(self, err: DenseError, a: Tensor, whole: _Update) -> Tensor:
        """``W -= AdamW(d_z.T @ a)`` (and the bias) in row blocks of the weight; returns the last
        block's gradient. Per block: ``g = d_z[:, rows].T @ a``, then AdamW on ``W[rows]``,
        ``b[rows]`` and their moments and copies, elementwise as in one launch. Under ``overlap``
        (on the side stream) each block's AdamW runs on the background stream, beside the next
        block's GEMM."""
        engine, d_z = self.engine, err.d_z
        out_features = d_z.shape[1]
        rows = -(-out_features // engine.update_chunks(d_z.shape[0]))
        side = torch.cuda.current_stream() if self.overlap else None
        background = engine.stream("background") if self.overlap else None
        grad = d_z
        for r0 in range(0, out_features, rows):
            r1 = min(out_features, r0 + rows)
            grad = engine.weight_grad(d_z[:, r0:r1].T, a, exact=False)
            block = _Update(
                [p[r0:r1] for p in whole.params], [grad, err.grad_bias[r0:r1]][: len(whole.params)],
                [m[r0:r1] for m in whole.exp_avg], [v[r0:r1] for v in whole.exp_avg_sq],
                [c[r0:r1] if c is not None else None for c in whole.shadow], whole.step,
            )
            if side is not None and background is not None:
                background.wait_stream(side)
                self._fork("background", background)
                self.keep.append(grad)
                with torch.cuda.stream(background):
                    engine.adamw(block)
            else:
                engine.adamw(block)
        return grad

    def _release_kept(self) -> None:
        """Under overlap, before a layer: mark the side streams' work so far with events, holding the tensors it
        reads; once more than ``KEPT_LAYERS`` layers are held, the main stream waits for the oldest one's events
        and drops its tensors, which the allocator may then hand to the main stream again."""
        if not self.overlap or self.main is None or not self.keep:
            return
        events = []
        for stream in self.forked_streams:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self.kept.append((events, self.keep))
        self.keep = []
        while len(self.kept) > KEPT_LAYERS:
            for event in self.kept.popleft()[0]:
                self.main.wait_event(event)

    def _fork(self, name: str, stream: torch.cuda.Stream) -> None:
        """Note that ``stream`` (side stream ``name``) took work from the main stream in this step."""
        self.forked.add(name)
        if all(stream is not s for s in self.forked_streams):
            self.forked_streams.append(stream)

    def _apply_small(self) -> None:
        """The collected small updates (local layers, local heads, the classifier) in one
        ``torch._fused_adamw_`` launch (their steps already counted); their gradients are then freed."""
        if not self.small_params:
            return
        self._fused_adamw(self.small_params, self.small_grads, self.small_exp_avg, self.small_exp_avg_sq, self.small_steps)
        self.small_params, self.small_grads, self.small_exp_avg, self.small_exp_avg_sq, self.small_steps = [], [], [], [], []

    def _fused_adamw(self, params: list[Tensor], grads: list[Tensor], exp_avg: list[Tensor], exp_avg_sq: list[Tensor],
                     steps: list[Tensor]) -> None:
        """One ``torch._fused_adamw_`` launch (no low-precision copies), one step counter per tensor."""
        config = self.engine.config
        lr = self.engine.lr_tensor if params[0].is_cuda else self.engine.lr_value
        torch._fused_adamw_(
            params, grads, exp_avg, exp_avg_sq, [], steps, amsgrad=False, lr=lr, beta1=config.betas[0], beta2=config.betas[1],  # type: ignore[arg-type]
            weight_decay=config.weight_decay, eps=config.eps, maximize=False,
        )

    def _collect_small(self, update: _Update) -> None:
        self.small_params += update.params
        self.small_grads += update.grads
        self.small_exp_avg += update.exp_avg
        self.small_exp_avg_sq += update.exp_avg_sq
        self.small_steps += [update.step] * len(update.params)

    def classifier_step(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """The classifier's Gram update, its output-head error (the kernel) and its AdamW."""
        self._join_error_stream()
        classifier, y = self.engine.classifier, self.batch.y
        assert classifier is not None
        classifier.accumulate(features, y)
        logits, loss, grads = classifier.gradients(features, y, None, backend="triton")
        state = classifier.state
        update = _Update(
            classifier.tensors, grads, state.moments("exp_avg"), state.moments("exp_avg_sq"),
            [None] * len(grads), _tensor(state.step),
        )
        if self.reducer is None:
            self.engine.adamw(update)
        else:
            self._collect_small(update)
        return logits, loss

    def _join_error_stream(self) -> None:
        if self.error_stream is not None and self.main is not None:
            # the local-head gradients, logits and loss of every layer come from the error stream
            self.main.wait_stream(self.error_stream)

    def finish(self, loss: Tensor) -> None:
        """The all-reduced small updates and pending layer updates, the running loss, the joins."""
        engine = self.engine
        if not self.plan.with_classifier:
            self._join_error_stream()
        if self.reducer is not None:
            self.reducer(self.small_grads)  # every local head and the classifier: one small blocking all-reduce
        if self.main is not None:
            # a local layer's loss and logits come from its side stream (without a classifier, the step's own)
            for role in (f"local-{i}" for i in range(min(self.local_turn, engine.options.local_streams))):
                self.main.wait_stream(self.engine.stream(role))
        super().finish(loss)
        self._apply_small()
        if self.overlap and self.main is not None:
            # join only the side streams this step forked: waiting on one that holds no captured
            # work is an error under capture (a model of DADBlocks alone forks none)
            for name in sorted(self.forked):
                self.main.wait_stream(engine.stream(name))
        if self.plan.dropout is not None and self.plan.dropout.p:
            engine.dropout.step.add_(1)
        if self.sample_stream is not None:
            torch.cuda.current_stream().wait_stream(self.sample_stream)
        self.keep.clear()
        self.kept.clear()
