"""Fused local error of a DAD layer: logits, softmax - onehot, ``d_z`` and the small gradients.

For a layer output ``h`` (M, N) with local head ``W_loc`` (C, N), ``b_loc`` (C,) this computes,
as :func:`torch_dad.functional.local_loss_and_gradients` does after its forward::

    logits   = h @ W_loc.T + b_loc                    (fp32 accumulation)
    d_logits = (softmax(logits) - q) / M              loss = mean CE(logits, q)
    q        = (1 - label_smoothing) * onehot(y) + label_smoothing / C
    g_W_loc  = d_logits.T @ h                         g_b_loc = d_logits.sum(0)
    d_z      = (d_logits @ W_loc) * act'(h)           g_b     = d_z.sum(0)

``act'`` is read off ``h`` (relu: ``h > 0``; tanh: ``1 - h^2``; identity: 1; leaky relu: 1 where
``h > 0``, else its slope), so the forward
need not keep ``z``. With ``with_dz=False`` the layer is an output head (the classifier):
``d_z`` and ``g_b`` are skipped and ``g_W_loc, g_b_loc`` are its weight and bias gradients.

On CUDA this is one or two Triton launches (:mod:`torch_dad.kernels.local_error`); elsewhere,
and for more than :data:`MAX_TRITON_CLASSES` classes, the PyTorch twin below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from .. import functional
from .._checks import check_fraction
from ..kernels import use_triton

__all__ = ["FUSED_ACTIVATIONS", "MAX_TRITON_CLASSES", "LocalError", "local_error"]

#: activations whose derivative can be read off the output ``h``
FUSED_ACTIVATIONS: tuple[str, ...] = ("relu", "tanh", "identity", "leaky_relu")
#: the most classes the Triton path takes: its column kernel keeps a (classes, BN) fp32
#: accumulator, which stops fitting past 256
MAX_TRITON_CLASSES = 256


@dataclass
class LocalError:
    """Outputs of :func:`local_error` (gradients in float32)."""

    logits: Tensor
    loss: Tensor
    grad_head_weight: Tensor
    grad_head_bias: Tensor
    d_z: Tensor | None
    grad_bias: Tensor | None


def _check(h: Tensor, head_weight: Tensor, head_bias: Tensor, target: Tensor, activation: str) -> None:
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} has no fused local error (its derivative needs z); "
            f"use one of {FUSED_ACTIVATIONS} or the eager backend"
        )
    if h.dim() != 2 or head_weight.dim() != 2 or head_weight.shape[1] != h.shape[1]:
        raise ValueError(
            f"h {tuple(h.shape)} and head_weight {tuple(head_weight.shape)} must be (M, N) and (C, N)"
        )
    if head_bias.shape != (head_weight.shape[0],):
        raise ValueError(f"head_bias must have shape ({head_weight.shape[0]},), got {tuple(head_bias.shape)}")
    if target.shape != (h.shape[0],):
        raise ValueError(f"target must have shape ({h.shape[0]},), got {tuple(target.shape)}")


def local_error(
    h: Tensor,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    activation: str = "relu",
    *,
    with_dz: bool = True,
    backend: str = "auto",
    label_smoothing: float = 0.0,
) -> LocalError:
    """The local error of a DAD layer from its output ``h`` (see the module docstring).

    ``h`` is in the compute dtype (bf16/fp16/fp32; fp32 products are IEEE fp32 on the Triton path,
    or TF32 when ``torch.backends.cuda.matmul.allow_tf32`` lets torch's own fp32 matmuls use it);
    ``head_weight``/``head_bias`` are the fp32
    masters (cast to ``h.dtype`` for the products, as the eager path does); ``target`` holds
    class ids in ``[0, C)``. ``d_z`` comes back in ``h.dtype``, everything else in float32 (float64 for a float64 ``h``).
    """
    _check(h, head_weight, head_bias, target, activation)
    label_smoothing = check_fraction("label_smoothing", label_smoothing)
    if use_triton(h, backend) and head_weight.shape[0] <= MAX_TRITON_CLASSES:
        return LocalError(
            *_kernels().launch_local_error(
                h, head_weight, head_bias, target, activation, with_dz, label_smoothing=label_smoothing
            )
        )
    return _local_error_torch(h, head_weight, head_bias, target, activation, with_dz, label_smoothing)


def _local_error_torch(
    h: Tensor,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    activation: str,
    with_dz: bool,
    label_smoothing: float = 0.0,
) -> LocalError:
    """PyTorch twin: products of ``h.dtype`` operands accumulated in fp32, as the kernel does (float64 in
    float64)."""
    wide = torch.promote_types(h.dtype, torch.float32)
    w = head_weight.to(h.dtype).to(wide)
    hf = h.to(wide)
    logits = torch.addmm(head_bias.to(wide), hf, w.T)
    loss, d_logits = functional.cross_entropy_error(logits, target, label_smoothing=label_smoothing)
    dl = d_logits.to(h.dtype).to(wide)
    d_z = grad_bias = None
    if with_dz:
        # every fused activation's derivative is a function of its output: h stands in for z
        dz = (dl @ w) * functional.activation_derivative(hf, hf, activation)
        grad_bias = dz.sum(0)
        d_z = dz.to(h.dtype)
    return LocalError(logits, loss, dl.T @ hf, d_logits.sum(0), d_z, grad_bias)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from ..kernels import local_error as kernels  # imports triton: on the first launch only

    return kernels
