"""The parts of :meth:`DADTrainer.fit <torch_dad.DADTrainer.fit>` that read no trainer internals: its
argument checks, its starting point (fresh or resumed) and the loop over one epoch's batches."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from .._checks import check_bool, check_positive_int
from . import checkpoint
from .checkpoint import FitProgress

__all__ = ["RunFolder", "check_fit_arguments", "end_epoch", "epoch_end_saved", "start_fit", "train_epoch"]


class RunFolder(Protocol):
    """Where ``fit`` keeps a run's checkpoints: one process's files
    (:class:`~torch_dad.training.checkpoint.CheckpointFolder`) or one shard per rank
    (:class:`~torch_dad.training.shards.ShardedFolder`)."""

    every: int | None

    def due(self, step: int) -> bool: ...
    def save(self, step: int, state: Any) -> Path: ...
    def flush(self) -> None: ...
    def newest(self) -> tuple[Path, Any] | None: ...
    def check_fresh_start(self, step: int) -> None: ...
    def remove_temporaries(self) -> None: ...


Folder = TypeVar("Folder", bound=RunFolder)


def epoch_end_saved(folder: RunFolder, epoch: int, epochs: int) -> bool:
    """Whether ``fit`` saves after epoch ``epoch``: at every epoch end without ``checkpoint_every``, else
    only at the last (the due steps are saved inside the epochs)."""
    return folder.every is None or epoch == epochs - 1


def end_epoch(run: FitProgress, generator: torch.Generator, folder: RunFolder | None, epoch: int, epochs: int,
              step_count: int, state_dict: Callable[[], dict[str, Any]]) -> None:
    """After epoch ``epoch``'s record: move ``run`` to the next epoch, then save if :func:`epoch_end_saved`."""
    run.next_epoch(generator.get_state())
    if folder is not None and epoch_end_saved(folder, epoch, epochs):
        folder.save(step_count, run.checkpoint(state_dict()))


def check_fit_arguments(
    epochs: object, schedule: object, checkpoint_dir: object, checkpoint_every: object, keep_last: object,
    resume: object, *, batch_size: object, make_folder: Callable[[Path, int | None, int], Folder],
) -> Folder | None:
    """Validate ``fit``'s arguments before anything changes; ``make_folder(path, every, keep_last)`` or ``None``."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be a positive int")
    check_positive_int("batch_size", batch_size)
    if schedule is not None and not callable(schedule):
        raise TypeError(f"schedule must be a callable step -> lr, got {type(schedule).__name__}")
    check_bool("resume", resume)
    every = None if checkpoint_every is None else check_positive_int("checkpoint_every", checkpoint_every)
    keep = check_positive_int("keep_last", keep_last)
    if checkpoint_dir is None:
        if resume or every is not None:
            raise ValueError(
                f"{'resume=True' if resume else f'checkpoint_every={every}'} needs checkpoint_dir= (the folder "
                "that holds the checkpoints)"
            )
        return None
    return make_folder(checkpoint.check_folder(checkpoint_dir), every, keep)


def train_epoch(
    step: Callable[..., tuple[Tensor, Tensor]], step_count: Callable[[], int],
    bar: Any, *, log_every: int, schedule: Callable[[int], float] | None, run: FitProgress,
    device: torch.device, save: Callable[[], object] | None = None, due: Callable[[int], bool] | None = None,
) -> dict[str, float]:
    """``step(x, y, lr)`` over ``bar``, continuing ``run``'s totals, and ``save()`` whenever
    ``due(step_count())``: ``{loss, train_s, img_per_s}``. Checkpoint writes are not counted in ``train_s``."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for inputs, labels in bar:
        _, loss = step(inputs, labels, lr=None if schedule is None else schedule(step_count()))
        run.loss_sum += loss
        run.batches += 1
        run.seen += inputs.shape[0]
        if run.batches % log_every == 0:
            mean_loss = float(run.loss_sum) / run.batches
            if mean_loss != mean_loss or mean_loss in (float("inf"), float("-inf")):
                raise FloatingPointError(
                    f"training loss became non-finite by step {step_count()}; lower lr, or use "
                    "amp_dtype=torch.bfloat16 instead of float16"
                )
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{mean_loss:.4f}")
        if save is not None and due is not None and due(step_count()):
            # no device sync: the snapshot is queued behind the step on its stream, and the device keeps
            # working while this thread hands the save over; only the handover's host time is left out
            run.seconds += time.perf_counter() - start
            save()
            start = time.perf_counter()
    synchronize()
    run.seconds += time.perf_counter() - start
    return {
        "loss": float(run.loss_sum) / max(run.batches, 1),
        "train_s": run.seconds,
        "img_per_s": run.seen / run.seconds if run.seconds > 0 else float("nan"),
    }


def start_fit(
    folder: RunFolder | None, resume: bool, args: dict[str, Any], generator: torch.Generator, *,
    history_length: int, step_count: int, device: torch.device, load: Callable[[dict[str, Any], str], None],
    announce: bool,
) -> FitProgress:
    """The starting point of ``fit``: the newest intact checkpoint's progress with ``resume`` (its
    trainer state handed to ``load(state, path)``), else a fresh one. ``announce`` prints where it resumed."""
    fresh = FitProgress(args, history_length, generator.get_state(), torch.zeros((), device=device))
    if folder is None:
        return fresh
    found = folder.newest() if resume else None
    if found is None:
        folder.check_fresh_start(step_count)
        folder.remove_temporaries()
        return fresh
    path, state = found
    if not isinstance(state, dict) or state.get("fit") is None:
        raise ValueError(f"resume=True: {path} holds no fit() progress (written by save_checkpoint?)")
    run = FitProgress.from_state(state["fit"], path, device)
    run.check_args(args, path)
    load(state["trainer"], str(path))
    folder.remove_temporaries()
    if announce:
        trainer_state = state["trainer"]
        print(f"resumed from {path}: step {trainer_state['step_count']}, epoch {run.epoch + 1}, "
              f"batch {run.batches} of that epoch done", file=sys.stderr)
    return run
