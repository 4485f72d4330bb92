"""The Triton kernels of :func:`torch_dad.ops.local_error.local_error` and their launcher.

The launch is two kernels instead of the ~12 PyTorch ops of the twin:

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

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import cdiv, next_pow2


@triton.jit
def softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count, smoothing, C):
    """``logits = acc + b``; ``d_logits = (softmax(logits) - q) * inv_count`` with the smoothed
    target ``q = (1 - smoothing) * onehot(y) + smoothing / C`` (0 outside the rows and classes);
    the rows' cross-entropy against ``q`` times ``inv_count`` (0 outside the rows)."""
    bias = tl.load(b_ptr + cls, mask=cmask, other=0.0).to(tl.float32)
    logits = acc + bias[None, :]
    masked = tl.where(cmask[None, :], logits, float("-inf"))
    row_max = tl.max(masked, axis=1)
    e = tl.exp(masked - row_max[:, None])
    denom = tl.sum(e, axis=1)
    y = tl.load(y_ptr + rows, mask=rmask, other=0)
    onehot = cls[None, :] == y[:, None]
    uniform = smoothing / C
    d_logits = (e / denom[:, None] - tl.where(onehot, 1.0 - smoothing, 0.0) - uniform) * inv_count
    d_logits = tl.where(rmask[:, None] & cmask[None, :], d_logits, 0.0)
    # CE against q: logsumexp - (1 - smoothing) * logit_y - smoothing / C * sum_c logit_c
    logit_y = tl.sum(tl.where(onehot, logits, 0.0), axis=1)
    logit_sum = tl.sum(tl.where(cmask[None, :], logits, 0.0), axis=1)
    target_logit = (1.0 - smoothing) * logit_y + uniform * logit_sum
    row_loss = tl.where(rmask, (row_max + tl.log(denom) - target_logit) * inv_count, 0.0)
    return logits, d_logits, row_loss


@triton.jit
def times_derivative(dz, h, ACT: tl.constexpr):
    """``dz * act'`` read off the output ``h``: relu ``h > 0``, tanh ``1 - h^2``, identity 1,
    leaky relu 1 where ``h > 0`` else its slope (0.01, ``functional.LEAKY_RELU_SLOPE``)."""
    hf = h.to(tl.float32)
    if ACT == 0:
        dz = tl.where(hf > 0, dz, 0.0)
    elif ACT == 1:
        dz = dz * (1.0 - hf * hf)
    elif ACT == 3:
        dz = tl.where(hf > 0, dz, dz * 0.01)
    return dz


@triton.jit
def rows_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, logits_ptr, dl_ptr, rowloss_ptr, zero_ptr, part_ptr, count_ptr,
    M, N, C, stride_h, inv_count, smoothing, zero_numel, zero_chunk, split_cols,
    BM: tl.constexpr, BN: tl.constexpr, CP: tl.constexpr, IEEE: tl.constexpr, ZBLOCK: tl.constexpr,
    SPLIT: tl.constexpr, SEM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    # zero this program's share of the gradient accumulators the column kernel adds into
    zstart = (pid_m * SPLIT + pid_s) * zero_chunk
    for z0 in range(0, zero_chunk, ZBLOCK):
        zo = zstart + z0 + tl.arange(0, ZBLOCK)
        tl.store(zero_ptr + zo, tl.zeros((ZBLOCK,), tl.float32), mask=(zo < zero_numel) & (z0 + tl.arange(0, ZBLOCK) < zero_chunk))
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    cls = tl.arange(0, CP)
    cmask = cls < C
    acc = tl.zeros((BM, CP), dtype=tl.float32)
    n_start = pid_s * split_cols
    for n0 in range(n_start, n_start + split_cols, BN):
        cols = n0 + tl.arange(0, BN)
        nmask = cols < N
        h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        w = tl.load(w_ptr + cls[:, None] * N + cols[None, :], mask=cmask[:, None] & nmask[None, :], other=0.0)
        w = w.to(h.dtype)
        if IEEE:
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)
    if SPLIT > 1:
        # split over the columns: add the partial logits, and let the row block's last
        # program to arrive read the sums from L2 and go on to the softmax (the others
        # compute on partial sums too, but store nothing: no early return). The adds are
        # relaxed; the barrier puts every thread's adds before the counter's release,
        # which the last program's acquire pairs with.
        tl.atomic_add(part_ptr + rows[:, None] * CP + cls[None, :], acc, mask=rmask[:, None], sem=SEM)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_m, 1.0, sem="acq_rel")
        store = rmask & ((tl.zeros((BM,), tl.int32) + arrived.to(tl.int32)) == SPLIT - 1)
        acc = tl.load(part_ptr + rows[:, None] * CP + cls[None, :], mask=rmask[:, None], other=0.0, cache_modifier=".cg")
    else:
        store = rmask
    logits, d_logits, row_loss = softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count, smoothing, C)
    tl.store(logits_ptr + rows[:, None] * C + cls[None, :], logits, mask=store[:, None] & cmask[None, :])
    tl.store(dl_ptr + rows[:, None] * CP + cls[None, :], d_logits, mask=store[:, None])
    tl.store(rowloss_ptr + rows, row_loss, mask=store)


