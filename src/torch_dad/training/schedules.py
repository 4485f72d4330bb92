"""Per-step learning-rate schedules for :meth:`DADTrainer.fit` / :meth:`DADTrainer.step`."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

__all__ = ["multistep", "warmup_cosine"]


def _check_lr(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}={value!r} must be a finite float >= 0")


def multistep(base_lr: float, milestones: Sequence[int], gamma: float = 0.1) -> Callable[[int], float]:
    """``lr(t) = base_lr * gamma ** (number of milestones <= t)``, as ``torch.optim.lr_scheduler.MultiStepLR``
    with ``t`` counted in whatever unit the milestones are (steps for ``fit(schedule=...)``)."""
    _check_lr("base_lr", base_lr)
    _check_lr("gamma", gamma)
    marks = list(milestones) if isinstance(milestones, Sequence) and not isinstance(milestones, str) else None
    if marks is None or any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in marks) \
            or marks != sorted(marks):
        raise ValueError(f"milestones={milestones!r} must be a sorted sequence of ints >= 0, e.g. [50, 75]")

    def lr(step: int) -> float:
        return base_lr * gamma ** bisect.bisect_right(marks, step)

    return lr


def warmup_cosine(
    base_lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0
) -> Callable[[int], float]:
    """``lr(t)``: linear warm-up ``base_lr * (t+1) / warmup_steps`` for ``t < warmup_steps``, then
    ``min_lr + (base_lr - min_lr) * (1 + cos(pi * p)) / 2`` with ``p = (t - warmup) / (total - warmup)``
    clipped to [0, 1] (steps past ``total_steps`` stay at ``min_lr``)."""
    for name, value in (("base_lr", base_lr), ("min_lr", min_lr)):
        _check_lr(name, value)
    for name, value in (("total_steps", total_steps), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if total_steps < 1 or warmup_steps > total_steps:
        raise ValueError(
            f"need 1 <= total_steps and warmup_steps <= total_steps; got total_steps={total_steps}, "
            f"warmup_steps={warmup_steps} (total_steps = epochs * batches per epoch)"
        )
    decay = total_steps - warmup_steps

    def lr(step: int) -> float:
        if step < warmup_steps:
            return base_lr * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / decay) if decay else 1.0
        return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr
