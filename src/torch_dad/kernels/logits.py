"""The Triton kernels of :func:`torch_dad.ops.linear_cross_entropy`'s recomputing sweep over vocabulary slices.

Each computes a slice's logits ``h @ W.T + b`` tile by tile and uses them in its epilogue, so they never reach
memory (cuBLAS then a row kernel would write each slice's logits and read them back):

- :func:`tile_log_sum_exp_kernel` (the forward) reduces each tile to its rows' log-sum-exp, and
  :func:`log_probs_kernel` merges those over the vocabulary and scores each row's target;
- :func:`logit_grad_kernel` (the backward) writes ``exp(logits - lse) - onehot(y)``.

The tile kernels are persistent (one program per SM walks the tiles), load through TMA descriptors, and flatten
their loop nest so that the next tile's loads overlap this tile's epilogue. Why, and what lost:
``docs/design-kernels.md``; ``python benchmarks/lm_head_slice_kernel.py`` times the gradient kernel's tiles against
cuBLAS + the row kernel.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from . import cdiv

# the fastest tile at both hidden sizes in results/lm_head_slice_kernel.json
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WARPS, STAGES = 128, 256, 64, 8, 8, 3
# exp(x - c) as exp2(x * LOG2E - c * LOG2E): one fused multiply-add per element ahead of the exp2 unit
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _logits_tile(h_desc, w_desc, b_ptr, tile, M, N, K: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """Tile number ``tile`` of ``x = h @ W.T + b`` (float32 accumulator), ``GROUP`` token tiles at a time (the
    weight rows a group reads stay in L2 across its token tiles): ``(x, first row, first column)``."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    first_m = (tile // per_group) * GROUP
    group_m = tl.minimum(tiles_m - first_m, GROUP)
    row0 = (first_m + (tile % per_group) % group_m) * BM
    col0 = ((tile % per_group) // group_m) * BN
    x = tl.zeros((BM, BN), tl.float32)
    # K is a compile-time constant (the model's hidden size): the trip count is known to the pipeliner
    for k in range(0, K, BK):
        x = tl.dot(h_desc.load([row0, k]), w_desc.load([col0, k]).T, x)
    if HAS_BIAS:
        cols = col0 + tl.arange(0, BN)
        x += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return x, row0, col0


@triton.jit
def logit_grad_kernel(
    h_desc, w_desc, out_desc, b_ptr, y_ptr, lse_ptr, M, N, K: tl.constexpr, col_offset, ignore_index,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    """``out[r, c] = exp(x[r, c] - lse[r]) - (c + col_offset == y[r])`` with ``x = h @ W.T + b`` (float32
    accumulator); 0 on rows whose ``y`` is ``ignore_index``. Tiles of ``BM x BN``."""
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), PROGRAMS, flatten=True):
        x, row0, col0 = _logits_tile(h_desc, w_desc, b_ptr, tile, M, N, K, HAS_BIAS, BM, BN, BK, GROUP)
        rows = row0 + tl.arange(0, BM)
        lse = tl.load(lse_ptr + rows, mask=rows < M, other=0.0)
        y = tl.load(y_ptr + rows, mask=rows < M, other=ignore_index).to(tl.int64)
        scored = y != ignore_index
        # per row, not per element: an ignored row gets exp2(-inf) = 0 and no target column
        shift = tl.where(scored, lse * LOG2E, float("inf"))
        target_col = tl.where(scored, y - col_offset - col0, -1)
        p = tl.exp2(x * LOG2E - shift[:, None])
        g = tl.where(tl.arange(0, BN)[None, :] == target_col[:, None], p - 1.0, p)
        out_desc.store([row0, col0], g.to(out_desc.dtype))


