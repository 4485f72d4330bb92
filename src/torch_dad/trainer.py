"""``DADTrainer``: the one-line decoupled training step, fit/evaluate, closed-form head, checkpoints."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from . import functional as F
from .layers import DADLinear, DADModel, LocalStepResult, check_inputs, check_labels, gradients_are_finite
from .optim import LocalOptimizerState, OptimizerConfig, check_optimizer
from .ridge import GramAccumulator, InputReservoir, RidgeSolution

__all__ = ["DADTrainer"]

_AMP_DTYPES = (torch.bfloat16, torch.float16)


def _resolve_device(device: torch.device | str | None, model: nn.Module) -> torch.device:
    if device is None:
        first = next(iter(model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device={device!r} is not a valid torch device string ({err})") from None
    if isinstance(device, torch.device):
        return device
    raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")


class DADTrainer:
    """Trains a :class:`~torch_dad.DADModel` layer by layer from local targets.

    ``step(x, y)`` runs, for each DAD layer in order: forward, local error, in-place update;
    only the current layer's activations are alive. If the model has a ``classifier``
    (``nn.Linear``), it is trained as an output head (its gradient is exactly backprop's for
    that layer) and its input features are accumulated into float64 Gram statistics for
    :meth:`solve_head`.

    Args:
        model: the ``DADModel`` to train (moved to ``device``).
        device: ``"cuda"``, ``torch.device(...)`` or ``None`` for the model's device.
        lr, weight_decay, optimizer, betas, eps, momentum: the local optimizer
            (``"adamw"``: decoupled weight decay as ``torch.optim.AdamW``; ``"sgd"``: momentum).
        amp_dtype: default compute dtype for :meth:`step` (``torch.bfloat16`` / ``torch.float16``
            on CUDA, ``torch.bfloat16`` on CPU); master weights stay float32.
        accumulate_head_statistics: accumulate the classifier's streamed Gram statistics in
            ``step``. ``"auto"``: only when ``head_sample_size=0``, since ``solve_head()`` then
            needs them; otherwise it solves from the input sample and the streamed GEMM
            would be wasted (on fmnist-wide-2 it was 228 of a 603 us H200 step at B=1024).
        head_statistics_window: forget statistics older than about this many samples
            (exponential decay), because features from early, stale weights hurt the solve.
            Measured on MNIST, seed model, 3 epochs: window 10k gives 97.22% after
            ``solve_head()``, 30k 97.07%, no forgetting 96.90% (local head: 96.93%).
            ``None`` keeps every sample since the last solve/reset.
        head_sample_size: ``step`` also keeps a uniform random sample of this many input rows
            (:class:`~torch_dad.ridge.InputReservoir`, no host sync) since the last solve/reset;
            ``solve_head()`` without a loader recomputes their features with the current
            weights and solves from those (streamed statistics mix in stale features: on real
            MNIST, 3 epochs, 2 seeds, 98.03%/97.84% against 97.20%/97.11% for the streamed
            statistics and 96.61%/97.06% for the last local head). ``0`` solves from the
            streamed Gram statistics instead.
        check_values: check label ranges and finiteness of inputs in ``step``. These checks
            read the tensors, which is free on CPU but a host sync on CUDA, so ``"auto"``
            checks on CPU only. Shapes and dtypes are always checked.
        on_nonfinite: what to do when a layer's local gradients contain NaN/Inf (e.g. a huge
            lr, or fp16 overflow): ``"raise"`` (``FloatingPointError``; that layer is not
            updated), ``"skip"`` (the update is skipped and counted in
            ``skipped_updates``), or ``"ignore"``. Checked whenever value checks are on
            (see ``check_values``); on CUDA without them, :meth:`fit` still raises when
            the running loss it reads every ``log_every`` steps is not finite.
        backend: how :meth:`step` runs (see :mod:`torch_dad.engine`): ``"eager"`` (reference
            PyTorch), ``"fused"`` (Triton kernels on CUDA, their twins on CPU),
            ``"cuda-graph"`` (the fused step captured per input shape) or ``"auto"``
            (``"cuda-graph"`` on CUDA where supported, else ``"eager"``). The fused step has
            no per-layer non-finite guard: with ``on_nonfinite`` other than ``"ignore"`` (the
            CPU default), ``step`` runs the eager loop, and a warning says so.
        local_loss: ``"ce"``, ``"predsim"`` or ``"drtp"`` sets every layer's local rule
            (:meth:`DADLinear.set_local_loss`); ``None`` keeps each layer's own.
        dropout: in ``step``, drop each hidden output with this probability (scaled by
            ``1/(1-p)``, as ``nn.Dropout``) before the next layer and the classifier (and its
            Gram statistics) see it; never at inference. Off by default (measurements:
            ``docs/benchmarks-accuracy.md``).
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
        accumulate_head_statistics: bool | str = "auto",
        head_statistics_window: float | None = 10_000,
        head_sample_size: int = 4096,
        check_values: bool | str = "auto",
        on_nonfinite: str = "raise",
        backend: str = "auto",
        local_loss: str | None = None,
        dropout: float = 0.0,
    ) -> None:
        if not isinstance(model, DADModel):
            raise TypeError(
                f"model must be a torch_dad.DADModel (a subclass declaring DADLinear layers), "
                f"got {type(model).__name__}"
            )
        layers = model._require_layers()
        if backend not in ("auto", "eager", "fused", "cuda-graph"):
            raise ValueError(f"backend={backend!r} must be one of 'auto', 'eager', 'fused', 'cuda-graph'")
        check_optimizer(optimizer)
        self.device = _resolve_device(device, model)
        self._check_amp(amp_dtype, "amp_dtype")
        if on_nonfinite not in ("raise", "skip", "ignore"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'raise', 'skip' or 'ignore'")
        if check_values not in (True, False, "auto"):
            raise ValueError(f"check_values={check_values!r} must be True, False or 'auto'")
        if local_loss is not None:
            F.check_local_loss(local_loss)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be a float in [0, 1)")
        self.dropout = float(dropout)
        self.config = OptimizerConfig(
            name=optimizer, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum
        )
        if local_loss is not None:
            for layer in layers:
                layer.set_local_loss(local_loss)
        self.model = model.to(self.device)
        self.amp_dtype = amp_dtype
        self.check_values = (self.device.type == "cpu") if check_values == "auto" else bool(check_values)
        if accumulate_head_statistics not in (True, False, "auto"):
            raise ValueError(
                f"accumulate_head_statistics={accumulate_head_statistics!r} must be True, False or 'auto'"
            )
        if accumulate_head_statistics == "auto":
            accumulate_head_statistics = head_sample_size == 0
        self.accumulate_head_statistics = bool(accumulate_head_statistics)
        self.on_nonfinite = on_nonfinite if self.check_values else "ignore"
        self.skipped_updates = 0
        self.num_classes = model.num_classes
        for layer in layers:
            if layer.num_classes != self.num_classes:
                raise ValueError(
                    f"every DADLinear must have num_classes={self.num_classes} (the classifier's), "
                    f"but {layer!r} has {layer.num_classes}"
                )
        head = model.head
        self.head_state: LocalOptimizerState | None = None
        self.head_statistics: GramAccumulator | None = None
        self.head_sample: InputReservoir | None = None
        if head is not None:
            if head.in_features != layers[-1].out_features:
                raise ValueError(
                    f"model.classifier takes {head.in_features} features but the last DADLinear "
                    f"gives {layers[-1].out_features}"
                )
            shapes = [p.shape for p in self._head_tensors()]
            self.head_state = LocalOptimizerState(shapes, device=self.device, dtype=head.weight.dtype)
            self.head_statistics = GramAccumulator(
                head.in_features, head.out_features, device=self.device, window=head_statistics_window
            )
            if isinstance(head_sample_size, bool) or not isinstance(head_sample_size, int) or head_sample_size < 0:
                raise ValueError(f"head_sample_size={head_sample_size!r} must be an int >= 0 (0 disables the sample)")
            if head_sample_size:
                self.head_sample = InputReservoir(
                    head_sample_size, layers[0].in_features, device=self.device, dtype=layers[0].weight.dtype
                )
        # Hooks for torch.distributed: called on each layer's local gradients before the
        # in-place update, and on the Gram statistics before a solve (see torch_dad.parallel).
        self.gradient_reducer: Callable[[list[Tensor]], None] | None = None
        self.statistics_reducer: Callable[[GramAccumulator], None] | None = None
        # per-layer reusable buffers (CPU only: CUDA's caching allocator already reuses memory)
        self._workspaces: list[dict[str, Tensor] | None] = [
            {} if self.device.type == "cpu" else None for _ in layers
        ]
        self.step_count = 0
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_batches = 0
        self.history: list[dict[str, float]] = []
        self._engine = self._make_engine(backend)
        self.backend = backend
        if self._engine is not None and self.on_nonfinite != "ignore":
            warnings.warn(
                f"backend={backend!r} with on_nonfinite={self.on_nonfinite!r}: the fused step has no per-layer "
                "non-finite guard, so step() runs the eager layer loop. Pass on_nonfinite='ignore' (or "
                "check_values=False) to run the fused step",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ helpers
    def _make_engine(self, backend: str) -> Any:
        if backend == "eager" or (backend == "auto" and self.device.type != "cuda"):
            return None  # the CPU never imports the engine (nor triton)
        from .engine import resolve_backend

        return resolve_backend(self, backend)

    def _check_amp(self, amp_dtype: torch.dtype | None, name: str) -> None:
        if amp_dtype is None or amp_dtype == torch.float32:
            return
        if amp_dtype not in _AMP_DTYPES:
            raise ValueError(f"{name}={amp_dtype!r}: use torch.bfloat16, torch.float16 or None")
        if amp_dtype == torch.float16 and self.device.type == "cpu":
            raise ValueError(f"{name}=torch.float16 is not supported on CPU; use torch.bfloat16")

    def _head_tensors(self) -> list[Tensor]:
        head = self.model.head
        assert head is not None
        return [head.weight.data] + ([head.bias.data] if head.bias is not None else [])

    def _prepare(self, inputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() == 0:
            raise ValueError("inputs must have a batch dimension, got a 0-dim tensor")
        first = self.model.dad_layers[0]
        if inputs.shape[0] == 0:
            raise ValueError("inputs are an empty batch; pass at least one row")
        x = inputs.to(self.device, non_blocking=True).reshape(inputs.shape[0], -1)
        if not x.dtype.is_floating_point:
            raise TypeError(f"inputs have dtype {inputs.dtype}; convert them with .float()")
        if x.dtype != first.weight.dtype:
            x = x.to(first.weight.dtype)
        check_inputs(x, first.in_features, check_values=self.check_values)
        if not isinstance(target, Tensor):
            raise TypeError(f"labels must be a torch.Tensor of class ids, got {type(target).__name__}")
        y = target.to(self.device, non_blocking=True)
        check_labels(y, x.shape[0], self.num_classes, check_values=self.check_values)
        return x, y.long()

    # ------------------------------------------------------------------ training
    def step(
        self,
        inputs: Tensor,
        labels: Tensor,
        lr: float | None = None,
        amp_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One decoupled training step; returns ``(logits, loss)``, both detached, no host sync.

        ``logits`` are the model's outputs for the batch, computed with the weights before
        this step's update; ``loss`` is their cross-entropy (a 0-dim tensor on the device).
        ``lr`` overrides the learning rate for this step; ``amp_dtype`` the compute dtype.
        Invalid input raises before anything is modified.
        """
        # the fused/graphed engine checks nothing per layer: value checks and the non-finite
        # guard (opted into with check_values=True on CUDA) take the eager path
        fused = self._engine_applies() and self.gradient_reducer is None
        x, y, rate, compute = self._begin_step(inputs, labels, lr, amp_dtype, sample=not fused)
        if fused:
            logits, loss = self._engine(x, y, rate, compute)
            self.step_count += 1
            self._loss_batches += 1
            return logits, loss
        h = x
        last = None
        for layer, workspace in zip(self.model.dad_layers, self._workspaces):
            last = self._layer_step(layer, h, y, rate, compute, workspace)
            h = last.output
            if self.dropout:
                h = nn.functional.dropout(h, self.dropout, training=True)
        assert last is not None
        head = self.model.head
        if head is None:
            logits, loss = last.logits, last.loss
        else:
            logits, loss = self._head_step(h, y, rate, compute)
        return self._end_step(logits, loss)

    def _engine_applies(self) -> bool:
        """Whether this step can run the fused engine: one exists, and neither the per-layer
        non-finite guard nor dropout (both in the eager layer loop only) is asked for."""
        return self._engine is not None and self.on_nonfinite == "ignore" and not self.dropout

    def _begin_step(
        self, inputs: Tensor, labels: Tensor, lr: float | None, amp_dtype: torch.dtype | None, sample: bool = True
    ) -> tuple[Tensor, Tensor, float, torch.dtype | None]:
        """Validate a step's arguments: ``(x, y, lr, compute dtype or None for the master dtype)``.

        With ``sample``, the rows are also offered to the head sample (the fused engine does
        that itself, inside its graph)."""
        if lr is not None and (not isinstance(lr, (int, float)) or not lr >= 0):
            raise ValueError(f"lr={lr!r} must be a finite float >= 0")
        compute = amp_dtype if amp_dtype is not None else self.amp_dtype
        self._check_amp(compute, "amp_dtype")
        if compute == torch.float32:
            compute = None
        x, y = self._prepare(inputs, labels)
        if sample and self.head_sample is not None:
            self.head_sample.add(x, y)
        return x, y, self.config.lr if lr is None else float(lr), compute

    def _layer_step(
        self,
        layer: DADLinear,
        h: Tensor,
        y: Tensor,
        rate: float,
        compute: torch.dtype | None,
        workspace: dict[str, Tensor] | None,
    ) -> LocalStepResult:
        """``layer.local_step`` with this trainer's config, gradient reducer and non-finite policy."""
        last = layer.local_step(
            h,
            y,
            self.config,
            rate,
            compute,
            reduce_gradients=self.gradient_reducer,
            workspace=workspace,
            on_nonfinite="skip" if self.on_nonfinite != "ignore" else "ignore",
        )
        if last.skipped:
            self._skipped_update(repr(layer))
        return last

    def _skipped_update(self, where: str) -> None:
        """Count an update skipped for non-finite gradients; raise ``FloatingPointError`` under ``"raise"``."""
        self.skipped_updates += 1
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite local gradients in {where} at step {self.step_count} (lr too high, or "
                "half-precision overflow?); it and the layers above it were not updated. Lower lr, "
                "or pass DADTrainer(on_nonfinite='skip') to skip and count such updates"
            )

    def _end_step(self, logits: Tensor, loss: Tensor) -> tuple[Tensor, Tensor]:
        """Count the step and its loss (on the device: no host sync); detached ``(logits, loss)``."""
        self.step_count += 1
        self._loss_sum += loss.detach().float()
        self._loss_batches += 1
        return logits.detach().float(), loss.detach().float()

    @torch.no_grad()
    def _head_step(self, features: Tensor, y: Tensor, lr: float, compute: torch.dtype | None) -> tuple[Tensor, Tensor]:
        head = self.model.head
        assert head is not None and self.head_state is not None and self.head_statistics is not None
        if self.accumulate_head_statistics:
            if features.is_cuda:
                # one bf16 GEMM with fp32 output and no host sync: 0.98 ms at B=16384, d=4096 on an
                # H200 against 11.5 ms for GramAccumulator.update's fp32 GEMM (device call 6)
                from .kernels.gram import gram_update_  # lazily: the CPU never imports triton

                gram_update_(self.head_statistics, features, y)
            else:
                self.head_statistics.update(features, y)
        dtype = compute or head.weight.dtype
        bias = head.bias.to(dtype) if head.bias is not None else None
        result = F.head_loss_and_gradients(features.to(dtype), head.weight.to(dtype), bias, y)
        grads = [result.grad_weight.to(head.weight.dtype)]
        if result.grad_bias is not None:
            grads.append(result.grad_bias.to(head.weight.dtype))
        if self.gradient_reducer is not None:
            self.gradient_reducer(grads)
        if self.on_nonfinite != "ignore" and not gradients_are_finite(grads):
            self._skipped_update("model.classifier")
            return result.logits, result.loss.float()
        self.head_state.apply_(self._head_tensors(), grads, self.config, lr)
        return result.logits, result.loss.float()

    @property
    def running_loss(self) -> float:
        """Mean loss over the steps since the last call (reads the device once)."""
        if self._loss_batches == 0:
            return float("nan")
        value = float(self._loss_sum) / self._loss_batches
        self._loss_sum.zero_()
        self._loss_batches = 0
        return value

    # ------------------------------------------------------------------ closed-form head
    def reset_head_statistics(self) -> None:
        """Forget the Gram statistics and the input sample accumulated by :meth:`step`."""
        if self.head_statistics is not None:
            self.head_statistics.reset()
        if self.head_sample is not None:
            self.head_sample.reset()

    def _require_head(self) -> nn.Linear:
        head = self.model.head
        if head is None or self.head_statistics is None:
            raise ValueError(
                "solve_head() needs model.classifier (an nn.Linear on the last DAD layer's output); "
                f"{type(self.model).__name__} has none. Add `self.classifier = torch.nn.Linear(features, classes)`"
            )
        return head

    @torch.no_grad()
    def solve_head(
        self,
        lambda_reg: float | str = "auto",
        loader: Iterable[tuple[Tensor, Tensor]] | None = None,
    ) -> RidgeSolution:
        """Solve ``model.classifier`` in closed form by ridge regression onto one-hot labels.

        With ``loader``, one no-grad pass computes the final features with the current
        weights. Without, it uses what ``step()`` accumulated since the last solve or reset
        (then reset): the features of the input sample recomputed with the current weights
        (``head_sample_size > 0``, the default), else the streamed Gram statistics.
        ``lambda_reg="auto"`` picks lambda by GCV.
        """
        head = self._require_head()
        assert self.head_statistics is not None and self.head_state is not None
        if loader is not None:
            stats = GramAccumulator(head.in_features, head.out_features, device=self.device)
            was_training = self.model.training
            self.model.eval()
            try:
                for inputs, labels in loader:
                    x, y = self._prepare(inputs, labels)
                    stats.update(self.model.features(x), y)
            finally:
                self.model.train(was_training)
        elif self.head_sample is not None and self.head_sample.size > 0:
            stats = GramAccumulator(head.in_features, head.out_features, device=self.device)
            was_training = self.model.training
            self.model.eval()
            try:
                for x, y in self.head_sample.batches():
                    stats.update(self.model.features(x), y)
            finally:
                self.model.train(was_training)
        else:
            stats = self.head_statistics
        if self.statistics_reducer is not None:
            self.statistics_reducer(stats)
        solution = stats.solve(lambda_reg)
        head.weight.copy_(solution.weight.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.copy_(solution.bias.to(head.bias.dtype))
        else:
            # no bias to hold the intercept: fold nothing, the solve already centred it away
            pass
        for buffer in self.head_state.buffers():
            buffer.zero_()
        if loader is None:
            self.reset_head_statistics()
        return solution

    # ------------------------------------------------------------------ loops
    def _batches(self, data: Any, batch_size: int, shuffle: bool, generator: torch.Generator | None) -> Iterator[tuple[Tensor, Tensor]]:
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
            inputs, labels = data
            n = inputs.shape[0]
            if labels.shape[0] != n:
                raise ValueError(f"inputs have {n} rows but labels have {labels.shape[0]}")
            order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                yield inputs[idx], labels[idx]
        else:
            yield from data

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
    ) -> list[dict[str, float]]:
        """Train for ``epochs``; returns (and appends to ``self.history``) one record per epoch.

        ``train``/``eval`` are iterables of ``(x, y)`` batches (e.g. a ``DataLoader``) or a
        pair of tensors ``(X, Y)`` batched here with ``batch_size``. Each record holds
        ``epoch, loss, train_s, img_per_s`` and, with ``eval``, ``accuracy`` / ``eval_loss``.
        A tqdm bar shows progress if tqdm is installed; the loss it shows is read every
        ``log_every`` steps only, so training stays free of host syncs in between.
        ``schedule(step_count) -> lr`` sets each step's learning rate (e.g.
        :func:`torch_dad.schedules.warmup_cosine`); ``None`` keeps the trainer's ``lr``.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} must be a positive int")
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a callable step -> lr, got {type(schedule).__name__}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        records = []
        for epoch in range(epochs):
            batches = self._batches(train, batch_size, shuffle, generator)
            bar = _progress(batches, progress, desc=f"epoch {epoch + 1}/{epochs}")
            seen = 0
            losses = torch.zeros((), device=self.device)
            count = 0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            for inputs, labels in bar:
                _, loss = self.step(inputs, labels, lr=None if schedule is None else schedule(self.step_count))
                losses += loss
                count += 1
                seen += inputs.shape[0]
                if count % log_every == 0:
                    mean_loss = float(losses) / count
                    if mean_loss != mean_loss or mean_loss in (float("inf"), float("-inf")):
                        raise FloatingPointError(
                            f"training loss became non-finite by step {self.step_count}; lower lr, or use "
                            "amp_dtype=torch.bfloat16 instead of float16"
                        )
                    if hasattr(bar, "set_postfix"):
                        bar.set_postfix(loss=f"{mean_loss:.4f}")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            record = {
                "epoch": float(len(self.history) + 1),
                "loss": float(losses) / max(count, 1),
                "train_s": elapsed,
                "img_per_s": seen / elapsed if elapsed > 0 else float("nan"),
            }
            if eval is not None:
                metrics = self.evaluate(eval, batch_size=batch_size)
                record["accuracy"] = metrics["accuracy"]
                record["eval_loss"] = metrics["loss"]
            if hasattr(bar, "close"):
                bar.close()
            self.history.append(record)
            records.append(record)
        return records

    @torch.no_grad()
    def evaluate(self, data: Any, *, batch_size: int = 1024, use_local_head: bool = False) -> dict[str, float]:
        """Accuracy and mean cross-entropy of ``model(x)`` (or the last local head) over ``data``."""
        was_training = self.model.training
        self.model.eval()
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        total = 0
        try:
            for inputs, labels in self._batches(data, batch_size, False, None):
                x, y = self._prepare(inputs, labels)
                logits = self.model.local_head_logits(x) if use_local_head else self.model(x)
                correct += (logits.argmax(1) == y).sum()
                loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
                total += y.shape[0]
        finally:
            self.model.train(was_training)
        if total == 0:
            raise ValueError("evaluate() got no batches")
        return {"accuracy": int(correct) / total, "loss": float(loss_sum) / total, "samples": float(total)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-for-bit: model (with local heads and moments),
        classifier optimizer state, Gram statistics, step count and hyper-parameters."""
        return {
            "model": self.model.state_dict(),
            "head_state": self.head_state.state_dict() if self.head_state is not None else None,
            "head_statistics": self.head_statistics.state_dict() if self.head_statistics is not None else None,
            "head_sample": self.head_sample.state_dict() if self.head_sample is not None else None,
            "step_count": self.step_count,
            "config": dict(vars(self.config)),
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        missing = {"model", "head_state", "head_statistics", "step_count", "config"} - set(state)
        if missing:
            raise ValueError(f"trainer state_dict is missing keys {sorted(missing)}")
        self.model.load_state_dict(state["model"])
        if self.head_state is not None:
            if state["head_state"] is None:
                raise ValueError("checkpoint has no classifier state but this model has a classifier")
            self.head_state.load_state_dict(state["head_state"])
            assert self.head_statistics is not None
            self.head_statistics.load_state_dict(state["head_statistics"])
            sample = state.get("head_sample")
            if self.head_sample is not None and sample is not None:
                self.head_sample.load_state_dict(sample)
            elif (self.head_sample is None) != (sample is None):
                raise ValueError(
                    "checkpoint and trainer disagree on head_sample_size (one keeps an input sample, the "
                    "other does not); build the trainer with the head_sample_size used when saving"
                )
        config = dict(state["config"])
        config["betas"] = tuple(config["betas"])
        self.config = OptimizerConfig(**config)
        self.step_count = int(state["step_count"])
        self.history = list(state.get("history", []))
        if self._engine is not None:
            self._engine.refresh_shadows()


def _progress(iterable: Iterable[Any], enabled: bool, desc: str) -> Any:
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    # disable=None: no bar when stdout is not a terminal (CI logs), as tqdm documents
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, disable=None)
