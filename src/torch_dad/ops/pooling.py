"""Pooling: adaptive average pooling to a small grid and its adjoint (two matrix products each), and
the 2 x 2 max pool with a 1-byte argmax and its backward.

``adaptive_avg_pool2d(x, grid)`` averages, per axis, the windows ``[floor(i*n/g), ceil((i+1)*n/g))``
(:func:`torch_dad.functional.conv_local_loss_and_gradients` writes it with the same windows in
float64). With the (g*g, H*W) 0/1 matrix ``S`` of the cells' windows and each window's area, per
(sample, channel) row of ``H*W`` values:

    pooled = (x @ S.T) / area          d_x = (d_pooled / area) @ S

Torch's CUDA backward of adaptive average pooling adds into its output atomically, which makes it
slow; each product here is one 2-D GEMM that reads or writes the big tensor once, and the 0/1
matrix is exact in every dtype: only the small pooled tensor is scaled (measurements:
``docs/design-kernels.md``).

``max_pool2x2(h)`` is the 2 x 2, stride-2 max pool (no padding, floor mode) with its argmax as a
uint8 code ``2a + b`` of the window element ``h[..., 2i + a, 2j + b]``, and
``max_pool2x2_backward`` routes ``d_out`` back by that code:

    out[n, c, i, j] = max_{a, b} h[n, c, 2i + a, 2j + b]
    d_h[n, c, 2i + a, 2j + b] = d_out[n, c, i, j] if arg[n, c, i, j] == 2a + b else 0   (0 in an odd last row/column)

with torch's choice of the maximum (the first wins ties, the last NaN of a window wins). The Triton
kernels (:mod:`torch_dad.kernels.max_pool`) read a 1-byte code where torch's backward reads int64
indices, and write each element of ``d_h`` once (``benchmarks/max_pool.py`` times both pairs).
Elsewhere (and for float64) a PyTorch twin gives the same values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from ..kernels import use_triton

__all__ = ["grid_pool", "grid_pool_backward", "max_pool2x2", "max_pool2x2_backward"]

#: the dtypes of the Triton max pool; others (float64) take the PyTorch twin
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    the division by their areas, ``(x.reshape(N * C, H * W) @ S.T) / area`` (channels-last: ``S @ x`` per
    row over ``(H * W, C)``, read in place)."""
    n, c, height, width = x.shape
    windows, area = _windows(height, width, grid, x.dtype, x.device)
    if _memory_format(x) == torch.channels_last:
        summed = (windows @ x.permute(0, 2, 3, 1).reshape(n, height * width, c)).transpose(1, 2)
    else:
        summed = x.reshape(n * c, height * width) @ windows.T
    return (summed / area.to(_wide(x.dtype))).to(x.dtype).reshape(n, c, grid, grid)


def grid_pool_backward(d_pooled: Tensor, x: Tensor, grid: int) -> Tensor:
    """The adjoint of :func:`grid_pool` at ``x``'s shape and memory format: ``(d_pooled / area) @ S``."""
    n, c, height, width = x.shape
    windows, area = _windows(height, width, grid, x.dtype, x.device)
    scaled = (d_pooled.reshape(n, c, grid * grid) / area.to(_wide(d_pooled.dtype))).to(x.dtype)
    if _memory_format(x) == torch.channels_last:  # (N, H * W, C) rows: the (N, C, H, W) channels-last layout
        return (windows.T @ scaled.transpose(1, 2)).reshape(n, height, width, c).permute(0, 3, 1, 2)
    return (scaled.reshape(n * c, grid * grid) @ windows).reshape(n, c, height, width)


def _check_pooled(name: str, tensor: object) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} has dtype {tensor.dtype}; the max pool needs a floating tensor")
    if tensor.dim() != 4:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected (batch, channels, height, width)")
    return tensor


