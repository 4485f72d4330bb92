"""``DADTrainer``: the decoupled training step, fit/evaluate, the closed-form classifier, checkpoints."""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import (
    check_bool,
    check_device,
    check_finite,
    check_fraction,
    check_inputs,
    check_labels,
    check_positive_int,
    gradients_are_finite,
)
from ..nn._local import LocalLayer
from ..nn.linear import DADLinear, DADModel
from ..ops.dropout import counter_dropout
from ..optim import LocalOptimizerState, OptimizerConfig, check_optimizer
from ..ridge import GramAccumulator, RidgeSolution
from . import checkpoint
from .checkpoint import CheckpointFolder, FitProgress
from .input_sample import InputReservoir
from .options import EngineOptions
from .step import Batch, Dropout, GradientReducer, StepOutput, progress_bar

if TYPE_CHECKING:
    from .engine import FusedStep

__all__ = ["DADTrainer"]

_AMP_DTYPES = (torch.bfloat16, torch.float16)
BACKENDS: tuple[str, ...] = ("auto", "eager", "fused", "cuda-graph")


def _resolve_device(device: torch.device | str | None, model: nn.Module) -> torch.device:
    """``device`` checked by :func:`~torch_dad._checks.check_device`, or the model's device when ``None``."""
    if device is None:
        first = next(iter(model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    return check_device(device)


#: the keys of a dict batch (e.g. from a ``DataLoader`` over a HuggingFace dataset), in the order tried
INPUT_KEYS: tuple[str, ...] = ("x", "inputs", "input", "pixel_values")
LABEL_KEYS: tuple[str, ...] = ("labels", "label", "y")


def as_batch_pair(batch: Any) -> tuple[Any, Any]:
    """``(x, y)`` of one batch: a pair ``(x, y)``, or a mapping holding one of :data:`INPUT_KEYS`
    and one of :data:`LABEL_KEYS` (the first present of each)."""
    if isinstance(batch, Mapping):
        x_key = next((k for k in INPUT_KEYS if k in batch), None)
        y_key = next((k for k in LABEL_KEYS if k in batch), None)
        if x_key is None or y_key is None:
            raise ValueError(
                f"a dict batch needs an input key ({', '.join(map(repr, INPUT_KEYS))}) and a label key "
                f"({', '.join(map(repr, LABEL_KEYS))}); got keys {sorted(map(str, batch))}"
            )
        return batch[x_key], batch[y_key]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"each batch must be a pair (inputs, labels) or a dict with keys such as 'x'/'pixel_values' and 'labels', "
        f"got {type(batch).__name__}; pass an iterable of batches (e.g. a DataLoader) or a pair of tensors (X, Y)"
    )


def _check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(repr(c) for c in choices)}")


def _check_amp(amp_dtype: torch.dtype | None, name: str, device: torch.device) -> None:
    if amp_dtype is None or amp_dtype == torch.float32:
        return
    if amp_dtype not in _AMP_DTYPES:
        raise ValueError(f"{name}={amp_dtype!r}: use torch.bfloat16, torch.float16 or None")
    if amp_dtype == torch.float16 and device.type == "cpu":
        raise ValueError(f"{name}=torch.float16 is not supported on CPU; use torch.bfloat16")


def _check_options(
    *,
    on_nonfinite: object,
    check_values: object,
    local_loss: str | None,
    dropout: object,
    dropout_seed: object,
    classifier_sample_size: object,
    accumulate_classifier_statistics: object,
) -> None:
    """The checks of :class:`DADTrainer`'s keyword options that need no model or device."""
    _check_choice("on_nonfinite", on_nonfinite, ("raise", "skip", "ignore"))
    _check_choice("check_values", check_values, (True, False, "auto"))
    _check_choice("accumulate_classifier_statistics", accumulate_classifier_statistics, (True, False, "auto"))
    if local_loss is not None:
        functional.check_local_loss(local_loss)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r} must be a float in [0, 1)")
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**63:
        raise ValueError(f"dropout_seed={dropout_seed!r} must be an int in [0, 2**63)")
    if isinstance(classifier_sample_size, bool) or not isinstance(classifier_sample_size, int) or classifier_sample_size < 0:
        raise ValueError(f"classifier_sample_size={classifier_sample_size!r} must be an int >= 0 (0 disables the sample)")


def _set_local_loss(layers: list[Any], local_loss: str) -> None:
    """Give every layer the rule ``local_loss``; checked against every layer's ``local_losses``
    before any layer changes."""
    for layer in layers:
        if local_loss not in layer.local_losses:
            raise ValueError(f"local_loss={local_loss!r}: {type(layer).__name__} implements "
                             f"{', '.join(repr(r) for r in layer.local_losses)} only")
    for layer in layers:
        layer.set_local_loss(local_loss)


