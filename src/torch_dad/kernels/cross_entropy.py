"""Cross-entropy over the rows of a logits chunk, turned into its gradient in place.

For a chunk of logits ``x`` (R, V) in the compute dtype and targets ``y`` (R,) this computes,
per row, as the loop body of ``torch_dad.lm_head._torch_linear_cross_entropy`` does::

    lse      = logsumexp(x)                              (float32)
    log_p    = x[y] - lse                                (0 on ignored rows)
    x       <- (softmax(x) - onehot(y)) * scale          (in place; 0 on ignored rows)
    entropy  = -sum softmax(x) * log softmax(x)          (optional, 0 on ignored rows)
    is_top1  = argmax(x) == y                            (optional, False on ignored rows)

The Triton version is one launch, one program per row: a first loop over V in blocks keeps a
per-lane running max and sum of exponentials (online softmax, float32) and the first index of
the max; a second loop rereads the row (from L2 at the chunk sizes used) and overwrites it with
the gradient in the logits' dtype. Two reads and one write of the compute-dtype logits, no
float32 copy of the chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from . import next_pow2, use_triton

__all__ = ["cross_entropy_rows_"]

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# vocabulary elements per block of the row loops: 4096 bf16 = 8 KiB a step, 16 a thread at 8 warps
_MAX_BLOCK_V = 4096


def cross_entropy_rows_(
    logits: Tensor,
    target: Tensor,
    log_probs: Tensor,
    *,
    ignore_index: int,
    scale: float,
    write_grad: bool = True,
    entropy: Tensor | None = None,
    is_top1: Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Fill ``log_probs`` (R,) (and ``entropy``, ``is_top1``) and, if ``write_grad``, overwrite
    ``logits`` (R, V) with ``(softmax - onehot(target)) * scale`` (zero on ignored rows).

    ``target`` holds ids in ``[0, V)`` or ``ignore_index``. ``backend="auto"`` runs the Triton
    kernel on CUDA (or under ``TRITON_INTERPRET=1``) for float32/fp16/bf16 logits, else the
    PyTorch twin.
    """
    if logits.dim() != 2 or target.shape != (logits.shape[0],) or log_probs.shape != (logits.shape[0],):
        raise ValueError(
            f"logits {tuple(logits.shape)}, target {tuple(target.shape)} and log_probs {tuple(log_probs.shape)} "
            "must be (R, V), (R,), (R,)"
        )
    fits = (
        logits.dtype in _TRITON_DTYPES
        and logits.stride(1) == 1
        and log_probs.dtype == torch.float32
        and log_probs.is_contiguous()
        and (entropy is None or (entropy.dtype == torch.float32 and entropy.is_contiguous()))
        and (is_top1 is None or is_top1.is_contiguous())
    )
    if backend == "triton" and not fits:
        raise ValueError(
            "backend='triton' needs float32/fp16/bf16 logits with unit column stride and contiguous float32 "
            "outputs; use backend='torch'"
        )
    if logits.shape[0] and use_triton(logits, backend) and fits:
        _cross_entropy_rows_triton(logits, target, log_probs, ignore_index, scale, write_grad, entropy, is_top1)
    else:
        _cross_entropy_rows_torch(logits, target, log_probs, ignore_index, scale, write_grad, entropy, is_top1)


def _cross_entropy_rows_torch(
    logits: Tensor,
    target: Tensor,
    log_probs: Tensor,
    ignore_index: int,
    scale: float,
    write_grad: bool,
    entropy: Tensor | None,
    is_top1: Tensor | None,
) -> None:
    """PyTorch twin (float32 softmax for half logits, as the kernel)."""
    wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
    valid = target != ignore_index
    t = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
    lse = torch.logsumexp(wide, dim=1)
    log_probs.copy_((wide.gather(1, t).squeeze(1) - lse).masked_fill_(~valid, 0))
    if is_top1 is not None:
        is_top1.copy_((wide.argmax(1) == t.squeeze(1)) & valid)
    if not (write_grad or entropy is not None):
        return
    probs = wide.sub_(lse.unsqueeze(1)).exp_()
    if entropy is not None:
        entropy.copy_(torch.special.entr(probs).sum(1).masked_fill_(~valid, 0))
    if write_grad:
        mask = valid.to(probs.dtype).unsqueeze(1)
        probs.scatter_add_(1, t, -mask)
        logits.copy_(probs.mul_(mask * scale))


# ---------------------------------------------------------------------------------- Triton
@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows_kernel(
        x_ptr, y_ptr, logp_ptr, ent_ptr, top1_ptr,
        V, stride_row, scale, ignore_index,
        BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, ENTROPY: tl.constexpr, TOP1: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_row
        y = tl.load(y_ptr + row).to(tl.int64)
        valid = y != ignore_index
        y_safe = tl.where(valid, y, 0)
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
        x_y = tl.load(x_row + y_safe).to(tl.float32)
        tl.store(logp_ptr + row, tl.where(valid, x_y - lse, 0.0))
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
                    tl.store(x_row + cols, g.to(x_ptr.dtype.element_ty), mask=inside)
            if ENTROPY:
                tl.store(ent_ptr + row, tl.where(valid, lse - tl.sum(px_vec, axis=0), 0.0))

    return ce_rows_kernel


def _cross_entropy_rows_triton(
    logits: Tensor,
    target: Tensor,
    log_probs: Tensor,
    ignore_index: int,
    scale: float,
    write_grad: bool,
    entropy: Tensor | None,
    is_top1: Tensor | None,
) -> None:
    kernel = _kernel()
    rows, vocab = logits.shape
    block = min(_MAX_BLOCK_V, max(16, next_pow2(vocab)))
    target = target.contiguous()
    top1 = None if is_top1 is None else (is_top1.view(torch.uint8) if is_top1.dtype == torch.bool else is_top1)
    kernel[(rows,)](
        logits, target, log_probs,
        log_probs if entropy is None else entropy,
        log_probs if top1 is None else top1,
        vocab, logits.stride(0), float(scale), int(ignore_index),
        BLOCK_V=block, WRITE_GRAD=bool(write_grad), ENTROPY=entropy is not None, TOP1=top1 is not None,
        num_warps=8 if block >= 2048 else 4,
    )
