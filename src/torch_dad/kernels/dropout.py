"""The Triton kernel of :func:`torch_dad.ops.dropout.counter_dropout` and its launcher.

Each program draws Philox-4x32-10 for ``BLOCK`` counters, one per group of 4 elements (the
generator of :mod:`torch_dad.kernels.reservoir`, keyed by the dropout seed), and each of the 4
words decides one element. The step counter is read from a device tensor, so a CUDA graph that
captured the launch draws a fresh mask at every replay.
"""

import triton
import triton.language as tl
from torch import Tensor
from triton.language.random import philox

from . import cdiv


@triton.jit
def drop_word(x_ptr, out_ptr, offsets, n, word, threshold, scale):
    """``out = x * scale`` where the word's top 24 bits are ``>= threshold``, else 0."""
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    keep = (word >> 8).to(tl.int32) >= threshold
    y = tl.where(keep, x.to(tl.float32) * scale, 0.0)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dropout_kernel(x_ptr, out_ptr, step_ptr, n, seed, layer, threshold, scale, BLOCK: tl.constexpr):
    groups = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    step = tl.load(step_ptr)
    c0 = groups.to(tl.uint32)
    zero = tl.zeros_like(c0)
    # tl.full, not layer.to(): triton passes an int argument equal to 1 as a constexpr
    c1 = tl.full((BLOCK,), layer, tl.uint32)
    c2 = zero + (step & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + (step >> 32).to(tl.uint32)
    w0, w1, w2, w3 = philox(seed, c0, c1, c2, c3)
    base = groups.to(tl.int64) * 4
    drop_word(x_ptr, out_ptr, base, n, w0, threshold, scale)
    drop_word(x_ptr, out_ptr, base + 1, n, w1, threshold, scale)
    drop_word(x_ptr, out_ptr, base + 2, n, w2, threshold, scale)
    drop_word(x_ptr, out_ptr, base + 3, n, w3, threshold, scale)


def launch_dropout(x: Tensor, out: Tensor, step: Tensor, seed: int, layer: int, threshold: int, scale: float) -> None:
    """``out = dropout(x)`` for contiguous ``x``/``out`` and a 0-dim int64 ``step`` (see the op)."""
    n = x.numel()
    block = 1024
    dropout_kernel[(cdiv(cdiv(n, 4), block),)](x, out, step, n, seed, layer, threshold, scale, BLOCK=block)