@triton.jit
def cols_kernel(
    h_ptr, dl_ptr, w_ptr, rowloss_ptr, dz_ptr, gw_ptr, gb_ptr, gbloc_ptr, loss_ptr,
    M, N, C, stride_h, rows_per_split,
    BM: tl.constexpr, BN: tl.constexpr, CP: tl.constexpr, ACT: tl.constexpr,
    WRITE_DZ: tl.constexpr, IEEE: tl.constexpr, SEM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    nmask = cols < N
    cls = tl.arange(0, CP)
    cmask = cls < C
    w = tl.load(w_ptr + cls[:, None] * N + cols[None, :], mask=cmask[:, None] & nmask[None, :], other=0.0)
    acc_gw = tl.zeros((CP, BN), dtype=tl.float32)
    acc_gb = tl.zeros((BN,), dtype=tl.float32)
    acc_gbloc = tl.zeros((CP,), dtype=tl.float32)
    acc_loss = tl.zeros((BM,), dtype=tl.float32)
    m_start = pid_m * rows_per_split
    for m0 in range(m_start, m_start + rows_per_split, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < M
        h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        dl = tl.load(dl_ptr + rows[:, None] * CP + cls[None, :], mask=rmask[:, None], other=0.0)
        dlc = dl.to(h.dtype)
        if IEEE:
            acc_gw = tl.dot(tl.trans(dlc), h, acc_gw, input_precision="ieee")
        else:
            acc_gw = tl.dot(tl.trans(dlc), h, acc_gw)
        if WRITE_DZ:
            wc = w.to(h.dtype)
            if IEEE:
                dz = tl.dot(dlc, wc, input_precision="ieee")
            else:
                dz = tl.dot(dlc, wc)
            dz = times_derivative(dz, h, ACT)
            dzc = dz.to(dz_ptr.dtype.element_ty)
            tl.store(dz_ptr + rows[:, None] * N + cols[None, :], dzc, mask=rmask[:, None] & nmask[None, :])
            acc_gb += tl.sum(dz, axis=0)
        if pid_n == 0:
            acc_gbloc += tl.sum(dl, axis=0)
            acc_loss += tl.load(rowloss_ptr + rows, mask=rmask, other=0.0)
    # relaxed: the sums are read only after this launch ends, so no ordering is needed
    tl.atomic_add(gw_ptr + cls[:, None] * N + cols[None, :], acc_gw, mask=cmask[:, None] & nmask[None, :], sem=SEM)
    if WRITE_DZ:
        tl.atomic_add(gb_ptr + cols, acc_gb, mask=nmask, sem=SEM)
    if pid_n == 0:
        tl.atomic_add(gbloc_ptr + cls, acc_gbloc, mask=cmask, sem=SEM)
        tl.atomic_add(loss_ptr, tl.sum(acc_loss, axis=0), sem=SEM)


@triton.jit
def one_pass_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, logits_ptr, dz_ptr, gw_ptr, gb_ptr, gbloc_ptr, loss_ptr,
    M, N, C, stride_h, inv_count, smoothing,
    BM: tl.constexpr, BN: tl.constexpr, CP: tl.constexpr, ACT: tl.constexpr,
    WRITE_DZ: tl.constexpr, IEEE: tl.constexpr, SEM: tl.constexpr,
):
    # a program owns BM whole rows: a pass over the columns for the logits, the softmax in
    # registers, then a second pass (its h tile now in L1/L2) for d_z and the gradients
    pid_m = tl.program_id(0)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    cls = tl.arange(0, CP)
    cmask = cls < C
    acc = tl.zeros((BM, CP), dtype=tl.float32)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        nmask = cols < N
        h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        w = tl.load(w_ptr + cls[:, None] * N + cols[None, :], mask=cmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(h, tl.trans(w.to(h.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w.to(h.dtype)), acc)
    logits, d_logits, row_loss = softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count, smoothing, C)
    tl.store(logits_ptr + rows[:, None] * C + cls[None, :], logits, mask=rmask[:, None] & cmask[None, :])
    tl.atomic_add(loss_ptr, tl.sum(row_loss, axis=0), sem=SEM)
    tl.atomic_add(gbloc_ptr + cls, tl.sum(d_logits, axis=0), mask=cmask, sem=SEM)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        nmask = cols < N
        h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        dlc = d_logits.to(h.dtype)
        if IEEE:
            gw = tl.dot(tl.trans(dlc), h, input_precision="ieee")
        else:
            gw = tl.dot(tl.trans(dlc), h)
        tl.atomic_add(gw_ptr + cls[:, None] * N + cols[None, :], gw, mask=cmask[:, None] & nmask[None, :], sem=SEM)
        if WRITE_DZ:
            w = tl.load(w_ptr + cls[:, None] * N + cols[None, :], mask=cmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                dz = tl.dot(dlc, w.to(h.dtype), input_precision="ieee")
            else:
                dz = tl.dot(dlc, w.to(h.dtype))
            dz = times_derivative(dz, h, ACT)
            tl.store(dz_ptr + rows[:, None] * N + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
                     mask=rmask[:, None] & nmask[None, :])
            tl.atomic_add(gb_ptr + cols, tl.sum(dz, axis=0), mask=nmask, sem=SEM)


#: the activation codes of :func:`times_derivative` (the ``ACT`` constexpr)
ACT_CODE = {"relu": 0, "tanh": 1, "identity": 2, "leaky_relu": 3}
# memory order of the atomic adds: nothing reads the sums before the launch ends (the split row kernel's partial
# logits wait on its acq_rel arrival counter), so relaxed suffices, and is faster (docs/design-kernels.md)
_ATOMIC_SEM = "relaxed"


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


def default_tiles(M: int, N: int, CP: int, element_size: int = 2) -> Tiles:
    """The launch configuration for an (M, N) layer output with CP padded classes whose ``h``
    has ``element_size`` bytes per entry. With at most 64 padded classes:

    - at most 256 outputs: the one-launch kernel (``one_pass``), which leaves a wider layer too
      few row blocks to fill the GPU;
    - at most 256 rows, 512 to 2047 outputs: 16 row-kernel programs per 16-row block, each over
      64 columns;
    - at most 2048 rows, at least 2048 outputs: 8 programs per 32-row block, each over an eighth
      of the columns;
    - other layers of at least 1024 outputs (or 512 with at least 2048 rows): 32-row tiles,
      512 columns wide for 2-byte ``h`` at 2048 outputs or more (in fp32 that pipeline does not
      fit in shared memory).

    Everything else takes the fixed tiles of the last branch. The local logits are made in the
    row kernel, not by cuBLAS, whose ``W_loc`` cast and padding would add two launches. The
    measurements behind each branch: ``docs/design-kernels.md``.
    """
    if CP <= 64 and N <= 256:
        return Tiles(
            rows_bm=16 if M <= 2048 else 32, rows_bn=128, rows_warps=4, rows_stages=3, one_pass=True,
            cols_bm=32, cols_bn=128, cols_warps=4, cols_stages=2, cols_programs_per_sm=2,
        )
    if CP <= 64 and 512 <= N < 2048 and M <= 256:
        return Tiles(
            rows_bm=16, rows_bn=64, rows_warps=4, rows_stages=3, rows_split=16,
            cols_bm=32, cols_bn=128, cols_warps=8, cols_stages=2, cols_programs_per_sm=2,
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


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def deterministic_tiles(tiles: Tiles) -> Tiles:
    """``tiles`` without the launches that add partial sums atomically: no column split in the row
    kernel, no one-launch kernel, and one column-kernel program per column block over all rows, so
    every sum is added once into its zeroed buffer and a run gives the same bits every time.
    :func:`launch_local_error` uses them under ``torch.use_deterministic_algorithms(True)``; with
    few column blocks (narrow layers) they leave most of the GPU idle."""
    return replace(tiles, rows_split=1, one_pass=False, cols_programs_per_sm=0)


def launch_local_error(
    h: Tensor,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    activation: str,
    with_dz: bool,
    tiles: Tiles | None = None,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(logits, loss, g_W_loc, g_b_loc, d_z, g_b)`` of checked arguments (``d_z, g_b`` are ``None``
    without ``with_dz``), by the kernels above with ``tiles`` (default :func:`default_tiles`; made
    :func:`deterministic_tiles` when torch's deterministic algorithms are on)."""
    label_smoothing = float(label_smoothing)
    h = h if h.stride(1) == 1 else h.contiguous()
    head_weight = head_weight.contiguous()
    M, N = h.shape
    C = head_weight.shape[0]
    CP = max(16, next_pow2(C))
    t = tiles or default_tiles(M, N, CP, h.element_size())
    if torch.are_deterministic_algorithms_enabled():
        t = deterministic_tiles(t)
    dev = h.device
    # fp32 products in IEEE fp32 unless torch's own fp32 matmuls may use TF32
    ieee = h.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
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
        one_pass_kernel[(cdiv(M, t.rows_bm),)](
            h, head_weight, head_bias, target, logits, dz, gw, gb, gbloc, loss,
            M, N, C, h.stride(0), 1.0 / M, label_smoothing,
            BM=t.rows_bm, BN=t.rows_bn, CP=CP, ACT=ACT_CODE[activation], WRITE_DZ=with_dz, IEEE=ieee,
            SEM=_ATOMIC_SEM, num_warps=t.rows_warps, num_stages=t.rows_stages,
        )
        return logits, loss, gw, gbloc, dz if with_dz else None, gb if with_dz else None
    dl = torch.empty(M, CP, device=dev, dtype=torch.float32)
    rowloss = torch.empty(M, device=dev, dtype=torch.float32)
    row_blocks = cdiv(M, t.rows_bm)
    split = max(1, min(t.rows_split, cdiv(N, t.rows_bn)))
    split_cols = cdiv(cdiv(N, split), t.rows_bn) * t.rows_bn
    split = cdiv(N, split_cols)
    # the split path's partial logits and per-row-block arrival counters: one memset
    scratch = torch.zeros(M * CP + row_blocks, device=dev, dtype=torch.float32) if split > 1 else rowloss
    zero_chunk = cdiv(flat.numel(), row_blocks * split)
    rows_kernel[(row_blocks, split)](
        h, head_weight, head_bias, target, logits, dl, rowloss, flat, scratch, scratch[M * CP :] if split > 1 else scratch,
        M, N, C, h.stride(0), 1.0 / M, label_smoothing, flat.numel(), zero_chunk, split_cols,
        BM=t.rows_bm, BN=t.rows_bn, CP=CP, IEEE=ieee, ZBLOCK=256, SPLIT=split, SEM=_ATOMIC_SEM,
        num_warps=t.rows_warps, num_stages=t.rows_stages,
    )
    dz = torch.empty(M, N, device=dev, dtype=h.dtype) if with_dz else h
    col_blocks = cdiv(N, t.cols_bn)
    m_blocks = cdiv(M, t.cols_bm)
    # split the rows so that about `cols_programs_per_sm` programs per SM run: at N=256,
    # B=1024 a single split would leave 8 programs on 132 SMs
    split = max(1, min(m_blocks, (t.cols_programs_per_sm * _num_sms(dev)) // col_blocks))
    rows_per_split = cdiv(m_blocks, split) * t.cols_bm
    split = cdiv(M, rows_per_split)
    cols_kernel[(col_blocks, split)](
        h, dl, head_weight, rowloss, dz, gw, gb, gbloc, loss,
        M, N, C, h.stride(0), rows_per_split,
        BM=t.cols_bm, BN=t.cols_bn, CP=CP, ACT=ACT_CODE[activation], WRITE_DZ=with_dz, IEEE=ieee,
        SEM=_ATOMIC_SEM, num_warps=t.cols_warps, num_stages=t.cols_stages,
    )
    if with_dz:
        return logits, loss, gw, gbloc, dz, gb
    return logits, loss, gw, gbloc, None, None
