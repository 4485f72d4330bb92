"""The normalisations of ``DADLinear(normalize=...)`` for the fused step, as single ATen kernels.

Same math as :func:`torch_dad.functional.batch_norm_forward` / ``batch_norm_backward`` and
``layer_norm_forward`` / ``layer_norm_backward`` (the float64 test oracle), through
``torch.native_batch_norm`` and ``torch.native_layer_norm`` and their backward ops: one launch
each way, with fp32 statistics for bf16/fp16 inputs, instead of the ~10 elementwise and reduction
launches of the oracle's formulas, which would dominate a small layer's fused step
(``docs/design-engine.md``).

The eager step (``DADLinear``/``DADConv2d.local_gradients``) and the fused step run these same
kernels. Given ``running_mean``/``running_var``, batch norm folds the batch's statistics into them
as it normalises (momentum :data:`~torch_dad.functional.BATCH_NORM_MOMENTUM`, the variance unbiased
by ``n / (n - 1)``), as ``nn.BatchNorm1d`` does in training mode: the fused step applies every update
it computes. The eager step passes none and folds :func:`batch_statistics` only with an applied update.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..functional import BATCH_NORM_EPS, BATCH_NORM_MOMENTUM, LAYER_NORM_EPS, NORMALIZATIONS

__all__ = ["NormalizationSaved", "batch_statistics", "normalization_backward", "normalization_forward"]


class NormalizationSaved(NamedTuple):
    """What the backward reads: the input ``z`` and its per-channel (batch norm) or per-row
    (layer norm) ``mean`` and ``inv_std``, both fp32."""

    kind: str
    z: Tensor
    mean: Tensor
    inv_std: Tensor


def _like(t: Tensor | None, z: Tensor) -> Tensor | None:
    """``t`` as the batch-norm kernels take it beside ``z``: as it is for fp32 with bf16/fp16 ``z``
    (their mixed mode, fp32 statistics) or ``z``'s dtype, else cast to ``z``'s dtype."""
    if t is None or t.dtype == z.dtype or (t.dtype == torch.float32 and z.dtype in (torch.bfloat16, torch.float16)):
        return t
    return t.to(z.dtype)


def normalization_forward(
    kind: str,
    z: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
) -> tuple[Tensor, NormalizationSaved]:
    """``(out, saved)`` for ``z`` (B, C), or (B, C, H, W) for batch norm (statistics per channel).

    ``"batchnorm"``: ``out = (z - mean_b) * inv_std * weight + bias`` with the batch's mean and biased
    variance per column, ``inv_std = 1/sqrt(var + eps)``; ``running_mean``/``running_var`` (if given)
    move towards the batch's statistics in place. ``"layernorm"``: ``out = (z - mean) * inv_std``
    per row, no affine (``weight``, ``bias`` and the running statistics must be ``None``).
    ``out`` has ``z``'s dtype; ``weight``, ``bias`` and the running statistics may be fp32 masters.
    """
    if kind == "batchnorm":
        weight, bias, running_mean, running_var = (_like(t, z) for t in (weight, bias, running_mean, running_var))
        out, mean, inv_std = torch.native_batch_norm(
            z, weight, bias, running_mean, running_var, True, BATCH_NORM_MOMENTUM, BATCH_NORM_EPS
        )
    elif kind == "layernorm":
        if any(t is not None for t in (weight, bias, running_mean, running_var)):
            raise ValueError("normalize='layernorm' has no affine and no running statistics; pass only z")
        out, mean, inv_std = torch.native_layer_norm(z, [z.shape[1]], None, None, LAYER_NORM_EPS)
    else:
        raise ValueError(f"normalize={kind!r}: choose one of {', '.join(NORMALIZATIONS)}")
    return out, NormalizationSaved(kind, z, mean, inv_std)


def normalization_backward(
    d_out: Tensor, saved: NormalizationSaved, weight: Tensor | None = None
) -> tuple[Tensor, list[Tensor]]:
    """``(dL/dz, affine gradients)`` from ``dL/dout`` of :func:`normalization_forward` (training mode).

    Batch norm: ``dL/dz = inv_std * (g - mean_b(g) - z_hat * mean_b(g * z_hat))`` with
    ``g = dL/dout * weight``, and ``[sum_b dL/dout * z_hat, sum_b dL/dout]`` for ``weight`` and
    ``bias`` (fp32). Layer norm: the same per row with ``weight = 1``, and no affine gradients.
    ``dL/dz`` has ``d_out``'s dtype.
    """
    if saved.kind == "batchnorm":
        d_z, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            d_out, saved.z, _like(weight, saved.z), None, None, saved.mean, saved.inv_std, True, BATCH_NORM_EPS,
            [True, weight is not None, weight is not None],
        )
        return d_z, [g for g in (grad_weight, grad_bias) if g is not None]
    d_z = torch.ops.aten.native_layer_norm_backward(
        d_out, saved.z, [saved.z.shape[1]], saved.mean, saved.inv_std, None, None, [True, False, False]
    )[0]
    return d_z, []


def batch_statistics(saved: NormalizationSaved) -> tuple[Tensor, Tensor]:
    """The batch's per-channel ``(mean, biased variance)`` that a batch norm normalised by (fp32, (C,)):
    ``var = 1 / inv_std**2 - eps``."""
    return saved.mean, saved.inv_std.pow(-2) - BATCH_NORM_EPS
