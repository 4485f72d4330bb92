"""The Triton kernels of :func:`torch_dad.ops.gram.gram_update_` and their launchers.

:func:`launch_augment` writes ``A = [h | 1 | onehot(y) | 0]``, each row padded to a multiple of
8 elements; :func:`launch_fold` adds the row block ``G[:d + 1]`` of ``G = A^T A`` into the
float64 statistics, ``buf = decay * buf + G_part``.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import cdiv


def launch_augment(features: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """``A = [features | 1 | onehot(target) | 0]`` (B, W) in ``features``' dtype, ``W`` the first
    multiple of 8 that holds ``d + 1 + num_classes`` columns."""
    batch, d = features.shape
    width = d + 1 + num_classes
    # rows padded to a multiple of 8 elements: an unaligned width sends cuBLAS to a slow "align1" kernel
    padded = cdiv(width, 8) * 8
    # in h's dtype: an fp32 copy would be the largest temporary of a bf16 step
    aug = torch.empty(batch, padded, device=features.device, dtype=features.dtype)
    block_r, block_c = 32, 128
    augment_kernel[(cdiv(batch, block_r), cdiv(padded, block_c))](
        features, target, aug, batch, d, padded, features.stride(0), BR=block_r, BC=block_c
    )
    return aug


def launch_fold(
    g: Tensor, gram: Tensor, sum_features: Tensor, count: Tensor, cross: Tensor, sum_targets: Tensor, decay: float
) -> None:
    """``buf = decay * buf + G_part`` for each float64 statistic, from ``g = A^T A`` (W, W) fp32
    (see the module docstring of :mod:`torch_dad.ops.gram` for which part is which)."""
    d, c = cross.shape
    width = d + 1 + c
    block = 64
    fold_kernel[(cdiv(d + 1, block), cdiv(width, block))](
        g, gram, sum_features, count, cross, sum_targets, d, c, width, g.shape[1], decay, BLOCK=block
    )


@triton.jit
def augment_kernel(h_ptr, y_ptr, out_ptr, B, D, W, stride_h, BR: tl.constexpr, BC: tl.constexpr):
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
def fold_kernel(
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
