"""``DADAutogradLinear``: an ``nn.Linear`` drop-in that trains itself inside ``loss.backward()``.

The layer runs a custom :class:`torch.autograd.Function`. Its forward is the plain layer
``out = act(x @ W.T + b)``; its backward ignores the upstream gradient for its *own* update
and instead computes the closed-form local gradients of a local target (see
:mod:`torch_dad.functional`):

* **hidden** role: ``CE(act(z) @ W_loc.T + b_loc, y)`` with the layer's own local head,
  the same math as :class:`~torch_dad.DADLinear`;
* **head** role (no activation, ``out_features == num_classes``): ``CE(out, y)``, the task
  loss itself, whose gradient is exactly what backprop gives that layer.

The local gradients are then applied in place with the layer's own fused AdamW
(``update="inplace"``, state in buffers) or accumulated into ``.grad`` for an external
optimizer (``update="grad"``). The input gradient is ``None`` (the backward chain stops
here) unless ``backprop_gradients=True``, which returns ``(grad_out * act'(z)) @ W`` with
the weights from before this step's update.

Labels reach the layer through :meth:`DADAutogradLinear.set_y_context` or the
:func:`label_context` context manager.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .. import functional
from .._checks import (
    check_bool,
    check_fraction,
    check_int,
    check_labels,
    check_num_classes,
    check_positive_int,
)
from ..backends import check_backend
from ..optim import OptimizerConfig
from ._local import LocalLayer, activation_backward, check_update, dense_local_error, kernel_applies
from .precondition import GramPreconditioner, check_precondition, softmax_curvature

__all__ = ["BACKENDS", "HIDDEN_LABEL_SMOOTHING", "ROLES", "DADAutogradFunction", "DADAutogradLinear", "label_context"]

ROLES: tuple[str, ...] = ("hidden", "head")
#: the default label smoothing of a hidden layer's local cross-entropy: a local head fits its batch
#: fast, and the plain one-hot target then leaves the layer little signal (docs/autograd.md)
HIDDEN_LABEL_SMOOTHING = 0.1
#: ``DADAutogradLinear(backend=...)``: the fused Triton local error where it applies, or plain PyTorch
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


def _check_backend(backend: object) -> str:
    backend = check_backend(backend, BACKENDS, " ('torch': plain PyTorch; 'triton': the fused kernel)")
    if backend == "triton":
        from ..kernels import triton_available

        if not triton_available():
            raise ValueError("backend='triton' needs triton (install torch-dad[gpu]); use backend='auto' or 'torch'")
    return backend


def _resolve_role(
    role: str | None, activation: str | None, num_classes: int | None, out_features: int
) -> tuple[str, int, str]:
    """``(role, num_classes, activation)`` with the defaults filled in (see the class docstring)."""
    if num_classes is not None:
        check_num_classes(num_classes)
    if activation is not None:
        functional.check_activation(activation)
    if role is None:
        role = "head" if activation is None and num_classes in (None, out_features) else "hidden"
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be 'hidden', 'head' or None (inferred)")
    if role == "hidden":
        if num_classes is None:
            raise ValueError("a hidden DADAutogradLinear needs num_classes for its local head; pass num_classes=")
        return role, num_classes, activation or "relu"
    if activation not in (None, "identity"):
        raise ValueError(
            f"role='head' feeds the loss with its logits and takes no activation; got activation={activation!r}. "
            "Drop the activation or use role='hidden'"
        )
    if num_classes not in (None, out_features):
        raise ValueError(
            f"role='head' outputs the logits, so num_classes={num_classes} must equal "
            f"out_features={out_features} (or be None)"
        )
    return role, out_features, "identity"


def _inside_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. checkpoint's recomputation)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _rows(tensor: Tensor) -> Tensor:
    """``tensor`` as (rows, last dim): (B, T, D) -> (B*T, D)."""
    return tensor.reshape(-1, tensor.shape[-1])


class DADAutogradFunction(torch.autograd.Function):
    """``out = act(x @ W.T + b)``; backward = local DAD update (+ optional true ``dL/dx``).

    ``apply(x, weight, bias, head_weight, head_bias, module, labels)``. The local gradients
    (``module._local_gradients``) depend only on forward-time tensors. Forward either saves
    ``x`` and one activation (``h`` for relu/tanh/identity, ``z`` for gelu; the logits for a
    head) and backward forms the gradients, or, when they are smaller than those activations
    (an LM head), forward forms them at once and saves only them (``module.early_gradients``).
    Backward then hands them to ``module._local_update``; ``dL/dx`` (if asked) comes first.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inputs: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        head_weight: Tensor | None,
        head_bias: Tensor | None,
        module: DADAutogradLinear,
        labels: Tensor | None,
    ) -> Tensor:
        a, w, b = module._cast_for_forward(inputs, weight, bias)
        z = nn.functional.linear(a, w, b)
        out = functional.activation_forward(z, module.activation)
        ctx.module = module
        ctx.input_dtype = inputs.dtype
        ctx.input_shape = inputs.shape
        ctx.update_count = module._update_count
        ctx.versions = module._versions()
        ctx.used = False
        # an undefined grad_output (None) tells backward that no gradient reached this output
        ctx.set_materialize_grads(False)
        saved = z if module.activation == "gelu" else out
        # what dL/dx needs besides W: act'(z), read off h (relu, tanh) or z (gelu)
        keep_for_input = module.backprop_gradients and module.activation != "identity"
        learns = labels is not None and module._trains()
        ctx.early = learns and module._gradients_early(a, saved, keep_for_input)
        ctx.labels = None if ctx.early else labels  # an attribute: checkpoint recomputation keeps it
        if ctx.early:
            assert labels is not None
            with torch.autocast(inputs.device.type, enabled=False):
                gelu_z = _rows(z) if module.activation == "gelu" else None
                grads = module._local_gradients(_rows(a), _rows(out), gelu_z, labels)
            ctx.save_for_backward(saved if keep_for_input else None, *grads)
        else:
            ctx.save_for_backward(saved, a if learns else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        module: DADAutogradLinear = ctx.module
        module._check_backward(ctx)
        if module._inferred_head and module._trains():
            module._check_feeds_loss(grad_output)
        ctx.used = True
        saved, *rest = ctx.saved_tensors
        h2 = z2 = None
        if saved is not None:
            z = saved if module.activation == "gelu" else None
            h = functional.activation_forward(saved, module.activation) if z is not None else saved
            h2, z2 = _rows(h), (_rows(z) if z is not None else None)
        grad_input = None
        if module.backprop_gradients and ctx.needs_input_grad[0] and grad_output is not None:
            # computed before the update below: dL/dx uses this step's pre-update weights
            grad_input = module._grad_input(_rows(grad_output), h2, z2)
            grad_input = grad_input.to(ctx.input_dtype).reshape(ctx.input_shape)
        grads: list[Tensor] | None = None
        if ctx.early:
            grads = list(rest)
        elif module._trains() and ctx.labels is not None and rest[0] is not None:
            assert h2 is not None
            grads = module._local_gradients(_rows(rest[0]), h2, z2, ctx.labels)
            if module.preconditioner is not None:
                grads = module._precondition(_rows(rest[0]), ctx.labels, grads)
        handed = None
        if grads is not None:
            # update="grad": autograd accumulates the handed gradients into .grad (gradient
            # accumulation sums; DDP's AccumulateGrad hooks fire as for nn.Linear)
            handed = module._local_update(grads)
            module._update_count += module.update == "inplace"
        return (grad_input, *module._grads_by_slot(handed, ctx.needs_input_grad[1:5]), None, None)


class DADAutogradLinear(LocalLayer):
    """``out = act(x @ weight.T + bias)`` that updates itself from a local target during backward.

    A drop-in for ``nn.Linear`` (same ``weight``, ``bias``, ``in_features``, ``out_features``;
    loads an ``nn.Linear`` state dict). In training mode with autograd on it needs labels
    (:meth:`set_y_context` / :func:`label_context`); in ``eval()`` or under ``torch.no_grad()``
    it is a plain layer and changes no state.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        num_classes: classes of the local target. ``None`` means ``out_features`` (a head).
        activation: ``"relu" | "gelu" | "tanh" | "identity"`` or ``None``. ``None`` is no
            activation for a head and ``"relu"`` for a hidden layer.
        backprop_gradients: return the true ``dL/dx`` (pre-update weights) instead of ``None``.
        update: ``"inplace"`` (own fused AdamW, state in buffers) or ``"grad"`` (accumulate into
            ``.grad`` for an external optimizer; the local head of a hidden layer is then a
            parameter too).
        lr, weight_decay, betas, eps: the in-place AdamW (ignored with ``update="grad"``).
        role: ``"hidden"``, ``"head"`` or ``None`` (inferred: head when ``num_classes`` is
            ``None`` or equals ``out_features`` and no activation was asked for). A head inferred
            from ``num_classes=None`` checks its first backward: ``ValueError`` if no gradient
            reaches its output (it feeds other DAD layers, not the loss), one warning if that
            gradient's rows do not sum to 0 as a softmax loss's do. ``torch_dad.to_dad`` sets roles
            for a whole model.
        ignore_index: as ``functional.cross_entropy``.
        label_smoothing: of the layer's cross-entropy, as ``functional.cross_entropy``. ``None``
            (default): :data:`HIDDEN_LABEL_SMOOTHING` for a hidden layer's local loss, 0 for a
            head (whose gradient is then exactly that of a plain cross-entropy on its output).
        check_values: check label ranges at forward (a host sync on CUDA); ``"auto"`` checks
            on CPU only. Shapes and dtypes are always checked.
        precondition: ``None`` (the exact local gradient) or ``"gram"``: right-multiply the
            layer's weight/bias gradient by ``(S/n + damping I)^-1``, ``S`` the running Gram of
            ``[x, 1]`` over the training rows (:class:`torch_dad.nn.precondition.GramPreconditioner`).
            For heads on badly conditioned frozen features; see ``docs/hf.md``.
            With ``update="inplace"`` the step is plain SGD (``p -= lr * (g @ M^-1)``, decoupled
            weight decay, no momentum): use ``lr`` near 1.
        precondition_damping, precondition_window: its relative damping and forgetting window.
        backend: ``"auto"`` (default), ``"torch"`` (formerly ``"eager"``) or ``"triton"``: how a hidden layer forms its
            local error. ``"triton"`` runs the fused kernel of
            :func:`torch_dad.ops.local_error.local_error` (one or two launches for the local-head
            logits, ``softmax - onehot``, ``d_z`` and the bias/head gradients) and raises if it
            cannot run here (no triton, or a CPU tensor without ``TRITON_INTERPRET=1``);
            ``"torch"`` is plain PyTorch and never imports triton; ``"auto"`` picks the kernel
            for CUDA tensors when triton is importable (CPU tensors: PyTorch, even under
            ``TRITON_INTERPRET=1``). The kernel applies to relu/tanh/identity,
            at most 256 classes and fp32/bf16/fp16 compute; anything else (and the head role, and
            CUDA-graph capture) runs the PyTorch path under every backend.
            Rows labelled ``ignore_index`` are dropped before the kernel (one host sync per
            backward for the count), which is the same math as the PyTorch path. Results match
            it up to float rounding (the kernel accumulates logits and ``g_b`` in
            fp32; on CUDA its atomic sums may vary in the last bits). Settable later.

    Attributes:
        early_gradients: ``None`` (default) forms the local gradients in forward when they are
            smaller than the activations backward would need (an LM head), else in backward;
            ``True``/``False`` forces one. Results are the same; only memory differs.
        grad_scaler: with ``update="grad"`` under fp16, set it to the ``torch.amp.GradScaler``
            in use so the local gradients land in ``.grad`` scaled like backprop's.
        last_local_loss: the local loss of the last backward (a 0-dim tensor, no host sync).
        last_backend: ``"triton"`` or ``"torch"``: the path that formed the last local gradients.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        num_classes: int | None = None,
        activation: str | None = None,
        backprop_gradients: bool = False,
        update: str = "inplace",
        lr: float = 1e-3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        role: str | None = None,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        ignore_index: int = functional.IGNORE_INDEX,
        label_smoothing: float | None = None,
        check_values: bool | str = "auto",
        precondition: str | None = None,
        precondition_damping: float = 0.1,
        precondition_window: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.backend = backend
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.role, self.num_classes, self.activation = _resolve_role(role, activation, num_classes, out_features)
        # the one default that can be wrong silently: checked at the first backward (_check_feeds_loss)
        self._inferred_head = role is None and num_classes is None and self.role == "head"
        self.update = check_update(update)
        self.backprop_gradients = check_bool("backprop_gradients", backprop_gradients)
        self.ignore_index = check_int("ignore_index", ignore_index)
        if label_smoothing is None:
            label_smoothing = HIDDEN_LABEL_SMOOTHING if self.role == "hidden" else 0.0
        self.label_smoothing = check_fraction("label_smoothing", label_smoothing)
        if check_values not in (True, False, "auto"):
            raise ValueError(f"check_values={check_values!r} must be True, False or 'auto'")
        self.check_values = check_values
        self.config = OptimizerConfig(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)  # type: ignore[arg-type]
        self._init_runtime_state()
        self._init_linear(in_features, out_features, bias, device, dtype)
        hidden = self.role == "hidden"
        self._init_local_head(self.num_classes if hidden else None, as_parameters=update == "grad")
        self.reset_parameters()
        self.optim_state = self._new_optim_state() if update == "inplace" else None
        self.preconditioner: GramPreconditioner | None = None
        if check_precondition(precondition) == "gram":
            self.preconditioner = GramPreconditioner(
                in_features, damping=precondition_damping, window=precondition_window, device=device
            )
            if update == "inplace":
                # the preconditioned gradient is already a scaled (Gauss-Newton-like) step: apply it
                # with plain SGD; AdamW's per-coordinate scaling undoes it (docs/hf.md)
                self.config = OptimizerConfig(name="sgd", lr=lr, weight_decay=weight_decay, momentum=0.0)
        self.register_load_state_dict_post_hook(DADAutogradLinear._keep_local)

    def _init_runtime_state(self) -> None:
        """What the layer tracks between calls; none of it is in ``state_dict``."""
        self.grad_scaler = None
        self.last_local_loss: Tensor | None = None
        self.last_backend: str | None = None
        self.early_gradients: bool | None = None
        self._y_context: Tensor | None = None
        self._forward_labels: Tensor | None = None
        self._update_count = 0
        self._kept_keys: set[str] = set()
        self._head_checked = False

    @property
    def backend(self) -> str:
        """``"auto" | "torch" | "triton"``: the local-error path (see the class docstring)."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = _check_backend(value)  # raises before anything changes

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(cls, linear: nn.Module, num_classes: int | None = None, **kwargs: Any) -> DADAutogradLinear:
        """A ``DADAutogradLinear`` with ``linear``'s shape, device, dtype and (copied) weights.

        A frozen ``linear`` (``weight.requires_grad`` False) gives a frozen layer: a drop-in
        keeps what was not trained.
        """
        layer = super().from_linear(linear, num_classes=num_classes, **kwargs)
        assert isinstance(linear.weight, Tensor)  # from_linear checked it
        layer.weight.requires_grad_(linear.weight.requires_grad)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"role={self.role!r}, num_classes={self.num_classes}, activation={self.activation!r}, "
            f"update={self.update!r}, backprop_gradients={self.backprop_gradients}"
            + ("" if self._backend == "auto" else f", backend={self._backend!r}")
        )

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # an nn.Linear state dict (weight [+ bias]) leaves the local head and the optimizer
        # moments as they are; _keep_local drops them from the missing keys afterwards
        if prefix + "weight" in state_dict:
            local = [n for n in ("head_weight", "head_bias") if getattr(self, n) is not None]
            if self.optim_state is not None:
                local += [f"optim_state.{k}" for k in self.optim_state.state_dict()]
            if self.preconditioner is not None:
                local += [f"preconditioner.{k}" for k in self.preconditioner.state_dict()]
            self._kept_keys = {prefix + n for n in local if prefix + n not in state_dict}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    @staticmethod
    def _keep_local(module: nn.Module, incompatible: Any) -> None:
        assert isinstance(module, DADAutogradLinear)
        kept = module._kept_keys
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in kept]
        module._kept_keys = set()

    # ------------------------------------------------------------------ labels
    def set_y_context(self, labels: Tensor | None) -> None:
        """Labels for the next training forwards (``None`` clears them).

        Shape: the layer input's leading dims, ``(B,)`` for ``(B, D)`` or ``(B, T)`` for
        ``(B, T, D)``; entries equal to ``ignore_index`` are skipped. They stay until replaced.
        """
        if labels is not None and not isinstance(labels, Tensor):
            raise TypeError(f"labels must be a torch.Tensor of class ids or None, got {type(labels).__name__}")
        self._y_context = labels

    @property
    def y_context(self) -> Tensor | None:
        """The labels set by :meth:`set_y_context` (or ``None``)."""
        return self._y_context

    def _check_y(self, inputs: Tensor, labels: Tensor) -> Tensor:
        """The labels flattened to (N,) after checking them against ``inputs``' leading dims."""
        lead = tuple(inputs.shape[:-1])
        if tuple(labels.shape) != lead:
            raise ValueError(
                f"labels have shape {tuple(labels.shape)} but the input {tuple(inputs.shape)} has leading dims "
                f"{lead}; pass one class id (or ignore_index={self.ignore_index}) per row, shape {lead}"
            )
        flat = labels.reshape(-1)
        if flat.device != inputs.device:
            raise ValueError(f"labels are on {flat.device} but the input is on {inputs.device}; move them with .to()")
        check = self.check_values if self.check_values != "auto" else inputs.device.type == "cpu"
        check_labels(flat, flat.shape[0], self.num_classes, check_values=bool(check), ignore_index=self.ignore_index)
        return flat.long()

    # ------------------------------------------------------------------ forward
    def _cast_for_forward(self, inputs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, ...]:
        """Inputs/weights in the compute dtype: the autocast dtype if autocast is on, else as given."""
        device_type = inputs.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        elif inputs.dtype != weight.dtype:
            raise TypeError(
                f"input dtype {inputs.dtype} does not match weight dtype {weight.dtype}; cast the input or "
                "the layer (layer.to(dtype)), or run under torch.autocast"
            )
        else:
            dtype = weight.dtype
        a = inputs if inputs.dtype == dtype else inputs.to(dtype)
        w = weight if weight.dtype == dtype else weight.to(dtype)
        b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        return a, w, b  # type: ignore[return-value]

    def forward(self, inputs: Tensor) -> Tensor:
        """``act(inputs @ weight.T + bias)``; with autograd on in training mode, a DAD node."""
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() < 1 or inputs.shape[-1] != self.in_features:
            raise ValueError(
                f"inputs have shape {tuple(inputs.shape)}; the last dim must be in_features={self.in_features}"
            )
        records = torch.is_grad_enabled() and (inputs.requires_grad or self._trains())
        recomputing = _inside_backward()
        if self.training and not recomputing:
            # what a checkpoint recomputation of this forward will need: use_reentrant=True runs
            # the first forward under no_grad and the recorded one inside backward, often after
            # the labels were cleared or replaced
            self._forward_labels = self._y_context
        if not (self.training and records):
            a, w, b = self._cast_for_forward(inputs, self.weight, self.bias)
            return functional.activation_forward(nn.functional.linear(a, w, b), self.activation)
        labels = self._forward_labels if recomputing and self._forward_labels is not None else self._y_context
        if labels is not None:
            labels = self._check_y(inputs, labels)
        elif self._trains():
            raise ValueError(
                "DADAutogradLinear needs labels in training mode: call layer.set_y_context(labels) or wrap the "
                "forward in `with torch_dad.label_context(model, labels):`; use model.eval() or torch.no_grad() "
                "for inference"
            )
        return DADAutogradFunction.apply(inputs, self.weight, self.bias, self.head_weight, self.head_bias, self, labels)

    # ------------------------------------------------------------------ local update
    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in self.trained_tensors())

    def _gradients_early(self, inputs: Tensor, saved: Tensor, keep_for_input: bool) -> bool:
        """Whether forward forms the local gradients (see ``early_gradients``)."""
        if self.preconditioner is not None:
            return False  # the Gram update needs this step's inputs at backward time
        if self.early_gradients is not None:
            return self.early_gradients
        # they depend only on forward-time tensors, so they can be formed now and the activations
        # dropped, whichever is smaller: for an LM head (8192 tokens, hidden 576, vocab 49152)
        # x and the logits are 14x the size of dL/dW
        grad_numel = sum(t.numel() for t in self.trained_tensors())
        return grad_numel < inputs.numel() + (0 if keep_for_input else saved.numel())

    def _check_backward(self, ctx: Any) -> None:
        """Raise if this backward would apply a stale update (see the messages)."""
        if self.update == "inplace" and (ctx.used or self._update_count != ctx.update_count):
            raise RuntimeError(
                "DADAutogradLinear(update='inplace') was already updated after this forward (a second "
                "backward through the same graph, or several forwards of the layer before one backward). "
                "Applying the local update again would use stale activations. Run a fresh forward before "
                "each backward, or use update='grad' to accumulate gradients instead."
            )
        if self._versions() != ctx.versions:
            raise RuntimeError(
                "the weights of this DADAutogradLinear were modified in place between its forward and its "
                "backward (e.g. optimizer.step() before loss.backward()); run the forward again"
            )

    def _check_feeds_loss(self, grad_output: Tensor | None) -> None:
        """Raise if an inferred head is used as a hidden layer; warn once if its output does not
        look like logits of a softmax loss.

        ``grad_output`` undefined: no gradient reached the output, so it feeds only layers that
        stop the backward chain. Defined: a softmax loss is unchanged by adding a constant to
        every logit of a row, so its gradient rows sum to 0 (``|g.sum(-1)|`` vs ``|g|.sum(-1)``).
        """
        if grad_output is None:
            raise ValueError(
                f"DADAutogradLinear({self.in_features}, {self.out_features}) took role='head' because num_classes "
                "was not given, but no gradient reaches its output: it feeds other DAD layers, not the loss, so "
                f"it is a hidden layer that would be trained as a {self.out_features}-class classifier. Pass "
                "num_classes=<number of classes> to give it a local head (or convert the model with "
                "torch_dad.to_dad(model, num_classes=...)); pass role='head' if it is a classifier"
            )
        if self._head_checked or (grad_output.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        self._head_checked = True
        g = _rows(grad_output).float()
        off = float(g.sum(-1).abs().sum() / g.abs().sum().clamp_min(1e-30))  # one host sync, once
        if off > 1e-2:
            warnings.warn(
                f"DADAutogradLinear({self.in_features}, {self.out_features}) took role='head' because num_classes "
                "was not given, but the gradient reaching its output is not that of a cross-entropy loss on it "
                f"(its rows sum to {off:.2g} of their absolute sum, not 0): it looks like a hidden layer, which "
                f"would be trained as a {self.out_features}-class classifier. Pass num_classes=<number of classes> "
                "to give it a local head (or convert the model with torch_dad.to_dad(model, num_classes=...)); "
                "pass role='head' to keep it a classifier and silence this warning",
                stacklevel=2,
            )

    def _grad_input(self, grad_output: Tensor, output: Tensor | None, pre_activation: Tensor | None) -> Tensor:
        """``dL/dx = (grad_output * act'(z)) @ W`` (rows), with the current (pre-update) weights."""
        g = grad_output
        if self.activation != "identity":
            assert output is not None
            z = pre_activation.to(g.dtype) if pre_activation is not None else None
            g = activation_backward(g, output.to(g.dtype), z, self.activation)
        weight = self.weight if self.weight.dtype == g.dtype else self.weight.to(g.dtype)
        return g @ weight.detach()

    def _local_gradients(
        self, inputs: Tensor, output: Tensor, pre_activation: Tensor | None, labels: Tensor
    ) -> list[Tensor]:
        """Closed-form local gradients, in the order of :meth:`trained_tensors`, before any update.

        ``inputs`` (N, in), ``output = act(z)`` (N, out), ``pre_activation = z`` (gelu only, else
        ``None``), ``labels`` (N,). Head: ``d = softmax(out) - onehot(y)`` (over valid rows);
        ``g_W = d.T @ x``. Hidden: the :func:`torch_dad.functional.local_loss_and_gradients` math.
        This is the hook a preconditioned variant overrides (e.g. a Gram-preconditioned head).
        Gradients are in the parameters' dtype; ``self.last_local_loss`` is set.
        """
        a = inputs if inputs.dtype == output.dtype else inputs.to(output.dtype)
        kernel = self._fused_applies(output)
        self.last_backend = "triton" if kernel else "torch"
        if self.role == "head":
            loss, d_out = self._cross_entropy_error(output, labels)
            grads = [d_out.T @ a] + ([d_out.sum(0)] if self.bias is not None else [])
        else:
            loss, grads = self._hidden_local_gradients(a, output, pre_activation, labels, kernel)
        self.last_local_loss = loss.detach()
        master = self.weight.dtype
        return [g if g.dtype == master else g.to(master) for g in grads]

    def _cross_entropy_error(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`torch_dad.functional.cross_entropy_error` with this layer's options."""
        return functional.cross_entropy_error(
            logits, labels, label_smoothing=self.label_smoothing, ignore_index=self.ignore_index
        )

    def _hidden_local_gradients(
        self, a: Tensor, output: Tensor, pre_activation: Tensor | None, labels: Tensor, kernel: bool
    ) -> tuple[Tensor, list[Tensor]]:
        """The hidden role, the dense local step of :func:`~torch_dad.nn._local.dense_local_error`:
        ``(loss, [g_W, [g_b,] g_W_loc, g_b_loc])``. The kernel takes class ids in ``[0, C)`` and
        divides by its row count, so with ``kernel`` the rows labelled ``ignore_index`` are dropped
        first (one host sync): the PyTorch path gives them a zero error and divides by the labelled
        count, the same sums."""
        assert self.head_weight is not None and self.head_bias is not None
        if kernel:
            keep = (labels != self.ignore_index).nonzero().squeeze(1)
            kernel = keep.numel() > 0  # no labelled row: the PyTorch path's zero gradients and loss
            if kernel and keep.numel() < labels.shape[0]:
                a, output, labels = a[keep], output[keep], labels[keep]
        self.last_backend = "triton" if kernel else "torch"
        err = dense_local_error(
            output, pre_activation, self.head_weight.detach(), self.head_bias.detach(), labels, self.activation,
            label_smoothing=self.label_smoothing, ignore_index=None if kernel else self.ignore_index,
            backend="triton" if kernel else "torch",
        )
        grads = [err.d_z.T @ a] + ([err.grad_bias] if self.bias is not None else [])
        return err.loss, grads + err.head_grads

    def _fused_applies(self, output: Tensor) -> bool:
        """Whether this hidden layer's local error goes through the Triton kernel (see ``backend``)."""
        if self._backend == "torch" or self.role != "hidden":
            return False
        if (
            not kernel_applies(self.activation, self.num_classes)  # gelu: its derivative needs z
            or output.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or (output.is_cuda and torch.cuda.is_current_stream_capturing())  # the row count syncs
        ):
            return False
        from ..kernels import interpreting, triton_available

        # "auto" on CPU stays PyTorch even under TRITON_INTERPRET=1 (set for other kernels' tests)
        on_device = output.is_cuda or (self._backend == "triton" and interpreting())
        runnable = on_device and triton_available()
        if self._backend == "triton" and not runnable:
            raise ValueError(
                "DADAutogradLinear(backend='triton') needs triton and a CUDA tensor (or TRITON_INTERPRET=1); "
                f"got a {output.device.type} tensor. Set layer.backend = 'auto' or 'torch'"
            )
        return runnable

    def _precondition(self, inputs: Tensor, labels: Tensor, grads: list[Tensor]) -> list[Tensor]:
        """``precondition="gram"`` on the labelled rows (local-head grads unchanged). Head: the
        stochastic Newton step ``B / (C + (d+1)/2) ([g_W, g_b] + rho [W, b]) @ M^-1`` (:mod:`torch_dad.nn.precondition`);
        hidden: ``[g_W, g_b] @ M^-1`` (its loss's curvature passes through the local head)."""
        assert self.preconditioner is not None
        keep = labels != self.ignore_index
        rows = inputs[keep]
        has_bias = self.bias is not None
        grad_bias_in = grads[1] if has_bias else None
        if self.role == "head":
            # the pre-update weights give this batch's logits (no update has run yet)
            bias = None if self.bias is None else self.bias.detach().to(rows.dtype)
            logits = nn.functional.linear(rows, self.weight.detach().to(rows.dtype), bias)
            curvature = softmax_curvature(logits, labels[keep])
            grad_weight, grad_bias = self.preconditioner.newton_step(
                rows, curvature, (grads[0], grad_bias_in), (self.weight, self.bias)
            )
        else:
            if rows.shape[0]:
                self.preconditioner.update(rows)
            grad_weight, grad_bias = self.preconditioner.precondition(grads[0], grad_bias_in)
        rest = grads[2:] if has_bias else grads[1:]
        return [grad_weight, *([grad_bias] if grad_bias is not None else []), *rest]


def _dad_modules(model: nn.Module) -> Iterator[DADAutogradLinear]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return (m for m in model.modules() if isinstance(m, DADAutogradLinear))


@contextmanager
def label_context(model: nn.Module, labels: Tensor | None) -> Iterator[nn.Module]:
    """Set ``labels`` on every :class:`DADAutogradLinear` in ``model`` for the block; restore after.

    ``with label_context(model, y): loss = crit(model(x), y); loss.backward()``.
    """
    if labels is not None and not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class ids or None, got {type(labels).__name__}")
    modules = list(_dad_modules(model))
    previous = [m._y_context for m in modules]
    for m in modules:
        m.set_y_context(labels)
    try:
        yield model
    finally:
        for m, old in zip(modules, previous):
            m._y_context = old
