"""In-place optimizer updates for parameters whose gradients DAD computes itself.

DAD layers never fill ``.grad``: each layer applies its own update the moment its
local gradients exist. The optimizer state lives in the owning module's buffers,
so it is saved by ``state_dict`` and never picked up by a user's optimizer.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .kernels import use_triton

OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")


def check_optimizer(name: str) -> str:
    """Return ``name`` if it is a supported optimizer, else raise ``ValueError``."""
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")
    return name


@dataclass
class OptimizerConfig:
    """Hyper-parameters shared by every DAD update: AdamW (decoupled decay) or SGD + momentum."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9

    def __post_init__(self) -> None:
        check_optimizer(self.name)
        for field, value in (("lr", self.lr), ("weight_decay", self.weight_decay), ("eps", self.eps)):
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"{field}={value!r} must be a finite number >= 0")
        if not (0.0 <= self.betas[0] < 1.0 and 0.0 <= self.betas[1] < 1.0):
            raise ValueError(f"betas={self.betas!r} must both lie in [0, 1)")


# an AdamW step moves each weight by about lr, whatever the gradient's size
LARGE_ADAMW_LR = 1.0
_large_lr_warned = False


def warn_if_large_lr(config: OptimizerConfig, lr: float | Tensor | None = None, *, stacklevel: int = 1) -> bool:
    """Warn (``UserWarning``, once per process) if AdamW runs with a learning rate above ``LARGE_ADAMW_LR``;
    ``lr`` is a step's override of ``config.lr`` (a ``Tensor`` is not read: no host sync). Returns whether
    it warned. The warning points at the line that calls this function (``stacklevel=1``), or at its caller
    (``stacklevel=2``), and so on."""
    global _large_lr_warned
    value = config.lr if lr is None else lr
    if _large_lr_warned or config.name != "adamw" or isinstance(value, Tensor) or not value > LARGE_ADAMW_LR:
        return False
    _large_lr_warned = True
    warnings.warn(
        f"lr={value:g} with AdamW: each AdamW step moves every weight by about lr, so weights of order 1 are "
        f"swamped by steps of {value:g}; AdamW learning rates are usually 1e-4 to 1e-2 (the default is 1e-3). "
        "This warning is shown once.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
    return True


def _row_kernel_runs(tensors: list[Tensor]) -> bool:
    """Whether :meth:`LocalOptimizerState.apply_rows_` takes AdamW's Triton kernel: CUDA (or the interpreter),
    1 or 2 parameters, every tensor float32 and contiguous."""
    return (len(tensors) in (4, 8) and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and use_triton(tensors[0], "auto"))


@functools.lru_cache(maxsize=1)
def _adamw_kernel() -> Any:
    from .kernels import adamw  # imports triton: on the first launch only

    return adamw


def _fused_available(device: torch.device) -> bool:
    # torch._fused_adamw_ exists for CUDA and CPU, and on both it is faster than the for-loop AdamW below
    return device.type in ("cuda", "cpu") and hasattr(torch, "_fused_adamw_")


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    step: Tensor,
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    advance_step: bool = True,
) -> None:
    """One AdamW step in place, identical to ``torch.optim.AdamW`` (``step`` is incremented first
    unless ``advance_step`` is False: another part of the same step already did).

    ``p -= lr * wd * p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr * m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps)``.
    ``step`` is a float32 0-dim tensor shared by the group, so no host sync is needed.
    """
    if advance_step:
        step.add_(1)
    params, grads = list(params), list(grads)
    if _fused_available(params[0].device) and all(p.dtype == g.dtype for p, g in zip(params, grads)):
        torch._fused_adamw_(
            params,
            grads,
            list(exp_avgs),
            list(exp_avg_sqs),
            [],
            [step] * len(params),
            amsgrad=False,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            weight_decay=weight_decay,
            eps=eps,
            maximize=False,
        )
        return
    beta1, beta2 = betas
    lr = float(lr)  # the fallback path (devices without fused AdamW) may sync here
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = g.to(p.dtype)
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / bias2).sqrt_().add_(eps)
        p.addcdiv_(m / bias1, denom, value=-lr)


def sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    step: Tensor,
    *,
    lr: float | Tensor,
    momentum: float,
    weight_decay: float,
    advance_step: bool = True,
) -> None:
    """SGD with momentum and decoupled weight decay: ``p -= lr*wd*p; m = mu m + g; p -= lr m``
    (``step`` counts the steps; incremented unless ``advance_step`` is False)."""
    if advance_step:
        step.add_(1)
    for p, g, m in zip(params, grads, momentum_buffers):
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        m.mul_(momentum).add_(g.to(p.dtype))
        if isinstance(lr, Tensor):  # read on the device: no host sync, and a CUDA graph replays the current lr
            p.addcmul_(m, lr, value=-1)
        else:
            p.add_(m, alpha=-lr)


class LocalOptimizerState(torch.nn.Module):
    """Optimizer moments for a fixed list of parameters, stored as buffers.

    Buffers: ``step`` (float32 scalar), ``exp_avg_<i>`` and ``exp_avg_sq_<i>``. SGD uses
    ``exp_avg_<i>`` as its momentum buffer, so one layout serves both optimizers and a
    ``state_dict`` loads whichever optimizer the trainer picks.
    """

    step: Tensor

    def __init__(self, shapes: Sequence[torch.Size], device=None, dtype=None) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.float32, device=device))
        self._count = len(shapes)
        for i, shape in enumerate(shapes):
            self.register_buffer(f"exp_avg_{i}", torch.zeros(shape, device=device, dtype=dtype))
            self.register_buffer(f"exp_avg_sq_{i}", torch.zeros(shape, device=device, dtype=dtype))

    def data_ptrs(self) -> tuple[int, ...]:
        """The addresses of ``step`` and the moments: they change when the state is moved or its buffers replaced."""
        # straight from the buffer table: this runs before every graphed step, and attribute lookups through
        # nn.Module.__getattr__ cost more than the rest of the key
        return tuple(t.data_ptr() for t in self._buffers.values() if t is not None)

    def moments(self, kind: str) -> list[Tensor]:
        """The ``exp_avg`` or ``exp_avg_sq`` buffers, in parameter order."""
        return [getattr(self, f"{kind}_{i}") for i in range(self._count)]

    def apply_(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        config: OptimizerConfig,
        lr: float | Tensor | None = None,
    ) -> None:
        """Update ``params`` in place from ``grads`` with this state and ``config``."""
        self._update(params, grads, self.moments("exp_avg"), self.moments("exp_avg_sq"), config, lr, True)

    def apply_rows_(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        config: OptimizerConfig,
        start: int,
        stop: int,
        *,
        advance_step: bool,
        lr: float | Tensor | None = None,
        grad_multiplier: Tensor | None = None,
    ) -> None:
        """:meth:`apply_` on rows ``start:stop`` (the leading dim) of the full ``params`` and their
        moments, from those rows' gradients ``grads`` (times ``grad_multiplier``, a 0-dim device tensor, if
        given); the step counter advances only with ``advance_step``.

        Both optimizers act elementwise, so updating a tensor slice by slice, the counter advanced
        with the first slice only, is one :meth:`apply_` of the whole.
        """
        rows = [t[start:stop] for t in params]
        moments = [[t[start:stop] for t in self.moments(kind)] for kind in ("exp_avg", "exp_avg_sq")]
        if config.name == "adamw" and _row_kernel_runs([*rows, *grads, *moments[0], *moments[1]]):
            # torch._fused_adamw_'s 64K-element blocks leave most of the GPU idle on a slice; the kernel's
            # 1024-element blocks fill it, with the same update (tests/gpu/test_kernels.py)
            if advance_step:
                self.step.add_(1)
            lr = config.lr if lr is None else lr
            lr_tensor = lr if isinstance(lr, Tensor) else torch.full((), lr, dtype=torch.float32, device=rows[0].device)
            _adamw_kernel().launch_adamw(list(zip(rows, grads, moments[0], moments[1], [None] * len(rows))),
                                         self.step, lr_tensor, config.betas, config.eps, config.weight_decay,
                                         grad_multiplier)
            return
        if grad_multiplier is not None:
            grads = [g * grad_multiplier.to(g.dtype) for g in grads]
        self._update(rows, grads, moments[0], moments[1], config, lr, advance_step)

    def _update(self, params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], config: OptimizerConfig, lr: float | Tensor | None,
               advance_step: bool) -> None:
        lr = config.lr if lr is None else lr
        if config.name == "adamw":
            adamw_(params, grads, exp_avgs, exp_avg_sqs, self.step, lr=lr, betas=config.betas, eps=config.eps,
                   weight_decay=config.weight_decay, advance_step=advance_step)
        else:
            sgd_(params, grads, exp_avgs, self.step, lr=lr, momentum=config.momentum,
                 weight_decay=config.weight_decay, advance_step=advance_step)
