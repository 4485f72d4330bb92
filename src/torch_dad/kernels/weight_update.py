"""A layer's weight gradient and its AdamW in one launch: the gradient never reaches memory.

For ``d_z`` (B, N) and the layer input ``a`` (B, K) this computes, per weight entry::

    g = (d_z.T @ a)[n, k]          (fp32 accumulation over the batch)
    W, m, v = AdamW(W, g, m, v)    shadow = W.to(shadow.dtype)

and the same AdamW on the bias with ``grad_bias`` (N,), exactly as
:func:`torch_dad.kernels.adamw.adamw_with_shadow_` does after ``g = mm_fp32(d_z.T, a)`` (the
PyTorch twin below is literally that). The step counter is read, not incremented.

Why: for fmnist-wide-2's 4096 x 4096 layer at B=1024 the unfused pair is a 50.6 µs GEMM and a
115.2 µs AdamW (470 MB at 4.08 TB/s), each waiting for the other (H200, device call 32). Here
each program computes one (BM, BN) tile of ``g`` in registers and updates that tile of the
weight, its moments and its bf16 copy straight away, so the gradient's write and read (64 MB
in bf16) and one launch disappear, and one program's memory-bound epilogue overlaps other
programs' products on the same SM.

Measured, the idea lost: on the H200 this kernel is slower than cuBLAS + the flat AdamW kernel
at every layer shape tried (4096 x 4096, B=1024: 189-237 µs against 165; device call 36), and
the engine leaves it off by default (``FusedStep.fused_weight_update`` has the numbers).

The Triton path multiplies in the inputs' dtype: bf16/fp16 on tensor cores, fp32 in IEEE
precision (slow; the engine fuses only low-precision steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import use_triton
from .adamw import adamw_with_shadow_, beta_args
from .gram import mm_fp32

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no triton
    triton = None

__all__ = ["UpdateTiles", "default_update_tiles", "weight_grad_adamw_"]


@dataclass(frozen=True)
class UpdateTiles:
    """Launch configuration: a (block_n x block_k) weight tile per program, ``block_b`` batch rows a step."""

    block_n: int = 128
    block_k: int = 128
    block_b: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8


def default_update_tiles(dtype: torch.dtype) -> UpdateTiles:
    """The launch configuration for ``dtype`` inputs (fp32: smaller tiles, the IEEE dot holds more registers)."""
    if dtype == torch.float32:
        return UpdateTiles(block_n=64, block_k=64, block_b=32, num_warps=4, num_stages=2)
    return UpdateTiles()


def weight_grad_adamw_(
    d_z: Tensor,
    a: Tensor,
    params: list[Tensor],
    grad_bias: Tensor | None,
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    shadows: list[Tensor | None],
    step: Tensor,
    lr: Tensor,
    *,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    tiles: UpdateTiles | None = None,
    backend: str = "auto",
) -> None:
    """AdamW on ``params = [W]`` or ``[W, b]`` with ``g_W = d_z.T @ a`` and ``g_b = grad_bias``.

    ``W`` (N, K), its moments and its optional low-precision copy are updated in place; the
    step (already incremented) and ``lr`` are 0-dim device tensors.
    """
    _check(d_z, a, params, grad_bias, exp_avgs, exp_avg_sqs, shadows)
    if not use_triton(d_z, backend):
        grads = [mm_fp32(d_z.T, a)] + ([grad_bias] if grad_bias is not None else [])
        adamw_with_shadow_(params, grads, exp_avgs, exp_avg_sqs, shadows, step, lr,
                           betas=betas, eps=eps, weight_decay=weight_decay, backend="torch")
        return
    tiles = tiles or default_update_tiles(d_z.dtype)
    batch, n_out = d_z.shape
    n_in = a.shape[1]
    weight = params[0]
    has_bias = len(params) == 2
    bias = params[1] if has_bias else weight
    w_shadow = shadows[0]
    b_shadow = shadows[1] if has_bias else None
    grid = (triton.cdiv(n_out, tiles.block_n) * triton.cdiv(n_in, tiles.block_k),)
    _grad_adamw_kernel[grid](
        d_z, a, weight, exp_avgs[0], exp_avg_sqs[0], w_shadow if w_shadow is not None else weight,
        bias, grad_bias if grad_bias is not None else bias, exp_avgs[-1], exp_avg_sqs[-1],
        b_shadow if b_shadow is not None else bias,
        step, lr, batch, n_out, n_in, d_z.stride(0), a.stride(0),
        *beta_args(betas), eps, weight_decay,
        BN=tiles.block_n, BK=tiles.block_k, BB=tiles.block_b, GROUP=tiles.group,
        EVEN=batch % tiles.block_b == 0 and n_out % tiles.block_n == 0 and n_in % tiles.block_k == 0,
        IEEE=d_z.dtype == torch.float32,
        W_SHADOW=w_shadow is not None, HAS_BIAS=has_bias, B_SHADOW=b_shadow is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _check(
    d_z: Tensor, a: Tensor, params: list[Tensor], grad_bias: Tensor | None, exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor], shadows: list[Tensor | None],
) -> None:
    if d_z.dim() != 2 or a.dim() != 2 or d_z.shape[0] != a.shape[0]:
        raise ValueError(f"d_z {tuple(d_z.shape)} and a {tuple(a.shape)} must be (B, N) and (B, K)")
    if d_z.dtype != a.dtype:
        raise TypeError(f"d_z ({d_z.dtype}) and a ({a.dtype}) must share a dtype; cast one of them")
    if d_z.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("d_z and a need unit stride along their last dimension (call .contiguous())")
    if not 1 <= len(params) <= 2 or not len(params) == len(exp_avgs) == len(exp_avg_sqs) == len(shadows):
        raise ValueError("params takes [weight] or [weight, bias], with one moment and shadow entry each")
    if (grad_bias is not None) != (len(params) == 2):
        raise ValueError("pass grad_bias exactly when params holds a bias")
    n_out, n_in = d_z.shape[1], a.shape[1]
    expected = [(n_out, n_in), (n_out,)]
    for i, p in enumerate(params):
        for name, t in (("params", p), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i])):
            if tuple(t.shape) != expected[i] or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be a contiguous float32 tensor of shape {expected[i]}, "
                                 f"got {tuple(t.shape)} {t.dtype}")
        s = shadows[i]
        if s is not None and (tuple(s.shape) != expected[i] or not s.is_contiguous()):
            raise ValueError(f"shadows[{i}] must be contiguous with shape {expected[i]}, got {tuple(s.shape)}")
    if grad_bias is not None and tuple(grad_bias.shape) != (n_out,):
        raise ValueError(f"grad_bias must have shape ({n_out},), got {tuple(grad_bias.shape)}")


if triton is not None:
    from .adamw import adamw_segment, adamw_values, bias_corrections

    @triton.jit
    def _grad_adamw_kernel(
        dz_ptr, a_ptr, w_ptr, wm_ptr, wv_ptr, ws_ptr, b_ptr, bg_ptr, bm_ptr, bv_ptr, bs_ptr,
        step_ptr, lr_ptr, batch, n_out, n_in, stride_dz, stride_a,
        b2, c1, c2, log_b1, log_b2, eps, wd,
        BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr,
        IEEE: tl.constexpr, W_SHADOW: tl.constexpr, HAS_BIAS: tl.constexpr, B_SHADOW: tl.constexpr,
    ):
        # grouped order: GROUP row tiles share each column tile of ``a`` while it sits in L2
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(n_out, BN)
        tiles_k = tl.cdiv(n_in, BK)
        per_group = GROUP * tiles_k
        first_n = (pid // per_group) * GROUP
        group_size = tl.minimum(tiles_n - first_n, GROUP)
        pid_n = first_n + (pid % per_group) % group_size
        pid_k = (pid % per_group) // group_size

        rn = pid_n * BN + tl.arange(0, BN)
        rk = pid_k * BK + tl.arange(0, BK)
        rb = tl.arange(0, BB)
        dz_ptrs = dz_ptr + rb[:, None] * stride_dz + rn[None, :]
        a_ptrs = a_ptr + rb[:, None] * stride_a + rk[None, :]
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for b0 in range(0, batch, BB):
            if EVEN:
                dz = tl.load(dz_ptrs)
                av = tl.load(a_ptrs)
            else:
                rows = (b0 + rb)[:, None] < batch
                dz = tl.load(dz_ptrs, mask=rows & (rn[None, :] < n_out), other=0.0)
                av = tl.load(a_ptrs, mask=rows & (rk[None, :] < n_in), other=0.0)
            if IEEE:
                acc = tl.dot(tl.trans(dz), av, acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(dz), av, acc)
            dz_ptrs += BB * stride_dz
            a_ptrs += BB * stride_a

        bc1, bc2_sqrt = bias_corrections(step_ptr, log_b1, log_b2)
        lr = tl.load(lr_ptr).to(tl.float32)
        offs = rn[:, None] * n_in + rk[None, :]
        if EVEN:
            p = tl.load(w_ptr + offs)
            m = tl.load(wm_ptr + offs)
            v = tl.load(wv_ptr + offs)
        else:
            inside = (rn[:, None] < n_out) & (rk[None, :] < n_in)
            p = tl.load(w_ptr + offs, mask=inside, other=0.0)
            m = tl.load(wm_ptr + offs, mask=inside, other=0.0)
            v = tl.load(wv_ptr + offs, mask=inside, other=0.0)
        p, m, v = adamw_values(p, acc, m, v, lr, b2, c1, c2, eps, wd, bc1, bc2_sqrt)
        if EVEN:
            tl.store(w_ptr + offs, p)
            tl.store(wm_ptr + offs, m)
            tl.store(wv_ptr + offs, v)
            if W_SHADOW:
                tl.store(ws_ptr + offs, p.to(ws_ptr.dtype.element_ty))
        else:
            tl.store(w_ptr + offs, p, mask=inside)
            tl.store(wm_ptr + offs, m, mask=inside)
            tl.store(wv_ptr + offs, v, mask=inside)
            if W_SHADOW:
                tl.store(ws_ptr + offs, p.to(ws_ptr.dtype.element_ty), mask=inside)
        if HAS_BIAS:
            # the first column tile of each row tile owns those rows' bias entries
            if pid_k == 0:
                adamw_segment(b_ptr, bg_ptr, bm_ptr, bv_ptr, bs_ptr, rn, n_out, lr, b2, c1, c2, eps, wd, bc1, bc2_sqrt, B_SHADOW)
