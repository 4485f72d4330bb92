"""Triton kernels of the recomputing vocabulary sweep: GEMM tiles ``h @ W.T`` whose epilogue is the softmax.

Both kernels tile the logits ``h @ W.T (+ b)`` (N, V) into ``BLOCK_M x BLOCK_N`` tiles, one program per
tile, accumulate each tile in float32 over the hidden dim and never write the logits:

- :func:`lse_partials_kernel` reduces its tile to each row's max and sum of ``exp(x - max)`` over the
  tile's columns (the log-sum-exp is combined from these partials by the caller) and picks out the
  target's logit;
- :func:`logit_grad_kernel` writes ``exp(x - lse) - onehot(y)`` (the summed CE's ``dL/dlogits``) in the
  output dtype, 0 on rows whose target is ``ignore_index``.

Programs are grouped ``GROUP_M`` row blocks at a time along the vocabulary, so the weight tiles a group
reads stay in L2. This module imports triton; :mod:`torch_dad.ops.linear_cross_entropy` imports it only on
the first launch.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_ids(N, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of this program: row blocks in groups of ``GROUP_M``, columns fastest within a group."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(N, BLOCK_M)
    blocks_n = tl.cdiv(V, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, stride_h, stride_w, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``h[rows] @ w[cols].T (+ b[cols])`` in float32 (``h`` and ``w`` in one 16-bit dtype). The hidden
    size ``K`` is a compile-time constant (one build per model width; the loop's trip count is then known)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_in = rows[:, None] < N
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                    mask=row_in & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                    mask=(cols[:, None] < V) & (ks[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def lse_partials_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, max_ptr, sum_ptr, target_logit_ptr,
    N, V, stride_h, stride_w,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tile ``(m, n)``: ``max[n, r] = max_c x[r, c]``, ``sum[n, r] = sum_c exp(x[r, c] - max[n, r])`` over the
    tile's columns ``c``, and ``target_logit[r] = x[r, y[r]]`` where ``y[r]`` falls in them."""
    pid_m, pid_n = _tile_ids(N, V, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, stride_h, stride_w, K=K,
                     HAS_BIAS=HAS_BIAS, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    x = tl.where(cols[None, :] < V, x, float("-inf"))
    row_max = tl.max(x, axis=1)
    row_sum = tl.sum(tl.exp(x - row_max[:, None]), axis=1)
    row_in = rows < N
    out = pid_n.to(tl.int64) * N + rows
    tl.store(max_ptr + out, row_max, mask=row_in)
    tl.store(sum_ptr + out, row_sum, mask=row_in)
    y = tl.load(y_ptr + rows, mask=row_in, other=-1).to(tl.int64)
    hit = cols[None, :].to(tl.int64) == y[:, None]
    has_target = tl.max(hit.to(tl.int32), axis=1) > 0
    tl.store(target_logit_ptr + rows, tl.sum(tl.where(hit, x, 0.0), axis=1), mask=row_in & has_target)


@triton.jit
def logit_grad_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, out_ptr,
    N, V, stride_h, stride_w, stride_out, col_offset, ignore_index,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tile ``(m, n)`` of ``out = exp(h @ w.T + b - lse[:, None]) - onehot(y - col_offset)`` (``w`` holds
    vocabulary rows ``col_offset ..``), 0 on rows with ``y == ignore_index``, in ``out``'s dtype."""
    pid_m, pid_n = _tile_ids(N, V, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, stride_h, stride_w, K=K,
                     HAS_BIAS=HAS_BIAS, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    row_in = rows < N
    lse = tl.load(lse_ptr + rows, mask=row_in, other=0.0)
    y = tl.load(y_ptr + rows, mask=row_in, other=ignore_index).to(tl.int64)
    onehot = (cols[None, :].to(tl.int64) + col_offset) == y[:, None]
    d = tl.exp(x - lse[:, None]) - onehot.to(tl.float32)
    d = tl.where((y != ignore_index)[:, None], d, 0.0)
    offsets = rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptr + offsets, d.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & (cols[None, :] < V))
