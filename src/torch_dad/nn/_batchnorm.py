"""The batch-norm state shared by :class:`~torch_dad.DADLinear` and :class:`~torch_dad.DADConv2d`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import functional
from ..ops.normalization import NormalizationSaved, batch_statistics, normalization_backward, normalization_forward
from ..optim import OptimizerConfig
from ._local import LocalLayer


class BatchNormLayer(LocalLayer):
    """A local layer whose pre-activation ``z`` (B, C, ...) may be batch-normalised per channel (axis 1),
    as ``nn.BatchNorm1d``/``nn.BatchNorm2d`` (math: :func:`torch_dad.functional.batch_norm_forward`).

    Training normalises by the batch's statistics (over the batch and any spatial axes), eval mode by
    the ``running_mean``/``running_var`` buffers (momentum 0.1, eps 1e-5); the affine
    ``norm_weight``/``norm_bias`` are parameters trained by the local loss, after the other trained
    tensors. The running statistics advance only with an applied local update
    (:meth:`apply_local_update`), so a skipped update leaves them unchanged.
    """

    norm_weight: nn.Parameter | None
    norm_bias: nn.Parameter | None
    running_mean: Tensor | None
    running_var: Tensor | None
    #: named by the error for a training batch of one row
    _small_batch_fix = "normalize=None"

    def _init_batch_norm(self, enabled: bool, channels: int) -> None:
        """The affine ``norm_weight``/``norm_bias`` parameters and the running-statistics buffers,
        ``channels`` each (uninitialised), or ``None`` for each; ``weight`` must exist."""
        kw: dict[str, Any] = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.norm_weight = nn.Parameter(torch.empty(channels, **kw)) if enabled else None
        self.norm_bias = nn.Parameter(torch.empty(channels, **kw)) if enabled else None
        self.register_buffer("running_mean", torch.empty(channels, **kw) if enabled else None)
        self.register_buffer("running_var", torch.empty(channels, **kw) if enabled else None)
        # (batch mean, biased batch variance, values per channel) of the last local step, folded
        # into the running statistics when its update is applied
        self._batch_statistics: tuple[Tensor, Tensor, int] | None = None

    @torch.no_grad()
    def _reset_batch_norm(self) -> None:
        """The batch norm's initialisation (if any), as ``nn.BatchNorm2d``: affine 1 and 0, running 0 and 1."""
        if self.norm_weight is not None and self.norm_bias is not None:
            self.norm_weight.fill_(1.0)
            self.norm_bias.zero_()
            self.reset_running_statistics()

    @torch.no_grad()
    def reset_running_statistics(self) -> None:
        """``running_mean = 0``, ``running_var = 1`` (``normalize="batchnorm"``; else nothing)."""
        if self.running_mean is not None and self.running_var is not None:
            self.running_mean.zero_()
            self.running_var.fill_(1.0)
        self._batch_statistics = None

    def trained_tensors(self) -> list[Tensor]:
        """``weight, [bias,] [head_weight, head_bias,] [norm_weight, norm_bias]``: the order of every
        local gradient list."""
        norm = [t for t in (self.norm_weight, self.norm_bias) if t is not None]
        return super().trained_tensors() + norm

    def _batch_norm(
        self, z: Tensor, training: bool, keep: bool = False
    ) -> tuple[Tensor, NormalizationSaved | None]:
        """``(out, saved)``: ``z`` normalised by the batch's statistics (``training``, one kernel:
        :func:`~torch_dad.ops.normalization.normalization_forward`; ``keep`` the statistics for
        :meth:`update_running_statistics`) or by the running ones (``saved`` is ``None``)."""
        assert self.running_mean is not None and self.running_var is not None
        if not training:
            weight = self.norm_weight.to(z.dtype) if self.norm_weight is not None else None
            bias = self.norm_bias.to(z.dtype) if self.norm_bias is not None else None
            mean, var = self.running_mean.to(z.dtype), self.running_var.to(z.dtype)
            return functional.batch_norm_forward(z, weight, bias, mean, var)[0], None
        if z.shape[0] < 2:
            raise ValueError(
                f"normalize='batchnorm' needs at least 2 rows per training batch, got {z.shape[0]}; "
                f"use larger batches or {self._small_batch_fix}"
            )
        out, saved = normalization_forward("batchnorm", z, self.norm_weight, self.norm_bias)
        if keep:
            self._batch_statistics = (*batch_statistics(saved), z.numel() // z.shape[1])
        return out, saved

    def _batch_norm_backward(self, d_out: Tensor, saved: NormalizationSaved) -> tuple[Tensor, list[Tensor]]:
        """``(d_z, [g_norm_weight, g_norm_bias])`` from ``d_out`` and :meth:`_batch_norm`'s ``saved``
        (:func:`~torch_dad.ops.normalization.normalization_backward`)."""
        return normalization_backward(d_out, saved, self.norm_weight)

    @torch.no_grad()
    def update_running_statistics(self) -> None:
        """Fold the last local step's batch statistics into ``running_mean``/``running_var`` as
        ``nn.BatchNorm1d``/``2d`` do (momentum 0.1, the variance unbiased by ``n / (n - 1)``, ``n`` the
        values per channel); nothing if no local step is pending. :meth:`apply_local_update` calls
        it; no host sync."""
        pending, self._batch_statistics = self._batch_statistics, None
        if pending is None or self.running_mean is None or self.running_var is None:
            return
        mean, var, count = pending
        momentum = functional.BATCH_NORM_MOMENTUM
        self.running_mean.lerp_(mean.reshape(-1).to(self.running_mean.dtype), momentum)
        unbiased = var.reshape(-1).to(self.running_var.dtype) * (count / (count - 1))
        self.running_var.lerp_(unbiased, momentum)

    @torch.no_grad()
    def apply_local_update(
        self, grads: list[Tensor], config: OptimizerConfig, lr: float | Tensor | None = None, **options: Any
    ) -> bool:
        """:meth:`LocalLayer.apply_local_update` (``options``: ``on_nonfinite``, ``loss``), then, if it
        applied, :meth:`update_running_statistics`."""
        applied = super().apply_local_update(grads, config, lr, **options)
        if applied:
            self.update_running_statistics()
        return applied
