"""The model's classifier as its own object: :class:`OutputClassifier`.

``model.classifier`` (an ``nn.Linear`` on the last DAD layer's flattened output) is trained online
as an output head, its gradient exactly backprop's for that layer, and solved in closed form by
:meth:`OutputClassifier.solve`. For the solve it keeps either a uniform sample of the input rows
(``sample_size > 0``, the default: their features are recomputed with the current weights) or
streamed float64 Gram statistics (``in_features²``, allocated only in that mode). Recomputed
features of fewer rows than ``in_features`` are solved in the dual, from the rows' ``n²`` products
(``GramAccumulator(keep_rows=True)``), with no ``in_features²`` matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import functional
from ..ops.gram import gram_update_
from ..ops.local_error import local_error
from ..optim import LocalOptimizerState, OptimizerConfig
from ..ridge import GramAccumulator, RidgeSolution, logit_scale
from .input_sample import InputReservoir

__all__ = ["OutputClassifier"]


class OutputClassifier:
    """``linear`` trained as the model's output head, with its optimizer state and what its solve reads.

    Args:
        linear: the model's classifier.
        sample_size: rows of the input sample kept for :meth:`solve` (``0``: none).
        statistics: accumulate the Gram statistics of its input features every step.
        window: forget statistics older than about this many samples (``None``: never).
        label_smoothing: of the online cross-entropy, as ``nn.CrossEntropyLoss(label_smoothing=)``.
    """

    def __init__(
        self, linear: nn.Linear, *, sample_size: int, statistics: bool, window: float | None,
        label_smoothing: float = 0.0,
    ) -> None:
        self.linear = linear
        self.label_smoothing = label_smoothing
        self.sample_size = sample_size
        self.window = window
        device = linear.weight.device
        self.state = LocalOptimizerState([p.shape for p in self.tensors], device=device, dtype=linear.weight.dtype)
        self.statistics: GramAccumulator | None = None
        self.keep_statistics(statistics)
        self.sample: InputReservoir | None = None

    # ------------------------------------------------------------------ configuration
    @property
    def tensors(self) -> list[Tensor]:
        """The trained tensors: ``[weight, bias]`` (no bias if the linear has none)."""
        linear = self.linear
        return [linear.weight.data] + ([linear.bias.data] if linear.bias is not None else [])

    def keep_statistics(self, on: bool) -> None:
        """Accumulate the Gram statistics every step (allocated here) or not (freed)."""
        if on and self.statistics is None:
            linear = self.linear
            self.statistics = GramAccumulator(
                linear.in_features, linear.out_features, device=linear.weight.device, window=self.window
            )
        elif not on:
            self.statistics = None

    def ensure_sample(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Make the input sample for rows of ``shape`` unless it exists or is off; True if made."""
        if self.sample is not None or not self.sample_size:
            return False
        self.sample = InputReservoir(self.sample_size, shape, device=self.linear.weight.device, dtype=dtype)
        return True

    def discard_sample(self) -> None:
        """Forget the input sample itself (it is made again at the next batch)."""
        self.sample = None

    def drop_sample(self) -> None:
        """Keep no input sample (a pipeline stage that never sees the raw inputs)."""
        self.sample = None
        self.sample_size = 0

    @property
    def keeps_sample(self) -> bool:
        return bool(self.sample_size)

    # ------------------------------------------------------------------ the online step
    def offer(self, inputs: Tensor, labels: Tensor) -> None:
        """Offer a batch of input rows to the sample (if one is kept)."""
        if self.sample is not None:
            self.sample.add(inputs, labels)

    def gradients(
        self, features: Tensor, labels: Tensor, compute_dtype: torch.dtype | None, *, backend: str = "torch"
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """``(logits, loss, [grad_weight, grad_bias])`` of the output head on ``features`` (rows):
        PyTorch ops in ``compute_dtype`` (``backend="torch"``), or the local-error kernel on
        ``features`` as given, fp32-accumulated (``"triton"``)."""
        linear = self.linear
        if backend == "triton":
            bias = linear.bias.detach() if linear.bias is not None else features.new_zeros(
                linear.out_features, dtype=torch.float32
            )
            err = local_error(
                features, linear.weight.detach(), bias, labels, with_dz=False, label_smoothing=self.label_smoothing
            )
            return err.logits, err.loss, [err.grad_head_weight, err.grad_head_bias][: len(self.tensors)]
        weight = linear.weight
        dtype = compute_dtype or weight.dtype
        bias_c = linear.bias.to(dtype) if linear.bias is not None else None
        result = functional.head_loss_and_gradients(
            features.to(dtype), weight.to(dtype), bias_c, labels, label_smoothing=self.label_smoothing
        )
        grads = [result.grad_weight.to(weight.dtype)]
        if result.grad_bias is not None:
            grads.append(result.grad_bias.to(weight.dtype))
        return result.logits, result.loss.float(), grads

    def accumulate(self, features: Tensor, labels: Tensor) -> None:
        """Add the feature rows to the Gram statistics, if they are kept."""
        if self.statistics is None:
            return
        if features.is_cuda:
            gram_update_(self.statistics, features, labels)
        else:
            self.statistics.update(features, labels)

    def apply(self, features: Tensor, labels: Tensor, grads: list[Tensor], config: OptimizerConfig, lr: float) -> None:
        """:meth:`accumulate` ``features``, then step the classifier from ``grads``."""
        self.accumulate(features, labels)
        self.state.apply_(self.tensors, grads, config, lr)

    # ------------------------------------------------------------------ the closed-form solve
    def statistics_of(self, batches: Iterable[tuple[Tensor, Tensor]]) -> GramAccumulator:
        """Statistics of the feature rows in ``batches`` (``(features, labels)`` pairs): the rows
        themselves while fewer than ``in_features`` (solved in the dual), else their Gram."""
        linear = self.linear
        stats = GramAccumulator(linear.in_features, linear.out_features, device=linear.weight.device, keep_rows=True)
        for features, labels in batches:
            stats.update(features.flatten(1), labels)
        return stats

    @torch.no_grad()
    def solve(
        self, stats: GramAccumulator, lambda_reg: float | str,
        calibration: Callable[[], Iterator[tuple[Tensor, Tensor]]] | None = None,
    ) -> RidgeSolution:
        """Ridge-solve the classifier from ``stats`` and reset its optimizer state.

        ``calibration`` yields ``(features, labels)`` batches: the solved scores are then scaled by
        the one positive factor that minimises their cross-entropy there (``argmax`` unchanged),
        so ``evaluate()``'s loss reads as a calibrated model's.
        """
        solution = stats.solve(lambda_reg)
        linear = self.linear
        linear.weight.copy_(solution.weight.to(linear.weight.dtype))
        if linear.bias is not None:
            # without a bias the intercept is dropped: the solve centred it away
            linear.bias.copy_(solution.bias.to(linear.bias.dtype))
        if calibration is not None:
            self.calibrate(calibration())
        for buffer in self.state.buffers():
            buffer.zero_()
        return solution

    @torch.no_grad()
    def calibrate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> None:
        """:meth:`calibrate_logits` on the classifier's outputs for ``(features, labels)`` batches."""
        pairs = [(self.linear(features.flatten(1)).float(), labels) for features, labels in batches]
        if pairs:
            self.calibrate_logits(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))

    @torch.no_grad()
    def calibrate_logits(self, logits: Tensor, labels: Tensor) -> None:
        """Scale weight and bias by the positive factor that minimises the cross-entropy of ``logits``
        (the classifier's outputs) on ``labels`` (:func:`~torch_dad.ridge.logit_scale`); argmax unchanged."""
        scale = logit_scale(logits, labels)
        self.linear.weight.mul_(scale)
        if self.linear.bias is not None:
            self.linear.bias.mul_(scale)

    def reset(self) -> None:
        """Forget the Gram statistics and the input sample."""
        if self.statistics is not None:
            self.statistics.reset()
        if self.sample is not None:
            self.sample.reset()

    # ------------------------------------------------------------------ state
    def buffers(self) -> list[Tensor]:
        """The optimizer state's and the statistics' tensors (what data parallelism keeps equal)."""
        tensors = list(self.state.buffers())
        if self.statistics is not None:
            tensors += list(self.statistics.buffers())
        return tensors

    def state_dict(self) -> dict[str, Any]:
        return {
            "classifier_state": self.state.state_dict(),
            "classifier_statistics": self.statistics.state_dict() if self.statistics is not None else None,
            "classifier_sample": self.sample.state_dict() if self.sample is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s entries (statistics this classifier does not keep are ignored)."""
        self.state.load_state_dict(state["classifier_state"])
        saved_statistics = state.get("classifier_statistics")
        if self.statistics is not None:
            if saved_statistics is None:
                self.statistics.reset()
            else:
                self.statistics.load_state_dict(saved_statistics)
        if self.sample is not None:
            self.sample.load_state_dict(state["classifier_sample"])
