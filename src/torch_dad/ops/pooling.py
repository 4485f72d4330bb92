"""Adaptive average pooling to a small grid, and its adjoint, as two matrix products each.

``adaptive_avg_pool2d(x, grid)`` averages, per axis, the windows ``[floor(i*n/g), ceil((i+1)*n/g))``
(:func:`torch_dad.functional.conv_local_loss_and_gradients` writes it with the same windows in
float64). With the (g*g, H*W) 0/1 matrix ``S`` of the cells' windows and each window's area, per
(sample, channel) row of ``H*W`` values:

    pooled = (x @ S.T) / area          d_x = (d_pooled / area) @ S

Torch's CUDA backward of adaptive average pooling adds into its output atomically. On an H200, in
a VGG-style net at batch 1024 (bf16), it took 15.9 of a DAD step's 36.8 ms and the forward 4.8 ms
(``benchmarks/conv.py --memory``). Each product here is one 2-D GEMM that reads or writes the big
tensor once, and the 0/1 matrix is exact in every dtype: only the small pooled tensor is scaled.
Two products per axis (``S_h @ x @ S_w.T``) were slower: the batched (g x H) products ran as 7 ms
of magma kernels in that step.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.lru_cache(maxsize=64)
def _windows(
    height: int, width: int, grid: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(S, area)``: the (grid * grid, height * width) 0/1 matrix whose row ``(i, j)`` marks the
    window of output cell ``(i, j)`` (``S_h[i, h] * S_w[j, w]``), and each window's area (fp32).
    Built with device ops, so a first call inside a graph capture works."""

    def axis(size: int) -> tuple[Tensor, Tensor]:
        cell = torch.arange(grid, device=device)
        lo = torch.div(cell * size, grid, rounding_mode="floor")
        hi = -torch.div(-(cell + 1) * size, grid, rounding_mode="floor")
        position = torch.arange(size, device=device)
        return (position >= lo[:, None]) & (position < hi[:, None]), (hi - lo).to(torch.float32)

    (rows, rows_count), (cols, cols_count) = axis(height), axis(width)
    windows = (rows[:, None, :, None] & cols[None, :, None, :]).reshape(grid * grid, height * width)
    return windows.to(dtype), (rows_count[:, None] * cols_count[None, :]).reshape(grid * grid)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the small pooled tensor is scaled in: fp32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def grid_pool(x: Tensor, grid: int) -> Tensor:
    """``adaptive_avg_pool2d(x, grid)`` of an (N, C, H, W) ``x``: one product with the windows, then
    the division by their areas, ``(x.reshape(N * C, H * W) @ S.T) / area``."""
    n, c, height, width = x.shape
    windows, area = _windows(height, width, grid, x.dtype, x.device)
    summed = x.reshape(n * c, height * width) @ windows.T
    return (summed / area.to(_wide(x.dtype))).to(x.dtype).reshape(n, c, grid, grid)


def grid_pool_backward(d_pooled: Tensor, x: Tensor, grid: int) -> Tensor:
    """The adjoint of :func:`grid_pool` at ``x``'s shape: ``(d_pooled / area) @ S``."""
    n, c, height, width = x.shape
    windows, area = _windows(height, width, grid, x.dtype, x.device)
    scaled = (d_pooled.reshape(n * c, grid * grid) / area.to(_wide(d_pooled.dtype))).to(x.dtype)
    return (scaled @ windows).reshape(n, c, height, width)
