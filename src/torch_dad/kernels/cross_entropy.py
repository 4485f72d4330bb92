"""The Triton kernel behind :func:`torch_dad.ops.cross_entropy.cross_entropy_rows_` (see its docstring).

This module imports triton, so :mod:`torch_dad.ops.cross_entropy` imports it only on the first
kernel launch; ``import torch_dad`` never does.
"""

import triton
import triton.language as tl


@triton.jit
def ce_rows_kernel(
    x_ptr, y_ptr, logp_ptr, ent_ptr, top1_ptr, lse_ptr, tlogit_ptr,
    V, stride_row, col_offset, scale, ignore_index,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, ENTROPY: tl.constexpr, TOP1: tl.constexpr, LSE: tl.constexpr,
    TARGET_LOGIT: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    """One program per row ``x`` of logits with target ``y``: ``log p(y) = x[y] - logsumexp(x)``;
    ``x <- (softmax(x) - onehot(y)) * scale`` if WRITE_GRAD; ``entropy = lse - sum p * x`` if
    ENTROPY; ``argmax(x) == y`` if TOP1; ``logsumexp(x)`` itself if LSE; ``x[y]`` if TARGET_LOGIT.
    The row holds vocabulary columns ``col_offset .. col_offset + V``; a row whose target is ``ignore_index``
    or outside them gets zeros and no ``x[y]`` (``logsumexp`` is written for every row). ONE_BLOCK:
    ``V <= BLOCK_V``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_row
    y = tl.load(y_ptr + row).to(tl.int64)
    y_local = y - col_offset
    valid = (y != ignore_index) & (y_local >= 0) & (y_local < V)
    y_safe = tl.where(valid, y_local, 0)
    # read before the row is overwritten by its gradient; a load is cheaper than picking it out of a one-block
    # row's registers, a third reduction over the block (docs/design-kernels.md)
    x_y = tl.load(x_row + y_safe).to(tl.float32)
    if ONE_BLOCK:
        lse = _one_block_row(x_row, ent_ptr, top1_ptr, lse_ptr, row, y_safe, valid, V, scale,
                             BLOCK_V, WRITE_GRAD, ENTROPY, TOP1, LSE)
    else:
        lse = _blocked_row(x_row, ent_ptr, top1_ptr, lse_ptr, row, y_safe, valid, V, scale,
                           BLOCK_V, WRITE_GRAD, ENTROPY, TOP1, LSE)
    tl.store(logp_ptr + row, tl.where(valid, x_y - lse, 0.0))
    if TARGET_LOGIT:
        tl.store(tlogit_ptr + row, x_y, mask=valid)


@triton.jit
def _one_block_row(
    x_row, ent_ptr, top1_ptr, lse_ptr, row, y_safe, valid, V, scale,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, ENTROPY: tl.constexpr, TOP1: tl.constexpr, LSE: tl.constexpr,
):
    """A row that fits one block (a vocabulary slice): read once and kept in registers, so the max, the sum of
    exponentials and the gradient take one exponential per element and no second read. Returns ``logsumexp(x)``."""
    cols = tl.arange(0, BLOCK_V)
    inside = cols < V
    x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    # an all -inf row subtracts 0 instead of -inf: its sum is 0 and its lse -inf, no NaN
    e = tl.exp(x - tl.where(m == float("-inf"), 0.0, m))
    lse = m + tl.log(tl.sum(e, axis=0))
    if LSE:
        tl.store(lse_ptr + row, lse)
    if TOP1:
        first = tl.min(tl.where(x == m, cols, V), axis=0)
        tl.store(top1_ptr + row, (valid & (first == y_safe)).to(top1_ptr.dtype.element_ty))
    if WRITE_GRAD or ENTROPY:
        p = tl.exp(x - lse)
        if ENTROPY:
            px = tl.sum(p * tl.where(p > 0.0, x, 0.0), axis=0)  # 0 * -inf would be NaN
            tl.store(ent_ptr + row, tl.where(valid, lse - px, 0.0))
        if WRITE_GRAD:
            g = (p - tl.where(cols == y_safe, 1.0, 0.0)) * tl.where(valid, scale, 0.0)
            tl.store(x_row + cols, g.to(x_row.dtype.element_ty), mask=inside)
    return lse


@triton.jit
def _blocked_row(
    x_row, ent_ptr, top1_ptr, lse_ptr, row, y_safe, valid, V, scale,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, ENTROPY: tl.constexpr, TOP1: tl.constexpr, LSE: tl.constexpr,
):
    """A row of several blocks: an online max / sum of exponentials per lane, then a second read for the
    gradient (from L2 at the chunk sizes used). Returns ``logsumexp(x)``."""
    lanes = tl.arange(0, BLOCK_V)
    # pass 1: per-lane running max, sum of exp(x - max) and first index of the max
    m_vec = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s_vec = tl.zeros((BLOCK_V,), tl.float32)
    i_vec = tl.zeros((BLOCK_V,), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        # lanes that have seen no finite value yet subtract 0 instead of -inf: their sum stays 0, no NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - m_ref) + tl.exp(x - m_ref)
        if TOP1:
            i_vec = tl.where(x > m_vec, cols.to(tl.int64), i_vec)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
    lse = m + tl.log(s)
    if LSE:
        tl.store(lse_ptr + row, lse)
    if TOP1:
        first = tl.min(tl.where(m_vec == m, i_vec, V), axis=0)
        tl.store(top1_ptr + row, (valid & (first == y_safe)).to(top1_ptr.dtype.element_ty))
    # pass 2: the gradient in place (and sum p * x for the entropy)
    if WRITE_GRAD or ENTROPY:
        row_scale = tl.where(valid, scale, 0.0)
        px_vec = tl.zeros((BLOCK_V,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + lanes
            inside = cols < V
            x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse)
            if ENTROPY:
                px_vec += p * tl.where(p > 0.0, x, 0.0)  # 0 * -inf would be NaN
            if WRITE_GRAD:
                g = (p - tl.where(cols == y_safe, 1.0, 0.0)) * row_scale
                tl.store(x_row + cols, g.to(x_row.dtype.element_ty), mask=inside)
        if ENTROPY:
            tl.store(ent_ptr + row, tl.where(valid, lse - tl.sum(px_vec, axis=0), 0.0))
    return lse


@triton.jit
def ce_grad_from_lse_kernel(
    x_ptr, y_ptr, lse_ptr, V, stride_row, col_offset, ignore_index, BLOCK_V: tl.constexpr,
):
    """Program ``(row, block)``: ``x[row, cols] <- exp(x - lse[row]) - (cols + col_offset == y[row])``
    over one block of columns of a vocabulary slice that starts at ``col_offset``; 0 on ignored rows."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < V
    y = tl.load(y_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    ptrs = x_ptr + row * stride_row + cols
    x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    g = tl.exp(x - lse) - tl.where(cols + col_offset == y, 1.0, 0.0)
    g = tl.where(y != ignore_index, g, 0.0)
    tl.store(ptrs, g.to(x_ptr.dtype.element_ty), mask=inside)
