"""One training step: what its parts pass each other, and :class:`LayerLoop`, its one per-layer loop.

:meth:`DADTrainer.step <torch_dad.DADTrainer.step>` is ``prepare_batch`` -> ``train_layers`` ->
``finish_step``. ``train_layers`` hands the batch and a :class:`StepPlan` to the trainer's
:class:`StepRunner`, picked once at construction: the eager runner (:mod:`torch_dad.training.eager`,
the reference, what runs on CPU) or the fused/graphed one (:mod:`torch_dad.training.engine`). Both
run :class:`LayerLoop`; data parallelism plugs in a :class:`GradientReducer`, the pipeline trains a
span of layers per stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from ..ops.dropout import counter_dropout
from ..optim import OptimizerConfig

__all__ = [
    "Batch", "Dropout", "GradientReducer", "HeldUpdates", "LayerLoop", "RunningLoss", "StepOutput", "StepPlan",
    "StepRunner", "input_dtype", "progress_bar",
]


class Batch(NamedTuple):
    """A validated training batch: ``x`` (B, in) on the trainer's device (floats in the master
    dtype; integer or bool inputs, e.g. token ids, as given), int64 labels ``y``, the step's ``lr``
    and ``compute_dtype`` (``None``: the master dtype)."""

    x: Tensor
    y: Tensor
    lr: float
    compute_dtype: torch.dtype | None


def input_dtype(x: Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the first layer reads ``x`` in: ``compute_dtype`` for float inputs, ``x``'s own
    for integer or bool inputs (token ids for an embedding are never cast), or without one."""
    if compute_dtype is None or not x.dtype.is_floating_point:
        return x.dtype
    return compute_dtype


class Dropout(NamedTuple):
    """The step's dropout: probability ``p``, the Philox key ``seed`` and the trainer's ``step_count``,
    the counter its masks are drawn for (:func:`torch_dad.ops.dropout.counter_dropout`)."""

    p: float
    seed: int
    step: int


class StepOutput(NamedTuple):
    """What training a span of layers returns: the detached float32 logits and loss of the last
    trained part (the classifier, or the span's last local head), the span's output ``features``
    (the next stage's input), and ``is_model_output``: whether that part was the model's output,
    whose loss the trainer's running loss counts; ``nonfinite``: where a guarded step found
    non-finite gradients (nothing was then updated), else ``None``."""

    logits: Tensor
    loss: Tensor
    features: Tensor
    is_model_output: bool
    nonfinite: str | None = None


class GradientReducer(Protocol):
    """Reduces local gradients across processes before they are applied.

    ``launch(grads)`` starts the reduction and returns ``(work, views)``: after ``work.wait()``
    (``work`` may be ``None`` when the reduction already finished) ``views`` hold the reduced
    gradients. ``__call__(grads)`` reduces in place and waits.
    """

    def launch(self, grads: Sequence[Tensor]) -> tuple[Any, list[Tensor]]: ...

    def __call__(self, grads: list[Tensor]) -> None: ...


class StepPlan(NamedTuple):
    """What a step trains: DAD layers ``[start, stop)``, then the classifier if ``with_classifier``;
    ``count_loss``: the loss is the model's output loss, added to the running loss; ``config``: the
    optimizer; ``dropout``: between layers (``None``: none)."""

    start: int
    stop: int
    with_classifier: bool
    count_loss: bool
    config: OptimizerConfig
    dropout: Dropout | None = None


class StepRunner(Protocol):
    """Runs one training step of a plan: the eager runner or the fused (CUDA-graphed) one."""

    def run(self, batch: Batch, plan: StepPlan, reducer: GradientReducer | None) -> StepOutput: ...

    def refresh(self) -> None:
        """Re-read the weights after an outside edit (e.g. a loaded checkpoint)."""


class RunningLoss:
    """The sum of the model's output losses on the device (no host sync) and the host count of steps."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), device=device)
        self.batches = 0

    def add(self, loss: Tensor) -> None:
        self.total += loss

    def count(self) -> None:
        """One more step's loss was added."""
        self.batches += 1

    def read(self) -> float:
        """Mean loss since the last read (reads the device once), then start over."""
        if self.batches == 0:
            return float("nan")
        value = float(self.total) / self.batches
        self.total.zero_()
        self.batches = 0
        return value


