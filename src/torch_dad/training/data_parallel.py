"""Exact data parallelism for DAD on ``torch.distributed``: :class:`DataParallelTrainer`.

Every rank holds the whole model and a shard of each batch. Each layer's local gradients are
flattened into one buffer, scaled by ``local_rows / global_rows`` (with token labels
``(batch, T)``: ``local / global`` labelled tokens) and all-reduced (sum) before that layer's
in-place update, so a global batch of ``W * B`` rows gives the single-process update for
those ``W * B`` rows. The all-reduce of layer ``k`` runs while layer ``k+1``
computes: layer ``k+1`` needs layer ``k``'s output under the *pre-update* weights, so the
update can wait. Gram statistics are summed before ``solve_head``.

``DADAutogradLinear`` with ``update="grad"`` needs no code here: wrap the model in
``torch.nn.parallel.DistributedDataParallel`` as usual (see ``docs/distributed.md``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import IGNORE_INDEX
from ..nn.linear import DADModel
from ..ridge import GramAccumulator, RidgeSolution
from .distributed import (
    GradientAllReduce,
    all_reduce_statistics,
    broadcast,
    check_same_on_all_ranks,
    group_info,
    is_tensor_pair,
)
from .shards import ShardedFolder
from .trainer import DADTrainer

__all__ = ["DataParallelTrainer"]


def _is_distributed_loader(data: Any) -> bool:
    sampler = getattr(data, "sampler", None)
    return isinstance(sampler, torch.utils.data.distributed.DistributedSampler)


def _shard_share(labels: Tensor, lo: int, hi: int) -> float:
    """The weight of rows ``[lo, hi)``'s mean loss in the mean over all ``labels``: their share of the
    rows, or, for token labels ``(batch, T)`` (a mean over labelled tokens), of the labelled tokens."""
    if labels.dim() < 2:
        return (hi - lo) / labels.shape[0]
    labelled = labels != IGNORE_INDEX
    mine, total = torch.stack([labelled[lo:hi].sum(), labelled.sum()]).tolist()
    # no labelled token anywhere: every shard's gradients are zero, any share will do
    return mine / total if total else (hi - lo) / labels.shape[0]


class DataParallelTrainer(DADTrainer):
    """:class:`~torch_dad.DADTrainer` for one rank of a data-parallel job.

    Takes ``DADTrainer``'s arguments plus ``process_group`` (default: the world) and
    ``overlap`` (all-reduce layer ``k`` while layer ``k+1`` computes; ``False``: one blocking
    all-reduce per layer). On construction
    it checks that every rank built the same model and settings, then copies rank 0's
    weights, local heads and optimizer state to every rank.

    ``fit((X, Y), batch_size=G)`` splits every global batch of ``G`` rows (same seeded
    order on all ranks) into ``W`` contiguous shards: the update equals single-process
    ``DADTrainer.fit((X, Y), batch_size=G)``. A ``DataLoader`` must use a
    ``DistributedSampler`` (its ``set_epoch`` is called every epoch). Only rank 0 shows a
    progress bar and writes files (:meth:`save`). ``classifier_statistics_window`` counts global
    samples: each rank decays its statistics by the single-process factor every step.

    ``solve_head()`` without a loader: with ``classifier_sample_size > 0`` (the default) every
    rank keeps its own sample of that many of its rows, recomputes their features with the
    current weights, and the Gram statistics of all ranks' samples are summed, so the solve
    uses ``W * classifier_sample_size`` rows. The result then depends on which rows each rank
    drew; ``classifier_sample_size=0`` solves from the streamed statistics instead, equal to the
    single-process solve, at the cost of one ``width x width`` GEMM per step (``docs/distributed.md``).
    The solved classifier is not calibrated here: each rank would fit its own scale.

    At world size 1 nothing is reduced: the trainer is ``DADTrainer`` (its step stays on the engine's CUDA
    graph, and ``solve_head`` calibrates), with this class's sharded checkpoints.
    """

    def __init__(self, model: DADModel, device: torch.device | str | None = None, *args: Any,
                 process_group: Any = None, overlap: bool = True, **kwargs: Any) -> None:
        rank, world = group_info(process_group)
        super().__init__(model, device, *args, **kwargs)
        check_same_on_all_ranks(self, process_group, {"mode": "data-parallel", "overlap": bool(overlap)})
        self.process_group = process_group
        self.rank, self.world_size = rank, world
        self.overlap = bool(overlap)
        broadcast(self.state_tensors(), 0, process_group)
        self._reducer = GradientAllReduce(process_group, blocking=not self.overlap)
        if world > 1:  # one rank: nothing to reduce, and the step stays on the engine's CUDA graph
            self.set_reducers(self._reducer, lambda stats: all_reduce_statistics(stats, process_group))
        # the window counts global rows; each rank decays by exp(-local/(window*local/global))
        # = exp(-global/window) per step, the single-process factor, even for uneven shards
        self._global_window = self.classifier_statistics.window if self.classifier_statistics is not None else None
        self._shard_scale: float | None = None
        self._fitting = False  # inside fit(): skip a global tail of fewer than W rows (see batches)

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the group: the rank that logs and saves."""
        return self.rank == 0

    def step(self, inputs: Tensor, labels: Tensor, lr: float | None = None, amp_dtype: torch.dtype | None = None,
             global_batch: int | None = None) -> tuple[Tensor, Tensor]:
        """One data-parallel step on this rank's shard; the update is the mean over the global batch.

        ``global_batch`` is the total rows over all ranks (default ``W * local rows``, i.e.
        equal shards). With token labels ``(batch, T)`` the shard's weight is then its share of
        the rows, exact when every row has as many labelled tokens (``fit`` weighs the tokens
        themselves). Returns this shard's ``(logits, loss)``.
        """
        rows = inputs.shape[0] if isinstance(inputs, Tensor) and inputs.dim() > 0 else 0
        scale = self._shard_scale
        self._shard_scale = None
        if global_batch is not None:
            if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < rows:
                raise ValueError(f"global_batch={global_batch!r} must be an int >= this rank's {rows} rows")
            scale = rows / global_batch
        self._reducer.scale = scale if scale is not None else 1.0 / self.world_size
        if self._global_window is not None and self.classifier_statistics is not None:
            self.classifier_statistics.window = self._global_window * self._reducer.scale
        return super().step(inputs, labels, lr, amp_dtype)

    def batches(self, data: Any, batch_size: int, shuffle: bool,
                 generator: torch.Generator | None) -> Iterator[tuple[Tensor, Tensor]]:
        if is_tensor_pair(data):
            training = self._fitting
            for inputs, labels in super().batches(data, batch_size, shuffle, generator):
                rows = inputs.shape[0]
                if training and rows < self.world_size:
                    continue  # every rank skips the same short tail: collectives stay matched
                lo, hi = self.rank * rows // self.world_size, (self.rank + 1) * rows // self.world_size
                if hi == lo:
                    continue
                self._shard_scale = _shard_share(labels, lo, hi)
                yield inputs[lo:hi], labels[lo:hi]
            return
        if hasattr(data, "sampler") and isinstance(data, torch.utils.data.DataLoader):
            if not _is_distributed_loader(data):
                raise ValueError(
                    "a DataLoader given to DataParallelTrainer must use "
                    "sampler=torch.utils.data.distributed.DistributedSampler(dataset) so ranks see different rows"
                )
            if self._fitting:  # epochs trained so far: a resumed run draws the same order
                data.sampler.set_epoch(len(self.history))  # type: ignore[attr-defined]
        yield from data

    def fit(self, train: Any, epochs: int = 1, eval: Any = None, *, batch_size: int = 256,
            progress: bool = True, **kwargs: Any) -> list[dict[str, float]]:
        """``DADTrainer.fit`` over this rank's shards; ``batch_size`` is the global batch.

        Other keyword arguments go to ``DADTrainer.fit`` unchanged (``seed`` must be the
        same on every rank). Records hold the global mean loss and global img/s (sum over
        ranks); only rank 0 shows progress. Raises ``ValueError`` if ``batch_size`` is not
        a multiple of the world size (shards would differ in size every step).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        if is_tensor_pair(train) and batch_size % self.world_size:
            raise ValueError(
                f"batch_size={batch_size} is the global batch and must be a multiple of the world size "
                f"{self.world_size}; use e.g. batch_size={max(1, round(batch_size / self.world_size)) * self.world_size}"
            )
        if is_tensor_pair(train) and kwargs.get("shuffle", True) and "seed" in kwargs and kwargs["seed"] is None:
            raise ValueError(
                "seed=None would shuffle differently on every rank (rows seen twice or never); pass an int seed"
            )
        self._fitting = True
        try:
            records = super().fit(train, epochs, eval, batch_size=batch_size, progress=progress and self.is_main,
                                  **kwargs)
        finally:
            self._fitting = False
        for record in records:
            totals = torch.tensor([record["loss"], record["img_per_s"]], dtype=torch.float64, device=self.device)
            dist.all_reduce(totals, group=self.process_group)
            record["loss"] = float(totals[0]) / self.world_size
            record["img_per_s"] = float(totals[1])
        return records

    def checkpoint_folder(self, folder: Path, every: int | None, keep_last: int) -> ShardedFolder:
        """``fit``'s checkpoints: rank 0's shard holds the state every rank shares, each rank's shard its
        input sample and fit progress, and a manifest commits them (see :mod:`~torch_dad.training.shards`)."""
        own = ("fit.", "trainer.classifier_sample.")
        return ShardedFolder(
            folder, every, keep_last, group=self.process_group,
            layout={"mode": "data-parallel", "world_size": self.world_size},
            owner=lambda key: None if key.startswith(own) else 0, shared_from=0, live=self.state_dict,
        )

    @torch.no_grad()
    def evaluate(self, data: Any, *, batch_size: int = 1024, use_local_head: bool = False) -> dict[str, float]:
        """Accuracy and mean cross-entropy over ``data``, each rank scoring its shards, summed over ranks
        (``samples``: rows, or labelled tokens for token labels ``(batch, T)``, as on one process)."""
        fitting, self._fitting = self._fitting, False  # score every row, even a tail shorter than W
        try:
            local = super().evaluate(data, batch_size=batch_size, use_local_head=use_local_head)
            n = local["samples"]
            sums = [local["accuracy"] * n, local["loss"] * n, n]
        except ValueError as err:
            if "no batches" not in str(err):
                raise
            sums = [0.0, 0.0, 0.0]
        finally:
            self._fitting = fitting
        totals = torch.tensor(sums, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=self.process_group)
        total = float(totals[2])
        if total == 0:
            raise ValueError("evaluate() got no batches")
        return {"accuracy": round(float(totals[0])) / total, "loss": float(totals[1]) / total, "samples": total}

    @torch.no_grad()
    def solve_head(self, lambda_reg: float | str = "auto", loader: Iterable[tuple[Tensor, Tensor]] | None = None,
                   *, statistics: GramAccumulator | None = None) -> RidgeSolution:
        """``DADTrainer.solve_head`` with the Gram statistics summed over ranks (same head on every rank).

        A ``(X, Y)`` pair as ``loader`` is sharded here; any other loader must already
        give each rank different rows.
        """
        if is_tensor_pair(loader):
            loader = self.batches(loader, 4096, False, None)
        return super().solve_head(lambda_reg, loader, statistics=statistics)

    def save(self, path: str | os.PathLike[str]) -> None:
        """``torch.save(self.state_dict(), path)`` on rank 0 only; every rank waits for it."""
        if self.is_main:
            torch.save(self.state_dict(), path)
        dist.barrier(group=self.process_group)