class DADTrainer:
    """Trains a :class:`~torch_dad.DADModel` layer by layer from local targets.

    ``step(x, y)`` runs, for each DAD layer in order (:class:`~torch_dad.DADLinear`,
    :class:`~torch_dad.DADConv2d`, :class:`~torch_dad.DADBlock`, in any mix): forward, local error,
    in-place update; only the current layer's activations are alive. If the model has a ``classifier``
    (``nn.Linear``), it is trained as an output head (its gradient is exactly backprop's for
    that layer) and its input features are accumulated into float64 Gram statistics for
    :meth:`solve_head`.

    Args:
        model: the ``DADModel`` to train (moved to ``device``).
        device: ``"cuda"``, ``torch.device(...)`` or ``None`` for the model's device.
        lr, weight_decay, optimizer, betas, eps, momentum: the local optimizer
            (``"adamw"``: decoupled weight decay as ``torch.optim.AdamW``; ``"sgd"``: momentum).
        amp_dtype: default compute dtype for :meth:`step` (``torch.bfloat16`` / ``torch.float16``
            on CUDA, ``torch.bfloat16`` on CPU); master weights stay float32.
        accumulate_classifier_statistics: accumulate the classifier's streamed Gram statistics in
            ``step``. ``"auto"``: only when ``classifier_sample_size=0``, since ``solve_head()`` then
            needs them; otherwise it solves from the input sample and the streamed GEMM
            would be wasted (on fmnist-wide-2 it was 228 of a 603 us H200 step at B=1024).
        classifier_statistics_window: forget statistics older than about this many samples
            (exponential decay), because features from early, stale weights hurt the solve.
            Measured on MNIST, the quickstart model, 3 epochs: window 10k gives 97.22% after
            ``solve_head()``, 30k 97.07%, no forgetting 96.90% (local head: 96.93%).
            ``None`` keeps every sample since the last solve/reset.
        classifier_sample_size: ``step`` also keeps a uniform random sample of this many input rows
            (:class:`~torch_dad.training.input_sample.InputReservoir`, no host sync) since the last solve/reset;
            ``solve_head()`` without a loader recomputes their features with the current
            weights and solves from those (streamed statistics mix in stale features: on real
            MNIST, 3 epochs, 2 seeds, 98.03%/97.84% against 97.20%/97.11% for the streamed
            statistics and 96.61%/97.06% for the last local head). ``0`` solves from the
            streamed Gram statistics instead.
        check_values: check label ranges and finiteness of inputs in ``step``. These checks
            read the tensors, which is free on CPU but a host sync on CUDA, so ``"auto"``
            checks on CPU only. Shapes and dtypes are always checked.
        on_nonfinite: what to do when a layer's local gradients contain NaN/Inf (e.g. a huge
            lr, or fp16 overflow): ``"raise"`` (``FloatingPointError``; the step is atomic:
            no layer, nor the classifier, its statistics or input sample, is updated),
            ``"skip"`` (the whole step is skipped likewise and counted once in
            ``skipped_updates``), or ``"ignore"``. Checked whenever value checks are on
            (see ``check_values``); on CUDA without them, :meth:`fit` still raises when
            the running loss it reads every ``log_every`` steps is not finite.
        backend: how :meth:`step` runs (see :mod:`torch_dad.training.engine`): ``"eager"`` (reference
            PyTorch), ``"fused"`` (Triton kernels on CUDA, their twins on CPU),
            ``"cuda-graph"`` (the fused step captured per input shape) or ``"auto"``
            (``"cuda-graph"`` on CUDA where supported, else ``"eager"``). The fused step has
            no per-layer non-finite guard: with ``on_nonfinite`` other than ``"ignore"`` (the
            CPU default), ``step`` runs the eager loop, and a warning says so.
        engine_options: a :class:`~torch_dad.training.EngineOptions` tuning the fused
            step (stream overlap, row-block updates); ``None`` takes the measured defaults.
        local_loss: ``"ce"``, ``"predsim"`` or ``"drtp"`` sets every layer's local rule
            (:meth:`DADLinear.set_local_loss`); ``None`` keeps each layer's own.
        dropout: in ``step``, drop each hidden output with this probability (scaled by
            ``1/(1-p)``, as ``nn.Dropout``) before the next layer and the classifier (and its
            Gram statistics) see it; never at inference. Off by default (measurements:
            ``docs/benchmarks.md``). The mask is drawn by :func:`~torch_dad.ops.dropout.counter_dropout`,
            a pure function of ``(dropout_seed, step_count, layer index, element)``: the same in
            every backend, and a resumed trainer continues it from ``step_count``.
        dropout_seed: the Philox key of the dropout masks, an int in ``[0, 2**63)``; in ``state_dict``.
        classifier_label_smoothing: label smoothing of the classifier's online cross-entropy
            (``functional.cross_entropy_error``), as ``nn.CrossEntropyLoss(label_smoothing=)`` on a
            backprop model's output; the layers' local losses take their own ``label_smoothing``.
    """

    def __init__(
        self,
        model: DADModel,
        device: torch.device | str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        optimizer: str = "adamw",
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.9,
        amp_dtype: torch.dtype | None = None,
        accumulate_classifier_statistics: bool | str = "auto",
        classifier_statistics_window: float | None = 10_000,
        classifier_sample_size: int = 4096,
        check_values: bool | str = "auto",
        on_nonfinite: str = "raise",
        backend: str = "auto",
        engine_options: EngineOptions | None = None,
        local_loss: str | None = None,
        dropout: float = 0.0,
        dropout_seed: int = 0,
        classifier_label_smoothing: float = 0.0,
    ) -> None:
        if not isinstance(model, DADModel):
            raise TypeError(
                f"model must be a torch_dad.DADModel (a subclass declaring DADLinear layers), "
                f"got {type(model).__name__}"
            )
        layers = model.require_layers()
        _check_choice("backend", backend, BACKENDS)
        check_optimizer(optimizer)
        self.device = _resolve_device(device, model)
        _check_amp(amp_dtype, "amp_dtype", self.device)
        self.classifier_label_smoothing = check_fraction("classifier_label_smoothing", classifier_label_smoothing)
        _check_options(
            on_nonfinite=on_nonfinite, check_values=check_values, local_loss=local_loss, dropout=dropout,
            dropout_seed=dropout_seed, classifier_sample_size=classifier_sample_size,
            accumulate_classifier_statistics=accumulate_classifier_statistics,
        )
        self.config = OptimizerConfig(
            name=optimizer, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum
        )
        self._check_layers(model, layers)
        # the module walk behind model.dad_layers costs microseconds a call, and a graphed step
        # is bound by its host time: the layout is read once (the model is fixed from here on)
        self._num_layers = len(layers)
        self._first_layer = layers[0]
        self._has_classifier = model.get_classifier() is not None
        if local_loss is not None:
            _set_local_loss(layers, local_loss)
        self.model = model.to(self.device)
        self.dropout, self.dropout_seed = float(dropout), dropout_seed
        self.amp_dtype = amp_dtype
        self.check_values = (self.device.type == "cpu") if check_values == "auto" else bool(check_values)
        if accumulate_classifier_statistics == "auto":
            accumulate_classifier_statistics = classifier_sample_size == 0
        self.accumulate_classifier_statistics = bool(accumulate_classifier_statistics)
        self.on_nonfinite = on_nonfinite if self.check_values else "ignore"
        self.skipped_updates = 0
        self.num_classes = model.num_classes
        self._build_classifier_state(classifier_statistics_window, classifier_sample_size)
        #: reduces every local gradient list across processes before it is applied (set by
        #: :class:`~torch_dad.training.DataParallelTrainer`); ``None`` on a single process
        self.gradient_reducer: GradientReducer | None = None
        #: sums the Gram statistics across processes before a solve
        self.statistics_reducer: Callable[[GramAccumulator], None] | None = None
        # per-layer reusable buffers (CPU only: CUDA's caching allocator already reuses memory)
        self._workspaces: list[dict[str, Tensor] | None] = [
            {} if self.device.type == "cpu" else None for _ in layers
        ]
        self.step_count = 0
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_batches = 0
        self.history: list[dict[str, float]] = []
        self.backend = backend
        self._engine = self._make_engine(backend, engine_options)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _check_layers(model: DADModel, layers: list[LocalLayer]) -> None:
        for layer in layers:
            if layer.num_classes != model.num_classes:
                raise ValueError(
                    f"every DADLinear must have num_classes={model.num_classes} (the classifier's), "
                    f"but {layer!r} has {layer.num_classes}"
                )
        classifier = model.get_classifier()
        # a convolution's or block's flattened output size depends on the input: the classifier's
        # own shape check reports it at the first step
        last = layers[-1]
        if classifier is not None and isinstance(last, DADLinear) and classifier.in_features != last.out_features:
            raise ValueError(
                f"model.classifier takes {classifier.in_features} features but the last DADLinear "
                f"gives {layers[-1].out_features}"
            )

    def _build_classifier_state(self, window: float | None, sample_size: int) -> None:
        """The classifier's optimizer state, its Gram statistics and the input sample for its solve."""
        self._sample_size = sample_size
        classifier = self.model.get_classifier()
        self.classifier_state: LocalOptimizerState | None = None
        self.classifier_statistics: GramAccumulator | None = None
        self.classifier_sample: InputReservoir | None = None
        if classifier is None:
            return
        shapes = [p.shape for p in self._classifier_tensors()]
        self.classifier_state = LocalOptimizerState(shapes, device=self.device, dtype=classifier.weight.dtype)
        self.classifier_statistics = GramAccumulator(
            classifier.in_features, classifier.out_features, device=self.device, window=window
        )
        first = self._first_layer
        if sample_size and isinstance(first, DADLinear):
            self._make_sample((first.in_features,))

    @property
    def keeps_input_sample(self) -> bool:
        """Whether ``step`` keeps the classifier's input sample (made at the first batch for a model
        whose first layer is a convolution or block)."""
        return self.classifier_sample is not None or bool(self._sample_size and self._has_classifier)

    def _make_sample(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> InputReservoir:
        """The classifier's input sample for rows of ``shape`` (``dtype``: the first layer's by default).
        A convolution or block learns its input's shape from the first batch, so its sample is made
        there (or from a checkpoint)."""
        dtype = dtype or self._first_layer.master_dtype
        self.classifier_sample = InputReservoir(self._sample_size, shape, device=self.device, dtype=dtype)
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.sample = self.classifier_sample
        return self.classifier_sample

    def _make_engine(self, backend: str, options: EngineOptions | None) -> FusedStep | None:
        if backend == "eager" or (backend == "auto" and self.device.type != "cuda"):
            if options is not None:
                raise ValueError("engine_options apply to backend='fused' or 'cuda-graph'; drop them or pick one")
            return None  # lazily imported: the CPU never imports the engine (nor triton)
        from .engine import make_engine

        engine = make_engine(self, backend, options, loss_total=self._loss_sum)
        if engine is not None and self.on_nonfinite != "ignore":
            warnings.warn(
                f"backend={backend!r} with on_nonfinite={self.on_nonfinite!r}: the fused step has no per-layer "
                "non-finite guard, so step() runs the eager layer loop. Pass on_nonfinite='ignore' (or "
                "check_values=False) to run the fused step",
                UserWarning,
                stacklevel=3,
            )
        return engine

    @property
    def engine(self) -> FusedStep | None:
        """The fused step (:class:`~torch_dad.training.engine.FusedStep`) or ``None`` for the eager loop."""
        return self._engine

    @property
    def uses_engine(self) -> bool:
        """Whether :meth:`step` runs the fused engine: one exists, and the per-layer non-finite
        guard (in the eager layer loop only) is not asked for."""
        return self._engine is not None and self.on_nonfinite == "ignore"

    def _classifier_tensors(self) -> list[Tensor]:
        classifier = self.model.get_classifier()
        assert classifier is not None
        return [classifier.weight.data] + ([classifier.bias.data] if classifier.bias is not None else [])

    # ------------------------------------------------------------------ the step
    def step(
        self,
        inputs: Tensor,
        labels: Tensor,
        lr: float | None = None,
        amp_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One decoupled training step; returns ``(logits, loss)``, both detached, no host sync.

        ``logits`` are the model's outputs for the batch, computed with the weights before
        this step's update; ``loss`` is their cross-entropy (a 0-dim tensor on the device).
        ``lr`` overrides the learning rate for this step; ``amp_dtype`` the compute dtype.
        Invalid input raises before anything is modified.
        """
        batch = self.prepare_batch(inputs, labels, lr, amp_dtype)
        return self.finish_step(self.train_layers(batch))

    def prepare_batch(
        self, inputs: Tensor, labels: Tensor, lr: float | None = None, amp_dtype: torch.dtype | None = None
    ) -> Batch:
        """Validate a step's arguments and move the batch to the device: a :class:`Batch`."""
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0):
            raise ValueError(f"lr={lr!r} must be a finite float >= 0")
        compute = amp_dtype if amp_dtype is not None else self.amp_dtype
        _check_amp(compute, "amp_dtype", self.device)
        x, y = self._prepare(inputs, labels)
        if self.classifier_sample is None and self._sample_size and self._has_classifier:
            self._make_sample(tuple(x.shape[1:]), x.dtype)
        lr = self.config.lr if lr is None else float(lr)
        return Batch(x, y, lr, None if compute == torch.float32 else compute)

    def _prepare(self, inputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() == 0:
            raise ValueError("inputs must have a batch dimension, got a 0-dim tensor")
        if inputs.shape[0] == 0:
            raise ValueError("inputs are an empty batch; pass at least one row")
        first = self._first_layer
        if isinstance(first, DADLinear):
            x = self._prepare_rows(inputs, first)
        else:
            first.check_input(inputs)
            x = inputs.to(self.device, non_blocking=True)
            if x.dtype.is_floating_point:
                x = x.to(first.master_dtype)
                if self.check_values:
                    check_finite(x)
        if not isinstance(target, Tensor):
            raise TypeError(f"labels must be a torch.Tensor of class ids, got {type(target).__name__}")
        y = target.to(self.device, non_blocking=True)
        check_labels(y, x.shape[0], self.num_classes, check_values=self.check_values)
        return x, y.long()

    def _prepare_rows(self, inputs: Tensor, first: DADLinear) -> Tensor:
        """``inputs`` on the device as (batch, in_features) rows in the first layer's dtype, checked."""
        if inputs.dim() < 2 or inputs[0].numel() != first.in_features:
            single = " (one sample? add a batch dimension: inputs.unsqueeze(0))" if inputs.numel() == first.in_features else ""
            raise ValueError(
                f"inputs have shape {tuple(inputs.shape)}; expected (batch, {first.in_features}), or (batch, ...) with "
                f"{first.in_features} values per row, to match in_features={first.in_features}{single}"
            )
        x = inputs.to(self.device, non_blocking=True).reshape(inputs.shape[0], -1)
        if not x.dtype.is_floating_point:
            raise TypeError(f"inputs have dtype {inputs.dtype}; convert them with .float()")
        if x.dtype != first.weight.dtype:
            x = x.to(first.weight.dtype)
        check_inputs(x, first.in_features, check_values=self.check_values)
        return x

    def train_layers(
        self, batch: Batch, *, span: tuple[int, int] | None = None, with_classifier: bool = True
    ) -> StepOutput:
        """Train DAD layers ``span`` (``[start, stop)``, default all) on ``batch``, then the
        classifier if ``with_classifier`` and the span ends at the last layer.

        Each layer runs forward, local error and in-place update; with a
        ``gradient_reducer`` every gradient list is reduced before it is applied. Rows entering
        the first layer are offered to the classifier's input sample. A span that ends at the
        model's output adds its loss to the running loss.
        """
        count = self._num_layers
        start, stop = span if span is not None else (0, count)
        if not 0 <= start < stop <= count:
            raise ValueError(f"span={span!r} must be a [start, stop) range of the {count} DAD layers")
        with_classifier = with_classifier and stop == count and self._has_classifier
        is_model_output = stop == count and (with_classifier or not self._has_classifier)
        if self._engine is not None and self.uses_engine:
            return self._engine.run(
                batch, self.config, span=(start, stop), with_classifier=with_classifier,
                reducer=self.gradient_reducer, count_loss=is_model_output,
                accumulate_statistics=self.accumulate_classifier_statistics,
                dropout=Dropout(self.dropout, self.dropout_seed, self.step_count) if self.dropout else None,
            )
        logits, loss, features = self._eager_layers(batch, start, stop, with_classifier)
        logits, loss = logits.detach().float(), loss.detach().float()
        if is_model_output:
            self._loss_sum += loss
        return StepOutput(logits, loss, features, is_model_output)

    @torch.no_grad()
    def _eager_layers(
        self, batch: Batch, start: int, stop: int, with_classifier: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The reference layer loop: per layer forward, local gradients, update.

        A layer's update may wait: layer ``k+1`` consumes layer ``k``'s *pre-update* output, so
        the result is the same. With a ``gradient_reducer`` an update waits one layer, while its
        gradients are reduced. With the non-finite guard every update (and the classifier's, its
        statistics and the input sample) waits to the end of the step, which applies all or none.
        """
        guarded = self.on_nonfinite != "ignore"
        if start == 0 and self.classifier_sample is not None and not guarded:
            self.classifier_sample.add(batch.x, batch.y)
        workspaces = self._workspaces[start:stop]
        if stop < self._num_layers:
            # the span's output leaves (e.g. with an asynchronous send): it must not live in a
            # workspace that the next batch overwrites
            workspaces[-1] = None
        reducer = self.gradient_reducer
        hold = stop - start if guarded else int(reducer is not None)
        pending: deque[tuple[LocalLayer, Any, list[Tensor], Tensor]] = deque()
        h = batch.x
        for index, (layer, workspace) in enumerate(zip(self.model.dad_layers[start:stop], workspaces), start):
            result, grads = layer.local_gradients(h, batch.y, batch.compute_dtype, workspace)
            work = None
            if reducer is not None:
                # grads[0] may alias the workspace: launch() copies it into its buffer at once
                work, grads = reducer.launch(grads)
            pending.append((layer, work, grads, result.loss))
            while len(pending) > hold:
                self._apply_pending(*pending.popleft(), batch.lr)
            h = result.output
            if self.dropout:
                h = counter_dropout(h, self.dropout, self.dropout_seed, self.step_count, index)
        logits, loss = result.logits, result.loss
        classifier_grads: list[Tensor] = []
        rows = h.flatten(1)  # the classifier reads a convolution's or block's output as rows
        if with_classifier:
            # the classifier reads the last layer's pre-update output: with a reducer its step
            # runs while the last layer's gradients are still being reduced
            logits, loss, classifier_grads = self._classifier_gradients(rows, batch)
            if not guarded:
                self._apply_classifier(rows, batch, classifier_grads)
        if guarded and not self._all_finite(pending, classifier_grads):
            self._skipped_update(self._first_nonfinite(pending, classifier_grads))
            return logits, loss, h
        while pending:
            self._apply_pending(*pending.popleft(), batch.lr)
        if guarded:
            if with_classifier:
                self._apply_classifier(rows, batch, classifier_grads)
            if start == 0 and self.classifier_sample is not None:
                self.classifier_sample.add(batch.x, batch.y)
        return logits, loss, h

    def _apply_pending(self, layer: LocalLayer, work: Any, grads: list[Tensor], loss: Tensor, lr: float) -> None:
        if work is not None:
            work.wait()
        layer.apply_local_update(grads, self.config, lr)

    def _all_finite(
        self, pending: deque[tuple[LocalLayer, Any, list[Tensor], Tensor]], classifier_grads: list[Tensor]
    ) -> bool:
        """Whether every pending gradient (after its reduction) and local loss is finite. With a
        reducer only the reduced gradients count: they are the same on every rank, the local
        losses are not, and every rank must skip alike."""
        witnesses: list[Tensor] = []
        for layer, work, grads, loss in pending:
            if work is not None:
                work.wait()
            witnesses += layer.nonfinite_witnesses(grads)
            if self.gradient_reducer is None:
                witnesses.append(loss)
        return gradients_are_finite(witnesses + classifier_grads)

    def _first_nonfinite(
        self, pending: deque[tuple[LocalLayer, Any, list[Tensor], Tensor]], classifier_grads: list[Tensor]
    ) -> str:
        """``model.<name>`` of the first layer (or the classifier) whose gradients are not all finite."""
        names = {id(module): f"model.{name}" for name, module in self.model.named_modules()}
        for layer, _, grads, _ in pending:
            if not gradients_are_finite(grads):
                return names[id(layer)]
        if classifier_grads and not gradients_are_finite(classifier_grads):
            return "model.classifier"
        return f"the local loss of {names[id(pending[0][0])]} or a layer above it"

    def _skipped_update(self, where: str) -> None:
        """Count a step skipped for non-finite gradients; raise ``FloatingPointError`` under ``"raise"``."""
        self.skipped_updates += 1
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite local gradients in {where} at step {self.step_count} (lr too high, or "
                "half-precision overflow?); nothing was updated in this step (no layer, no classifier). Lower lr, "
                "or pass DADTrainer(on_nonfinite='skip') to skip and count such steps"
            )

    def _classifier_gradients(self, features: Tensor, batch: Batch) -> tuple[Tensor, Tensor, list[Tensor]]:
        """``(logits, loss, [grad_weight, grad_bias])`` of the classifier as an output head, reduced
        across processes when a ``gradient_reducer`` is set; nothing is updated."""
        classifier = self.model.get_classifier()
        assert classifier is not None
        dtype = batch.compute_dtype or classifier.weight.dtype
        bias = classifier.bias.to(dtype) if classifier.bias is not None else None
        result = functional.head_loss_and_gradients(
            features.to(dtype), classifier.weight.to(dtype), bias, batch.y, label_smoothing=self.classifier_label_smoothing
        )
        grads = [result.grad_weight.to(classifier.weight.dtype)]
        if result.grad_bias is not None:
            grads.append(result.grad_bias.to(classifier.weight.dtype))
        if self.gradient_reducer is not None:
            self.gradient_reducer(grads)
        return result.logits, result.loss.float(), grads

    def _apply_classifier(self, features: Tensor, batch: Batch, grads: list[Tensor]) -> None:
        """Step the classifier from ``grads`` and add ``features`` to its Gram statistics."""
        assert self.classifier_state is not None and self.classifier_statistics is not None
        if self.accumulate_classifier_statistics:
            if features.is_cuda:
                from ..ops.gram import gram_update_  # lazily: the CPU never imports the kernels

                gram_update_(self.classifier_statistics, features, batch.y)
            else:
                self.classifier_statistics.update(features, batch.y)
        self.classifier_state.apply_(self._classifier_tensors(), grads, self.config, batch.lr)

    def finish_step(self, output: StepOutput) -> tuple[Tensor, Tensor]:
        """Count the step (and, for the model's output, its loss; no host sync): ``(logits, loss)``."""
        self.step_count += 1
        if output.is_model_output:
            self._loss_batches += 1
        return output.logits, output.loss

    @property
    def running_loss(self) -> float:
        """Mean loss over the steps since the last call (reads the device once)."""
        if self._loss_batches == 0:
            return float("nan")
        value = float(self._loss_sum) / self._loss_batches
        self._loss_sum.zero_()
        self._loss_batches = 0
        return value

    # ------------------------------------------------------------------ closed-form classifier
    def reset_classifier_statistics(self) -> None:
        """Forget the Gram statistics and the input sample accumulated by :meth:`step`."""
        if self.classifier_statistics is not None:
            self.classifier_statistics.reset()
        if self.classifier_sample is not None:
            self.classifier_sample.reset()

    def require_classifier(self) -> nn.Linear:
        """``model.classifier``; raises ``ValueError`` naming the fix when the model has none."""
        classifier = self.model.get_classifier()
        if classifier is None or self.classifier_statistics is None:
            raise ValueError(
                "solve_head() needs model.classifier (an nn.Linear on the last DAD layer's output); "
                f"{type(self.model).__name__} has none. Add `self.classifier = torch.nn.Linear(features, classes)`"
            )
        return classifier

    @torch.no_grad()
    def features_statistics(self, batches: Iterable[tuple[Tensor, Tensor]]) -> GramAccumulator:
        """Gram statistics of ``model.features(x)`` over ``batches``, computed in eval mode."""
        classifier = self.require_classifier()
        stats = GramAccumulator(classifier.in_features, classifier.out_features, device=self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in batches:
                x, y = self._prepare(*as_batch_pair(batch))
                stats.update(self.model.features(x), y)
        finally:
            self.model.train(was_training)
        return stats

    @torch.no_grad()
    def solve_head(
        self,
        lambda_reg: float | str = "auto",
        loader: Iterable[tuple[Tensor, Tensor]] | None = None,
        *,
        statistics: GramAccumulator | None = None,
    ) -> RidgeSolution:
        """Solve ``model.classifier`` in closed form by ridge regression onto one-hot labels.

        With ``loader``, one no-grad pass computes the final features with the current
        weights. With ``statistics``, it solves from those (e.g. gathered by a pipeline's last
        stage). Without either, it uses what ``step()`` accumulated since the last solve or
        reset (then reset): the features of the input sample recomputed with the current
        weights (``classifier_sample_size > 0``, the default), else the streamed Gram statistics.
        ``lambda_reg="auto"`` picks lambda by GCV.
        """
        classifier = self.require_classifier()
        assert self.classifier_statistics is not None and self.classifier_state is not None
        if statistics is not None:
            stats = statistics
        elif loader is not None:
            stats = self.features_statistics(loader)
        elif self.classifier_sample is not None and self.classifier_sample.size > 0:
            stats = self.features_statistics(self.classifier_sample.batches())
        else:
            stats = self.classifier_statistics
        if self.statistics_reducer is not None:
            self.statistics_reducer(stats)
        solution = stats.solve(lambda_reg)
        # without a bias the intercept is dropped: the solve centred it away
        classifier.weight.copy_(solution.weight.to(classifier.weight.dtype))
        if classifier.bias is not None:
            classifier.bias.copy_(solution.bias.to(classifier.bias.dtype))
        for buffer in self.classifier_state.buffers():
            buffer.zero_()
        if loader is None and statistics is None:
            self.reset_classifier_statistics()
        return solution

    # ------------------------------------------------------------------ loops
    def batches(
        self, data: Any, batch_size: int, shuffle: bool, generator: torch.Generator | None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """``(x, y)`` batches of ``data``: a pair of tensors ``(X, Y)`` is cut into ``batch_size``
        rows (shuffled with ``generator``); any other iterable yields its batches through
        :func:`as_batch_pair` (pairs, or dicts with an input and a label key)."""
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
            inputs, labels = data
            n = inputs.shape[0]
            if labels.shape[0] != n:
                raise ValueError(f"inputs have {n} rows but labels have {labels.shape[0]}")
            order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                yield inputs[idx], labels[idx]
        elif isinstance(data, (Mapping, str, Tensor)) or not isinstance(data, Iterable):
            raise TypeError(
                f"data must be a pair of tensors (X, Y) or an iterable of batches (e.g. a DataLoader), got "
                f"{type(data).__name__}" + ("; for a dict of tensors pass (d['x'], d['labels'])" if isinstance(data, Mapping) else "")
            )
        else:
            for batch in data:
                yield as_batch_pair(batch)

    def fit(
        self,
        train: Any,
        epochs: int = 1,
        eval: Any = None,
        *,
        batch_size: int = 256,
        shuffle: bool = True,
        seed: int | None = 0,
        progress: bool = True,
        log_every: int = 50,
        schedule: Callable[[int], float] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep_last: int = 2,
        resume: bool = False,
    ) -> list[dict[str, float]]:
        """Train for ``epochs``; returns (and appends to ``self.history``) one record per epoch.

        ``train``/``eval`` are a pair of tensors ``(X, Y)``, batched here with ``batch_size``, or
        an iterable of batches (e.g. a ``DataLoader``), each either a pair ``(x, y)`` or a dict
        with an input key (``"x"``, ``"inputs"``, ``"input"`` or ``"pixel_values"``) and a label
        key (``"labels"``, ``"label"`` or ``"y"``), as a ``DataLoader`` over a HuggingFace dataset
        yields; inputs of shape ``(batch, ...)`` are flattened per row when the first layer is a
        :class:`~torch_dad.DADLinear`, and kept as they are for a ``DADConv2d`` (``(batch, C, H, W)``) or a
        ``DADBlock``. Each record holds
        ``epoch, loss, train_s, img_per_s`` and, with ``eval``, ``accuracy`` / ``eval_loss``.
        A tqdm bar shows progress if tqdm is installed; the loss it shows is read every
        ``log_every`` steps only, so training stays free of host syncs in between.
        ``schedule(step_count) -> lr`` sets each step's learning rate (e.g.
        :func:`torch_dad.training.schedules.warmup_cosine`); ``None`` keeps the trainer's ``lr``.
        ``seed`` draws the data order (``None``: from torch's global generator, once per call).

        With ``checkpoint_dir``, the whole training state (see :mod:`torch_dad.training.checkpoint`)
        is written there every ``checkpoint_every`` steps (``None``: only at epoch ends) and at the
        end of each epoch, keeping the newest ``keep_last`` files. ``resume=True`` continues from
        the newest intact checkpoint there, mid-epoch included (a corrupt one is skipped with a
        warning; none at all starts from the beginning, with a warning); on CPU the result is
        bitwise that of an uninterrupted run. An iterable ``train`` is then re-iterated from its
        start and the batches already trained on are skipped: it must yield the same batches in
        the same order. Guide: ``docs/checkpoints.md``.
        """
        folder = self._check_fit_arguments(epochs, schedule, checkpoint_dir, checkpoint_every, keep_last, resume)
        args = {"epochs": epochs, "batch_size": batch_size, "seed": seed, "shuffle": shuffle}
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else seed)
        run = self._start_fit(folder, resume, args, generator)
        for epoch in range(run.epoch, epochs):
            generator.set_state(run.generator_state)
            batches = itertools.islice(self.batches(train, batch_size, shuffle, generator), run.batches, None)
            bar = progress_bar(batches, progress, desc=f"epoch {epoch + 1}/{epochs}")
            record = self._train_epoch(bar, log_every, schedule, run, folder)
            if eval is not None:
                metrics = self.evaluate(eval, batch_size=batch_size)
                record["accuracy"] = metrics["accuracy"]
                record["eval_loss"] = metrics["loss"]
            if hasattr(bar, "close"):
                bar.close()
            self.history.append(record)
            run.next_epoch(generator.get_state())
            if folder is not None:
                folder.save(self.step_count, self._checkpoint_state(run))
        return self.history[run.history_start :]

    def _check_fit_arguments(
        self,
        epochs: object,
        schedule: object,
        checkpoint_dir: object,
        checkpoint_every: object,
        keep_last: object,
        resume: object,
    ) -> CheckpointFolder | None:
        """Validate ``fit``'s arguments before anything changes; the checkpoint folder or ``None``."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} must be a positive int")
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a callable step -> lr, got {type(schedule).__name__}")
        check_bool("resume", resume)
        every = None if checkpoint_every is None else check_positive_int("checkpoint_every", checkpoint_every)
        keep = check_positive_int("keep_last", keep_last)
        if checkpoint_dir is None:
            if resume or every is not None:
                raise ValueError(
                    f"{'resume=True' if resume else f'checkpoint_every={every}'} needs checkpoint_dir= (the folder "
                    "that holds the checkpoints)"
                )
            return None
        if self.gradient_reducer is not None:
            raise ValueError(
                "checkpoint_dir: fit() checkpoints a single process; with data parallelism call "
                "save_checkpoint(path) on rank 0 between fit() calls"
            )
        return CheckpointFolder(checkpoint.check_folder(checkpoint_dir), every, keep)

    def _start_fit(
        self, folder: CheckpointFolder | None, resume: bool, args: dict[str, Any], generator: torch.Generator
    ) -> FitProgress:
        """The starting point of ``fit``: restored from the newest intact checkpoint with ``resume``, else fresh."""
        fresh = FitProgress(args, len(self.history), generator.get_state(), torch.zeros((), device=self.device))
        if folder is None:
            return fresh
        found = folder.newest() if resume else None
        if found is None:
            if resume:
                warnings.warn(
                    f"resume=True: no checkpoint in {folder.folder}; training from the start", UserWarning, stacklevel=3
                )
            folder.check_fresh_start(self.step_count)
            folder.remove_temporaries()
            return fresh
        path, state = found
        if not isinstance(state, dict) or state.get("fit") is None:
            raise ValueError(f"resume=True: {path} holds no fit() progress (written by save_checkpoint?)")
        run = FitProgress.from_state(state["fit"], path, self.device)
        run.check_args(args, path)
        self._restore(state["trainer"], path)
        folder.remove_temporaries()
        return run

    def _checkpoint_state(self, run: FitProgress) -> dict[str, Any]:
        return {"trainer": self.state_dict(), "fit": run.state()}

    def _train_epoch(
        self,
        bar: Any,
        log_every: int,
        schedule: Callable[[int], float] | None,
        run: FitProgress,
        folder: CheckpointFolder | None = None,
    ) -> dict[str, float]:
        """:meth:`step` over ``bar``, continuing ``run``'s totals (checkpointed to ``folder`` when due):
        ``{epoch, loss, train_s, img_per_s}``. Checkpoint writes are not counted in ``train_s``."""
        self._synchronize()
        start = time.perf_counter()
        for inputs, labels in bar:
            _, loss = self.step(inputs, labels, lr=None if schedule is None else schedule(self.step_count))
            run.loss_sum += loss
            run.batches += 1
            run.seen += inputs.shape[0]
            if run.batches % log_every == 0:
                mean_loss = float(run.loss_sum) / run.batches
                if mean_loss != mean_loss or mean_loss in (float("inf"), float("-inf")):
                    raise FloatingPointError(
                        f"training loss became non-finite by step {self.step_count}; lower lr, or use "
                        "amp_dtype=torch.bfloat16 instead of float16"
                    )
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{mean_loss:.4f}")
            if folder is not None and folder.due(self.step_count):
                self._synchronize()
                run.seconds += time.perf_counter() - start
                folder.save(self.step_count, self._checkpoint_state(run))
                start = time.perf_counter()
        self._synchronize()
        run.seconds += time.perf_counter() - start
        return {
            "epoch": float(len(self.history) + 1),
            "loss": float(run.loss_sum) / max(run.batches, 1),
            "train_s": run.seconds,
            "img_per_s": run.seen / run.seconds if run.seconds > 0 else float("nan"),
        }

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def evaluate(self, data: Any, *, batch_size: int = 1024, use_local_head: bool = False) -> dict[str, float]:
        """Accuracy and mean cross-entropy of ``model(x)`` (or the last local head) over ``data``."""
        was_training = self.model.training
        self.model.eval()
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        total = 0
        try:
            for inputs, labels in self.batches(data, batch_size, False, None):
                x, y = self._prepare(inputs, labels)
                logits = self.model.local_head_logits(x) if use_local_head else self.model(x)
                correct += (logits.argmax(1) == y).sum()
                loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
                total += y.shape[0]
        finally:
            self.model.train(was_training)
        if total == 0:
            raise ValueError("evaluate() got no batches")
        return {"accuracy": int(correct) / total, "loss": float(loss_sum) / total, "samples": float(total)}

    # ------------------------------------------------------------------ checkpoints
    def state_tensors(self) -> list[Tensor]:
        """Every tensor of the trainer's state in a fixed order: model, classifier optimizer, Gram statistics."""
        tensors = list(self.model.state_dict().values())
        if self.classifier_state is not None:
            tensors += list(self.classifier_state.buffers())
        if self.classifier_statistics is not None:
            tensors += list(self.classifier_statistics.buffers())
        return tensors

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-for-bit: model (with local heads and moments),
        classifier optimizer state, Gram statistics, input sample, step count and hyper-parameters."""
        return {
            "model": self.model.state_dict(),
            "classifier_state": self.classifier_state.state_dict() if self.classifier_state is not None else None,
            "classifier_statistics": self.classifier_statistics.state_dict() if self.classifier_statistics is not None else None,
            "classifier_sample": self.classifier_sample.state_dict() if self.classifier_sample is not None else None,
            "step_count": self.step_count,
            "dropout_seed": self.dropout_seed,
            "skipped_updates": self.skipped_updates,
            "config": dict(vars(self.config)),
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        missing = {"model", "classifier_state", "classifier_statistics", "step_count", "config"} - set(state)
        if missing:
            raise ValueError(f"trainer state_dict is missing keys {sorted(missing)}")
        if self.classifier_state is not None and state["classifier_state"] is None:
            raise ValueError("checkpoint has no classifier state but this model has a classifier")
        self._sample_for(state)
        if self.classifier_state is not None and (self.classifier_sample is None) != (state.get("classifier_sample") is None):
            raise ValueError(
                "checkpoint and trainer disagree on classifier_sample_size (one keeps an input sample, the "
                "other does not); build the trainer with the classifier_sample_size used when saving"
            )
        self.model.load_state_dict(state["model"])
        if self.classifier_state is not None:
            assert self.classifier_statistics is not None
            self.classifier_state.load_state_dict(state["classifier_state"])
            self.classifier_statistics.load_state_dict(state["classifier_statistics"])
            if self.classifier_sample is not None:
                self.classifier_sample.load_state_dict(state["classifier_sample"])
        config = dict(state["config"])
        config["betas"] = tuple(config["betas"])
        self.config = OptimizerConfig(**config)
        self.step_count = int(state["step_count"])
        self.dropout_seed = int(state.get("dropout_seed", self.dropout_seed))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.history = list(state.get("history", []))
        if self._engine is not None:
            self._engine.refresh_shadows()

    def _sample_for(self, state: dict[str, Any]) -> bool:
        """Make the input sample that ``state`` holds if this trainer has not made it yet (a convolution
        or block makes it at its first batch); True if it did."""
        saved = state.get("classifier_sample")
        inputs = saved.get("inputs") if isinstance(saved, dict) else None
        if self.classifier_sample is not None or not self._sample_size or not isinstance(inputs, Tensor):
            return False
        if self.classifier_state is None:
            return False
        self._make_sample(tuple(inputs.shape[1:]), inputs.dtype)
        return True

    def _drop_sample(self) -> None:
        self.classifier_sample = None
        if self._engine is not None:
            self._engine.sample = None

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` to ``path`` as one safetensors file (tensors; the rest as JSON in its
        metadata, with a sha256 of the whole), atomically: see ``docs/checkpoints.md``."""
        checkpoint.write(path, {"trainer": self.state_dict(), "fit": None})

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` or by ``fit(checkpoint_dir=...)``.

        No code runs on load (no pickle). Raises ``ValueError`` naming the file and the fault when it is
        truncated or corrupted, and naming each difference (``"model.l1.weight: checkpoint (512, 784),
        model (256, 784)"``) when it was written for another model or configuration; the trainer is then
        unchanged.
        """
        state = checkpoint.read(path)
        if not isinstance(state, dict) or not isinstance(state.get("trainer"), dict):
            raise checkpoint.CheckpointError(f"{path} holds no trainer state")
        self._restore(state["trainer"], path)

    def _restore(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """:meth:`load_state_dict` after checking every tensor's presence, shape and dtype; on any failure
        the previous state is put back."""
        made = self._sample_for(state)
        problems = checkpoint.mismatches(self.state_dict(), state)
        if problems:
            if made:
                self._drop_sample()
            raise ValueError(f"checkpoint {path} does not match this trainer: " + "; ".join(problems))
        skeleton, tensors = checkpoint.flatten(self.state_dict())
        try:
            self.load_state_dict(state)
        except Exception:
            self.load_state_dict(checkpoint.unflatten(skeleton, tensors))
            raise
