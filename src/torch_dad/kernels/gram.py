"""Graph-safe update of :class:`torch_dad.ridge.GramAccumulator` in three launches.

``GramAccumulator.update`` (the twin) uses ``bincount``, which reads the labels on the host,
so it cannot sit inside a CUDA graph, and it launches ~15 kernels. Here, with
``A = [h | 1 | onehot(y)]`` (B, d + 1 + C) in ``h``'s dtype (ones and one-hots are exact in
bf16, and bf16 products are exact in the fp32 accumulator), one GEMM ``G = A^T A`` with fp32
output holds every statistic at once::

    gram = G[:d, :d]   sum_features = G[d, :d]   count = G[d, d]
    cross = G[:d, d+1:]   sum_targets = G[d, d+1:]

and one kernel folds ``G`` into the float64 buffers: ``buf = decay * buf + G_part``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ridge import GramAccumulator
from . import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no triton
    triton = None

__all__ = ["gram_update_", "mm_fp32"]


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


_mm_fp32 = mm_fp32


def gram_update_(acc: GramAccumulator, features: Tensor, target: Tensor, *, backend: str = "auto") -> None:
    """``acc.update(features, target)`` without host syncs (see the module docstring)."""
    if features.dim() != 2 or features.shape[1] != acc.num_features:
        raise ValueError(f"features must have shape (batch, {acc.num_features}), got {tuple(features.shape)}")
    if target.shape != (features.shape[0],):
        raise ValueError(f"target must have shape ({features.shape[0]},), got {tuple(target.shape)}")
    if not use_triton(features, backend):
        acc.update(features, target)
        return
    batch, d = features.shape
    c = acc.num_classes
    width = d + 1 + c
    # pad the row to a multiple of 8 elements: measured on the H200, an unaligned width (267 or
    # 4107) sent cuBLAS to an sm75 "align1" kernel, at d=4096 slower than a whole layer's GEMMs
    padded = -(-width // 8) * 8
    # in h's dtype: an fp32 copy would be the largest temporary of a bf16 step (256 MiB at
    # B=16384, d=4096)
    aug = torch.empty(batch, padded, device=features.device, dtype=features.dtype)
    block_r, block_c = 32, 128
    _augment_kernel[(-(-batch // block_r), -(-padded // block_c))](
        features, target, aug, batch, d, padded, features.stride(0), BR=block_r, BC=block_c
    )
    g = _mm_fp32(aug.T, aug)
    decay = math.exp(-batch / acc.window) if acc.window is not None else 1.0
    block = 64
    _fold_kernel[(-(-(d + 1) // block), -(-width // block))](
        g, acc.gram, acc.sum_features, acc.count, acc.cross, acc.sum_targets, d, c, width, padded, decay, BLOCK=block
    )


if triton is not None:

    @triton.jit
    def _augment_kernel(h_ptr, y_ptr, out_ptr, B, D, W, stride_h, BR: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        rmask = rows < B
        h = tl.load(
            h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & (cols[None, :] < D), other=0.0
        ).to(tl.float32)
        y = tl.load(y_ptr + rows, mask=rmask, other=0)
        one = tl.where(cols[None, :] == D, 1.0, 0.0)
        hot = tl.where(cols[None, :] - D - 1 == y[:, None], 1.0, 0.0)
        val = tl.where(cols[None, :] < D, h, one + hot)
        tl.store(out_ptr + rows[:, None] * W + cols[None, :], val.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols[None, :] < W))

    @triton.jit
    def _fold_kernel(
        g_ptr, gram_ptr, sumf_ptr, count_ptr, cross_ptr, sumt_ptr, D, C, W, WP, decay, BLOCK: tl.constexpr
    ):
        # rows 0..D of G only (the onehot rows duplicate what the columns already hold)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ii = i[:, None]
        jj = j[None, :]
        valid = (ii <= D) & (jj < W)
        g = tl.load(g_ptr + ii * WP + jj, mask=valid, other=0.0).to(tl.float64)
        # gram[i, j]
        m = valid & (ii < D) & (jj < D)
        ptr = gram_ptr + ii * D + jj
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # cross[i, c]
        m = valid & (ii < D) & (jj > D)
        ptr = cross_ptr + ii * C + (jj - D - 1)
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # sum_features[j]
        m = valid & (ii == D) & (jj < D)
        ptr = sumf_ptr + jj + ii * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # count
        m = valid & (ii == D) & (jj == D)
        ptr = count_ptr + ii * 0 + jj * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # sum_targets[c]
        m = valid & (ii == D) & (jj > D)
        ptr = sumt_ptr + (jj - D - 1) + ii * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
