"""Graph-safe update of :class:`torch_dad.ridge.GramAccumulator` in three launches.

``GramAccumulator.update`` (the twin) uses ``bincount``, which reads the labels on the host,
so it cannot sit inside a CUDA graph, and it launches ~15 kernels. Here, with
``A = [h | 1 | onehot(y)]`` (B, d + 1 + C) in ``h``'s dtype (ones and one-hots are exact in
bf16, and bf16 products are exact in the fp32 accumulator), one GEMM ``G = A^T A`` with fp32
output holds every statistic at once::

    gram = G[:d, :d]   sum_features = G[d, :d]   count = G[d, d]
    cross = G[:d, d+1:]   sum_targets = G[d, d+1:]

and one kernel folds ``G`` into the float64 buffers: ``buf = decay * buf + G_part``. The two
kernels are in :mod:`torch_dad.kernels.gram`; the GEMM between them is :func:`mm_fp32`.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
from torch import Tensor

from ..kernels import use_triton
from ..ridge import GramAccumulator

__all__ = ["accumulate_mm", "gram_update_", "mm_fp32"]


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``(a @ b)`` accumulated and returned in float32 (a single cuBLAS call for bf16 inputs)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # type: ignore[call-overload]
        except (TypeError, RuntimeError):
            pass
    return a.float() @ b.float()


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor, first: bool = False, alpha: float = 1.0) -> None:
    """``acc += alpha * a @ b`` (``acc = alpha * a @ b`` if ``first``) with ``acc`` kept in its (wider) dtype."""
    # beta=0 never reads acc: the first product needs no zeroed buffer, so a parameter-sized gradient costs
    # no memset and no extra read per step (addmm ignores NaN/Inf in self when beta is 0)
    beta = 0 if first else 1
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta, alpha=alpha)
    elif acc.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):
        # cuBLAS reads bf16/fp16 and accumulates into the float32 buffer directly: no
        # parameter-sized temporary per product (torch >= 2.8)
        torch.addmm(acc, a, b, out_dtype=acc.dtype, beta=beta, alpha=alpha, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta, alpha=alpha)


def gram_update_(acc: GramAccumulator, features: Tensor, target: Tensor, *, backend: str = "auto") -> None:
    """``acc.update(features, target)`` without host syncs (see the module docstring)."""
    if features.dim() != 2 or features.shape[1] != acc.num_features:
        raise ValueError(f"features must have shape (batch, {acc.num_features}), got {tuple(features.shape)}")
    if target.shape != (features.shape[0],):
        raise ValueError(f"target must have shape ({features.shape[0]},), got {tuple(target.shape)}")
    if not use_triton(features, backend):
        acc.update(features, target)
        return
    kernels = _kernels()
    aug = kernels.launch_augment(features, target, acc.num_classes)
    g = mm_fp32(aug.T, aug)
    decay = math.exp(-features.shape[0] / acc.window) if acc.window is not None else 1.0
    kernels.launch_fold(g, acc.gram, acc.sum_features, acc.count, acc.cross, acc.sum_targets, decay)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from ..kernels import gram as kernels  # imports triton: on the first launch only

    return kernels
