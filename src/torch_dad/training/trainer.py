"""``DADTrainer``: validation, the decoupled training step, fit/evaluate, the closed-form classifier, checkpoints."""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import check_device, check_fraction, check_int, check_positive_int
from ..backends import check_backend
from ..nn._local import LocalLayer
from ..nn.linear import DADLinear, DADModel
from ..optim import OptimizerConfig, check_optimizer, warn_if_large_lr
from ..ridge import GramAccumulator, RidgeSolution
from . import batches, checkpoint
from .batches import as_batch_pair, classification_metrics, iterate_batches, prepare_batch_tensors, reiterable
from .checkpoint import CheckpointFolder
from .classifier import OutputClassifier
from .eager import EagerRunner
from .fit import RunFolder, check_fit_arguments, end_epoch, start_fit, train_epoch
from .options import EngineOptions
from .step import Batch, Dropout, GradientReducer, RunningLoss, StepOutput, StepPlan, StepRunner, progress_bar

if TYPE_CHECKING:
    from .engine import FusedStep

__all__ = ["BACKENDS", "DADTrainer", "as_batch_pair"]

_AMP_DTYPES = (torch.bfloat16, torch.float16)
#: ``DADTrainer(backend=...)``: a subset of :data:`torch_dad.backends.BACKENDS`
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "cuda-graph")


def _resolve_device(device: torch.device | str | None, model: nn.Module) -> torch.device:
    """``device`` checked by :func:`~torch_dad._checks.check_device`, or the model's device when ``None``."""
    if device is None:
        first = next(iter(model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    return check_device(device)


def _check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(repr(c) for c in choices)}")


def _check_amp(amp_dtype: torch.dtype | None, name: str, device: torch.device) -> None:
    if amp_dtype is None or amp_dtype == torch.float32:
        return
    if amp_dtype not in _AMP_DTYPES:
        raise ValueError(f"{name}={amp_dtype!r}: use torch.bfloat16, torch.float16 or None")
    if amp_dtype == torch.float16 and device.type == "cpu":
        raise ValueError(f"{name}=torch.float16 is not supported on CPU; use torch.bfloat16")


def _check_options(
    *, on_nonfinite: object, check_values: object, local_loss: str | None, dropout: object, dropout_seed: object,
    classifier_sample_size: object, accumulate_classifier_statistics: object, amp_dtype: torch.dtype | None,
    device: torch.device, backend: str, engine_options: object,
) -> None:
    """The checks of :class:`DADTrainer`'s keyword options that need no model."""
    _check_amp(amp_dtype, "amp_dtype", device)
    _check_choice("on_nonfinite", on_nonfinite, ("raise", "skip", "ignore"))
    _check_choice("check_values", check_values, (True, False, "auto"))
    _check_choice("accumulate_classifier_statistics", accumulate_classifier_statistics, (True, False, "auto"))
    if local_loss is not None:
        functional.check_local_loss(local_loss)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r} must be a float in [0, 1)")
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**63:
        raise ValueError(f"dropout_seed={dropout_seed!r} must be an int in [0, 2**63)")
    if isinstance(classifier_sample_size, bool) or not isinstance(classifier_sample_size, int) or classifier_sample_size < 0:
        raise ValueError(f"classifier_sample_size={classifier_sample_size!r} must be an int >= 0 (0 disables the sample)")
    if engine_options is not None:
        if backend == "torch" or (backend == "auto" and device.type != "cuda"):
            raise ValueError("engine_options apply to backend='triton' or 'cuda-graph'; drop them or pick one")
        if not isinstance(engine_options, EngineOptions):
            raise TypeError(f"engine_options must be a torch_dad.training.EngineOptions, got {type(engine_options).__name__}")


def _check_layers(model: DADModel, layers: list[LocalLayer], local_loss: str | None) -> None:
    """Every layer's class count is the model's, the classifier reads the last layer, and every layer
    implements ``local_loss``."""
    for layer in layers:
        if layer.num_classes != model.num_classes:
            raise ValueError(
                f"every DADLinear must have num_classes={model.num_classes} (the classifier's), but {layer!r} has "
                f"{layer.num_classes}"
            )
        if local_loss is not None and local_loss not in layer.local_losses:
            raise ValueError(f"local_loss={local_loss!r}: {type(layer).__name__} implements "
                             f"{', '.join(repr(r) for r in layer.local_losses)} only")
    classifier = model.get_classifier()
    batches.check_token_model(layers, classifier is not None)
    # a convolution's or block's flattened output size depends on the input: the classifier's own
    # shape check reports it at the first step
    last = layers[-1]
    if classifier is not None and isinstance(last, DADLinear) and classifier.in_features != last.out_features:
        raise ValueError(
            f"model.classifier takes {classifier.in_features} features but the last DADLinear gives {last.out_features}"
        )


