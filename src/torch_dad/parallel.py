"""DAD on ``torch.distributed``: exact data parallelism and a decoupled layer pipeline.

Two ways to spread DAD training over processes (one per GPU, launched by ``torchrun``):

* :class:`DataParallelTrainer` (a drop-in :class:`~torch_dad.DADTrainer`): every rank
  holds the whole model and a shard of each batch. Each layer's local gradients are
  flattened into one buffer, scaled by ``local_rows / global_rows`` and all-reduced
  (sum) before that layer's in-place update, so a global batch of ``W * B`` rows gives
  the single-process update for those ``W * B`` rows. The all-reduce of layer ``k``
  runs while layer ``k+1`` computes: layer ``k+1`` needs layer ``k``'s output under
  the *pre-update* weights, so the update can wait. Gram statistics are summed before
  ``solve_head``.
* :class:`Pipeline`: the DAD layers are split into contiguous stages, one per rank.
  Stage ``s`` runs its layers on batch ``t`` (each layer updates at once), sends the
  activations and labels to stage ``s+1`` with ``isend`` and goes on with batch ``t+1``.
  Stage ``s+1`` sees stage ``s``'s output for batch ``t`` under stage ``s``'s weights
  from before batch ``t``, exactly what sequential DAD computes, so the result equals
  single-process training. There is no backward pass, so there is no pipeline bubble
  beyond filling and draining once per stream.

``DADAutogradLinear`` with ``update="grad"`` (a layer whose update goes through
``.grad`` and a user optimizer) needs no code here: wrap the model in
``torch.nn.parallel.DistributedDataParallel`` as usual (see ``docs/distributed.md``).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .layers import DADLinear, DADModel, gradients_are_finite
from .ridge import GramAccumulator, RidgeSolution
from .trainer import DADTrainer, _progress

__all__ = [
    "DataParallelTrainer",
    "GradientAllReduce",
    "Pipeline",
    "all_reduce_statistics",
    "partition_layers",
]


# ---------------------------------------------------------------------------- helpers
def _group_info(process_group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group(...) "
            "first (torchrun sets the environment it needs)"
        )
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _signature(trainer: DADTrainer) -> dict[str, Any]:
    """What must agree across ranks: model layout, dtypes and hyper-parameters."""
    model = {k: (tuple(v.shape), str(v.dtype)) for k, v in trainer.model.state_dict().items()}
    return {
        "model": type(trainer.model).__name__,
        "state": model,
        "config": dict(vars(trainer.config)),
        "amp_dtype": str(trainer.amp_dtype),
        "window": trainer.head_statistics.window if trainer.head_statistics is not None else None,
    }


def _check_same_on_all_ranks(trainer: DADTrainer, process_group: Any, extra: dict[str, Any]) -> None:
    """Raise the same ``ValueError`` on every rank if any rank's model or settings differ from rank 0's."""
    rank, world = _group_info(process_group)
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


def _trainer_tensors(trainer: DADTrainer) -> list[Tensor]:
    """Every tensor of a trainer's state, in a fixed order: model, classifier optimizer, Gram statistics."""
    tensors = list(trainer.model.state_dict().values())
    if trainer.head_state is not None:
        tensors += list(trainer.head_state.buffers())
    if trainer.head_statistics is not None:
        tensors += list(trainer.head_statistics.buffers())
    return tensors


@torch.no_grad()
def _broadcast(tensors: Iterable[Tensor], src: int, process_group: Any) -> None:
    for tensor in tensors:
        dist.broadcast(tensor, src=dist.get_global_rank(process_group, src) if process_group else src, group=process_group)


