"""Graph-safe update of :class:`torch_dad.ridge.GramAccumulator` in three launches.

``GramAccumulator.update`` (the twin) uses ``bincount``, which reads the labels on the host,
so it cannot sit inside a CUDA graph, and it launches ~15 kernels. Here, with
``A = [h | 1 | onehot(y)]`` (B, d + 1 + C) in ``h``'s dtype (ones and one-hots are exact in
bf16, and bf16 products are exact in the fp32 accumulator), one GEMM ``G = A^T A`` with fp32
output holds every statistic at once::

    gram = G[:d, :d]   sum_features = G[d, :d]   count = G[d, d]
    cross = G[:d, d+1:]   sum_targets = G[d, d+1:]

and one kernel folds ``G`` into the float64 buffers: ``buf = decay * buf + G_part``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ridge import GramAccumulator
from . import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no triton
    triton = None

__all__ = ["gram_update_", "mm_fp32"]


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``(a @ b)`` accumulated and returned in float32 (a single cuBLAS call for bf16 inputs)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # type: ignore[call-overload]
        except (TypeError, RuntimeError):
            pass
    return a.float() @ b.float()


_mm_fp32 = mm_fp32


def gram_update_(acc: GramAccumulator, features: Tensor, target: Tensor, *, backend: str = "auto") -> None:
    """``acc.update(features, target)`` without host syncs (see the module docstring)."""
    if features.dim() != 2 or features.shape[1] != acc.num_features:
        raise ValueError(f"features must have shape (batch, {acc.num_features}), got {tuple(features.shape)}")
    if target.shape != (features.shape[0],):
        raise ValueError(f"target must have shape ({features.shape[0]},), got {tuple(target.shape)}")
    if not use_triton(features, backend):
        acc.update(features, target)
        return
    batch, d = features.shape
    c = acc.num_classes
    width = d + 1 + c
    # pad the row to a multiple of 8 elements: measured on the H200, an unaligned width (267 or
    # 4107) sent cuBLAS to an sm75 "align1" kernel, at d=4096 slower than a whole layer's GEMMs
    padded = -(-width // 8) * 8
    # in h's dtype: an fp32 copy would be the largest temporary of a bf16 step (256 MiB at
    # B=16384, d=4096)
    aug = torch.empty(batch, padded, device=features.device, dtype=features.dtype)
    block_r, block_c = 32, 128
    _augment_kernel[(-(-batch // block_r), -(-padded // block_c))](
        features, target, aug, batch, d, padded, features.stride(0), BR=block_r, BC=block_c
    )
    decay = math.exp(-batch / acc.window) if acc.window is not None else 1.0
    if _SYRK:
        # A^T A is symmetric: one kernel computes the upper-triangle tiles only and folds each
        # tile straight into the float64 buffers (mirroring the Gram block), so neither the
        # lower half's FLOPs nor the fp32 G round trip are paid. Measured before it, on the H200 at
        # d=4096, B=1024: Gram GEMM 60 us + separate fold 154 us of a 603 us step.
        bm, bk = 64, 64
        tiles = -(-width // bm)
        _syrk_fold_kernel[(-(-(d + 1) // bm), tiles)](
            aug, acc.gram, acc.sum_features, acc.count, acc.cross, acc.sum_targets,
            batch, d, c, width, padded, decay, BM=bm, BK=bk, num_warps=4, num_stages=3,
        )
        return
    g = _mm_fp32(aug.T, aug)
    block = 64
    _fold_kernel[(-(-(d + 1) // block), -(-width // block))](
        g, acc.gram, acc.sum_features, acc.count, acc.cross, acc.sum_targets, d, c, width, padded, decay, BLOCK=block
    )


# the one-kernel symmetric path; False selects GEMM + fold (kept as the measured baseline)
_SYRK = True


if triton is not None:

    @triton.jit
    def _augment_kernel(h_ptr, y_ptr, out_ptr, B, D, W, stride_h, BR: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        rmask = rows < B
        h = tl.load(
            h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & (cols[None, :] < D), other=0.0
        ).to(tl.float32)
        y = tl.load(y_ptr + rows, mask=rmask, other=0)
        one = tl.where(cols[None, :] == D, 1.0, 0.0)
        hot = tl.where(cols[None, :] - D - 1 == y[:, None], 1.0, 0.0)
        val = tl.where(cols[None, :] < D, h, one + hot)
        tl.store(out_ptr + rows[:, None] * W + cols[None, :], val.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols[None, :] < W))

    @triton.jit
    def _fold_kernel(
        g_ptr, gram_ptr, sumf_ptr, count_ptr, cross_ptr, sumt_ptr, D, C, W, WP, decay, BLOCK: tl.constexpr
    ):
        # rows 0..D of G only (the onehot rows duplicate what the columns already hold)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ii = i[:, None]
        jj = j[None, :]
        valid = (ii <= D) & (jj < W)
        g = tl.load(g_ptr + ii * WP + jj, mask=valid, other=0.0).to(tl.float64)
        # gram[i, j]
        m = valid & (ii < D) & (jj < D)
        ptr = gram_ptr + ii * D + jj
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # cross[i, c]
        m = valid & (ii < D) & (jj > D)
        ptr = cross_ptr + ii * C + (jj - D - 1)
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # sum_features[j]
        m = valid & (ii == D) & (jj < D)
        ptr = sumf_ptr + jj + ii * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # count
        m = valid & (ii == D) & (jj == D)
        ptr = count_ptr + ii * 0 + jj * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # sum_targets[c]
        m = valid & (ii == D) & (jj > D)
        ptr = sumt_ptr + (jj - D - 1) + ii * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)

    @triton.jit
    def _fold_tile(acc, ii, jj, gram_ptr, sumf_ptr, count_ptr, cross_ptr, sumt_ptr, D, C, W, decay):
        """``buf = decay * buf + G`` for the upper-triangle elements (ii <= jj) of one tile of G."""
        g = acc.to(tl.float64)
        valid = (ii <= jj) & (ii <= D) & (jj < W)
        # gram[i, j] and its mirror gram[j, i]
        m = valid & (jj < D)
        ptr = gram_ptr + ii * D + jj
        new = decay * tl.load(ptr, mask=m, other=0.0) + g
        tl.store(ptr, new, mask=m)
        tl.store(gram_ptr + jj * D + ii, new, mask=m & (ii != jj))
        # sum_features[i] = G[i, D] (the ones column)
        m = valid & (ii < D) & (jj == D)
        ptr = sumf_ptr + ii + jj * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # count = G[D, D]
        m = valid & (ii == D) & (jj == D)
        ptr = count_ptr + ii * 0 + jj * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # cross[i, c] = G[i, D + 1 + c]
        m = valid & (ii < D) & (jj > D)
        ptr = cross_ptr + ii * C + (jj - D - 1)
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)
        # sum_targets[c] = G[D, D + 1 + c]
        m = valid & (ii == D) & (jj > D)
        ptr = sumt_ptr + (jj - D - 1) + ii * 0
        tl.store(ptr, decay * tl.load(ptr, mask=m, other=0.0) + g, mask=m)

    @triton.jit
    def _syrk_fold_kernel(
        a_ptr, gram_ptr, sumf_ptr, count_ptr, cross_ptr, sumt_ptr, B, D, C, W, WP, decay,
        BM: tl.constexpr, BK: tl.constexpr,
    ):
        pid_i = tl.program_id(0)
        pid_j = tl.program_id(1)
        if pid_i <= pid_j:
            i = pid_i * BM + tl.arange(0, BM)
            j = pid_j * BM + tl.arange(0, BM)
            acc = tl.zeros((BM, BM), dtype=tl.float32)
            for m0 in range(0, B, BK):
                rows = m0 + tl.arange(0, BK)
                rmask = rows < B
                ai = tl.load(a_ptr + rows[:, None] * WP + i[None, :], mask=rmask[:, None] & (i[None, :] < WP), other=0.0)
                aj = tl.load(a_ptr + rows[:, None] * WP + j[None, :], mask=rmask[:, None] & (j[None, :] < WP), other=0.0)
                if a_ptr.dtype.element_ty == tl.float32:
                    acc = tl.dot(tl.trans(ai), aj, acc, input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(ai), aj, acc)
            _fold_tile(acc, i[:, None], j[None, :], gram_ptr, sumf_ptr, count_ptr, cross_ptr, sumt_ptr, D, C, W, decay)