def _make_runner(
    backend: str, options: EngineOptions | None, model: DADModel, layers: list[LocalLayer], device: torch.device,
    config: OptimizerConfig, on_nonfinite: str, classifier: OutputClassifier | None, running: RunningLoss,
) -> tuple[StepRunner, bool]:
    """The step runner ``backend`` resolves to on this device and model, and whether it is the fused one."""
    cuda = device.type == "cuda"
    names = {id(module): f"model.{name}" for name, module in model.named_modules()}
    eager = EagerRunner(layers, classifier, running, backend="torch", guard=on_nonfinite != "ignore", names=names,
                        device=device)
    if backend == "torch" or (backend == "auto" and not cuda):
        return eager, False
    from ..kernels import triton_available
    from .engine import FusedStep, unsupported_reason  # the CPU's default never imports the engine

    reason = unsupported_reason(model, config)
    if backend == "auto" and (reason is not None or not triton_available()):
        return eager, False
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this model: {reason}; use backend='torch'")
    if backend == "cuda-graph" and not cuda:
        raise ValueError(f"backend='cuda-graph' needs a CUDA device, got {device}; use 'triton' or 'torch'")
    if on_nonfinite != "ignore":
        warnings.warn(
            f"backend={backend!r} with on_nonfinite={on_nonfinite!r}: the fused step has no per-layer non-finite "
            "guard, so step() runs the eager layer loop. Pass on_nonfinite='ignore' (or check_values=False) to "
            "run the fused step", UserWarning, stacklevel=4,
        )
        return eager, False
    fused = FusedStep(model, device, options or EngineOptions(), graphed=backend != "triton", classifier=classifier,
                      running_loss=running)
    return fused, True


def _make_classifier(
    model: DADModel, layers: list[LocalLayer], sample_size: int, accumulate: bool | str, window: float | None,
    label_smoothing: float,
) -> OutputClassifier | None:
    """The model's classifier as an :class:`OutputClassifier` (``None`` without one); the sample of a
    dense first layer's rows is made here, a convolution's or block's at its first batch."""
    linear = model.get_classifier()
    if linear is None:
        return None
    statistics = sample_size == 0 if accumulate == "auto" else bool(accumulate)
    classifier = OutputClassifier(linear, sample_size=sample_size, statistics=statistics, window=window,
                                  label_smoothing=label_smoothing)
    if isinstance(layers[0], DADLinear):
        classifier.ensure_sample((layers[0].in_features,), layers[0].master_dtype)
    return classifier


def _nonfinite_message(where: str, step: int) -> str:
    return (f"non-finite local gradients in {where} at step {step} (lr too high, or half-precision overflow?); "
            "nothing was updated in this step (no layer, no classifier). Lower lr, or pass "
            "DADTrainer(on_nonfinite='skip') to skip and count such steps")


def _classifier_part(name: str) -> Any:
    """A read-only trainer property for ``trainer.classifier.<name>`` (``None`` without a classifier)."""
    return property(lambda self: getattr(self.classifier, name) if self.classifier is not None else None,
                    doc=f"``classifier.{name}`` (``None`` without a classifier).")


