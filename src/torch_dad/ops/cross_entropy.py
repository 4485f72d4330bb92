"""Cross-entropy over the rows of a logits chunk, turned into its gradient in place.

For a chunk of logits ``x`` (R, V) in the compute dtype and targets ``y`` (R,) this computes,
per row (the chunk body of :func:`torch_dad.ops.linear_cross_entropy.linear_cross_entropy`)::

    lse      = logsumexp(x)                              (float32)
    log_p    = x[y] - lse                                (0 on ignored rows)
    x       <- (softmax(x) - onehot(y)) * scale          (in place; 0 on ignored rows)
    entropy  = -sum softmax(x) * log softmax(x)          (optional, 0 on ignored rows)
    is_top1  = argmax(x) == y                            (optional, False on ignored rows)
    lse                                                  (optional output, every row)

:func:`logit_grad_from_lse_` is the second half alone, for a slice of the vocabulary whose rows'
``lse`` is already known: ``x <- exp(x - lse) - onehot(y)`` in place (scale 1; 0 on ignored rows).

The Triton kernel (:mod:`torch_dad.kernels.cross_entropy`) is one launch, one program per row: a
first loop over V in blocks keeps a per-lane running max and sum of exponentials (online softmax,
float32) and the first index of the max; a second loop rereads the row (from L2 at the chunk sizes
used) and overwrites it with the gradient in the logits' dtype. Two reads and one write of the
compute-dtype logits, no float32 copy of the chunk. A row of at most 8192 logits (a vocabulary slice of
the recomputing sweep) is read once into registers instead: its max, sum and gradient then cost one
exponential an element, where the online loop takes two (three with the gradient).

The PyTorch twin computes the gradient of :func:`torch_dad.functional.cross_entropy_error`
(rescaled from ``1 / valid rows`` to ``scale``) without calling it: the oracle returns only the
mean loss, so the per-row ``log_p`` would need a logsumexp pass of its own, and its gradient comes
back in a new buffer to be copied over the logits: two more passes over the chunk
(``docs/design-kernels.md``). ``tests/test_lm_head.py`` checks the twin against the oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..kernels import cdiv, next_pow2, use_triton

__all__ = ["cross_entropy_rows_", "logit_grad_from_lse_"]

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# vocabulary elements per block of the row loops: 4096 bf16 = 8 KiB a step, 16 a thread at 8 warps
_MAX_BLOCK_V = 4096
# a row up to this long (a vocabulary slice) is held in registers whole: one read, one exponential an element
# (32 float32 values a thread at 8 warps)
_MAX_ONE_BLOCK_V = 8192


@dataclass
class _Rows:
    """One call's row targets, options and outputs (what the kernel and its twin both take)."""

    target: Tensor
    log_probs: Tensor
    ignore_index: int
    scale: float
    write_grad: bool
    entropy: Tensor | None
    is_top1: Tensor | None
    lse: Tensor | None = None
    target_logit: Tensor | None = None
    col_offset: int = 0

    def fits_kernel(self, logits: Tensor) -> bool:
        """Whether the Triton kernel can take these tensors (dtype, strides)."""
        return (
            logits.dtype in _TRITON_DTYPES
            and logits.stride(1) == 1
            and self.log_probs.dtype == torch.float32
            and self.log_probs.is_contiguous()
            and (self.entropy is None or (self.entropy.dtype == torch.float32 and self.entropy.is_contiguous()))
            and (self.is_top1 is None or self.is_top1.is_contiguous())
            and all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in (self.lse, self.target_logit))
        )


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
    lse: Tensor | None = None,
    target_logit: Tensor | None = None,
    col_offset: int = 0,
    backend: str = "auto",
) -> None:
    """Fill ``log_probs`` (R,) (and ``entropy``, ``is_top1``, ``lse``) and, if ``write_grad``, overwrite
    ``logits`` (R, V) with ``(softmax - onehot(target)) * scale`` (zero on ignored rows).

    ``target`` holds ids in ``[0, V)`` or ``ignore_index``. With ``col_offset`` the logits are columns
    ``col_offset .. col_offset + V`` of a larger vocabulary (a slice): a row whose target lies outside them counts
    as ignored. ``target_logit`` (R,) float32 receives ``logits[r, target[r] - col_offset]`` on the rows not
    ignored and is left as it is on the others, so the slices of a vocabulary fill it in turn. ``backend="auto"``
    runs the Triton kernel on CUDA (or under ``TRITON_INTERPRET=1``) for float32/fp16/bf16 logits, else the
    PyTorch twin.
    """
    if logits.dim() != 2 or target.shape != (logits.shape[0],) or log_probs.shape != (logits.shape[0],):
        raise ValueError(
            f"logits {tuple(logits.shape)}, target {tuple(target.shape)} and log_probs {tuple(log_probs.shape)} "
            "must be (R, V), (R,), (R,)"
        )
    rows = _Rows(target, log_probs, ignore_index, scale, write_grad, entropy, is_top1, lse, target_logit,
                 int(col_offset))
    fits = rows.fits_kernel(logits)
    if backend == "triton" and not fits:
        raise ValueError(
            "backend='triton' needs float32/fp16/bf16 logits with unit column stride and contiguous float32 "
            "outputs; use backend='torch'"
        )
    if logits.shape[0] and use_triton(logits, backend) and fits:
        _cross_entropy_rows_triton(logits, rows)
    else:
        _cross_entropy_rows_torch(logits, rows)


