"""The Triton kernels of :mod:`torch_dad.ops.reservoir` and their launchers (see its docstrings).

:func:`launch_draw` turns each batch row into a slot and ``atomic_max``-es the kept rows'
indices into ``winner``; :func:`launch_store` copies ``sample[s] = batch[winner[s]]``;
:func:`launch_uniforms` writes the Philox uniforms the draw kernel makes for itself.
"""

import triton
import triton.language as tl
from torch import Tensor
from triton.language.random import philox

from . import cdiv, next_pow2


@triton.jit
def row_uniform(seed, index):
    """float64 uniforms in [0, 1) for int64 row indices: 53 bits of Philox(seed, index)."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    zero = tl.zeros_like(lo)
    a, b, _, _ = philox(seed, lo, hi, zero, zero)
    return ((a >> 5).to(tl.float64) * 67108864.0 + (b >> 6).to(tl.float64)) * (1.0 / 9007199254740992.0)


@triton.jit
def uniform_kernel(start_ptr, out_ptr, n, seed, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = row_uniform(seed, tl.load(start_ptr) + rows)
    tl.store(out_ptr + rows, u, mask=rows < n)


@triton.jit
def draw_kernel(seen_ptr, draws_ptr, winner_ptr, n, slots, seed, DRAW: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n
    count = tl.load(seen_ptr) + rows + 1  # int64: the row's 1-based rank among all rows seen
    if DRAW:
        u = row_uniform(seed, count - 1)
    else:
        u = tl.load(draws_ptr + rows, mask=valid, other=0.0)
    slot = tl.where(count <= slots, count - 1, (u * count.to(tl.float64)).to(tl.int64))
    keep = valid & (slot < slots)
    # relaxed: the store kernel reads the winners after this launch ends
    tl.atomic_max(winner_ptr + tl.where(keep, slot, 0), rows.to(tl.int32), mask=keep, sem="relaxed")


@triton.jit
def store_kernel(out_ptr, out_y_ptr, x_ptr, y_ptr, winner_ptr, seen_ptr, n, D, stride_out, stride_x,
                 RESET: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.program_id(0)
    row = tl.load(winner_ptr + slot)
    if row >= 0:
        tl.store(out_y_ptr + slot, tl.load(y_ptr + row))
        for d0 in range(0, D, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            mask = cols < D
            values = tl.load(x_ptr + row * stride_x + cols, mask=mask)
            tl.store(out_ptr + slot * stride_out + cols, values.to(out_ptr.dtype.element_ty), mask=mask)
        if RESET:
            tl.store(winner_ptr + slot, -1)
    if RESET:
        if slot == 0:
            tl.store(seen_ptr, tl.load(seen_ptr) + n)


def launch_draw(seen: Tensor, draws: Tensor | None, winner: Tensor, batch: int, seed: int) -> None:
    """``winner[slot(i)] = max(i)`` over the batch rows ``i`` kept by Algorithm R, from ``draws``,
    or with ``draws=None`` from Philox uniforms keyed by ``seed`` and the row's index ``seen + i``."""
    block = 1024
    draw_kernel[(cdiv(batch, block),)](seen, draws if draws is not None else seen, winner, batch, winner.numel(),
                                       seed, DRAW=draws is None, BLOCK=block)


def launch_store(sample_inputs: Tensor, sample_labels: Tensor, inputs: Tensor, labels: Tensor, winner: Tensor,
                 seen: Tensor | None, reset: bool) -> None:
    """``sample[s] = batch[winner[s]]`` where ``winner[s] >= 0``; with ``reset``, ``winner[s] = -1``
    after and ``seen += B`` (program 0)."""
    inputs = inputs if inputs.stride(1) == 1 else inputs.contiguous()
    width = inputs.shape[1]
    block = min(1024, next_pow2(width))
    store_kernel[(winner.numel(),)](
        sample_inputs, sample_labels, inputs, labels, winner, seen if seen is not None else winner,
        inputs.shape[0], width, sample_inputs.stride(0), inputs.stride(0), RESET=reset, BLOCK=block,
    )


def launch_uniforms(first: Tensor, out: Tensor, seed: int) -> None:
    """``out[i] = row_uniform(seed, first + i)`` for the float64 ``out`` (``first`` 0-dim int64)."""
    n = out.numel()
    uniform_kernel[(cdiv(n, 1024),)](first, out, n, seed, BLOCK=1024)
