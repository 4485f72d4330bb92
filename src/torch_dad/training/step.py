"""What one training step passes between its parts: the validated batch, the result, the reducer hook.

:meth:`DADTrainer.step <torch_dad.DADTrainer.step>` is ``prepare_batch`` -> ``train_layers`` ->
``finish_step``. ``train_layers`` runs either the eager layer loop or the fused engine; data
parallelism plugs in a :class:`GradientReducer`, the pipeline trains a span of layers per stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = ["Batch", "Dropout", "GradientReducer", "StepOutput", "progress_bar"]


class Batch(NamedTuple):
    """A validated training batch: ``x`` (B, in) on the trainer's device in the master dtype,
    int64 labels ``y``, the step's ``lr`` and ``compute_dtype`` (``None``: the master dtype)."""

    x: Tensor
    y: Tensor
    lr: float
    compute_dtype: torch.dtype | None


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
    whose loss the trainer's running loss counts."""

    logits: Tensor
    loss: Tensor
    features: Tensor
    is_model_output: bool


class GradientReducer(Protocol):
    """Reduces local gradients across processes before they are applied.

    ``launch(grads)`` starts the reduction and returns ``(work, views)``: after ``work.wait()``
    (``work`` may be ``None`` when the reduction already finished) ``views`` hold the reduced
    gradients. ``__call__(grads)`` reduces in place and waits.
    """

    def launch(self, grads: Sequence[Tensor]) -> tuple[Any, list[Tensor]]: ...

    def __call__(self, grads: list[Tensor]) -> None: ...


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