class DADTrainer:
    """Trains a :class:`~torch_dad.DADModel` layer by layer from local targets.

    ``step(x, y)`` runs, for each DAD layer in order (:class:`~torch_dad.DADLinear`,
    :class:`~torch_dad.DADConv2d`, :class:`~torch_dad.DADBlock`, in any mix): forward, local error,
    in-place update; only the current layer's activations are alive. A model's ``classifier``
    (``nn.Linear``) is trained as an output head by :attr:`classifier`
    (:class:`~torch_dad.training.classifier.OutputClassifier`), which keeps what :meth:`solve_head` needs.

    Args:
        model: the ``DADModel`` to train (moved to ``device``).
        device: ``"cuda"``, ``torch.device(...)`` or ``None`` for the model's device.
        lr, weight_decay, optimizer, betas, eps, momentum: the local optimizer
            (``"adamw"``: decoupled weight decay as ``torch.optim.AdamW``; ``"sgd"``: momentum).
        amp_dtype: default compute dtype of :meth:`step` (bf16/fp16 on CUDA, bf16 on CPU); master
            weights stay float32.
        accumulate_classifier_statistics: accumulate the classifier's float64 Gram statistics
            (``in_features²``) in ``step``; ``"auto"``: only when ``classifier_sample_size=0``.
        classifier_statistics_window: forget statistics older than about this many samples
            (features from stale weights hurt the solve); ``None`` keeps all since the last solve.
        classifier_sample_size: rows of the input sample ``step`` keeps for ``solve_head()``, which
            recomputes their features with the current weights; ``0`` solves from the statistics.
        check_values: check label ranges and finite inputs in ``step`` (a host sync on CUDA, so
            ``"auto"`` checks on CPU only). Shapes and dtypes are always checked.
        on_nonfinite: on NaN/Inf local gradients (checked when values are): ``"raise"``
            (``FloatingPointError``; nothing of the step is applied), ``"skip"`` (likewise, counted
            in ``skipped_updates``) or ``"ignore"``.
        backend: from :data:`torch_dad.backends.BACKENDS`: ``"torch"`` (the eager reference loop),
            ``"triton"`` (the fused step op by op: Triton kernels on CUDA, their twins on CPU),
            ``"cuda-graph"`` (the fused step captured per input shape) or ``"auto"`` (``"cuda-graph"``
            on CUDA where supported, else ``"torch"``); ``"eager"``/``"fused"`` are former names.
            Resolved once, here; with ``on_nonfinite`` other than ``"ignore"`` the guarded eager
            loop runs instead of the fused step, with a warning.
        engine_options: a :class:`~torch_dad.training.EngineOptions` tuning the fused step.
        local_loss: ``"ce"``, ``"predsim"`` or ``"drtp"`` for every layer; ``None`` keeps each layer's.
        dropout: drop each hidden output with this probability in ``step`` (scaled as
            ``nn.Dropout``), with masks that are a pure function of ``(dropout_seed, step_count,
            layer, element)``: the same in every backend and after a resume.
        dropout_seed: the Philox key of the dropout masks, an int in ``[0, 2**63)``.
        classifier_label_smoothing: label smoothing of the classifier's online cross-entropy.
    """

    def __init__(
        self,
        model: DADModel,
        device: torch.device | str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        optimizer: str = "adamw",
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.9,
        amp_dtype: torch.dtype | None = None,
        accumulate_classifier_statistics: bool | str = "auto",
        classifier_statistics_window: float | None = 10_000,
        classifier_sample_size: int = 4096,
        check_values: bool | str = "auto",
        on_nonfinite: str = "raise",
        backend: str = "auto",
        engine_options: EngineOptions | None = None,
        local_loss: str | None = None,
        dropout: float = 0.0,
        dropout_seed: int = 0,
        classifier_label_smoothing: float = 0.0,
    ) -> None:
        if not isinstance(model, DADModel):
            raise TypeError(
                f"model must be a torch_dad.DADModel (a subclass declaring DADLinear layers), got {type(model).__name__}"
            )
        layers = model.require_layers()
        backend = check_backend(backend, BACKENDS)
        check_optimizer(optimizer)
        self.device = _resolve_device(device, model)
        label_smoothing = check_fraction("classifier_label_smoothing", classifier_label_smoothing)
        _check_options(
            on_nonfinite=on_nonfinite, check_values=check_values, local_loss=local_loss, dropout=dropout,
            dropout_seed=dropout_seed, classifier_sample_size=classifier_sample_size,
            accumulate_classifier_statistics=accumulate_classifier_statistics, amp_dtype=amp_dtype,
            device=self.device, backend=backend, engine_options=engine_options,
        )
        self.config = OptimizerConfig(name=optimizer, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum)
        _check_layers(model, layers, local_loss)
        # everything is checked: from here on the trainer and the model change
        if local_loss is not None:
            for layer in layers:
                layer.set_local_loss(local_loss)
        # the module walk behind model.local_layers costs microseconds a call: the layout is read once
        self._layers = layers
        self.model = model.to(self.device)
        self.dropout, self.dropout_seed = float(dropout), dropout_seed
        self.amp_dtype = amp_dtype
        self.check_values = (self.device.type == "cpu") if check_values == "auto" else bool(check_values)
        self.on_nonfinite = on_nonfinite if self.check_values else "ignore"
        self.skipped_updates = 0
        self.num_classes = model.num_classes
        #: the model's classifier with its optimizer state, input sample or Gram statistics (``None``: none)
        self.classifier = _make_classifier(model, layers, classifier_sample_size, accumulate_classifier_statistics,
                                           classifier_statistics_window, label_smoothing)
        self.step_count = 0
        self._gradient_reducer: GradientReducer | None = None
        self._statistics_reducer: Callable[[GramAccumulator], None] | None = None
        self._running = RunningLoss(self.device)
        self.history: list[dict[str, float]] = []
        self.backend = backend
        warn_if_large_lr(self.config, stacklevel=2)
        self._runner, self._fused = _make_runner(backend, engine_options, model, layers, self.device, self.config,
                                                 self.on_nonfinite, self.classifier, self._running)

    @property
    def engine(self) -> FusedStep | None:
        """The fused step (:class:`~torch_dad.training.engine.FusedStep`) or ``None`` for the eager loop."""
        return self._runner if self._fused else None  # type: ignore[return-value]

    @property
    def uses_engine(self) -> bool:
        """Whether :meth:`step` runs the fused engine."""
        return self._fused

    def set_reducers(self, gradient_reducer: GradientReducer | None = None,
                     statistics_reducer: Callable[[GramAccumulator], None] | None = None) -> None:
        """Reduce local gradients across processes before they are applied, and the Gram statistics
        before a solve (data parallelism); ``None`` for a single process."""
        for name, value in (("gradient_reducer", gradient_reducer), ("statistics_reducer", statistics_reducer)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        self._gradient_reducer, self._statistics_reducer = gradient_reducer, statistics_reducer

    @property
    def gradient_reducer(self) -> GradientReducer | None:
        """Reduces every local gradient list across processes before it is applied (see :meth:`set_reducers`)."""
        return self._gradient_reducer

    @property
    def statistics_reducer(self) -> Callable[[GramAccumulator], None] | None:
        """Sums the Gram statistics across processes before a solve (see :meth:`set_reducers`)."""
        return self._statistics_reducer

    # the classifier's parts under their former names
    classifier_state = _classifier_part("state")
    classifier_statistics = _classifier_part("statistics")
    classifier_sample = _classifier_part("sample")

    accumulate_classifier_statistics = property(lambda self: self.classifier_statistics is not None,
                                                doc="Whether ``step`` accumulates the classifier's Gram statistics.")
    keeps_input_sample = property(lambda self: self.classifier is not None and self.classifier.keeps_sample,
                                  doc="Whether ``step`` keeps the classifier's input sample.")

    def step(
        self, inputs: Tensor, labels: Tensor, lr: float | None = None, amp_dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """One decoupled training step; returns ``(logits, loss)``, detached, with no host sync: the
        model's outputs under the weights before this step's update, and their cross-entropy.
        ``lr``/``amp_dtype`` override the step's learning rate and compute dtype. Invalid input
        raises before anything is modified."""
        batch = self.prepare_batch(inputs, labels, lr, amp_dtype)
        return self.finish_step(self.train_layers(batch))

    def prepare_batch(
        self, inputs: Tensor, labels: Tensor, lr: float | None = None, amp_dtype: torch.dtype | None = None
    ) -> Batch:
        """Validate a step's arguments and move the batch to the device: a :class:`Batch`."""
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0):
            raise ValueError(f"lr={lr!r} must be a finite float >= 0")
        compute = amp_dtype if amp_dtype is not None else self.amp_dtype
        _check_amp(compute, "amp_dtype", self.device)
        x, y = self._prepare(inputs, labels)
        if self.classifier is not None:
            self.classifier.ensure_sample(tuple(x.shape[1:]), x.dtype)
        if lr is not None:
            warn_if_large_lr(self.config, float(lr), stacklevel=3)
        lr = self.config.lr if lr is None else float(lr)
        return Batch(x, y, lr, None if compute == torch.float32 else compute)

    def _prepare(self, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return prepare_batch_tensors(inputs, labels, self._layers[0], self.device, self.num_classes, self.check_values)

    def train_layers(
        self, batch: Batch, *, span: tuple[int, int] | None = None, with_classifier: bool = True
    ) -> StepOutput:
        """Train DAD layers ``span`` (``[start, stop)``, default all) on ``batch``, then the classifier if
        ``with_classifier`` and the span ends at the last layer, with the runner chosen at construction."""
        count = len(self._layers)
        start, stop = span if span is not None else (0, count)
        if not 0 <= start < stop <= count:
            raise ValueError(f"span={span!r} must be a [start, stop) range of the {count} DAD layers")
        has_classifier = self.classifier is not None
        with_classifier = with_classifier and stop == count and has_classifier
        dropout = Dropout(self.dropout, self.dropout_seed, self.step_count) if self.dropout else None
        plan = StepPlan(start, stop, with_classifier, stop == count and (with_classifier or not has_classifier),
                        self.config, dropout)
        return self._runner.run(batch, plan, self.gradient_reducer)

    def finish_step(self, output: StepOutput) -> tuple[Tensor, Tensor]:
        """Count the step (and, for the model's output, its loss; no host sync): ``(logits, loss)``.
        A guarded step that found non-finite gradients is counted in ``skipped_updates``, and
        raises under ``on_nonfinite="raise"``."""
        if output.nonfinite is not None:
            self.skipped_updates += 1
            if self.on_nonfinite == "raise":
                raise FloatingPointError(_nonfinite_message(output.nonfinite, self.step_count))
        self.step_count += 1
        if output.is_model_output:
            self._running.count()
        return output.logits, output.loss

    def set_step_count(self, step_count: int) -> None:
        """Set the number of steps taken (a pipeline agrees on it across stages)."""
        self.step_count = check_positive_int("step_count + 1", check_int("step_count", step_count) + 1) - 1

    @property
    def running_loss(self) -> float:
        """Mean loss over the steps since the last call (reads the device once)."""
        return self._running.read()

    def reset_classifier_statistics(self) -> None:
        """Forget the Gram statistics and the input sample accumulated by :meth:`step`."""
        if self.classifier is not None:
            self.classifier.reset()

    def require_classifier(self) -> nn.Linear:
        """``model.classifier``; raises ``ValueError`` naming the fix when the model has none."""
        if self.classifier is None:
            raise ValueError(f"solve_head() needs model.classifier; {type(self.model).__name__} has none. "
                             "Add `self.classifier = nn.Linear(features, classes)` (token labels (batch, T): no solve)")
        return self.classifier.linear

    @torch.no_grad()
    def _eval_rows(self, batches: Iterable[Any], outputs: Callable[[Tensor], Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
        """``(outputs(x), y)`` for each batch, in eval mode."""
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in batches:
                x, y = self._prepare(*as_batch_pair(batch))
                yield outputs(x), y
        finally:
            self.model.train(was_training)

    def features_statistics(self, batches: Iterable[tuple[Tensor, Tensor]]) -> GramAccumulator:
        """Gram statistics of ``model.features(x)`` over ``batches``, computed in eval mode."""
        self.require_classifier()
        assert self.classifier is not None
        return self.classifier.statistics_of(self._eval_rows(batches, self.model.features))

    @torch.no_grad()
    def solve_head(
        self, lambda_reg: float | str = "auto", loader: Iterable[tuple[Tensor, Tensor]] | None = None, *,
        statistics: GramAccumulator | None = None,
    ) -> RidgeSolution:
        """Solve ``model.classifier`` in closed form by ridge regression onto one-hot labels
        (``lambda_reg="auto"``: lambda by GCV), from the features of ``loader`` (one no-grad pass),
        from ``statistics``, or else from what ``step()`` kept since the last solve (then reset): the
        input sample's features recomputed with the current weights, or the streamed statistics.
        On one process the solved scores are then calibrated: one positive scale fitted on the
        input sample (or on a re-iterable ``loader``), argmax unchanged, so ``evaluate()``'s loss
        reads as a calibrated model's.
        """
        self.require_classifier()
        out = self.classifier
        assert out is not None
        sample = out.sample if out.sample is not None and out.sample.size > 0 else None
        if statistics is not None:
            stats = statistics
        elif loader is not None:
            stats = self.features_statistics(loader)
        elif sample is not None:
            stats = self.features_statistics(sample.batches())
        elif out.statistics is not None and out.statistics.num_samples > 0:
            stats = out.statistics
        else:
            raise ValueError(
                "solve_head(): nothing to solve from yet: no rows were trained on since the last solve or reset "
                "(the input sample and the Gram statistics are empty); train with step() or fit() first, or pass loader="
            )
        if self.statistics_reducer is not None:
            self.statistics_reducer(stats)
        rows = sample.batches() if sample is not None else loader if reiterable(loader) else None
        # ranks must stay equal: no per-rank calibration under data parallelism
        calibration = None if rows is None or self.statistics_reducer else partial(self._eval_rows, rows, self.model.features)
        solution = out.solve(stats, lambda_reg, calibration)
        if loader is None and statistics is None:
            out.reset()
        return solution

    def batches(
        self, data: Any, batch_size: int, shuffle: bool, generator: torch.Generator | None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """``(x, y)`` batches of ``data`` (see :func:`~torch_dad.training.batches.iterate_batches`)."""
        return iterate_batches(data, batch_size, shuffle, generator)

    def fit(
        self,
        train: Any,
        epochs: int = 1,
        eval: Any = None,
        *,
        batch_size: int = 256,
        shuffle: bool = True,
        seed: int | None = 0,
        progress: bool = True,
        log_every: int = 50,
        schedule: Callable[[int], float] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep_last: int = 2,
        resume: bool = False,
    ) -> list[dict[str, float]]:
        """Train for ``epochs``; returns (and appends to ``self.history``) one record per epoch:
        ``epoch, loss, train_s, img_per_s`` and, with ``eval``, ``accuracy`` / ``eval_loss``.

        ``train``/``eval`` are a pair of tensors ``(X, Y)`` (batched here) or an iterable of batches,
        each a pair ``(x, y)`` or a dict with an input and a label key (see
        :func:`~torch_dad.training.batches.as_batch_pair`). A tqdm bar shows progress if tqdm is
        installed (its loss read every ``log_every`` steps). ``schedule(step_count) -> lr`` sets each
        step's learning rate; ``seed`` draws the data order (``None``: from torch's global generator).

        With ``checkpoint_dir`` the whole training state is written there every ``checkpoint_every``
        steps and at the end of ``fit`` (without ``checkpoint_every``: at each epoch's end), keeping the
        newest ``keep_last``. ``resume=True`` continues from
        the newest intact checkpoint there, mid-epoch included, and says from which file, step and
        epoch (none: it starts from the beginning); on CPU the result is bitwise that of an
        uninterrupted run. An iterable ``train`` must then yield the same batches in the same order.
        Guide: ``docs/checkpoints.md``.
        """
        folder = check_fit_arguments(epochs, schedule, checkpoint_dir, checkpoint_every, keep_last, resume,
                                     batch_size=batch_size, make_folder=self.checkpoint_folder)
        args = {"epochs": epochs, "batch_size": batch_size, "seed": seed, "shuffle": shuffle}
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else seed)
        run = start_fit(folder, resume, args, generator, history_length=len(self.history), step_count=self.step_count,
                        device=self.device, load=self.restore, announce=progress)
        for epoch in range(run.epoch, epochs):
            generator.set_state(run.generator_state)
            batches = itertools.islice(self.batches(train, batch_size, shuffle, generator), run.batches, None)
            bar = progress_bar(batches, progress, desc=f"epoch {epoch + 1}/{epochs}")
            save = None if folder is None else (lambda: folder.save(self.step_count, run.checkpoint(self.state_dict())))
            record = {"epoch": float(len(self.history) + 1), **train_epoch(
                self.step, lambda: self.step_count, bar, log_every=log_every, schedule=schedule, run=run,
                device=self.device, save=save, due=None if folder is None else folder.due,
            )}
            if eval is not None:
                metrics = self.evaluate(eval, batch_size=batch_size)
                record.update(accuracy=metrics["accuracy"], eval_loss=metrics["loss"])
            if hasattr(bar, "close"):
                bar.close()
            self.history.append(record)
            end_epoch(run, generator, folder, epoch, epochs, self.step_count, self.state_dict)
        if folder is not None:
            folder.flush()
        return self.history[run.history_start :]

    def checkpoint_folder(self, folder: Path, every: int | None, keep_last: int) -> RunFolder:
        """Where ``fit(checkpoint_dir=...)`` saves: one file per checkpoint (data parallelism shards it)."""
        if self.gradient_reducer is not None:
            raise ValueError("checkpoint_dir with a gradient_reducer: use DataParallelTrainer, whose fit() shards")
        return CheckpointFolder(folder, every, keep_last)

    def evaluate(self, data: Any, *, batch_size: int = 1024, use_local_head: bool = False) -> dict[str, float]:
        """Accuracy and mean cross-entropy of ``model(x)`` (or the last local head) over ``data``."""
        outputs = self.model.local_head_logits if use_local_head else self.model
        return classification_metrics(self._eval_rows(self.batches(data, batch_size, False, None), outputs), self.device)

    # ------------------------------------------------------------------ checkpoints
    def state_tensors(self) -> list[Tensor]:
        """Every tensor of the trainer's state in a fixed order: model, classifier optimizer, Gram statistics."""
        tensors = list(self.model.state_dict().values())
        if self.classifier is not None:
            tensors += self.classifier.buffers()
        return tensors

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-for-bit: model (with local heads and moments),
        classifier optimizer state, Gram statistics, input sample, step count and hyper-parameters."""
        if self.classifier is not None:
            classifier = self.classifier.state_dict()
        else:
            classifier = {"classifier_state": None, "classifier_statistics": None, "classifier_sample": None}
        return {
            "model": self.model.state_dict(), **classifier, "step_count": self.step_count,
            "dropout_seed": self.dropout_seed, "skipped_updates": self.skipped_updates,
            "config": dict(vars(self.config)), "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        missing = {"model", "classifier_state", "classifier_statistics", "step_count", "config"} - set(state)
        if missing:
            raise ValueError(f"trainer state_dict is missing keys {sorted(missing)}")
        classifier = self.classifier
        if classifier is not None and state["classifier_state"] is None:
            raise ValueError("checkpoint has no classifier state but this model has a classifier")
        self._sample_for(state)
        if classifier is not None and (classifier.sample is None) != (state.get("classifier_sample") is None):
            raise ValueError(
                "checkpoint and trainer disagree on classifier_sample_size (one keeps an input sample, the "
                "other does not); build the trainer with the classifier_sample_size used when saving"
            )
        self.model.load_state_dict(state["model"])
        if classifier is not None:
            classifier.load_state_dict(state)
        config = dict(state["config"])
        config["betas"] = tuple(config["betas"])
        self.config = OptimizerConfig(**config)
        self.step_count = int(state["step_count"])
        self.dropout_seed = int(state.get("dropout_seed", self.dropout_seed))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.history = list(state.get("history", []))
        self._runner.refresh()

    def _sample_for(self, state: dict[str, Any]) -> bool:
        """Make the input sample that ``state`` holds if this trainer has not made it yet (a convolution
        or block makes it at its first batch); True if it did."""
        saved = state.get("classifier_sample")
        inputs = saved.get("inputs") if isinstance(saved, dict) else None
        if self.classifier is None or not isinstance(inputs, Tensor):
            return False
        return self.classifier.ensure_sample(tuple(inputs.shape[1:]), inputs.dtype)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` to ``path`` as one safetensors file (tensors; the rest as JSON in its
        metadata, with a sha256 of the whole), atomically: see ``docs/checkpoints.md``."""
        checkpoint.write(path, {"trainer": self.state_dict(), "fit": None})

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` or by ``fit(checkpoint_dir=...)``.

        No code runs on load (no pickle). Raises ``ValueError`` naming the file and the fault when it is
        truncated or corrupted, and naming each difference (``"model.l1.weight: checkpoint (512, 784),
        model (256, 784)"``) when it was written for another model or configuration; the trainer is then
        unchanged.
        """
        state = checkpoint.read(path)
        if not isinstance(state, dict) or not isinstance(state.get("trainer"), dict):
            raise checkpoint.CheckpointError(f"{path} holds no trainer state")
        self.restore(state["trainer"], path)

    def restore(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """:meth:`load_state_dict` after checking every tensor's presence, shape and dtype; on any failure
        the previous state is put back."""
        if self.classifier_statistics is None:
            state = {**state, "classifier_statistics": None}  # statistics this trainer does not keep
        made = self._sample_for(state)
        problems = checkpoint.mismatches(self.state_dict(), state)
        if problems:
            if made and self.classifier is not None:
                self.classifier.discard_sample()
            raise ValueError(f"checkpoint {path} does not match this trainer: " + "; ".join(problems))
        checkpoint.load_or_roll_back(self.state_dict(), self.load_state_dict, state)
