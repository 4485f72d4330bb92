"""AdamW on a layer's weight and bias in one launch, also refreshing their low-precision copies.

Per element, exactly :func:`torch_dad.optim.adamw_` (``torch._fused_adamw_``) in float32::

    p *= 1 - lr * wd;  m = m + (1 - b1) (g - m);  v = b2 v + (1 - b2) g^2
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps);  shadow = p.to(shadow.dtype)

``lr`` and the step ``t`` are read from device tensors, so a CUDA graph that captured the
launch follows a new learning rate without re-capture. The bf16 ``shadow`` is what the next
forward multiplies with: writing it here replaces a separate cast kernel per weight per step.
The step is *not* incremented here (the caller increments all layers' steps in one launch).
On CUDA the update is one Triton launch (:mod:`torch_dad.kernels.adamw`); elsewhere the twin
is :func:`torch_dad.optim.adamw_`.
"""

from __future__ import annotations

import functools
from types import ModuleType

from torch import Tensor

from ..kernels import use_triton
from ..optim import adamw_

__all__ = ["adamw_with_shadow_"]


def adamw_with_shadow_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    shadows: list[Tensor | None],
    step: Tensor,
    lr: Tensor,
    *,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    backend: str = "auto",
) -> None:
    """AdamW step (already-incremented ``step``) on 1 or 2 fp32 tensors, then ``shadow.copy_(p)``."""
    if not 1 <= len(params) <= 2 or not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(shadows):
        raise ValueError("adamw_with_shadow_ takes 1 or 2 tensors and one grad/moment/shadow entry per tensor")
    if use_triton(params[0], backend):
        for t in (*params, *grads, *exp_avgs, *exp_avg_sqs):
            if not t.is_contiguous():
                raise ValueError("adamw_with_shadow_ needs contiguous tensors")
        tensors = list(zip(params, grads, exp_avgs, exp_avg_sqs, shadows))
        _kernels().launch_adamw(tensors, step, lr, betas, eps, weight_decay)
        return
    # the twin: the reference update with the step counter rewound, since adamw_ increments it
    step.sub_(1)
    adamw_(params, grads, exp_avgs, exp_avg_sqs, step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for p, s in zip(params, shadows):
        if s is not None:
            s.copy_(p)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from ..kernels import adamw as kernels  # imports triton: on the first launch only

    return kernels
