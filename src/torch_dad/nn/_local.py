"""What every DAD layer shares: its trained tensors, their optimizer state and the local update.

A dense DAD layer owns ``weight`` (out, in), an optional ``bias`` (out,) and, if it has a local
head, ``head_weight`` (C, out) and ``head_bias`` (C,) (a convolution: the same names, a 4-D
``weight``; a block: its module's and its head's parameters). Its local gradients come as a list in
that order (:meth:`LocalLayer.trained_tensors`) and are applied in place by the layer's own
optimizer state (``update="inplace"``) or handed to autograd, which accumulates them into
``.grad`` for an external optimizer (``update="grad"``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple, Self, cast

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import check_choice, gradients_are_finite
from ..ops.local_error import FUSED_ACTIVATIONS, MAX_TRITON_CLASSES, local_error
from ..optim import LocalOptimizerState, OptimizerConfig

__all__ = [
    "NONFINITE_POLICIES", "UPDATES", "DenseError", "LocalLayer", "activation_backward", "check_update",
    "dense_local_error", "kernel_applies",
]

#: ``update=``: the layer's own optimizer step in backward, or the gradients into ``.grad``
UPDATES: tuple[str, ...] = ("inplace", "grad")
#: ``on_nonfinite=`` of :meth:`LocalLayer.apply_local_update`
NONFINITE_POLICIES: tuple[str, ...] = ("ignore", "skip", "raise")
# every gradient list is in this order, absent tensors (None) left out
_SLOTS: tuple[str, ...] = ("weight", "bias", "head_weight", "head_bias")


def check_update(update: object) -> str:
    """``update`` if it is one of :data:`UPDATES`, else ``ValueError``."""
    return check_choice(
        "update", update, UPDATES, " ('inplace': the layer's own optimizer step; 'grad': fill .grad)"
    )


def activation_backward(
    grad: Tensor, output: Tensor, pre_activation: Tensor | None, activation: str, *, inplace: bool = False
) -> Tensor:
    """``grad * act'(z)`` from ``output = act(z)`` (``pre_activation = z`` is needed for gelu only).

    ``inplace`` overwrites ``grad`` (not for gelu). Each activation takes autograd's own fused backward
    kernel: one pass and no temporaries, where the formulas of :func:`functional.activation_derivative`
    take several passes (docs/design-cpu-step.md).
    Leaky ReLU's derivative is read off the output, which has the sign of ``z``.
    """
    aten = torch.ops.aten
    if activation == "relu":
        if inplace:
            return aten.threshold_backward.grad_input(grad, output, 0, grad_input=grad)
        return aten.threshold_backward(grad, output, 0)
    if activation == "identity":
        return grad
    if activation == "leaky_relu":
        slope = functional.LEAKY_RELU_SLOPE
        if inplace:
            return aten.leaky_relu_backward.grad_input(grad, output, slope, True, grad_input=grad)
        return aten.leaky_relu_backward(grad, output, slope, True)
    if activation == "tanh":
        return aten.tanh_backward.grad_input(grad, output, grad_input=grad) if inplace else aten.tanh_backward(grad, output)
    if activation == "gelu" and pre_activation is not None:
        return aten.gelu_backward(grad, pre_activation)
    z = pre_activation if pre_activation is not None else output
    derivative = functional.activation_derivative(z, output, activation)
    return grad.mul_(derivative) if inplace else grad * derivative


class DenseError(NamedTuple):
    """A dense layer's local error: its local ``logits`` and ``loss``, ``d_z`` (rows x out, the
    compute dtype), the bias gradient ``grad_bias`` and the local head's ``[g_W_loc, g_b_loc]``."""

    logits: Tensor
    loss: Tensor
    d_z: Tensor
    grad_bias: Tensor
    head_grads: list[Tensor]


def kernel_applies(activation: str, num_classes: int) -> bool:
    """Whether :func:`~torch_dad.ops.local_error.local_error` covers a layer: an activation whose
    derivative is read off its output, and a head of at most ``MAX_TRITON_CLASSES`` classes."""
    return activation in FUSED_ACTIVATIONS and num_classes <= MAX_TRITON_CLASSES


