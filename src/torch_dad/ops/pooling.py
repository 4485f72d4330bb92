"""Adaptive average pooling to a small grid, and its adjoint, as two matrix products each.

``adaptive_avg_pool2d(x, grid)`` averages, per axis, the windows ``[floor(i*n/g), ceil((i+1)*n/g))``
(:func:`torch_dad.functional.conv_local_loss_and_gradients` writes it with the same windows in
float64). With 0/1 window matrices ``S_h`` (g x H) and ``S_w`` (g x W) and each cell's window area:

    pooled = (S_h @ x @ S_w.T) / area          d_x = S_h.T @ (d_pooled / area) @ S_w

Torch's CUDA backward of adaptive average pooling adds into its output atomically. On an H200, in
a VGG-style net at batch 1024 (bf16), it took 15.9 of a DAD step's 36.8 ms and the forward 4.8 ms
(``benchmarks/conv.py --memory``). The products read and write the big tensor once each way, and
the 0/1 matrices are exact in every dtype: only the small pooled tensor is scaled.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.lru_cache(maxsize=64)
def _windows(size: int, grid: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(S, count)``: the (grid, size) 0/1 matrix of adaptive pooling's windows along one axis and
    each window's length (fp32). Built with device ops, so a first call inside a graph capture works."""
    cell = torch.arange(grid, device=device)
    lo = torch.div(cell * size, grid, rounding_mode="floor")
    hi = -torch.div(-(cell + 1) * size, grid, rounding_mode="floor")
    position = torch.arange(size, device=device)
    inside = (position >= lo[:, None]) & (position < hi[:, None])
    return inside.to(dtype), (hi - lo).to(torch.float32)


def _grid(x: Tensor, grid: int) -> tuple[Tensor, Tensor, Tensor]:
    rows, rows_count = _windows(x.shape[-2], grid, x.dtype, x.device)
    cols, cols_count = _windows(x.shape[-1], grid, x.dtype, x.device)
    return rows, cols, rows_count[:, None] * cols_count[None, :]


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the small pooled tensor is scaled in: fp32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def grid_pool(x: Tensor, grid: int) -> Tensor:
    """``adaptive_avg_pool2d(x, grid)`` of an (N, C, H, W) ``x``: ``(S_h @ x @ S_w.T) / area``."""
    rows, cols, area = _grid(x, grid)
    summed = rows @ (x @ cols.T)
    return (summed / area.to(_wide(x.dtype))).to(x.dtype)


def grid_pool_backward(d_pooled: Tensor, x: Tensor, grid: int) -> Tensor:
    """The adjoint of :func:`grid_pool` at ``x``'s shape: ``S_h.T @ (d_pooled / area) @ S_w``."""
    rows, cols, area = _grid(x, grid)
    scaled = (d_pooled / area.to(_wide(d_pooled.dtype))).to(x.dtype)
    return (rows.T @ scaled) @ cols
