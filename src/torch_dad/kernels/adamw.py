"""The Triton kernel of :func:`torch_dad.ops.adamw.adamw_with_shadow_` and its launcher.

One launch updates a layer's weight and bias: the programs of the first ``blocks1`` blocks
take the first tensor, the rest the second. ``lr``, the step and an optional gradient multiplier
are read from device tensors.
"""

import math

import triton
import triton.language as tl
from torch import Tensor

from . import cdiv


def beta_args(betas: tuple[float, float]) -> tuple[float, float, float, float, float]:
    """The kernel's beta arguments ``(b2, 1 - b1, 1 - b2, log b1, log b2)``, in float64 here.

    ``1 - b`` is taken before the kernel sees fp32: ``1 - fp32(b)`` would carry its rounding
    error whole into the update ``v = b2 v + (1 - b2) g^2`` when ``v`` is small
    (``docs/design-kernels.md``). ``b^t = exp(t log b)`` in :func:`bias_corrections`; -1e30
    stands for log 0.
    """
    b1, b2 = betas
    logs = [math.log(b) if b > 0 else -1e30 for b in betas]
    return b2, 1.0 - b1, 1.0 - b2, logs[0], logs[1]


@triton.jit
def adamw_values(p, g, m, v, lr, b2, c1, c2, eps, wd, bc1, bc2_sqrt):
    """The AdamW update of fp32 values ``p, g, m, v`` (any shape), ``c1 = 1 - b1``, ``c2 = 1 - b2``
    (from :func:`beta_args`): returns the new ``(p, m, v)``."""
    p = p * (1.0 - lr * wd)
    m = m + c1 * (g - m)
    v = b2 * v + c2 * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - (lr / bc1) * m / denom
    return p, m, v


@triton.jit
def bias_corrections(step_ptr, log_b1, log_b2):
    """``(1 - b1^t, sqrt(1 - b2^t))`` for the step ``t`` read from the device."""
    # in float64: 1 - 0.999^t in fp32 loses ~1e-4 relative at small t
    t = tl.load(step_ptr).to(tl.float64)
    bc1 = (1.0 - tl.exp(t * log_b1)).to(tl.float32)
    bc2_sqrt = tl.sqrt((1.0 - tl.exp(t * log_b2)).to(tl.float32))
    return bc1, bc2_sqrt


@triton.jit
def adamw_segment(p_ptr, g_ptr, m_ptr, v_ptr, s_ptr, offs, n, lr, g_mul, b2, c1, c2, eps, wd, bc1, bc2_sqrt,
                  HAS_SHADOW: tl.constexpr):
    """AdamW in place on the 1-D elements ``offs < n`` of ``p, m, v`` with gradient ``g * g_mul``; the
    low-precision copy too."""
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g_mul
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p, m, v = adamw_values(p, g, m, v, lr, b2, c1, c2, eps, wd, bc1, bc2_sqrt)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_SHADOW:
        tl.store(s_ptr + offs, p.to(s_ptr.dtype.element_ty), mask=mask)


@triton.jit
def adamw_kernel(
    p1, g1, m1, v1, s1, n1, p2, g2, m2, v2, s2, n2, step_ptr, lr_ptr, g_mul_ptr,
    b2, c1, c2, log_b1, log_b2, eps, wd, blocks1,
    BLOCK: tl.constexpr, SHADOW1: tl.constexpr, SHADOW2: tl.constexpr, GRAD_MULTIPLIER: tl.constexpr,
):
    pid = tl.program_id(0)
    bc1, bc2_sqrt = bias_corrections(step_ptr, log_b1, log_b2)
    lr = tl.load(lr_ptr).to(tl.float32)
    g_mul = tl.load(g_mul_ptr).to(tl.float32) if GRAD_MULTIPLIER else 1.0
    if pid < blocks1:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        adamw_segment(p1, g1, m1, v1, s1, offs, n1, lr, g_mul, b2, c1, c2, eps, wd, bc1, bc2_sqrt, SHADOW1)
    else:
        offs = (pid - blocks1) * BLOCK + tl.arange(0, BLOCK)
        adamw_segment(p2, g2, m2, v2, s2, offs, n2, lr, g_mul, b2, c1, c2, eps, wd, bc1, bc2_sqrt, SHADOW2)


def launch_adamw(
    tensors: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]],
    step: Tensor,
    lr: Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    grad_multiplier: Tensor | None = None,
) -> None:
    """AdamW in place on 1 or 2 contiguous fp32 ``(param, grad, exp_avg, exp_avg_sq, shadow)``
    tuples, then ``shadow.copy_(param)`` where ``shadow`` is not ``None``; ``step`` is not
    incremented. ``grad_multiplier`` (0-dim, on the device): the update uses ``grad * grad_multiplier``."""
    block = 1024
    segs = []
    for i in range(2):
        j = min(i, len(tensors) - 1)
        p, g, m, v, s = tensors[j]
        n = p.numel() if i < len(tensors) else 0
        segs.append((p, g, m, v, s if s is not None else p, n, s is not None))
    blocks1 = cdiv(segs[0][5], block)
    blocks2 = cdiv(segs[1][5], block)
    # without a multiplier the kernel never reads its pointer: lr stands in for it
    adamw_kernel[(blocks1 + blocks2,)](
        *segs[0][:6], *segs[1][:6], step, lr, lr if grad_multiplier is None else grad_multiplier,
        *beta_args(betas), eps, weight_decay, blocks1,
        BLOCK=block, SHADOW1=segs[0][6], SHADOW2=segs[1][6] and segs[1][5] > 0,
        GRAD_MULTIPLIER=grad_multiplier is not None,
    )
