"""A decoupled layer pipeline for DAD on ``torch.distributed``: :class:`Pipeline`.

The DAD layers are split into contiguous stages, one per rank. Stage ``s`` trains its layers
on batch ``t`` (each layer updates at once), sends the activations and labels to stage
``s+1`` with ``isend`` and goes on with batch ``t+1``. Stage ``s+1`` sees stage ``s``'s output
for batch ``t`` under stage ``s``'s weights from before batch ``t``, exactly what sequential DAD
computes, so the result equals single-process training. There is no backward pass, so there
is no pipeline bubble beyond filling and draining once per stream.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..nn.linear import DADLinear, DADModel
from ..ridge import GramAccumulator, RidgeSolution
from .batches import classification_metrics, reiterable
from .checkpoint import FitProgress
from .data_parallel import DataParallelTrainer
from .distributed import broadcast, check_same_on_all_ranks, group_info
from .fit import check_fit_arguments, end_epoch, start_fit
from .shards import ShardedFolder
from .step import Batch, progress_bar
from .trainer import DADTrainer

__all__ = ["Pipeline", "layer_costs", "partition_layers"]


def layer_costs(model: DADModel, accumulate_classifier_statistics: bool = True) -> list[float]:
    """Relative cost of one step of each DAD layer: ``2*in*out`` (forward + weight gradient GEMMs)
    plus ``out*classes`` (local head), plus ``out*out`` for the Gram update after the last layer.
    A layer without ``in_features``/``out_features`` (a convolution or block, whose cost depends
    on the input size) counts ``2 *`` its trained parameters: pass ``balance=`` to do better."""
    layers = model.require_layers()
    costs = [_layer_cost(m) for m in layers]
    classifier = model.get_classifier()
    if classifier is not None and accumulate_classifier_statistics:
        costs[-1] += float(classifier.in_features) ** 2
    return costs


def _layer_cost(layer: Any) -> float:
    if isinstance(layer, DADLinear):
        return 2.0 * layer.in_features * layer.out_features + 2.0 * layer.out_features * layer.num_classes
    return 2.0 * sum(t.numel() for t in layer.trained_tensors())


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
#: the most dimensions of an activation sent between stages (a (B, C, H, W) conv output has 4)
_MAX_DIMS = 6
#: the most dimensions of the labels sent along: (B,) class ids or (B, T) token ids
_MAX_LABEL_DIMS = 2
_END, _TRAIN, _FORWARD = 0.0, 1.0, 2.0


def _shape_fields(shape: Sequence[int], limit: int, what: str) -> list[float]:
    """``[ndim, *shape]`` padded with zeros to ``1 + limit`` numbers: one shape in a stage's header."""
    if len(shape) > limit:
        raise ValueError(f"{what} of shape {tuple(shape)} has more than {limit} dimensions")
    return [float(len(shape)), *map(float, shape)] + [0.0] * (limit - len(shape))


def _read_shape(fields: Sequence[float]) -> list[int]:
    """The shape that :func:`_shape_fields` packed."""
    return [int(d) for d in fields[1 : 1 + int(fields[0])]]


_HEADER = 4 + 1 + _MAX_DIMS + 1 + _MAX_LABEL_DIMS  # kind, dtype, lr, amp; activation shape; label shape