class HeldUpdates:
    """Updates that wait: layer ``k+1`` reads layer ``k``'s pre-update output, so an update may be
    applied later with the same result. Each is ``(work, apply)``: ``work`` (an all-reduce, or
    ``None``) is waited for before ``apply()``."""

    def __init__(self) -> None:
        self.items: deque[tuple[Any, Callable[[], None]]] = deque()

    def push(self, work: Any, apply: Callable[[], None], hold: int) -> None:
        """Hold one more update, then apply the oldest while more than ``hold`` wait."""
        self.items.append((work, apply))
        while len(self.items) > hold:
            self.apply_oldest()

    def apply_oldest(self) -> None:
        work, apply = self.items.popleft()
        if work is not None:
            work.wait()
        apply()

    def apply_all(self) -> None:
        while self.items:
            self.apply_oldest()

    def wait_all(self) -> None:
        """Wait for every held update's reduction (its gradients are then final)."""
        for work, _ in self.items:
            if work is not None:
                work.wait()
        self.items = deque((None, apply) for _, apply in self.items)

    def drop_all(self) -> None:
        self.wait_all()
        self.items.clear()


class LayerLoop:
    """One pass of a step over a plan's layers: the per-layer loop both runners share.

    Per layer :meth:`layer_step` (forward, local error, update, as the runner places it), then
    dropout of its output; then the classifier's step, and :meth:`finish` (held updates, the
    running loss). A runner subclasses it and fills in the per-layer and classifier steps.
    """

    def __init__(
        self, layers: Sequence[Any], batch: Batch, plan: StepPlan, reducer: GradientReducer | None,
        running_loss: RunningLoss,
    ) -> None:
        self.layers, self.batch, self.plan, self.reducer = layers[plan.start : plan.stop], batch, plan, reducer
        self.running_loss = running_loss
        self.held = HeldUpdates()
        #: the dropout masks' step counter: the trainer's step (eager) or a device tensor (a graph)
        self.dropout_step: int | Tensor = plan.dropout.step if plan.dropout is not None else 0

    def train(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits, loss, span output)`` of the step on the plan's span, updates applied."""
        self.begin()
        a = self.first_input()
        logits = loss = a
        for i, layer in enumerate(self.layers):
            h, logits, loss = self.layer_step(i, layer, a)
            a = self.drop(h, self.plan.start + i)
        if self.plan.with_classifier:
            logits, loss = self.classifier_step(a.flatten(1))  # a convolution's or block's output, as rows
        self.finish(loss)
        return logits, loss, a

    def drop(self, h: Tensor, index: int) -> Tensor:
        """Dropout of layer ``index``'s output: Philox of (seed, step, layer index, element), as in every runner."""
        dropout = self.plan.dropout
        if dropout is None or not dropout.p:
            return h
        return counter_dropout(h, dropout.p, dropout.seed, self.dropout_step, index)

    def begin(self) -> None:
        """Before the first layer (e.g. offer the rows to the classifier's input sample)."""

    def first_input(self) -> Tensor:
        return self.batch.x

    def layer_step(self, index: int, layer: Any, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Train ``layer`` on ``a``: ``(output, local logits, local loss)``."""
        raise NotImplementedError

    def classifier_step(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Train the classifier on ``features``: ``(logits, loss)``."""
        raise NotImplementedError

    def finish(self, loss: Tensor) -> None:
        """Apply what is held, and add the model's output loss to the running loss."""
        self.held.apply_all()
        if self.plan.count_loss:
            self.running_loss.add(loss)


def progress_bar(iterable: Iterable[Any], enabled: bool, desc: str) -> Any:
    """``tqdm(iterable)`` when ``enabled`` and tqdm is installed, else ``iterable`` itself."""
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    # disable=None: no bar when stdout is not a terminal (CI logs), as tqdm documents
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, disable=None)