@triton.jit
def tile_log_sum_exp_kernel(
    h_desc, w_desc, b_ptr, out_ptr, M, N, K: tl.constexpr, first_tile, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr,
):
    """``out[first_tile + j, r] = log(sum(exp(x[r, j*BN : (j+1)*BN])))`` for each ``BN``-column tile ``j`` of
    ``x = h @ W.T + b`` (float32 accumulator); the logits stay in registers."""
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), PROGRAMS, flatten=True):
        x, row0, col0 = _logits_tile(h_desc, w_desc, b_ptr, tile, M, N, K, HAS_BIAS, BM, BN, BK, GROUP)
        rows, cols = row0 + tl.arange(0, BM), col0 + tl.arange(0, BN)
        x = tl.where(cols[None, :] < N, x, float("-inf"))
        top = tl.max(x, axis=1)
        total = tl.sum(tl.exp2(x * LOG2E - (top * LOG2E)[:, None]), axis=1)
        out = out_ptr + (first_tile + col0 // BN).to(tl.int64) * M + rows
        tl.store(out, top + tl.log(total), mask=rows < M)


@triton.jit
def log_probs_kernel(
    parts_ptr, h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, out_ptr, M, T, V, K, stride_h, stride_w, ignore_index,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    """``lse[r] = logsumexp(parts[:T, r])`` and ``out[r] = min(h[r] @ W[y[r]] + b[y[r]] - lse[r], 0)`` with ``W``
    and ``b`` rounded to ``h``'s dtype (float32 sums); ``out`` is 0 on rows whose ``y`` is ``ignore_index`` or
    outside ``[0, V)``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    for t in range(0, T, BT):
        ts = t + tl.arange(0, BT)
        part = tl.load(parts_ptr + ts[None, :].to(tl.int64) * M + rows[:, None],
                       mask=(rows < M)[:, None] & (ts < T)[None, :], other=float("-inf"))
        # rows past M read 0 (never stored): an all -inf row would make NaNs
        part = tl.where((rows < M)[:, None], part, 0.0)
        new_top = tl.maximum(top, tl.max(part, axis=1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(part - new_top[:, None]), axis=1)
        top = new_top
    lse = top + tl.log(total)
    y = tl.load(y_ptr + rows, mask=rows < M, other=ignore_index).to(tl.int64)
    # an id out of range reads nothing (the caller's label check reports it)
    scored = (rows < M) & (y != ignore_index) & (y >= 0) & (y < V)
    y = tl.where(scored, y, 0)
    logit = tl.zeros((ROWS,), tl.float32)
    for k in range(0, K, BK):
        ks = k + tl.arange(0, BK)
        inside = scored[:, None] & (ks < K)[None, :]
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :], mask=inside, other=0.0)
        w = tl.load(w_ptr + y[:, None] * stride_w + ks[None, :], mask=inside, other=0.0)
        logit += tl.sum(h.to(tl.float32) * w.to(h.dtype).to(tl.float32), axis=1)
    if HAS_BIAS:
        logit += tl.load(b_ptr + y, mask=scored, other=0.0).to(h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(lse_ptr + rows, lse, mask=rows < M)
    # log p <= 0: lse sums the tensor cores' accumulations and this logit is summed here in another order, so where
    # p ~ 1 (a memorised batch at hidden size 4096) the difference alone could make the loss negative
    tl.store(out_ptr + rows, tl.where(scored, tl.minimum(logit - lse, 0.0), 0.0), mask=rows < M)


@functools.lru_cache(maxsize=8)
def _programs(device: torch.device) -> int:
    """One program per SM (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def logit_grad(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, lse: Tensor, out: Tensor,
               col_offset: int, ignore_index: int) -> None:
    """Launch :func:`logit_grad_kernel`: ``out`` (N, S) from ``h`` (N, D), a weight slice (S, D) and its ``bias``
    (S,), the tokens' ``target`` and ``lse`` (N,). ``h``, ``weight`` and ``out`` are :func:`tma_compatible`."""
    (m, k), n = h.shape, weight.shape[0]
    programs = _programs(h.device)
    logit_grad_kernel[(min(programs, cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N)),)](
        TensorDescriptor.from_tensor(h, [BLOCK_M, BLOCK_K]), TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]),
        TensorDescriptor.from_tensor(out, [BLOCK_M, BLOCK_N]), lse if bias is None else bias, target, lse, m, n, k,
        int(col_offset), int(ignore_index), HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        GROUP=GROUP_M, PROGRAMS=programs, num_warps=WARPS, num_stages=STAGES,
    )


def log_sum_exp_tiles(columns: int) -> int:
    """Rows of :func:`tile_log_sum_exp`'s output that a weight slice of ``columns`` rows fills."""
    return cdiv(columns, BLOCK_N)


def tile_log_sum_exp(h: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor, first_tile: int) -> int:
    """Launch :func:`tile_log_sum_exp_kernel`: rows ``first_tile ..`` of ``out`` (tiles, N), float32, get the
    log-sum-exp of each ``BLOCK_N``-column tile of ``h @ weight.T + bias`` (``h`` (N, D) and the weight slice (S, D)
    :func:`tma_compatible`). Returns the number of rows written, :func:`log_sum_exp_tiles` ``(S)``."""
    (m, k), n = h.shape, weight.shape[0]
    programs = _programs(h.device)
    tile_log_sum_exp_kernel[(min(programs, cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N)),)](
        TensorDescriptor.from_tensor(h, [BLOCK_M, BLOCK_K]), TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]),
        out if bias is None else bias, out, m, n, k, int(first_tile), HAS_BIAS=bias is not None, BM=BLOCK_M,
        BN=BLOCK_N, BK=BLOCK_K, GROUP=GROUP_M, PROGRAMS=programs, num_warps=WARPS, num_stages=STAGES,
    )
    return log_sum_exp_tiles(n)


def log_probs(parts: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, lse: Tensor,
              out: Tensor, ignore_index: int) -> None:
    """Launch :func:`log_probs_kernel`: ``lse`` (N,) merges the tiles' log-sum-exps ``parts`` (tiles, N) and ``out``
    (N,) gets ``log p(target) = min(h @ W[target] + b[target] - lse, 0)`` (both float32; ``out`` 0 on ignored rows), from
    ``h`` (N, D), the whole ``weight`` (V, D) and ``bias`` (V,) in any float dtype (unit column stride)."""
    m, k = h.shape
    rows = 32
    log_probs_kernel[(cdiv(m, rows),)](
        parts, h, weight, out if bias is None else bias, target, lse, out, m, parts.shape[0], weight.shape[0], k,
        h.stride(0), weight.stride(0), int(ignore_index), HAS_BIAS=bias is not None, ROWS=rows, BT=64, BK=64,
        num_warps=4,
    )


def tma_compatible(t: Tensor) -> bool:
    """Whether a 2-D ``t`` can back a TMA descriptor: not empty, unit last stride, 16-byte aligned start and row
    stride."""
    size = t.element_size()
    return t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0
