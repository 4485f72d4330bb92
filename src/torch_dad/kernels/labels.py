"""The Triton kernel of :func:`torch_dad.ops.linear_cross_entropy.next_token_targets` and its launcher.

One launch reads the labels once and writes the next-token targets, their mask, and the two counts the host
reads before a step's backward: the labels outside the vocabulary, and the scored targets. In torch ops that
is a shift, a compare and a range check of about ten small kernels, each a launch the step's host issues (or a
node of its CUDA graph) before the head's GEMMs can start.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import cdiv

BLOCK = 1024


@triton.jit
def next_token_targets_kernel(labels_ptr, targets_ptr, mask_ptr, counts_ptr, n, row_len, vocab, ignore_index,
                              SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    labels = tl.load(labels_ptr + offsets, mask=inside, other=ignore_index)
    out_of_range = inside & (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if SHIFT:
        # position t takes label t + 1 of its own row; a row's last position has none
        has_next = inside & ((offsets % row_len) != row_len - 1)
        targets = tl.load(labels_ptr + offsets + 1, mask=has_next, other=ignore_index)
        tl.store(targets_ptr + offsets, targets, mask=inside)
    else:
        targets = labels
    scored = inside & (targets != ignore_index)
    tl.store(mask_ptr + offsets, scored, mask=inside)
    tl.atomic_add(counts_ptr, tl.sum(out_of_range.to(tl.int32), 0))
    tl.atomic_add(counts_ptr + 1, tl.sum(scored.to(tl.int32), 0))


def next_token_targets(labels: Tensor, vocab: int, ignore_index: int, shift: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(targets, mask, counts)`` of contiguous int32/int64 ``labels``: ``targets`` the labels shifted one place
    left along the last dim (``ignore_index`` at each row's end) if ``shift``, else ``labels`` itself; ``mask = targets !=
    ignore_index``; ``counts`` (int32) the labels neither ``ignore_index`` nor in ``[0, vocab)``, and ``mask``'s
    true entries."""
    targets = torch.empty_like(labels) if shift else labels
    mask = torch.empty(labels.shape, dtype=torch.bool, device=labels.device)
    counts = torch.zeros(2, dtype=torch.int32, device=labels.device)
    n = labels.numel()
    row_len = labels.shape[-1] if labels.dim() else 1
    next_token_targets_kernel[(cdiv(n, BLOCK),)](labels, targets, mask, counts, n, row_len, vocab, ignore_index,
                                                 SHIFT=shift, BLOCK=BLOCK)
    return targets, mask, counts