def _check_backward(d_out: Tensor, arg: Tensor, h_shape: Sequence[int]) -> tuple[int, int, int, int]:
    _check_pooled("d_out", d_out)
    if not isinstance(arg, Tensor) or arg.dtype != torch.uint8 or arg.shape != d_out.shape:
        got = f"{arg.dtype} {tuple(arg.shape)}" if isinstance(arg, Tensor) else type(arg).__name__
        raise ValueError(f"arg must be the uint8 code of max_pool2x2, shaped like d_out {tuple(d_out.shape)}; got {got}")
    if arg.device != d_out.device:
        raise ValueError(f"arg is on {arg.device} but d_out on {d_out.device}")
    shape = tuple(int(s) for s in h_shape)
    if len(shape) != 4 or shape[:2] != tuple(d_out.shape[:2]) or (shape[2] // 2, shape[3] // 2) != d_out.shape[2:]:
        raise ValueError(f"h_shape={shape} is not the input shape of a 2 x 2 pool to d_out {tuple(d_out.shape)}")
    return shape[0], shape[1], shape[2], shape[3]


def max_pool2x2(h: Tensor, *, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(out, arg)``: ``out[n,c,i,j] = max_{a,b} h[n,c,2i+a,2j+b]``, ``arg = 2a+b`` of that element (uint8)."""
    _check_pooled("h", h)
    n, c, height, width = h.shape
    out_shape = (n, c, height // 2, width // 2)
    if 0 in out_shape:  # aten refuses an empty output; here it is just empty
        return h.new_empty(out_shape), torch.empty(out_shape, dtype=torch.uint8, device=h.device)
    if h.dtype in _KERNEL_DTYPES and use_triton(h, backend):
        # a channels-last input is read in place and gives a channels-last output, as torch's pooling does,
        # so the next layer's convolutions and elementwise ops do not mix layouts
        layout = _memory_format(h)
        source = h.contiguous(memory_format=layout)
        out = torch.empty(out_shape, dtype=h.dtype, device=h.device, memory_format=layout)
        arg = torch.empty(out_shape, dtype=torch.uint8, device=h.device, memory_format=layout)
        _kernels().launch_max_pool(source, out, arg, layout == torch.channels_last)
        return out, arg
    return _max_pool2x2_torch(h)


def _memory_format(x: Tensor) -> torch.memory_format:
    """``torch.channels_last`` for a channels-last (and not also contiguous) 4-d ``x``, else contiguous."""
    cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


def max_pool2x2_backward(d_out: Tensor, arg: Tensor, h_shape: Sequence[int], *, backend: str = "auto") -> Tensor:
    """``d_h[n,c,2i+a,2j+b] = d_out[n,c,i,j] if arg[n,c,i,j] == 2a+b else 0`` (0 where no window reaches)."""
    shape = _check_backward(d_out, arg, h_shape)
    if d_out.numel() == 0:
        return d_out.new_zeros(shape)
    if d_out.dtype in _KERNEL_DTYPES and use_triton(d_out, backend):
        layout = _memory_format(d_out)  # d_h comes in d_out's layout, as torch's backward gives it
        d_h = torch.empty(shape, dtype=d_out.dtype, device=d_out.device, memory_format=layout)
        _kernels().launch_max_pool_backward(d_out.contiguous(memory_format=layout),
                                            arg.contiguous(memory_format=layout), d_h, layout == torch.channels_last)
        return d_h
    return _max_pool2x2_backward_torch(d_out, arg, shape)


def _max_pool2x2_torch(h: Tensor) -> tuple[Tensor, Tensor]:
    """The twin: aten's max pool, its flat argmax ``(2i+a) * W + 2j+b`` turned into ``2a+b``."""
    out, flat = torch.ops.aten.max_pool2d_with_indices(h, [2, 2], [2, 2])
    width = h.shape[-1]
    rows = torch.arange(out.shape[-2], device=h.device)[:, None]
    cols = torch.arange(out.shape[-1], device=h.device)
    code = 2 * (torch.div(flat, width, rounding_mode="floor") - 2 * rows) + (flat % width - 2 * cols)
    return out, code.to(torch.uint8)


def _max_pool2x2_backward_torch(d_out: Tensor, arg: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """The twin: each window's 4 gradients ``where(arg == k, d_out, 0)``, laid out as 2 x 2 blocks,
    then zero rows/columns padded on for an odd height/width."""
    n, c, height, width = shape
    out_h, out_w = d_out.shape[-2:]
    codes = torch.arange(4, device=d_out.device, dtype=torch.uint8)
    blocks = torch.where(arg[..., None] == codes, d_out[..., None], d_out.new_zeros(()))
    d_h = blocks.reshape(n, c, out_h, out_w, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, c, 2 * out_h, 2 * out_w)
    return torch.nn.functional.pad(d_h, (0, width - 2 * out_w, 0, height - 2 * out_h))


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from ..kernels import max_pool as kernels  # imports triton: on the first launch only

    return kernels
