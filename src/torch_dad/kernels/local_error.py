"""Fused local error of a DAD layer: logits, softmax - onehot, ``d_z`` and the small gradients.

For a layer output ``h`` (M, N) with local head ``W_loc`` (C, N), ``b_loc`` (C,) this computes,
as :func:`torch_dad.functional.local_loss_and_gradients` does after its forward::

    logits   = h @ W_loc.T + b_loc                    (fp32 accumulation)
    d_logits = (softmax(logits) - onehot(y)) / M      loss = mean CE(logits, y)
    g_W_loc  = d_logits.T @ h                         g_b_loc = d_logits.sum(0)
    d_z      = (d_logits @ W_loc) * act'(h)           g_b     = d_z.sum(0)

``act'`` is read off ``h`` (relu: ``h > 0``; tanh: ``1 - h^2``; identity: 1), so the forward
need not keep ``z``. With ``with_dz=False`` the layer is an output head (the classifier):
``d_z`` and ``g_b`` are skipped and ``g_W_loc, g_b_loc`` are its weight and bias gradients.

The Triton version is two launches instead of the ~12 PyTorch ops of the twin:
1. a row kernel: each program owns ``BM`` rows, streams ``h`` once for the logits, does the
   softmax in registers, writes logits, ``d_logits`` and the per-row loss, and zeroes the
   gradient accumulators;
2. a column kernel: programs own ``BN`` columns of ``h`` and a slice of the rows; they stream
   ``h`` again, write ``d_z`` and accumulate ``g_W_loc``, ``g_b`` (and ``g_b_loc``, loss).
   When the rows are split over several programs (to fill the GPU at small widths) the partial
   sums are added atomically, so the fp32 summation order, and the last bits, may vary.

With few rows and wide layers (see :func:`default_tiles`) the row kernel also splits the columns
over several programs per row block: their partial logits are added atomically into a zeroed
buffer (one more launch, a memset), and the last program to arrive does the softmax.

Narrow layers (``Tiles.one_pass``) take one launch after a memset of the sums: each program owns
``BM`` whole rows, makes their logits and softmax, then passes over its rows again (now in cache)
for ``d_z`` and adds its share of the gradients atomically.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from . import next_pow2, use_triton

__all__ = ["LocalError", "local_error", "FUSED_ACTIVATIONS"]

#: activations whose derivative can be read off the output ``h``
FUSED_ACTIVATIONS: tuple[str, ...] = ("relu", "tanh", "identity")
_ACT_CODE = {"relu": 0, "tanh": 1, "identity": 2}
# the column kernel keeps a (CP, BN) fp32 accumulator; 256 classes is where it stops fitting
_MAX_TRITON_CLASSES = 256


@dataclass
class LocalError:
    """Outputs of :func:`local_error` (gradients in float32)."""

    logits: Tensor
    loss: Tensor
    grad_head_weight: Tensor
    grad_head_bias: Tensor
    d_z: Tensor | None
    grad_bias: Tensor | None


def _check(h: Tensor, head_weight: Tensor, head_bias: Tensor, target: Tensor, activation: str) -> None:
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} has no fused local error (its derivative needs z); "
            f"use one of {FUSED_ACTIVATIONS} or the eager backend"
        )
    if h.dim() != 2 or head_weight.dim() != 2 or head_weight.shape[1] != h.shape[1]:
        raise ValueError(
            f"h {tuple(h.shape)} and head_weight {tuple(head_weight.shape)} must be (M, N) and (C, N)"
        )
    if head_bias.shape != (head_weight.shape[0],):
        raise ValueError(f"head_bias must have shape ({head_weight.shape[0]},), got {tuple(head_bias.shape)}")
    if target.shape != (h.shape[0],):
        raise ValueError(f"target must have shape ({h.shape[0]},), got {tuple(target.shape)}")


def local_error(
    h: Tensor,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    activation: str = "relu",
    *,
    with_dz: bool = True,
    backend: str = "auto",
) -> LocalError:
    """The local error of a DAD layer from its output ``h`` (see the module docstring).

    ``h`` is in the compute dtype (bf16/fp16/fp32); ``head_weight``/``head_bias`` are the fp32
    masters (cast to ``h.dtype`` for the products, as the eager path does); ``target`` holds
    class ids in ``[0, C)``. ``d_z`` comes back in ``h.dtype``, everything else in float32.
    """
    _check(h, head_weight, head_bias, target, activation)
    if use_triton(h, backend) and head_weight.shape[0] <= _MAX_TRITON_CLASSES:
        return _local_error_triton(h, head_weight, head_bias, target, activation, with_dz)
    return _local_error_torch(h, head_weight, head_bias, target, activation, with_dz)


def _derivative_from_output(h: Tensor, activation: str) -> Tensor:
    if activation == "relu":
        return (h > 0).to(h.dtype)
    if activation == "tanh":
        return 1.0 - h * h
    return torch.ones_like(h)


def _local_error_torch(
    h: Tensor, head_weight: Tensor, head_bias: Tensor, target: Tensor, activation: str, with_dz: bool
) -> LocalError:
    """PyTorch twin: products of ``h.dtype`` operands accumulated in fp32, as the kernel does."""
    w = head_weight.to(h.dtype).float()
    hf = h.float()
    logits = torch.addmm(head_bias.float(), hf, w.T)
    loss, d_logits = F.cross_entropy_error(logits, target)
    dl = d_logits.to(h.dtype).float()
    d_z = grad_bias = None
    if with_dz:
        dz = (dl @ w) * _derivative_from_output(hf, activation)
        grad_bias = dz.sum(0)
        d_z = dz.to(h.dtype)
    return LocalError(logits, loss, dl.T @ hf, d_logits.sum(0), d_z, grad_bias)


# ---------------------------------------------------------------------------------- Triton
@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    from . import local_error_triton as kernels  # imports triton: only on the first launch

    return kernels.rows_kernel, kernels.cols_kernel, kernels.one_pass_kernel


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@dataclass(frozen=True)
class Tiles:
    """Launch configuration of the two kernels: tile sizes, warps and pipeline stages, and how
    many column-kernel programs to aim for per SM (the rows are split to get there)."""

    rows_bm: int
    rows_bn: int
    rows_warps: int
    rows_stages: int
    cols_bm: int
    cols_bn: int
    cols_warps: int
    cols_stages: int
    cols_programs_per_sm: int
    #: programs per row block of the row kernel, each over a slice of the columns (1: none)
    rows_split: int = 1
    #: one launch instead of two: the row kernel (``rows_*`` tiles) also makes ``d_z`` and the
    #: gradients in a second pass over its rows, adding the gradients atomically into zeroed
    #: sums (a memset before it); ``cols_*`` and ``rows_split`` are then unused
    one_pass: bool = False
    #: memory order of the atomic adds: "relaxed", or "acq_rel" (Triton's default). Relaxed is
    #: enough (the sums are read after the launch, or after the split path's counter) and faster:
    #: 4096 x 1024 16.1 -> 13.8 us, 1024 x 4096 17.3 -> 15.2 us; fmnist-wide-2's step at B=1024
    #: 348.1 -> 326.4 us, deep-8x1024's 268.8 -> 253.8 us (device call 50)
    atomic_sem: str = "relaxed"


def default_tiles(M: int, N: int, CP: int, element_size: int = 2) -> Tiles:
    """The launch configuration for an (M, N) layer output with CP padded classes whose ``h``
    has ``element_size`` bytes per entry.

    Chosen by a sweep of 36 row-kernel x 162 column-kernel configurations on an H200, bf16,
    10 classes, each call timed inside a CUDA graph (device calls 12-13 of 2026-11-30,
    ``notes/gpu-2026-11-30/call12-*``). Against the previous fixed tiles (the ``else``
    branch), per call: 4096 x 1024 21.5 -> 16.1 us, 4096 x 4096 60.8 -> 45.7 us,
    1024 x 4096 25.0 -> 21.9 us, 4096 x 512 14.6 -> 12.5 us; at N = 256 and at 1024 x 512
    the old tiles stay best (8.6 vs 9.1 us). Computing the logits by a cuBLAS GEMM instead of
    in the row kernel was slower everywhere: the cast and padding of ``W_loc`` alone are
    two launches of ~3 us each in a graph. The 512-wide row tiles are for 2-byte ``h`` only:
    in fp32 their pipeline needs 288 KiB of shared memory (the H200 has 227 KiB).

    Few rows and many columns (M <= 2048, N >= 2048) leave the row kernel with one program per
    32 rows looping over all columns: there 8 programs per row block, each over an eighth of
    the columns, took 1024 x 4096 from 23.6 to 17.4 us (classifier mode 22.2 to 15.6 us). With
    4096 rows the split gained nothing (device call 16).

    Layers of at most 256 outputs take the one-launch kernel (``one_pass``): at N = 256 it took
    1024 x 256 from 6.5 to 6.3 us (output-head mode 5.9 to 5.5) and 4096 x 256 from 8.5 to 7.6 us
    (7.7 to 6.7); wider layers were slower with it, e.g. 1024 x 4096 15.2 vs 34.0 us, with too few
    row blocks to fill the GPU (device call 50, ``notes/gpu-2026-11-30/call50-*``).
    """
    if CP <= 64 and N <= 256:
        return Tiles(
            rows_bm=16 if M <= 2048 else 32, rows_bn=128, rows_warps=4, rows_stages=3, one_pass=True,
            cols_bm=32, cols_bn=128, cols_warps=4, cols_stages=2, cols_programs_per_sm=2,
        )
    if CP <= 64 and N >= 2048 and M <= 2048:
        return Tiles(
            rows_bm=32, rows_bn=64, rows_warps=4, rows_stages=4, rows_split=8,
            cols_bm=32, cols_bn=128, cols_warps=8, cols_stages=2, cols_programs_per_sm=2,
        )
    if CP <= 64 and (N >= 1024 or (N >= 512 and M >= 2048)):
        return Tiles(
            rows_bm=32, rows_bn=512 if N >= 2048 and element_size <= 2 else 128, rows_warps=4, rows_stages=4,
            cols_bm=32, cols_bn=128, cols_warps=8, cols_stages=2, cols_programs_per_sm=2,
        )
    return Tiles(
        rows_bm=16 if CP > 64 else 32,
        rows_bn=64 if CP > 64 else 128,
        rows_warps=4,
        rows_stages=3,
        cols_bm=64 if CP <= 64 else 32,
        cols_bn=64 if N >= 2048 else 32,
        cols_warps=4,
        cols_stages=3,
        cols_programs_per_sm=2,
    )


def _local_error_triton(
    h: Tensor,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    activation: str,
    with_dz: bool,
    tiles: Tiles | None = None,
) -> LocalError:
    rows_kernel, cols_kernel, one_pass_kernel = _kernels()
    h = h if h.stride(1) == 1 else h.contiguous()
    head_weight = head_weight.contiguous()
    M, N = h.shape
    C = head_weight.shape[0]
    CP = max(16, next_pow2(C))
    t = tiles or default_tiles(M, N, CP, h.element_size())
    dev = h.device
    ieee = h.dtype == torch.float32
    # one flat fp32 block for every accumulator: the row kernel zeroes it in the same launch
    flat = torch.empty(C * N + N + C + 1, device=dev, dtype=torch.float32)
    gw = flat[: C * N].view(C, N)
    gb = flat[C * N : C * N + N]
    gbloc = flat[C * N + N : C * N + N + C]
    loss = flat[-1]
    logits = torch.empty(M, C, device=dev, dtype=torch.float32)
    if t.one_pass:
        flat.zero_()
        dz = torch.empty(M, N, device=dev, dtype=h.dtype) if with_dz else h
        one_pass_kernel[(triton_cdiv(M, t.rows_bm),)](
            h, head_weight, head_bias, target, logits, dz, gw, gb, gbloc, loss,
            M, N, C, h.stride(0), 1.0 / M,
            BM=t.rows_bm, BN=t.rows_bn, CP=CP, ACT=_ACT_CODE[activation], WRITE_DZ=with_dz, IEEE=ieee,
            SEM=t.atomic_sem, num_warps=t.rows_warps, num_stages=t.rows_stages,
        )
        return LocalError(logits, loss, gw, gbloc, dz if with_dz else None, gb if with_dz else None)
    dl = torch.empty(M, CP, device=dev, dtype=torch.float32)
    rowloss = torch.empty(M, device=dev, dtype=torch.float32)
    row_blocks = triton_cdiv(M, t.rows_bm)
    split = max(1, min(t.rows_split, triton_cdiv(N, t.rows_bn)))
    split_cols = triton_cdiv(triton_cdiv(N, split), t.rows_bn) * t.rows_bn
    split = triton_cdiv(N, split_cols)
    # the split path's partial logits and per-row-block arrival counters: one memset
    scratch = torch.zeros(M * CP + row_blocks, device=dev, dtype=torch.float32) if split > 1 else rowloss
    zero_chunk = triton_cdiv(flat.numel(), row_blocks * split)
    rows_kernel[(row_blocks, split)](
        h, head_weight, head_bias, target, logits, dl, rowloss, flat, scratch, scratch[M * CP :] if split > 1 else scratch,
        M, N, C, h.stride(0), 1.0 / M, flat.numel(), zero_chunk, split_cols,
        BM=t.rows_bm, BN=t.rows_bn, CP=CP, IEEE=ieee, ZBLOCK=256, SPLIT=split, SEM=t.atomic_sem,
        num_warps=t.rows_warps, num_stages=t.rows_stages,
    )
    dz = torch.empty(M, N, device=dev, dtype=h.dtype) if with_dz else h
    col_blocks = triton_cdiv(N, t.cols_bn)
    m_blocks = triton_cdiv(M, t.cols_bm)
    # split the rows so that about `cols_programs_per_sm` programs per SM run: at N=256,
    # B=1024 a single split would leave 8 programs on 132 SMs
    split = max(1, min(m_blocks, (t.cols_programs_per_sm * _num_sms(dev)) // col_blocks))
    rows_per_split = triton_cdiv(m_blocks, split) * t.cols_bm
    split = triton_cdiv(M, rows_per_split)
    cols_kernel[(col_blocks, split)](
        h, dl, head_weight, rowloss, dz, gw, gb, gbloc, loss,
        M, N, C, h.stride(0), rows_per_split,
        BM=t.cols_bm, BN=t.cols_bn, CP=CP, ACT=_ACT_CODE[activation], WRITE_DZ=with_dz, IEEE=ieee,
        SEM=t.atomic_sem, num_warps=t.cols_warps, num_stages=t.cols_stages,
    )
    if with_dz:
        return LocalError(logits, loss, gw, gbloc, dz, gb)
    return LocalError(logits, loss, gw, gbloc, None, None)


def triton_cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)