class Pipeline:
    """Runs ``trainer``'s DAD layers as a pipeline: stage ``s`` = rank ``s`` of ``process_group``.

    ``balance`` gives the number of layers per stage (default: :func:`partition_layers`
    on :func:`layer_costs`). Every rank builds the same model and ``DADTrainer``; rank 0's
    initial weights are copied to all. Stage 0 reads the data; activations and labels
    stream to the next stage with ``isend``/``irecv`` (at most ``max_in_flight`` batches
    buffered per link), labels as class ids ``(B,)`` or token ids ``(B, T)``; the classifier
    head, its Gram statistics and ``solve_head`` live on the last stage. With NCCL, small
    headers travel over a gloo group so no rank waits on a GPU to learn a batch's shapes.
    """

    def __init__(self, trainer: DADTrainer, *, process_group: Any = None, balance: Sequence[int] | None = None,
                 max_in_flight: int = 2) -> None:
        if not isinstance(trainer, DADTrainer):
            raise TypeError(f"trainer must be a torch_dad.DADTrainer, got {type(trainer).__name__}")
        if isinstance(trainer, DataParallelTrainer):
            raise TypeError("Pipeline takes a plain DADTrainer, not a DataParallelTrainer")
        rank, world = group_info(process_group)
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r} must be a positive int")
        layers = trainer.model.require_layers()
        # Stage 0 keeps the trainer's input sample, if it has one (classifier_sample_size > 0, the
        # default): solve_head() streams it through the stages with the current weights, as
        # DADTrainer.solve_head() recomputes its features. Without a sample the last stage
        # accumulates the Gram statistics every step, one width x width GEMM that can make it the
        # slower stage.
        self._sampled = trainer.keeps_input_sample
        if trainer.gradient_reducer is not None:
            raise ValueError("trainer.gradient_reducer is set; a Pipeline stage updates from its own batch only")
        # agree first, so a rank with another model cannot fail alone and leave the others waiting
        check_same_on_all_ranks(
            trainer, process_group, {"mode": "pipeline", "balance": None if balance is None else list(balance)}
        )
        if balance is None:
            bounds = partition_layers(layer_costs(trainer.model, not self._sampled), world)
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
        if trainer.classifier is not None:
            trainer.classifier.keep_statistics(not self._sampled)
            if rank != 0:
                trainer.classifier.drop_sample()  # only stage 0 sees raw inputs
        broadcast(trainer.state_tensors(), 0, process_group)
        self.trainer = trainer
        self.process_group = process_group
        self.stage, self.num_stages = rank, world
        self.bounds = bounds
        self.layers = layers[bounds[rank][0] : bounds[rank][1]]
        self.is_first, self.is_last = rank == 0, rank == world - 1
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
        code = _DTYPES.index(h.dtype) if h is not None else 0
        amp = _DTYPES.index(compute) if compute is not None else -1
        shapes = _shape_fields(list(h.shape) if h is not None else [], _MAX_DIMS, "a stage output")
        shapes += _shape_fields(list(y.shape) if y is not None else [], _MAX_LABEL_DIMS, "labels")
        header = torch.tensor([kind, code, lr, amp, *shapes], dtype=torch.float64)
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

    def _receive(self) -> tuple[float, Batch] | None:
        """The previous stage's next ``(kind, batch)``, or ``None`` at the end of its stream."""
        src = self._global(self.stage - 1)
        header = torch.empty(_HEADER, dtype=torch.float64)
        dist.recv(header, src, group=self._control)
        kind, code, lr, amp, *shapes = header.tolist()
        if kind == _END:
            return None
        device = self.trainer.device
        h = torch.empty(_read_shape(shapes[: 1 + _MAX_DIMS]), dtype=_DTYPES[int(code)], device=device)
        y = torch.empty(_read_shape(shapes[1 + _MAX_DIMS :]), dtype=torch.long, device=device)
        for work in (dist.irecv(h, src, group=self.process_group), dist.irecv(y, src, group=self.process_group)):
            if work is not None:  # None only on ranks outside the group, which never get here
                work.wait()
        return kind, Batch(h, y, lr, _DTYPES[int(amp)] if amp >= 0 else None)

    # -------------------------------------------------------------- streaming
    def _outputs(self, batches: Iterable[tuple[Tensor, Tensor]] | None, kind: float,
                 lr: float | None) -> Iterator[tuple[Tensor, Tensor, Any]]:
        """Push ``batches`` through every stage, yielding this stage's ``(output, labels, result)`` per batch
        (``result``: the last stage's ``(logits, loss)`` of a training step, else ``None``). Exhaust it:
        its end ends the next stage's stream."""
        if self.is_first:
            if batches is None:
                raise ValueError("stage 0 reads the data: pass the batches on rank 0")
            for inputs, labels in batches:
                yield self._process(kind, self.trainer.prepare_batch(inputs, labels, lr))
        else:
            while (received := self._receive()) is not None:
                yield self._process(*received)
        if not self.is_last:
            self._send(_END, None, None, 0.0, None)
        self._flush()

    def _stream(self, batches: Iterable[tuple[Tensor, Tensor]] | None, kind: float, lr: float | None,
                on_output: Callable[[int, Tensor, Tensor, Any], None] | None) -> int:
        """:meth:`_outputs`, calling ``on_output(index, output, labels, result)`` for each; returns the
        number of batches this stage handled."""
        count = 0
        for h, y, result in self._outputs(batches, kind, lr):
            if on_output is not None:
                on_output(count, h, y, result)
            count += 1
        return count

    @torch.no_grad()
    def _process(self, kind: float, batch: Batch) -> tuple[Tensor, Tensor, Any]:
        """Train this stage's layers on ``batch`` (or, for forward passes, run them), send the
        output on; only training rows reach the stage's layers' updates and the input sample."""
        result: Any = None
        if kind == _TRAIN:
            start, stop = self.bounds[self.stage]
            out = self.trainer.train_layers(batch, span=(start, stop), with_classifier=self.is_last)
            h = out.features
            logits_loss = self.trainer.finish_step(out)
            result = logits_loss if self.is_last else None
        else:
            h = batch.x
            for layer in self.layers:
                h = layer(h)
        if not self.is_last:
            self._send(kind, h, batch.y, batch.lr, batch.compute_dtype)
        return h, batch.y, result

    def run(self, batches: Iterable[tuple[Tensor, Tensor]] | None, lr: float | None = None,
            callback: Callable[[int, Tensor, Tensor, Any], None] | None = None) -> int:
        """Train on ``batches`` (an iterable of ``(x, y)``; rank 0 only, ``None`` elsewhere).

        Every rank must call ``run``. ``callback(index, h, y, result)`` is called on every
        stage after each batch (``result`` is the last stage's ``(logits, loss)``, else
        ``None``). Returns the number of batches this stage trained on.
        """
        return self._stream(batches, _TRAIN, lr, callback)

    def _stage0_batches(self, data: Any, batch_size: int, shuffle: bool, generator: torch.Generator | None) -> Any:
        return self.trainer.batches(data, batch_size, shuffle, generator) if self.is_first else None

    def fit(self, train: Any, epochs: int = 1, eval: Any = None, *, batch_size: int = 256, shuffle: bool = True,
            seed: int | None = 0, progress: bool = True, checkpoint_dir: str | os.PathLike[str] | None = None,
            checkpoint_every: int | None = None, keep_last: int = 2, resume: bool = False) -> list[dict[str, float]]:
        """Pipelined ``DADTrainer.fit``: same batches, same result; records are returned on every rank.

        ``train``/``eval`` matter on rank 0 only (pass ``None`` elsewhere). Records hold
        ``epoch, loss, train_s, img_per_s`` (+ ``accuracy, eval_loss`` with ``eval``).
        ``checkpoint_dir`` (the same folder, shared by every rank), ``checkpoint_every``, ``keep_last``
        and ``resume`` work as in ``DADTrainer.fit``: every ``checkpoint_every`` steps the stages drain,
        each writes its shard and rank 0 a manifest (:mod:`~torch_dad.training.shards`); ``resume=True``
        continues from the newest complete checkpoint, bitwise on CPU.
        """
        folder = check_fit_arguments(epochs, None, checkpoint_dir, checkpoint_every, keep_last, resume,
                                     batch_size=batch_size, make_folder=self._checkpoint_folder)
        if self.is_first and train is None:
            raise ValueError("stage 0 reads the data: pass train= on rank 0")
        trainer = self.trainer
        args = {"epochs": epochs, "batch_size": batch_size, "seed": seed, "shuffle": shuffle}
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else seed)
        run = start_fit(folder, resume, args, generator, history_length=len(trainer.history),
                        step_count=trainer.step_count, device=trainer.device, load=trainer.restore,
                        announce=progress and self.is_first)
        for epoch in range(run.epoch, epochs):
            generator.set_state(run.generator_state)
            batches = None
            if self.is_first:
                batches = itertools.islice(trainer.batches(train, batch_size, shuffle, generator), run.batches, None)
                batches = progress_bar(batches, progress, desc=f"epoch {epoch + 1}/{epochs}")
            self._train_epoch(batches, run, folder)
            seconds = run.seconds
            record = {"epoch": float(len(trainer.history) + 1), "loss": float(run.loss_sum) / max(run.batches, 1),
                      "train_s": seconds, "img_per_s": run.seen / seconds if seconds > 0 else float("nan")}
            metrics = self.evaluate(eval if self.is_first else None, batch_size=batch_size)
            if metrics is not None:
                record["accuracy"], record["eval_loss"] = metrics["accuracy"], metrics["loss"]
            trainer.history.append(self._from_last(record))
            end_epoch(run, generator, folder, epoch, epochs, trainer.step_count, trainer.state_dict)
        if folder is not None:
            folder.flush()
        return trainer.history[run.history_start :]

    def _train_epoch(self, batches: Iterable[tuple[Tensor, Tensor]] | None, run: FitProgress,
                     folder: ShardedFolder | None) -> None:
        """Stream ``batches`` (stage 0) in segments that end where a checkpoint is due; after each segment
        every stage has drained, and the checkpoint is written."""
        due = folder.due if folder is not None else (lambda step: False)
        source = iter(batches) if batches is not None else None

        def tally(_: int, h: Tensor, y: Tensor, result: Any) -> None:
            run.batches += 1
            run.seen += y.shape[0]
            if result is not None:
                run.loss_sum += result[1]

        def segment(first: tuple[Tensor, Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
            yield first
            while not due(self.trainer.step_count) and (item := next(source, None)) is not None:  # type: ignore[arg-type]
                yield item

        while True:
            first = next(source, None) if source is not None else None
            if not self._from_first(first is not None):
                return
            self._sync()
            start = time.perf_counter()
            self.run(segment(first) if first is not None else None, callback=tally)
            self._sync()
            run.seconds += time.perf_counter() - start
            if folder is not None and due(self.trainer.step_count):
                folder.save(self.trainer.step_count, run.checkpoint(self.trainer.state_dict()))

    def _checkpoint_folder(self, folder: Path, every: int | None, keep_last: int) -> ShardedFolder:
        """One shard per stage: its layers (the last stage also the classifier, stage 0 the input sample)."""
        model = self.trainer.model
        names = {id(module): name for name, module in model.named_modules()}
        owners = {f"trainer.model.{names[id(layer)]}.": stage
                  for stage, (start, stop) in enumerate(self.bounds) for layer in model.dad_layers[start:stop]}
        classifier = model.get_classifier()
        last = self.num_stages - 1
        if classifier is not None:
            owners[f"trainer.model.{names[id(classifier)]}."] = last
        owners.update({"trainer.classifier_state.": last, "trainer.classifier_statistics.": last, "fit.": -1})

        def owner(key: str) -> int | None:
            stage = next((s for prefix, s in owners.items() if key.startswith(prefix)), 0)
            return None if stage < 0 else stage

        layout = {"mode": "pipeline", "world_size": self.num_stages, "bounds": [list(b) for b in self.bounds]}
        return ShardedFolder(folder, every, keep_last, group=self._control, layout=layout, owner=owner,
                             shared_from=None, live=lambda: {"trainer": self.trainer.state_dict()})

    def _sync(self) -> None:
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)
        dist.barrier(group=self._control)

    def _from_last(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(self.num_stages - 1), group=self._control)
        return box[0]

    def _forward(self, data: Any, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        """This stage's ``(output, labels)`` for each batch of rank 0's ``data``, streamed through the
        stages in eval mode (no update; the rows never enter the input sample). Exhaust it on every rank."""
        model = self.trainer.model
        was_training = model.training
        model.eval()
        try:
            for h, y, _ in self._outputs(self._stage0_batches(data, batch_size, False, None), _FORWARD, None):
                yield h, y
        finally:
            model.train(was_training)

    @torch.no_grad()
    def evaluate(self, data: Any, *, batch_size: int = 1024) -> dict[str, float] | None:
        """Pipelined ``DADTrainer.evaluate`` (rank 0 passes the data, ``None`` elsewhere; every rank calls).

        The last stage scores ``model.classifier`` (or the last layer's local head) with the metrics of
        one process: per labelled token for token labels ``(batch, T)``, ``samples`` counting the tokens.
        Returns the metrics on every rank, or ``None`` on all ranks when rank 0 passed ``None``.
        """
        if not self._from_first(data is not None):
            return None
        outputs = self._forward(data, batch_size)
        metrics: dict[str, float] | str | None = None
        if self.is_last:
            head, last = self.trainer.model.get_classifier(), self.layers[-1]
            pairs = ((head(h.flatten(1)) if head is not None else last.local_head(h), y) for h, y in outputs)
            try:
                metrics = classification_metrics(pairs, self.trainer.device)
            except ValueError as err:  # no batch or no labelled token: the same error on every rank
                metrics = str(err)
        else:
            for _ in outputs:
                pass
        metrics = self._from_last(metrics)
        if isinstance(metrics, str):
            raise ValueError(metrics)
        return metrics

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
        same way (then reset), or, with ``classifier_sample_size=0``, the last stage solves from
        the Gram statistics it accumulated while training. A model without ``classifier`` (token
        labels ``(batch, T)``) raises ``ValueError`` on every rank before anything is streamed.
        """
        trainer = self.trainer
        classifier = trainer.require_classifier()  # the same model on every rank: all raise or none
        from_sample = data is None and self._sampled
        if from_sample:
            sample = trainer.classifier_sample
            rows = self._from_first(sample.size if self.is_first and sample is not None else 0)
            if rows == 0:
                raise ValueError("solve_head(): stage 0 has sampled no rows yet; train first, or pass data=")
            if self.is_first and sample is not None:
                data = list(sample.batches())
        streamed = self._from_first(data is not None)
        solution = None
        if streamed:
            stats = GramAccumulator(classifier.in_features, classifier.out_features, device=trainer.device)
            for h, y in self._forward(data, batch_size):
                if self.is_last:
                    stats.update(h.flatten(1), y)
            if self.is_last:
                solution = trainer.solve_head(lambda_reg, statistics=stats)
            if self._from_first(self.is_first and reiterable(data)):
                self._calibrate(data, batch_size)
        elif self.is_last:
            solution = trainer.solve_head(lambda_reg)
        if from_sample and trainer.classifier_sample is not None:
            trainer.classifier_sample.reset()
        return solution

    def _calibrate(self, data: Any, batch_size: int) -> None:
        """Stream ``data`` once more and calibrate the solved classifier on the last stage's outputs,
        as :meth:`DADTrainer.solve_head` does on one process."""
        trainer, logits, labels = self.trainer, [], []
        for h, y in self._forward(data, batch_size):
            if self.is_last and trainer.classifier is not None:
                logits.append(trainer.classifier.linear(h.flatten(1)).float())
                labels.append(y)
        if self.is_last and trainer.classifier is not None and logits:
            trainer.classifier.calibrate_logits(torch.cat(logits), torch.cat(labels))

    @torch.no_grad()
    def synchronize(self) -> None:
        """Copy every stage's layers (and the last stage's classifier state) to all ranks.

        Afterwards ``trainer.state_dict()`` on any rank is the whole trained model, as a
        sequential run would have left it.
        """
        trainer = self.trainer
        for stage, (start, stop) in enumerate(self.bounds):
            for layer in trainer.model.dad_layers[start:stop]:
                broadcast(list(layer.state_dict().values()), stage, self.process_group)
        rest: list[Tensor] = []
        classifier = trainer.model.get_classifier()
        if classifier is not None:
            rest += list(classifier.state_dict().values())
        if trainer.classifier is not None:
            rest += trainer.classifier.buffers()
        broadcast(rest, self.num_stages - 1, self.process_group)
        trainer.set_step_count(int(self._from_last(trainer.step_count)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """:meth:`synchronize`, then ``torch.save(trainer.state_dict(), path)`` on rank 0 only."""
        self.synchronize()
        if self.stage == 0:
            torch.save(self.trainer.state_dict(), path)
        dist.barrier(group=self._control)
