"""The Triton kernels of :func:`torch_dad.ops.pooling.max_pool2x2` and its backward, and their launchers.

For a contiguous (N, C, H, W) ``h``, seen as ``P = N * C`` planes of H x W, with ``Ho = H // 2`` and
``Wo = W // 2`` (a 2 x 2 window, stride 2, no padding, floor mode):

    out[p, i, j] = max_{a, b in {0, 1}} h[p, 2i + a, 2j + b]
    arg[p, i, j] = 2a + b of the chosen element (uint8, 0..3)
    d_h[p, y, x] = d_out[p, y // 2, x // 2] if arg[p, y // 2, x // 2] == 2 (y % 2) + x % 2 else 0

and ``d_h`` is 0 in a last odd row or column, which no window covers. A channels-last ``h`` (memory order
N, H, W, C) is read in place and gives ``out``, ``arg`` and ``d_h`` in that order too (``CHANNELS_LAST``).
The window is scanned in row-major order and an element replaces the running maximum when
``val > max or isnan(val)``, the rule of torch's own kernels: the first maximum wins ties, and the last
NaN of a window wins.

The forward kernel owns a block of flat output positions (of one or several planes); the backward
kernel owns a block of flat ``d_h`` positions and writes each of them once, so ``d_h`` needs no zero
fill and no atomics. The 1-byte code replaces torch's int64 flat indices: the backward reads 3 bytes
per output position (2 of ``d_out``, 1 of ``arg`` in bf16) instead of 10.
"""

import triton
import triton.language as tl
from torch import Tensor

from . import cdiv

# flat positions per program: a multiple of the 128 threads of 4 warps, large enough to keep
# several loads in flight per thread
BLOCK = 1024


@triton.jit
def flat_block(n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """This program's ``BLOCK`` flat positions and the mask of those below ``n``; int64 (``WIDE``)
    only for tensors of 2**31 elements or more, since int32 divisions are cheaper."""
    start = tl.program_id(0)
    if WIDE:
        start = start.to(tl.int64)
    offsets = start * BLOCK + tl.arange(0, BLOCK)
    return offsets, offsets < n


@triton.jit
def take_if_larger(best, code, ptr, mask, k):
    """Torch's scan step: the element at ``ptr`` (code ``k``) replaces ``best`` when larger or NaN."""
    val = tl.load(ptr, mask=mask, other=0.0)
    # compared in fp32, exact for every input dtype (triton's interpreter has no bf16 arithmetic);
    # the winner is kept as loaded, its bits untouched
    wide = val.to(tl.float32)
    take = (wide > best.to(tl.float32)) | (wide != wide)
    return tl.where(take, val, best), tl.where(take, k, code)


@triton.jit
def max_pool_kernel(
    h_ptr, out_ptr, arg_ptr, n_out, C, H, W, Ho, Wo, BLOCK: tl.constexpr, WIDE: tl.constexpr,
    CHANNELS_LAST: tl.constexpr,
):
    o, mask = flat_block(n_out, BLOCK, WIDE)
    if CHANNELS_LAST:  # o runs over (n, i, j, c); a window's neighbours are C and W * C apart
        c = o % C
        pixel = o // C
        j = pixel % Wo
        row = pixel // Wo
        i = row % Ho
        top_left = h_ptr + (((row // Ho) * H + 2 * i) * W + 2 * j) * C + c
        right, down = C, W * C
    else:  # o runs over (plane, i, j)
        plane = o // (Ho * Wo)
        rest = o - plane * (Ho * Wo)
        i = rest // Wo
        j = rest - i * Wo
        top_left = h_ptr + plane * H * W + 2 * i * W + 2 * j
        right, down = 1, W
    # torch starts from -inf with the first element's index; starting from the first element
    # itself ends the same (either it replaces -inf, or it is -inf and keeps its index)
    best = tl.load(top_left, mask=mask, other=0.0)
    code = tl.zeros((BLOCK,), tl.int32)
    best, code = take_if_larger(best, code, top_left + right, mask, 1)
    best, code = take_if_larger(best, code, top_left + down, mask, 2)
    best, code = take_if_larger(best, code, top_left + down + right, mask, 3)
    tl.store(out_ptr + o, best, mask=mask)
    tl.store(arg_ptr + o, code.to(tl.uint8), mask=mask)


@triton.jit
def max_pool_backward_kernel(
    d_out_ptr, arg_ptr, d_h_ptr, n_in, C, H, W, Ho, Wo, BLOCK: tl.constexpr, WIDE: tl.constexpr,
    CHANNELS_LAST: tl.constexpr,
):
    e, mask = flat_block(n_in, BLOCK, WIDE)
    if CHANNELS_LAST:  # e runs over (n, y, x, c)
        c = e % C
        pixel = e // C
        x = pixel % W
        row = pixel // W
        y = row % H
        plane = row // H  # the image
    else:  # e runs over (plane, y, x)
        plane = e // (H * W)
        rest = e - plane * (H * W)
        y = rest // W
        x = rest - y * W
    i = y // 2
    j = x // 2
    # a last odd row or column belongs to no window: its gradient is 0
    covered = mask & (i < Ho) & (j < Wo)
    if CHANNELS_LAST:
        o = ((plane * Ho + i) * Wo + j) * C + c
    else:
        o = plane * (Ho * Wo) + i * Wo + j
    # neighbours read the same arg and d_out entries: one fetch from memory, the rest from cache
    arg = tl.load(arg_ptr + o, mask=covered, other=4).to(tl.int32)
    grad = tl.load(d_out_ptr + o, mask=covered, other=0.0)
    chosen = arg == 2 * (y - 2 * i) + (x - 2 * j)
    # where, not a product: a NaN of d_out must not leak into the window's other elements
    tl.store(d_h_ptr + e, tl.where(chosen, grad, 0.0).to(d_h_ptr.dtype.element_ty), mask=mask)


def _wide(*tensors: Tensor) -> bool:
    return max(t.numel() for t in tensors) >= 2**31


def launch_max_pool(h: Tensor, out: Tensor, arg: Tensor, channels_last: bool) -> None:
    """``out, arg`` ((N, C, H // 2, W // 2), ``h``'s dtype and uint8) of ``h``: all three contiguous, or all
    three channels-last (``channels_last``)."""
    channels, height, width = h.shape[1:]
    n_out = out.numel()
    max_pool_kernel[(cdiv(n_out, BLOCK),)](
        h, out, arg, n_out, channels, height, width, out.shape[-2], out.shape[-1], BLOCK=BLOCK, WIDE=_wide(h, out),
        CHANNELS_LAST=channels_last,
    )


def launch_max_pool_backward(d_out: Tensor, arg: Tensor, d_h: Tensor, channels_last: bool) -> None:
    """``d_h`` ((N, C, H, W)) from ``d_out`` and ``arg`` of (N, C, H // 2, W // 2): all three contiguous, or all
    three channels-last (``channels_last``)."""
    channels, height, width = d_h.shape[1:]
    n_in = d_h.numel()
    max_pool_backward_kernel[(cdiv(n_in, BLOCK),)](
        d_out, arg, d_h, n_in, channels, height, width, d_out.shape[-2], d_out.shape[-1], BLOCK=BLOCK,
        WIDE=_wide(d_h), CHANNELS_LAST=channels_last,
    )