def dense_local_error(
    h: Tensor, z: Tensor | None, head_weight: Tensor, head_bias: Tensor, target: Tensor, activation: str, *,
    label_smoothing: float = 0.0, ignore_index: int | None = None, backend: str = "torch",
    d_h_out: Tensor | None = None,
) -> DenseError:
    """The ``"ce"`` local error of ``h = act(z)`` under the head ``(head_weight, head_bias)``
    (fp32 masters, cast to ``h``'s dtype): the math of :func:`torch_dad.functional.local_loss_and_gradients`.

    ``backend="triton"`` takes :func:`~torch_dad.ops.local_error.local_error` (one or two Triton
    launches on CUDA, their PyTorch twin elsewhere) where :func:`kernel_applies` and no row is
    ignored; otherwise PyTorch ops (``d_h_out``: a buffer for ``d_logits @ W_loc``). ``z`` is needed
    for gelu only.
    """
    if backend == "triton" and ignore_index is None and kernel_applies(activation, head_weight.shape[0]):
        err = local_error(h, head_weight, head_bias, target, activation, label_smoothing=label_smoothing)
        assert err.d_z is not None and err.grad_bias is not None
        return DenseError(err.logits, err.loss, err.d_z, err.grad_bias, [err.grad_head_weight, err.grad_head_bias])
    w_head = head_weight.to(h.dtype)
    logits = torch.addmm(head_bias.to(h.dtype), h, w_head.T)
    loss, d_logits = functional.cross_entropy_error(
        logits, target, label_smoothing=label_smoothing, ignore_index=ignore_index
    )
    d_h = torch.mm(d_logits, w_head, out=d_h_out)
    d_z = activation_backward(d_h, h, z, activation, inplace=True)
    return DenseError(logits, loss, d_z, d_z.sum(0), [d_logits.T @ h, d_logits.sum(0)])


