"""Copy the rows an input sample keeps, and only those: the device half of ``InputReservoir``.

``InputReservoir.add_on_device`` decides on the device, with no host sync, which row of a
batch lands in which slot: ``winner[s]`` is the batch row stored in slot ``s``, or ``-1``
(slot unchanged). :func:`reservoir_store_` then does, for every slot ``s`` with
``winner[s] >= 0``::

    sample_inputs[s] = inputs[winner[s]]     sample_labels[s] = labels[winner[s]]

Why a kernel: the batch's kept rows are few (``B * capacity / seen`` once the sample is
full) but their number is only known on the device. The twin below copies a row per slot;
the path this replaced (``index_copy_`` of every batch row, the dropped ones all into one
spare row, after a ``scatter_reduce_`` with the same pile-up on one index) made the sample
cost 78-112 us of an H200 step at B=4096 (e.g. cifar10-medium-3: 342 us against 230 us
without the sample; ``benchmarks/results/gpu_throughput.json``, commit ecf18ef). Here one
program per slot reads ``winner[s]`` and returns at once when it is ``-1``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from . import next_pow2, use_triton

__all__ = ["reservoir_store_"]


def reservoir_store_(
    sample_inputs: Tensor, sample_labels: Tensor, inputs: Tensor, labels: Tensor, winner: Tensor,
    *, backend: str = "auto",
) -> None:
    """``sample[s] = batch[winner[s]]`` for every slot ``s`` with ``winner[s] >= 0`` (in place).

    ``sample_inputs`` (S', D) and ``sample_labels`` (S',) with ``S' >= S = winner.numel()``;
    ``inputs`` (B, D) in any float dtype (cast to the sample's), ``labels`` (B,) int64,
    ``winner`` (S,) int64 in ``[-1, B)``.
    """
    slots = winner.numel()
    if inputs.dim() != 2 or sample_inputs.dim() != 2 or inputs.shape[1] != sample_inputs.shape[1]:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and sample_inputs {tuple(sample_inputs.shape)} must be 2-D "
            "with the same number of columns"
        )
    if sample_inputs.shape[0] < slots or sample_labels.shape[0] < slots or labels.shape != (inputs.shape[0],):
        raise ValueError(
            f"winner has {slots} slots: sample_inputs/sample_labels need at least that many rows, "
            f"labels one per input row; got {tuple(sample_inputs.shape)}, {tuple(sample_labels.shape)}, "
            f"{tuple(labels.shape)}"
        )
    if not use_triton(inputs, backend) or slots == 0:
        _store_torch(sample_inputs, sample_labels, inputs, labels, winner)
        return
    kernel = _kernel()
    inputs = inputs if inputs.stride(1) == 1 else inputs.contiguous()
    width = inputs.shape[1]
    block = min(1024, next_pow2(width))
    kernel[(slots,)](
        sample_inputs, sample_labels, inputs, labels, winner, width,
        sample_inputs.stride(0), inputs.stride(0), BLOCK=block,
    )


def _store_torch(sample_inputs: Tensor, sample_labels: Tensor, inputs: Tensor, labels: Tensor,
                 winner: Tensor) -> None:
    """The twin: gather a row for every slot, keep the old one where ``winner`` is ``-1``."""
    slots = winner.numel()
    kept = winner >= 0
    rows = winner.clamp(min=0)
    gathered = inputs.index_select(0, rows).to(sample_inputs.dtype)
    head = sample_inputs[:slots]
    head.copy_(torch.where(kept[:, None], gathered, head))
    sample_labels[:slots].copy_(torch.where(kept, labels.index_select(0, rows), sample_labels[:slots]))


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def store_kernel(out_ptr, out_y_ptr, x_ptr, y_ptr, winner_ptr, D, stride_out, stride_x, BLOCK: tl.constexpr):
        slot = tl.program_id(0)
        row = tl.load(winner_ptr + slot)
        if row >= 0:
            tl.store(out_y_ptr + slot, tl.load(y_ptr + row))
            for d0 in range(0, D, BLOCK):
                cols = d0 + tl.arange(0, BLOCK)
                mask = cols < D
                values = tl.load(x_ptr + row * stride_x + cols, mask=mask)
                tl.store(out_ptr + slot * stride_out + cols, values.to(out_ptr.dtype.element_ty), mask=mask)

    return store_kernel