def _cross_entropy_rows_torch(logits: Tensor, rows: _Rows) -> None:
    """PyTorch twin, in one float32 buffer (softmax in float32 for half logits, as the kernel)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        wide = logits.float()
    else:  # overwritten anyway when the gradient is written: no copy then
        wide = logits if rows.write_grad else logits.clone()
    local = rows.target - rows.col_offset
    valid = (rows.target != rows.ignore_index) & (local >= 0) & (local < wide.shape[1])
    t = torch.where(valid, local, torch.zeros_like(local)).unsqueeze(1)
    lse = torch.logsumexp(wide, dim=1)
    if rows.lse is not None:
        rows.lse.copy_(lse)
    picked = wide.gather(1, t).squeeze(1)
    if rows.target_logit is not None:
        rows.target_logit.copy_(torch.where(valid, picked, rows.target_logit))
    rows.log_probs.copy_((picked - lse).masked_fill_(~valid, 0))
    if rows.is_top1 is not None:
        rows.is_top1.copy_((wide.argmax(1) == t.squeeze(1)) & valid)
    if not (rows.write_grad or rows.entropy is not None):
        return
    probs = wide.sub_(lse.unsqueeze(1)).exp_()
    if rows.entropy is not None:
        rows.entropy.copy_(torch.special.entr(probs).sum(1).masked_fill_(~valid, 0))
    if rows.write_grad:
        mask = valid.to(probs.dtype).unsqueeze(1)
        probs.scatter_add_(1, t, -mask)  # - onehot(y) on valid rows
        probs.mul_(mask * rows.scale)  # ignored rows -> 0
        if probs is not logits:
            logits.copy_(probs)


def logit_grad_from_lse_(
    logits: Tensor, target: Tensor, lse: Tensor, *, col_offset: int, ignore_index: int, backend: str = "auto"
) -> None:
    """Overwrite ``logits`` (R, S), columns ``col_offset .. col_offset + S`` of the vocabulary, with
    ``exp(logits - lse[:, None]) - onehot(target - col_offset)``; 0 on rows whose target is ``ignore_index``.

    ``lse`` (R,) float32 is each row's log-sum-exp over the whole vocabulary (``cross_entropy_rows_(lse=...)``),
    so each slice of a row gets its share of ``softmax - onehot`` without the rest of the row.
    """
    if logits.dim() != 2 or target.shape != (logits.shape[0],) or lse.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)}, target {tuple(target.shape)} and lse {tuple(lse.shape)} "
                         "must be (R, S), (R,), (R,)")
    if logits.numel() == 0:
        return
    fits = logits.dtype in _TRITON_DTYPES and logits.stride(1) == 1 and lse.dtype == torch.float32
    if use_triton(logits, backend) and fits:
        block = min(_MAX_BLOCK_V, max(16, next_pow2(logits.shape[1])))
        _kernels().ce_grad_from_lse_kernel[(logits.shape[0], cdiv(logits.shape[1], block))](
            logits, target.contiguous(), lse.contiguous(), logits.shape[1], logits.stride(0), int(col_offset),
            int(ignore_index), BLOCK_V=block, num_warps=_row_warps(block, reduce_only=False),
        )
        return
    valid = target != ignore_index
    probs = (logits.to(torch.promote_types(logits.dtype, torch.float32)) - lse.unsqueeze(1)).exp_()
    local = target - col_offset
    inside = (valid & (local >= 0) & (local < logits.shape[1])).to(probs.dtype).unsqueeze(1)
    # - onehot on the rows whose target falls in this slice, as a scatter: no host sync to find them
    probs.scatter_add_(1, local.clamp(0, logits.shape[1] - 1).unsqueeze(1), -inside)
    logits.copy_(probs.masked_fill_(~valid.unsqueeze(1), 0.0))


# ---------------------------------------------------------------------------------- Triton
@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    from ..kernels import cross_entropy as kernels  # imports triton: only on the first launch

    return kernels


def _cross_entropy_rows_triton(logits: Tensor, rows: _Rows) -> None:
    """Launch :func:`torch_dad.kernels.cross_entropy.ce_rows_kernel`, one program per row."""
    kernel = _kernels().ce_rows_kernel
    n_rows, vocab = logits.shape
    one_block = vocab <= _MAX_ONE_BLOCK_V
    block = max(16, next_pow2(vocab)) if one_block else _MAX_BLOCK_V
    log_probs, entropy, is_top1 = rows.log_probs, rows.entropy, rows.is_top1
    top1 = None if is_top1 is None else (is_top1.view(torch.uint8) if is_top1.dtype == torch.bool else is_top1)
    kernel[(n_rows,)](
        logits, rows.target.contiguous(), log_probs,
        log_probs if entropy is None else entropy,
        log_probs if top1 is None else top1,
        log_probs if rows.lse is None else rows.lse,
        log_probs if rows.target_logit is None else rows.target_logit,
        vocab, logits.stride(0), rows.col_offset, float(rows.scale), int(rows.ignore_index),
        BLOCK_V=block, WRITE_GRAD=bool(rows.write_grad), ENTROPY=entropy is not None, TOP1=top1 is not None,
        LSE=rows.lse is not None, TARGET_LOGIT=rows.target_logit is not None, ONE_BLOCK=one_block,
        num_warps=_row_warps(block, one_block and not rows.write_grad and entropy is None and top1 is None),
    )


def _row_warps(block: int, reduce_only: bool) -> int:
    """Warps per program of the row kernel: a row held whole that is only reduced (the log-sum-exp pass) gets 32
    values a thread (at most 8 warps); any other row 8 warps for a block of at least 2048 values, else 4
    (``docs/design-kernels.md``)."""
    if reduce_only:
        return max(1, min(8, block // 1024))
    return 8 if block >= 2048 else 4
