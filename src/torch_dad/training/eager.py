"""The eager runner: the reference step, one layer at a time through each layer's own local step.

Every layer type computes its gradients in ``local_gradients`` and applies them with
``apply_local_update``; the classifier steps through :class:`~torch_dad.training.classifier.OutputClassifier`.
With a non-finite guard every update waits to the end of the step, which applies all or none.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from .._checks import gradients_are_finite
from ..nn._local import LocalLayer
from .classifier import OutputClassifier
from .step import Batch, GradientReducer, LayerLoop, RunningLoss, StepOutput, StepPlan

__all__ = ["EagerRunner"]


class EagerRunner:
    """Runs a step of :class:`~torch_dad.training.step.LayerLoop` with each layer's ``local_gradients``.

    ``backend`` (``"torch"`` or ``"triton"``) is handed to the layers' local steps; ``guard``
    (``"raise"``/``"skip"``) holds every update until the whole step is known finite; ``names``
    maps a layer to its name in the model, for the guard's message.
    """

    def __init__(
        self, layers: list[LocalLayer], classifier: OutputClassifier | None, running_loss: RunningLoss, *,
        backend: str, guard: bool, names: dict[int, str], device: torch.device,
    ) -> None:
        self.layers, self.classifier, self.running_loss = layers, classifier, running_loss
        self.backend, self.guard, self.names = backend, guard, names
        # per-layer reusable buffers (CPU only: CUDA's caching allocator already reuses memory)
        self.workspaces: list[dict[str, Tensor] | None] = [{} if device.type == "cpu" else None for _ in layers]

    @torch.no_grad()
    def run(self, batch: Batch, plan: StepPlan, reducer: GradientReducer | None) -> StepOutput:
        loop = _EagerLoop(self, batch, plan, reducer)
        logits, loss, features = loop.train()
        return StepOutput(logits.detach().float(), loss.detach().float(), features, plan.count_loss, loop.nonfinite)

    def refresh(self) -> None:
        """Nothing derived from the weights is kept."""


class _EagerLoop(LayerLoop):
    def __init__(self, runner: EagerRunner, batch: Batch, plan: StepPlan, reducer: GradientReducer | None) -> None:
        super().__init__(runner.layers, batch, plan, reducer, runner.running_loss)
        self.runner = runner
        self.classifier = runner.classifier
        workspaces = runner.workspaces[plan.start : plan.stop]
        if plan.stop < len(runner.layers):
            # the span's output leaves (e.g. with an asynchronous send): no workspace may hold it
            workspaces[-1] = None
        self.workspaces = workspaces
        self.hold = plan.stop - plan.start if runner.guard else int(reducer is not None)
        self.checked: list[tuple[LocalLayer, list[Tensor], Tensor]] = []
        self.classifier_update: tuple[Tensor, list[Tensor]] | None = None
        self.nonfinite: str | None = None

    def begin(self) -> None:
        if self.plan.start == 0 and self.classifier is not None and not self.runner.guard:
            self.classifier.offer(self.batch.x, self.batch.y)

    def layer_step(self, index: int, layer: Any, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch = self.batch
        # a later layer's input is this loop's own activation, dead after this step: a row-streamed layer may
        # write its output over it, unless that output leaves the span (it may be an earlier layer's workspace)
        leaves = index == len(self.layers) - 1 and self.plan.stop < len(self.runner.layers)
        result, grads = layer.local_gradients(
            a, batch.y, batch.compute_dtype, self.workspaces[index], backend=self.runner.backend,
            reuse_input=index > 0 and not leaves,
        )
        work = None
        if self.reducer is not None:
            # grads[0] may alias the workspace: launch() copies it into its buffer at once
            work, grads = self.reducer.launch(grads)
        if self.runner.guard:
            self.checked.append((layer, grads, result.loss))
        self.held.push(work, partial(layer.apply_local_update, grads, self.plan.config, batch.lr), self.hold)
        return result.output, result.logits, result.loss

    def classifier_step(self, features: Tensor) -> tuple[Tensor, Tensor]:
        assert self.classifier is not None
        batch = self.batch
        logits, loss, grads = self.classifier.gradients(features, batch.y, batch.compute_dtype)
        if self.reducer is not None:
            # the classifier reads the last layer's pre-update output: it runs while that
            # layer's gradients are still being reduced
            self.reducer(grads)
        if self.runner.guard:
            self.classifier_update = (features, grads)
        else:
            self.classifier.apply(features, batch.y, grads, self.plan.config, batch.lr)
        return logits, loss

    def finish(self, loss: Tensor) -> None:
        if self.runner.guard:
            self.held.wait_all()
            self.nonfinite = self._first_nonfinite()
            if self.nonfinite is not None:
                self.held.drop_all()
            else:
                self._apply_guarded()
        super().finish(loss)

    def _apply_guarded(self) -> None:
        batch, classifier = self.batch, self.classifier
        self.held.apply_all()
        if classifier is not None and self.classifier_update is not None:
            features, grads = self.classifier_update
            classifier.apply(features, batch.y, grads, self.plan.config, batch.lr)
        if self.plan.start == 0 and classifier is not None:
            classifier.offer(batch.x, batch.y)

    def _first_nonfinite(self) -> str | None:
        """``model.<name>`` of the first layer (or the classifier) whose gradients, or whose local loss,
        are not all finite; ``None`` when all are. With a reducer only the reduced gradients count:
        they are the same on every rank, the local losses are not, and every rank must skip alike."""
        witnesses: list[Tensor] = []
        for layer, grads, loss in self.checked:
            witnesses += layer.nonfinite_witnesses(grads)
            if self.reducer is None:
                witnesses.append(loss)
        classifier_grads = self.classifier_update[1] if self.classifier_update is not None else []
        if gradients_are_finite(witnesses + classifier_grads):
            return None
        for layer, grads, _ in self.checked:
            if not gradients_are_finite(grads):
                return self.runner.names[id(layer)]
        if classifier_grads and not gradients_are_finite(classifier_grads):
            return "model.classifier"
        return f"the local loss of {self.runner.names[id(self.checked[0][0])]} or a layer above it"
