"""The Triton kernels behind :func:`torch_dad.kernels.local_error.local_error` (see its docstring).

This module imports triton, so :mod:`torch_dad.kernels.local_error` imports it only on the first
kernel launch; ``import torch_dad`` never does.
"""
import triton
import triton.language as tl


@triton.jit
def softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count):
    """``logits = acc + b``; ``d_logits = (softmax(logits) - onehot(y)) * inv_count`` (0 outside
    the rows and classes); the rows' cross-entropy times ``inv_count`` (0 outside the rows)."""
    bias = tl.load(b_ptr + cls, mask=cmask, other=0.0).to(tl.float32)
    logits = acc + bias[None, :]
    masked = tl.where(cmask[None, :], logits, float("-inf"))
    row_max = tl.max(masked, axis=1)
    e = tl.exp(masked - row_max[:, None])
    denom = tl.sum(e, axis=1)
    y = tl.load(y_ptr + rows, mask=rmask, other=0)
    onehot = cls[None, :] == y[:, None]
    d_logits = (e / denom[:, None] - tl.where(onehot, 1.0, 0.0)) * inv_count
    d_logits = tl.where(rmask[:, None] & cmask[None, :], d_logits, 0.0)
    logit_y = tl.sum(tl.where(onehot, logits, 0.0), axis=1)
    row_loss = tl.where(rmask, (row_max + tl.log(denom) - logit_y) * inv_count, 0.0)
    return logits, d_logits, row_loss


@triton.jit
def times_derivative(dz, h, ACT: tl.constexpr):
    """``dz * act'`` read off the output ``h``: relu ``h > 0``, tanh ``1 - h^2``, identity 1."""
    hf = h.to(tl.float32)
    if ACT == 0:
        dz = tl.where(hf > 0, dz, 0.0)
    elif ACT == 1:
        dz = dz * (1.0 - hf * hf)
    return dz


@triton.jit
def rows_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, logits_ptr, dl_ptr, rowloss_ptr, zero_ptr, part_ptr, count_ptr,
    M, N, C, stride_h, inv_count, zero_numel, zero_chunk, split_cols,
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
    logits, d_logits, row_loss = softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count)
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
    M, N, C, stride_h, inv_count,
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
    logits, d_logits, row_loss = softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count)
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