class GradientAllReduce:
    """In-place mean of a gradient list over ranks: ``g_i <- sum_ranks(scale * g_i)``, one buffer per call.

    The list is flattened into one contiguous buffer (one collective per layer instead of
    one per tensor), multiplied by ``scale`` (``local_rows / global_rows``; ``1/W`` for
    equal shards) and summed. Usable as ``DADTrainer.gradient_reducer``.
    """

    def __init__(self, process_group: Any = None) -> None:
        _, world = _group_info(process_group)
        self.process_group = process_group
        self.scale = 1.0 / world

    def launch(self, grads: Sequence[Tensor]) -> tuple[Tensor, Any, list[Tensor]]:
        """Start the all-reduce: returns ``(buffer, work, views)``; ``views`` hold the result after ``work.wait()``."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.scale != 1.0:
            flat.mul_(self.scale)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        views = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        return flat, work, views

    def __call__(self, grads: list[Tensor]) -> None:
        _, work, views = self.launch(grads)
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


def _is_tensor_pair(data: Any) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data)


def _is_distributed_loader(data: Any) -> bool:
    sampler = getattr(data, "sampler", None)
    return isinstance(sampler, torch.utils.data.distributed.DistributedSampler)


# ---------------------------------------------------------------------------- data parallel
class DataParallelTrainer(DADTrainer):
    """:class:`~torch_dad.DADTrainer` for one rank of a data-parallel job.

    Takes ``DADTrainer``'s arguments plus ``process_group`` (default: the world) and
    ``overlap`` (all-reduce layer ``k`` while layer ``k+1`` computes; ``False`` uses the
    plain ``gradient_reducer`` hook, one blocking all-reduce per layer). On construction
    it checks that every rank built the same model and settings, then copies rank 0's
    weights, local heads and optimizer state to every rank.

    ``fit((X, Y), batch_size=G)`` splits every global batch of ``G`` rows (same seeded
    order on all ranks) into ``W`` contiguous shards: the update equals single-process
    ``DADTrainer.fit((X, Y), batch_size=G)``. A ``DataLoader`` must use a
    ``DistributedSampler`` (its ``set_epoch`` is called every epoch). Only rank 0 shows a
    progress bar and writes files (:meth:`save`). ``head_statistics_window`` counts global
    samples: each rank decays its statistics by the single-process factor every step.

    ``solve_head()`` without a loader: with ``head_sample_size > 0`` (the default) every
    rank keeps its own sample of that many of its rows, recomputes their features with the
    current weights, and the Gram statistics of all ranks' samples are summed, so the solve
    uses ``W * head_sample_size`` rows. The result then depends on which rows each rank
    drew; ``head_sample_size=0`` solves from the streamed statistics instead, equal to the
    single-process solve, at the cost of one ``width x width`` GEMM per step (0.98 ms at
    B=16384, width 4096 on an H200, about 4% of that step).
    """

    def __init__(self, model: DADModel, device: torch.device | str | None = None, *args: Any,
                 process_group: Any = None, overlap: bool = True, **kwargs: Any) -> None:
        rank, world = _group_info(process_group)
        super().__init__(model, device, *args, **kwargs)
        _check_same_on_all_ranks(self, process_group, {"mode": "data-parallel", "overlap": bool(overlap)})
        self.process_group = process_group
        self.rank, self.world_size = rank, world
        self.overlap = bool(overlap)
        _broadcast(_trainer_tensors(self), 0, process_group)
        self._reducer = GradientAllReduce(process_group)
        self.gradient_reducer = self._reducer
        self.statistics_reducer = lambda stats: all_reduce_statistics(stats, process_group)
        # the window counts global rows; each rank decays by exp(-local/(window*local/global))
        # = exp(-global/window) per step, the single-process factor, even for uneven shards
        self._global_window = self.head_statistics.window if self.head_statistics is not None else None
        self._shard_scale: float | None = None
        self._epoch = 0
        self._fitting = False  # inside fit(): skip a global tail of fewer than W rows (see _batches)

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the group: the rank that logs and saves."""
        return self.rank == 0

    def step(self, inputs: Tensor, labels: Tensor, lr: float | None = None, amp_dtype: torch.dtype | None = None,
             global_batch: int | None = None) -> tuple[Tensor, Tensor]:
        """One data-parallel step on this rank's shard; the update is the mean over the global batch.

        ``global_batch`` is the total rows over all ranks (default ``W * local rows``, i.e.
        equal shards). Returns this shard's ``(logits, loss)``.
        """
        rows = inputs.shape[0] if isinstance(inputs, Tensor) and inputs.dim() > 0 else 0
        scale = self._shard_scale
        self._shard_scale = None
        if global_batch is not None:
            if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < rows:
                raise ValueError(f"global_batch={global_batch!r} must be an int >= this rank's {rows} rows")
            scale = rows / global_batch
        self._reducer.scale = scale if scale is not None else 1.0 / self.world_size
        if self._global_window is not None and self.head_statistics is not None:
            self.head_statistics.window = self._global_window * self._reducer.scale
        dropout = float(getattr(self, "dropout", 0.0))
        if not self.overlap or dropout > 0:
            # options that change DADTrainer.step's layer loop (e.g. dropout between layers)
            # take the hook path, which runs that loop itself
            return super().step(inputs, labels, lr, amp_dtype)
        if self._engine_applies():
            return self._fused_step(inputs, labels, lr, amp_dtype)
        return self._overlapped_step(inputs, labels, lr, amp_dtype)

    @torch.no_grad()
    def _fused_step(self, inputs: Tensor, labels: Tensor, lr: float | None,
                    amp_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        # the trainer's fused engine (Triton local error, AdamW with bf16 copies), uncaptured,
        # with each layer's all-reduce under the next layer's GEMMs as in _overlapped_step
        x, y, rate, compute = self._begin_step(inputs, labels, lr, amp_dtype)
        logits, loss, _ = self._engine.run_span(x, y, rate, compute, reducer=self._reducer)
        return self._end_step(logits, loss)

    @torch.no_grad()
    def _overlapped_step(self, inputs: Tensor, labels: Tensor, lr: float | None,
                         amp_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        # DADTrainer.step with each layer's update deferred by one layer: the update of
        # layer k only has to land before layer k's next batch, and layer k+1 consumes
        # the pre-update output anyway, so the all-reduce hides behind layer k+1's GEMMs.
        x, y, rate, compute = self._begin_step(inputs, labels, lr, amp_dtype)
        pending: deque[tuple[DADLinear, Any, list[Tensor], Tensor]] = deque()
        h, last = x, None
        for layer, workspace in zip(self.model.dad_layers, self._workspaces):
            # grads[0] may alias the workspace: launch() copies it into the flat buffer at once
            last, grads = layer.local_gradients(h, y, compute, workspace)
            flat, work, views = self._reducer.launch(grads)
            pending.append((layer, work, views, flat))
            h = last.output
            while len(pending) > 1:
                self._apply(pending.popleft(), rate)
        assert last is not None
        if self.model.head is None:
            logits, loss = last.logits, last.loss
        else:
            # the classifier reads the last layer's pre-update output: its step (and the Gram
            # update) runs while the last layer's gradients are still being reduced
            logits, loss = self._head_step(h, y, rate, compute)
        while pending:
            self._apply(pending.popleft(), rate)
        return self._end_step(logits, loss)

    def _apply(self, item: tuple[DADLinear, Any, list[Tensor], Tensor], rate: float) -> None:
        layer, work, views, _ = item
        work.wait()
        # the reduced gradients are the same on every rank, so every rank skips alike
        if self.on_nonfinite != "ignore" and not gradients_are_finite(views):
            self._skipped_update(repr(layer))
            return
        layer.optim_state.apply_(layer._trained_tensors(), views, self.config, rate)

    def _batches(self, data: Any, batch_size: int, shuffle: bool,
                 generator: torch.Generator | None) -> Iterator[tuple[Tensor, Tensor]]:
        if _is_tensor_pair(data):
            training = self._fitting
            for inputs, labels in super()._batches(data, batch_size, shuffle, generator):
                rows = inputs.shape[0]
                if training and rows < self.world_size:
                    continue  # every rank skips the same short tail: collectives stay matched
                lo, hi = self.rank * rows // self.world_size, (self.rank + 1) * rows // self.world_size
                if hi == lo:
                    continue
                self._shard_scale = (hi - lo) / rows
                yield inputs[lo:hi], labels[lo:hi]
            return
        if hasattr(data, "sampler") and isinstance(data, torch.utils.data.DataLoader):
            if not _is_distributed_loader(data):
                raise ValueError(
                    "a DataLoader given to DataParallelTrainer must use "
                    "sampler=torch.utils.data.distributed.DistributedSampler(dataset) so ranks see different rows"
                )
            if self._fitting:
                data.sampler.set_epoch(self._epoch)  # type: ignore[attr-defined]
                self._epoch += 1
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
        if _is_tensor_pair(train) and batch_size % self.world_size:
            raise ValueError(
                f"batch_size={batch_size} is the global batch and must be a multiple of the world size "
                f"{self.world_size}; use e.g. batch_size={max(1, round(batch_size / self.world_size)) * self.world_size}"
            )
        if _is_tensor_pair(train) and kwargs.get("shuffle", True) and "seed" in kwargs and kwargs["seed"] is None:
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

    @torch.no_grad()
    def evaluate(self, data: Any, *, batch_size: int = 1024, use_local_head: bool = False) -> dict[str, float]:
        """Accuracy and mean cross-entropy over ``data``, each rank scoring its shards, summed over ranks."""
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
    def solve_head(self, lambda_reg: float | str = "auto",
                   loader: Iterable[tuple[Tensor, Tensor]] | None = None) -> RidgeSolution:
        """``DADTrainer.solve_head`` with the Gram statistics summed over ranks (same head on every rank).

        A ``(X, Y)`` pair as ``loader`` is sharded here; any other loader must already
        give each rank different rows.
        """
        if _is_tensor_pair(loader):
            loader = self._batches(loader, 4096, False, None)
        return super().solve_head(lambda_reg, loader)

    def save(self, path: str | os.PathLike[str]) -> None:
        """``torch.save(self.state_dict(), path)`` on rank 0 only; every rank waits for it."""
        if self.is_main:
            torch.save(self.state_dict(), path)
        dist.barrier(group=self.process_group)


# ---------------------------------------------------------------------------- pipeline
def layer_costs(model: DADModel, accumulate_head_statistics: bool = True) -> list[float]:
    """Relative cost of one step of each DAD layer: ``2*in*out`` (forward + weight gradient GEMMs)
    plus ``out*classes`` (local head), plus ``out*out`` for the Gram update after the last layer."""
    layers = model._require_layers()
    costs = [2.0 * m.in_features * m.out_features + 2.0 * m.out_features * m.num_classes for m in layers]
    if model.head is not None and accumulate_head_statistics:
        costs[-1] += float(layers[-1].out_features) ** 2
    return costs


def partition_layers(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges, one per stage, minimising the most expensive stage.

    ``num_stages`` may not exceed ``len(costs)``: every stage needs a layer.
    """
    n = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be a positive int")
    if num_stages > n:
        raise ValueError(
            f"{num_stages} pipeline stages but the model has only {n} DADLinear layers; "
            f"launch at most {n} processes (one stage per process)"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: smallest max-stage cost splitting layers[:i] into s stages
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, stop = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_END, _TRAIN, _FORWARD = 0.0, 1.0, 2.0


class Pipeline:
    """Runs ``trainer``'s DAD layers as a pipeline: stage ``s`` = rank ``s`` of ``process_group``.

    ``balance`` gives the number of layers per stage (default: :func:`partition_layers`
    on :func:`layer_costs`). Every rank builds the same model and ``DADTrainer``; rank 0's
    initial weights are copied to all. Stage 0 reads the data; activations and labels
    stream to the next stage with ``isend``/``irecv`` (at most ``max_in_flight`` batches
    buffered per link); the classifier head, its Gram statistics and ``solve_head`` live
    on the last stage. With NCCL, small headers travel over a gloo group so no rank waits
    on a GPU to learn a batch's shape.
    """

    def __init__(self, trainer: DADTrainer, *, process_group: Any = None, balance: Sequence[int] | None = None,
                 max_in_flight: int = 2) -> None:
        if not isinstance(trainer, DADTrainer):
            raise TypeError(f"trainer must be a torch_dad.DADTrainer, got {type(trainer).__name__}")
        if isinstance(trainer, DataParallelTrainer):
            raise TypeError("Pipeline takes a plain DADTrainer, not a DataParallelTrainer")
        rank, world = _group_info(process_group)
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r} must be a positive int")
        layers = trainer.model._require_layers()
        # Stage 0 keeps the trainer's input sample, if it has one (head_sample_size > 0, the
        # default): solve_head() streams it through the stages with the current weights, as
        # DADTrainer.solve_head() recomputes its features. Without a sample the last stage
        # accumulates the Gram statistics every step, one width x width GEMM: 4 ms of a 55 ms
        # stage at B=65536, width 4096 on an H200, which made it the slower stage.
        self._sampled = trainer.head_sample is not None
        trainer.accumulate_head_statistics = not self._sampled
        if trainer.gradient_reducer is not None:
            raise ValueError("trainer.gradient_reducer is set; a Pipeline stage updates from its own batch only")
        # agree first, so a rank with another model cannot fail alone and leave the others waiting
        _check_same_on_all_ranks(
            trainer, process_group, {"mode": "pipeline", "balance": None if balance is None else list(balance)}
        )
        if balance is None:
            bounds = partition_layers(layer_costs(trainer.model, trainer.accumulate_head_statistics), world)
        else:
            counts = list(balance)
            if len(counts) != world or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
                    or sum(counts) != len(layers):
                raise ValueError(
                    f"balance={counts!r} must list {world} positive layer counts (one per process) "
                    f"summing to the model's {len(layers)} DADLinear layers"
                )
            starts = [sum(counts[:i]) for i in range(world)]
            bounds = [(a, a + c) for a, c in zip(starts, counts)]
        _broadcast(_trainer_tensors(trainer), 0, process_group)
        self.trainer = trainer
        self.process_group = process_group
        self.stage, self.num_stages = rank, world
        self.bounds = bounds
        self.layers = layers[bounds[rank][0] : bounds[rank][1]]
        self.is_first, self.is_last = rank == 0, rank == world - 1
        if not self.is_first:
            trainer.head_sample = None  # only stage 0 sees raw inputs
        self.max_in_flight = max_in_flight
        self._sends: deque[list[Any]] = deque()
        nccl = dist.get_backend(process_group) == "nccl"
        ranks = [self._global(r) for r in range(world)]
        # shapes must be known before a GPU buffer can be posted; a CPU header avoids a device sync
        self._control = dist.new_group(ranks, backend="gloo") if nccl else process_group

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.process_group, stage) if self.process_group is not None else stage

    # -------------------------------------------------------------- point-to-point
    def _send(self, kind: float, h: Tensor | None, y: Tensor | None, lr: float, compute: torch.dtype | None) -> None:
        dst = self._global(self.stage + 1)
        rows = h.shape[0] if h is not None else 0
        cols = h.shape[1] if h is not None else 0
        code = _DTYPES.index(h.dtype) if h is not None else 0
        amp = _DTYPES.index(compute) if compute is not None else -1
        header = torch.tensor([kind, rows, cols, code, lr, amp], dtype=torch.float64)
        works = [dist.isend(header, dst, group=self._control)]
        keep: list[Any] = [header]
        if h is not None and y is not None:
            h, y = h.contiguous(), y.contiguous()
            works += [dist.isend(h, dst, group=self.process_group), dist.isend(y, dst, group=self.process_group)]
            keep += [h, y]
        self._sends.append([works, keep])
        while len(self._sends) > self.max_in_flight:
            self._wait_oldest_send()

    def _wait_oldest_send(self) -> None:
        works, _ = self._sends.popleft()
        for work in works:
            work.wait()

    def _flush(self) -> None:
        while self._sends:
            self._wait_oldest_send()

    def _receive(self) -> tuple[float, Tensor | None, Tensor | None, float, torch.dtype | None]:
        src = self._global(self.stage - 1)
        header = torch.empty(6, dtype=torch.float64)
        dist.recv(header, src, group=self._control)
        kind, rows, cols, code, lr, amp = header.tolist()
        compute = _DTYPES[int(amp)] if amp >= 0 else None
        if kind == _END:
            return kind, None, None, lr, compute
        device = self.trainer.device
        h = torch.empty(int(rows), int(cols), dtype=_DTYPES[int(code)], device=device)
        y = torch.empty(int(rows), dtype=torch.long, device=device)
        for work in (dist.irecv(h, src, group=self.process_group), dist.irecv(y, src, group=self.process_group)):
            if work is not None:  # None only on ranks outside the group, which never get here
                work.wait()
        return kind, h, y, lr, compute

    # -------------------------------------------------------------- streaming
    @torch.no_grad()
    def _stage_train(self, h: Tensor, y: Tensor, rate: float,
                     compute: torch.dtype | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Train this stage's layers (and, on the last stage, the classifier): ``(output, (logits, loss))``."""
        trainer = self.trainer
        last = None
        dropout = float(getattr(self.trainer, "dropout", 0.0))  # as DADTrainer.step, where it exists
        start, stop = self.bounds[self.stage]
        if trainer._engine_applies():
            # the fused engine on this stage's span; its output is a fresh tensor, safe to send
            logits, loss, out = trainer._engine.run_span(h, y, rate, compute, span=(start, stop),
                                                         with_head=self.is_last)
            return out, (logits, loss)
        workspaces = self.trainer._workspaces[start:stop]
        for i, layer in enumerate(self.layers):
            # the stage's output leaves with an asynchronous send, so it must not live in a
            # workspace that the next batch overwrites
            workspace = workspaces[i] if i < len(self.layers) - 1 else None
            last = self.trainer._layer_step(layer, h, y, rate, compute, workspace)
            h = last.output
            if dropout:
                h = torch.nn.functional.dropout(h, dropout, training=True)
        assert last is not None
        if self.is_last and trainer.model.head is not None:
            return h, trainer._head_step(h, y, rate, compute)
        return h, (last.logits, last.loss)

    def _stream(self, batches: Iterable[tuple[Tensor, Tensor]] | None, kind: float, lr: float | None,
                on_output: Callable[[int, Tensor, Tensor, Any], None] | None) -> int:
        """Push ``batches`` through every stage; returns the number of batches this stage handled."""
        trainer = self.trainer
        count = 0
        if self.is_first:
            if batches is None:
                raise ValueError("stage 0 reads the data: pass the batches on rank 0")
            for inputs, labels in batches:
                # only training rows go into the head sample (not evaluate() or solve_head() rows)
                x, y, rate, compute = trainer._begin_step(inputs, labels, lr, None, sample=kind == _TRAIN)
                self._process(kind, x, y, rate, compute, count, on_output)
                count += 1
        else:
            while True:
                kind_in, h, y_in, rate, compute = self._receive()
                if kind_in == _END:
                    break
                assert h is not None and y_in is not None
                self._process(kind_in, h, y_in, rate, compute, count, on_output)
                count += 1
        if not self.is_last:
            self._send(_END, None, None, 0.0, None)
        self._flush()
        return count

    @torch.no_grad()
    def _process(self, kind: float, h: Tensor, y: Tensor, rate: float, compute: torch.dtype | None, index: int,
                 on_output: Callable[[int, Tensor, Tensor, Any], None] | None) -> None:
        trainer = self.trainer
        result: Any = None
        if kind == _TRAIN:
            h, result = self._stage_train(h, y, rate, compute)
        else:
            for layer in self.layers:
                h = layer(h)
        if not self.is_last:
            self._send(kind, h, y, rate, compute)
        if kind == _TRAIN and self.is_last:
            result = trainer._end_step(*result)
        else:
            result = None
            trainer.step_count += kind == _TRAIN
        if on_output is not None:
            on_output(index, h, y, result)

    def run(self, batches: Iterable[tuple[Tensor, Tensor]] | None, lr: float | None = None,
            callback: Callable[[int, Tensor, Tensor, Any], None] | None = None) -> int:
        """Train on ``batches`` (an iterable of ``(x, y)``; rank 0 only, ``None`` elsewhere).

        Every rank must call ``run``. ``callback(index, h, y, result)`` is called on every
        stage after each batch (``result`` is the last stage's ``(logits, loss)``, else
        ``None``). Returns the number of batches this stage trained on.
        """
        return self._stream(batches, _TRAIN, lr, callback)

    def _stage0_batches(self, data: Any, batch_size: int, shuffle: bool, generator: torch.Generator | None) -> Any:
        return self.trainer._batches(data, batch_size, shuffle, generator) if self.is_first else None

    def fit(self, train: Any, epochs: int = 1, eval: Any = None, *, batch_size: int = 256, shuffle: bool = True,
            seed: int | None = 0, progress: bool = True) -> list[dict[str, float]]:
        """Pipelined ``DADTrainer.fit``: same batches, same result; records are returned on every rank.

        ``train``/``eval`` matter on rank 0 only (pass ``None`` elsewhere). Records hold
        ``epoch, loss, train_s, img_per_s`` (+ ``accuracy, eval_loss`` with ``eval``).
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} must be a positive int")
        if self.is_first and train is None:
            raise ValueError("stage 0 reads the data: pass train= on rank 0")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        records = []
        for epoch in range(epochs):
            batches = self._stage0_batches(train, batch_size, shuffle, generator)
            if batches is not None:
                batches = _progress(batches, progress, desc=f"epoch {epoch + 1}/{epochs}")
            seen = torch.zeros((), dtype=torch.float64)
            losses = torch.zeros((), device=self.trainer.device)

            def tally(_: int, h: Tensor, y: Tensor, result: Any, seen: Tensor = seen, losses: Tensor = losses) -> None:
                seen.add_(y.shape[0])
                if result is not None:
                    losses.add_(result[1])

            self._sync()
            start = time.perf_counter()
            count = self.run(batches, callback=tally)
            self._sync()
            elapsed = time.perf_counter() - start
            record = {"epoch": float(len(self.trainer.history) + 1), "loss": float(losses) / max(count, 1),
                      "train_s": elapsed, "img_per_s": float(seen) / elapsed if elapsed > 0 else float("nan")}
            metrics = self.evaluate(eval if self.is_first else None, batch_size=batch_size)
            if metrics is not None:
                record["accuracy"], record["eval_loss"] = metrics["accuracy"], metrics["loss"]
            record = self._from_last(record)
            self.trainer.history.append(record)
            records.append(record)
        return records

    def _sync(self) -> None:
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)
        dist.barrier(group=self._control)

    def _from_last(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(self.num_stages - 1), group=self._control)
        return box[0]

    @torch.no_grad()
    def evaluate(self, data: Any, *, batch_size: int = 1024) -> dict[str, float] | None:
        """Pipelined ``DADTrainer.evaluate`` (rank 0 passes the data, ``None`` elsewhere; every rank calls).

        Returns the metrics on every rank, or ``None`` on all ranks when rank 0 passed ``None``.
        """
        has_data = self._from_first(data is not None)
        if not has_data:
            return None
        trainer = self.trainer
        sums = torch.zeros(3, dtype=torch.float64, device=trainer.device)

        def score(_: int, h: Tensor, y: Tensor, result: Any) -> None:
            if not self.is_last:
                return
            head = trainer.model.head
            logits = head(h) if head is not None else self.layers[-1].local_head(h)
            sums[0] += (logits.argmax(1) == y).sum()
            sums[1] += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[2] += y.shape[0]

        was_training = trainer.model.training
        trainer.model.eval()
        try:
            self._stream(self._stage0_batches(data, batch_size, False, None), _FORWARD, None, score)
        finally:
            trainer.model.train(was_training)
        values = self._from_last(sums.tolist())
        if values[2] == 0:
            raise ValueError("evaluate() got no batches")
        return {"accuracy": values[0] / values[2], "loss": values[1] / values[2], "samples": values[2]}

    def _from_first(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self._control)
        return box[0]

    @torch.no_grad()
    def solve_head(self, lambda_reg: float | str = "auto", data: Any = None, *,
                   batch_size: int = 4096) -> RidgeSolution | None:
        """``DADTrainer.solve_head`` on the last stage (every rank calls; returns ``None`` elsewhere).

        With ``data`` (rank 0's ``(X, Y)`` or loader) the features are streamed through the
        stages with the current weights. Without it, stage 0's input sample is streamed the
        same way (then reset), or, with ``head_sample_size=0``, the last stage solves from
        the Gram statistics it accumulated while training.
        """
        trainer = self.trainer
        head = trainer._require_head()
        from_sample = data is None and self._sampled
        if from_sample:
            sample = trainer.head_sample
            rows = self._from_first(sample.size if self.is_first and sample is not None else 0)
            if rows == 0:
                raise ValueError("solve_head(): stage 0 has sampled no rows yet; train first, or pass data=")
            if self.is_first and sample is not None:
                data = list(sample.batches())
        streamed = self._from_first(data is not None)
        solution = None
        if streamed:
            stats = GramAccumulator(head.in_features, head.out_features, device=trainer.device)
            was_training = trainer.model.training
            trainer.model.eval()
            try:
                self._stream(self._stage0_batches(data, batch_size, False, None), _FORWARD, None,
                             lambda _, h, y, __: stats.update(h, y) if self.is_last else None)
            finally:
                trainer.model.train(was_training)
            if self.is_last:
                kept, trainer.head_statistics = trainer.head_statistics, stats
                try:
                    solution = trainer.solve_head(lambda_reg)
                finally:
                    trainer.head_statistics = kept
        elif self.is_last:
            solution = trainer.solve_head(lambda_reg)
        if from_sample and trainer.head_sample is not None:
            trainer.head_sample.reset()
        return solution

    @torch.no_grad()
    def synchronize(self) -> None:
        """Copy every stage's layers (and the last stage's classifier state) to all ranks.

        Afterwards ``trainer.state_dict()`` on any rank is the whole trained model, as a
        sequential run would have left it.
        """
        trainer = self.trainer
        for stage, (start, stop) in enumerate(self.bounds):
            for layer in trainer.model.dad_layers[start:stop]:
                _broadcast(list(layer.state_dict().values()), stage, self.process_group)
        rest: list[Tensor] = []
        head = trainer.model.head
        if head is not None:
            rest += list(head.state_dict().values())
        if trainer.head_state is not None:
            rest += list(trainer.head_state.buffers())
        if trainer.head_statistics is not None:
            rest += list(trainer.head_statistics.buffers())
        _broadcast(rest, self.num_stages - 1, self.process_group)
        step = self._from_last(trainer.step_count)
        trainer.step_count = int(step)

    def save(self, path: str | os.PathLike[str]) -> None:
        """:meth:`synchronize`, then ``torch.save(trainer.state_dict(), path)`` on rank 0 only."""
        self.synchronize()
        if self.stage == 0:
            torch.save(self.trainer.state_dict(), path)
        dist.barrier(group=self._control)
