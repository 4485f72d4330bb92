"""Matrix products of local heads, small enough to run without a GEMM library.

A local head's product (a batch of pooled features times a few classes) is tiny, and it runs on the side
stream of its layer. cuBLAS keeps a workspace per stream and per API (32 MiB each on Hopper), so one such
product on a side stream costs that stream 32-64 MiB for the whole run. Below :data:`SMALL_PRODUCT`
multiply-adds on CUDA, :func:`matmul` is a broadcast product summed over the inner dimension in float32 (one
elementwise kernel and one reduction, the same float32 accumulation a GEMM does); above it, or on another
device, it is ``torch.matmul``. Both are differentiable.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SMALL_PRODUCT", "broadcast_linear", "broadcast_matmul", "linear", "matmul"]

#: multiply-adds up to which a CUDA product runs as a broadcast product and a sum (its float32
#: temporary is at most 4 MiB)
SMALL_PRODUCT = 1 << 20


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of 2-d ``a`` (m, k) and ``b`` (k, n), in their promoted dtype."""
    return broadcast_matmul(a, b) if _small(a, b.shape[1]) else a @ b


def broadcast_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as ``(a[:, :, None] * b[None]).sum(1)`` in float32 (float64 for float64), in the promoted dtype."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    wide = torch.promote_types(dtype, torch.float32)
    return (a.to(wide)[:, :, None] * b.to(wide)[None, :, :]).sum(1).to(dtype)


def broadcast_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` as ``(x[:, None] * weight[None]).sum(2)``, like :func:`broadcast_matmul`; autograd
    gives ``weight`` a gradient in its own layout (fused optimizers need that)."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    wide = torch.promote_types(dtype, torch.float32)
    return (x.to(wide)[:, None, :] * weight.to(wide)[None, :, :]).sum(2).to(dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` of 2-d ``x`` (m, in) and ``weight`` (out, in), in their promoted dtype."""
    if not _small(x, weight.shape[0]):
        return torch.nn.functional.linear(x, weight, bias)
    out = broadcast_linear(x, weight)
    return out if bias is None else out + bias.to(out.dtype)


def _small(a: Tensor, n: int) -> bool:
    """Whether ``a`` (m, k) times a (k, n) matrix runs as a broadcast product."""
    return a.is_cuda and a.shape[0] * a.shape[1] * n <= SMALL_PRODUCT