class LocalLayer(nn.Module):
    """Base of every DAD layer: :class:`~torch_dad.DADLinear`, :class:`~torch_dad.DADConv2d`,
    :class:`~torch_dad.DADBlock`, :class:`~torch_dad.DADAutogradLinear` and :class:`~torch_dad.DADLMHead`:
    the trained tensors (:meth:`trained_tensors`, any list), their optimizer state and the local update.

    The trainer trains every subclass that adds ``local_gradients(inputs, target, compute_dtype,
    workspace) -> (LocalStepResult, grads)`` (grads in :meth:`trained_tensors` order), ``local_head``
    and ``num_classes``. Dense subclasses create ``weight``/``bias`` with :meth:`_init_linear` and,
    if they have one, the local head with :meth:`_init_local_head`. ``config``/``update``/``grad_scaler`` are used by
    the layers that update themselves inside ``backward`` (:meth:`_local_update`).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    head_weight: Tensor | None
    head_bias: Tensor | None
    optim_state: LocalOptimizerState | None
    config: OptimizerConfig
    update: str = "inplace"
    #: the local rules the layer implements (``set_local_loss`` takes one of them)
    local_losses: tuple[str, ...] = ("ce",)
    #: the rule in use; a layer with more than one (``DADLinear``) sets it per instance
    local_loss: str = "ce"
    #: with ``update="grad"`` under fp16: the ``torch.amp.GradScaler`` in use
    grad_scaler: Any = None
    _warned_fp16: bool = False

    def set_local_loss(self, local_loss: str) -> None:
        """Switch the local rule; here only ``"ce"`` exists, so anything else raises ``ValueError``
        (``DADLinear`` overrides this with its other rules)."""
        check_choice("local_loss", local_loss, self.local_losses)

    # ------------------------------------------------------------------ construction
    def _init_linear(
        self, in_features: int, out_features: int, bias: bool, device: Any = None, dtype: Any = None
    ) -> None:
        """Uninitialised ``weight`` (out, in) and ``bias`` (out,) (or ``None``) parameters."""
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None

    def _init_local_head(self, num_classes: int | None, *, as_parameters: bool = False) -> None:
        """Uninitialised local head ``head_weight`` (C, out), ``head_bias`` (C,), or none for ``None``.

        Buffers (in ``state_dict``, never in a user's optimizer) unless ``as_parameters``
        (``update="grad"``: the external optimizer must see the local head).
        """
        if num_classes is None:
            self.register_buffer("head_weight", None)
            self.register_buffer("head_bias", None)
            return
        kw: dict[str, Any] = {"device": self.weight.device, "dtype": self.weight.dtype}
        head_weight = torch.empty(num_classes, self.weight.shape[0], **kw)
        head_bias = torch.empty(num_classes, **kw)
        if as_parameters:
            self.head_weight = nn.Parameter(head_weight)
            self.head_bias = nn.Parameter(head_bias)
        else:
            self.register_buffer("head_weight", head_weight)
            self.register_buffer("head_bias", head_bias)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation for the layer and for its local head (if any)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.weight.shape[1])
            nn.init.uniform_(self.bias, -bound, bound)
        self._reset_local()

    @torch.no_grad()
    def _reset_local(self) -> None:
        """``nn.Linear``'s initialisation for the local head, if the layer has one."""
        head_weight, head_bias = getattr(self, "head_weight", None), getattr(self, "head_bias", None)
        if head_weight is None or head_bias is None:
            return
        nn.init.kaiming_uniform_(head_weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(head_weight.shape[1])
        nn.init.uniform_(head_bias, -bound, bound)

    def _new_optim_state(self) -> LocalOptimizerState:
        """Zero optimizer moments for :meth:`trained_tensors`, on the first one's device and dtype."""
        tensors = self.trained_tensors()
        shapes = [t.shape for t in tensors]
        return LocalOptimizerState(shapes, device=tensors[0].device, dtype=tensors[0].dtype)

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the trained tensors (the layer's inputs are cast to it)."""
        return self.trained_tensors()[0].dtype

    def update_running_statistics(self) -> None:
        """Fold the last local step's batch statistics into running ones; layers without any do nothing."""

    def check_input(self, inputs: Tensor, name: str = "inputs") -> None:
        """Raise ``ValueError``/``TypeError`` unless ``inputs`` is a batch this layer takes (here: any)."""

    @classmethod
    def from_linear(cls, linear: nn.Module, **kwargs: Any) -> Self:
        """A layer with ``linear``'s shape, device and dtype and a copy (not a view) of its weights.

        ``cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)``;
        ``device``/``dtype`` default to the weight's.
        """
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise TypeError(
                f"from_linear expects a torch.nn.Linear (a module with a 2-D .weight), got {type(linear).__name__}"
            )
        for key in ("in_features", "out_features", "vocab_size", "bias"):
            if key in kwargs:
                raise TypeError(f"from_linear takes {key} from the linear layer; do not pass {key}=")
        bias = getattr(linear, "bias", None)
        kwargs.setdefault("device", weight.device)
        kwargs.setdefault("dtype", weight.dtype)
        layer = cast(Any, cls)(weight.shape[1], weight.shape[0], bias=bias is not None, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if isinstance(bias, Tensor) and layer.bias is not None:
                layer.bias.copy_(bias)
        return cast(Self, layer)

    # ------------------------------------------------------------------ trained tensors
    def trained_tensors(self) -> list[Tensor]:
        """``weight, [bias,] [head_weight, head_bias]``: the order of every local gradient list."""
        tensors = (getattr(self, name, None) for name in _SLOTS)
        return [t for t in tensors if t is not None]

    def _trains(self) -> bool:
        """Whether autograd should update the layer: its weight or bias requires grad."""
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)

    def _matched(self, grads: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """``(tensors, grads)``: :meth:`trained_tensors` (detached) and ``grads`` cast to their dtypes."""
        tensors = [t.detach() for t in self.trained_tensors()]
        if len(grads) != len(tensors):
            raise ValueError(
                f"grads has {len(grads)} tensors but {type(self).__name__} trains {len(tensors)}; pass one "
                "gradient per tensor of trained_tensors(), in that order"
            )
        return tensors, [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, tensors)]

    # ------------------------------------------------------------------ the update
    def nonfinite_witnesses(self, grads: list[Tensor]) -> list[Tensor]:
        """The gradients whose finiteness implies that of all of ``grads``."""
        return grads

    @torch.no_grad()
    def apply_local_update(
        self,
        grads: list[Tensor],
        config: OptimizerConfig,
        lr: float | Tensor | None = None,
        *,
        on_nonfinite: str = "ignore",
        loss: Tensor | None = None,
    ) -> bool:
        """``optim_state`` steps :meth:`trained_tensors` in place from ``grads`` (same order); True.

        ``lr`` overrides ``config.lr``. ``on_nonfinite="skip"``/``"raise"`` first check that
        ``grads`` (and ``loss``, if given) are finite (one reduction per gradient, a host sync on
        CUDA); if not, nothing changes and it returns False (``"skip"``) or raises
        ``FloatingPointError`` (``"raise"``). Gradients are cast to each tensor's dtype.
        """
        check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
        params, grads = self._matched(grads)
        if self.optim_state is None:
            raise RuntimeError(f"{type(self).__name__}(update='grad') has no optimizer state; its gradients go to .grad")
        if on_nonfinite != "ignore" and not (
            (loss is None or bool(torch.isfinite(loss))) and gradients_are_finite(self.nonfinite_witnesses(grads))
        ):
            if on_nonfinite == "raise":
                raise FloatingPointError(
                    f"non-finite local gradients in {self!r} (lr too high, or overflow in half precision?); "
                    "this layer was not updated. Lower lr, or pass on_nonfinite='skip' to skip such updates"
                )
            return False
        self.optim_state.apply_(params, grads, config, lr)
        return True

    @torch.no_grad()
    def _local_update_rows(self, start: int, stop: int, grads: list[Tensor], *, first: bool,
                           lr: float | Tensor | None = None, grad_multiplier: Tensor | None = None) -> None:
        """``update="inplace"`` on rows ``start:stop`` of every trained tensor, from those rows' final
        gradients (:meth:`trained_tensors` order, times ``grad_multiplier`` if given); ``first`` advances the step
        counter; ``lr`` overrides ``config.lr``. Updating every row range once this way is one
        :meth:`apply_local_update` of the whole."""
        params, grads = self._matched(grads)
        if self.optim_state is None:
            raise RuntimeError(f"{type(self).__name__}(update='grad') has no optimizer state; its gradients go to .grad")
        self.optim_state.apply_rows_(params, grads, self.config, start, stop, advance_step=first, lr=lr,
                                     grad_multiplier=grad_multiplier)

    def _local_update(self, grads: list[Tensor]) -> list[Tensor] | None:
        """``update="inplace"``: step with ``self.config`` now, return ``None``. ``update="grad"``:
        return ``grads`` in the tensors' dtypes for autograd to accumulate into ``.grad``.

        With ``grad_scaler`` set (and enabled) the handed gradients are multiplied by its scale,
        so ``scaler.unscale_`` / ``scaler.step`` see them like backprop's.
        """
        if self.update == "inplace":
            self.apply_local_update(grads, self.config)
            return None
        grads = self._matched(grads)[1]
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            scale = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else scaler.get_scale()
            if scale is not None:
                grads = [g * scale.to(g.dtype) if isinstance(scale, Tensor) else g * scale for g in grads]
        elif not self._warned_fp16 and any(g.dtype == torch.float16 for g in grads):
            self._warned_fp16 = True
            warnings.warn(
                f"{type(self).__name__}(update='grad') with float16 weights: if a GradScaler is in use, set "
                "layer.grad_scaler = scaler so the local gradients are scaled like backprop's",
                stacklevel=3,
            )
        return grads

    def _grads_by_slot(self, grads: list[Tensor] | None, needed: tuple[bool, ...]) -> list[Tensor | None]:
        """``grads`` (in :meth:`trained_tensors` order) spread over the slots ``weight, bias,
        head_weight, head_bias``, ``None`` where a tensor is absent or ``needed`` is False."""
        out: list[Tensor | None] = [None] * len(_SLOTS)
        if grads is None:
            return out
        given = iter(grads)
        for slot, name in enumerate(_SLOTS):
            if getattr(self, name, None) is not None:
                grad = next(given)
                if slot < len(needed) and needed[slot]:
                    out[slot] = grad
        return out
