"""What data parallelism and the pipeline share: group checks, broadcasts and the all-reduce hooks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..ridge import GramAccumulator

__all__ = ["GradientAllReduce", "all_reduce_statistics", "broadcast", "check_same_on_all_ranks", "group_info"]


def group_info(process_group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group(...) "
            "first (torchrun sets the environment it needs)"
        )
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _signature(trainer: Any) -> dict[str, Any]:
    """What must agree across ranks: model layout, dtypes and hyper-parameters."""
    model = {k: (tuple(v.shape), str(v.dtype)) for k, v in trainer.model.state_dict().items()}
    return {
        "model": type(trainer.model).__name__,
        "state": model,
        "config": dict(vars(trainer.config)),
        "amp_dtype": str(trainer.amp_dtype),
        "window": trainer.classifier.window if trainer.classifier is not None else None,
    }


def check_same_on_all_ranks(trainer: Any, process_group: Any, extra: dict[str, Any]) -> None:
    """Raise the same ``ValueError`` on every rank if any rank's model or settings differ from rank 0's."""
    rank, world = group_info(process_group)
    mine = {**_signature(trainer), **extra}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=process_group)
    reference = everyone[0]
    for other_rank, other in enumerate(everyone):
        if other == reference:
            continue
        keys = sorted(k for k in set(reference) | set(other) if reference.get(k) != other.get(k))
        detail = keys[0]
        if detail == "state":
            a, b = reference["state"], other["state"]
            names = [k for k in a if a[k] != b.get(k)] + [k for k in b if k not in a]
            detail = f"state entry {names[0]!r}: rank 0 has {a.get(names[0])}, rank {other_rank} has {b.get(names[0])}"
        else:
            detail = f"{detail}: rank 0 has {reference.get(detail)!r}, rank {other_rank} has {other.get(detail)!r}"
        raise ValueError(
            f"ranks disagree ({detail}); build the same model with the same trainer arguments on every rank"
        )


@torch.no_grad()
def broadcast(tensors: Iterable[Tensor], src: int, process_group: Any) -> None:
    for tensor in tensors:
        dist.broadcast(tensor, src=dist.get_global_rank(process_group, src) if process_group else src, group=process_group)


class GradientAllReduce:
    """In-place mean of a gradient list over ranks: ``g_i <- sum_ranks(scale * g_i)``, one buffer per call.

    The list is flattened into one contiguous buffer (one collective per layer instead of
    one per tensor), multiplied by ``scale`` (``local_rows / global_rows``; ``1/W`` for
    equal shards) and summed. A :class:`~torch_dad.training.step.GradientReducer`: set it as
    ``DADTrainer.gradient_reducer``. With ``blocking``, :meth:`launch` waits for the result.
    """

    def __init__(self, process_group: Any = None, *, blocking: bool = False) -> None:
        _, world = group_info(process_group)
        self.process_group = process_group
        self.scale = 1.0 / world
        self.blocking = blocking

    def launch(self, grads: Sequence[Tensor]) -> tuple[Any, list[Tensor]]:
        """Start the all-reduce: ``(work, views)``; ``views`` hold the result after ``work.wait()``
        (``work`` is ``None`` when blocking). The gradients are copied at once."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.scale != 1.0:
            flat.mul_(self.scale)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        views = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        if self.blocking:
            work.wait()
            work = None
        return work, views

    def __call__(self, grads: list[Tensor]) -> None:
        work, views = self.launch(grads)
        if work is not None:
            work.wait()
        for g, v in zip(grads, views):
            g.copy_(v)


def all_reduce_statistics(stats: GramAccumulator, process_group: Any = None) -> None:
    """Sum a :class:`~torch_dad.GramAccumulator` over ranks in place (one float64 buffer)."""
    buffers = list(stats.buffers())
    flat = torch.cat([b.reshape(-1) for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
    for b, v in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(v.view(b.shape))


def is_tensor_pair(data: Any) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data)
