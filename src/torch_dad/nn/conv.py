"""``DADConv2d``: a convolution trained by its own local head, in closed form."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import check_choice, check_fraction, check_num_classes, check_positive_int
from ..ops.pooling import grid_pool, grid_pool_backward, max_pool2x2, max_pool2x2_backward
from ..optim import LocalOptimizerState
from ._batchnorm import BatchNormLayer
from ._local import activation_backward, dense_local_error
from .linear import LocalStepResult

__all__ = ["DADConv2d"]


#: activations whose derivative the local step reads off their output, so they may overwrite their input
_DERIVATIVE_FROM_OUTPUT = ("relu", "leaky_relu", "identity")


def _activate_(z: Tensor, activation: str) -> Tensor:
    """``act(z)`` written into ``z`` (relu, leaky relu, identity)."""
    if activation == "relu":
        return z.relu_()
    if activation == "leaky_relu":
        return nn.functional.leaky_relu_(z, functional.LEAKY_RELU_SLOPE)
    return z


class DADConv2d(BatchNormLayer):
    """A convolution ``o = pool(act(conv2d(x, weight, bias, stride, padding, groups=groups)))`` trained by a local head.

    The local head reads the output ``o`` (what the next layer reads) through an adaptive
    average pool to ``local_head_grid x local_head_grid``, flattened:
    ``logits = adaptive_avg_pool2d(o, grid).flatten(1) @ head_weight.T + head_bias``, the
    auxiliary heads of the local-loss papers (Nøkland & Eidnes 2019; Belilovsky et al. 2020).
    :meth:`local_gradients` computes the gradients of ``CE(logits, y)`` in closed form (math and
    float64 oracle: :func:`torch_dad.functional.conv_local_loss_and_gradients`): the pooling
    adjoints, the activation derivative, then torch's convolution weight-gradient primitive.

    Why the default grid is 4 rather than 1 or 2: ``docs/conv-and-blocks.md``. ``pool``
    (``None``, ``"max"`` or ``"avg"``) is a 2 x 2, stride-2 pooling after the activation
    (``nn.MaxPool2d(2)`` / ``nn.AvgPool2d(2)``). Only the ``"ce"`` local rule is implemented. The
    local head and the optimizer moments are buffers, as for :class:`~torch_dad.DADLinear`.

    ``normalize="batchnorm"`` makes the layer ``pool(act(BN(conv2d(x, weight, bias))))`` as
    ``nn.BatchNorm2d`` (statistics over the batch and the positions, per channel): batch statistics
    in training, the ``running_mean``/``running_var`` buffers in eval mode, the affine
    ``norm_weight``/``norm_bias`` trained by the local loss, running statistics advanced by each
    applied local update only, as :class:`~torch_dad.DADLinear` does. The convolution's bias then has
    gradient 0 (the mean subtraction cancels it); a training batch needs at least 2 rows.
    """

    head_weight: Tensor
    head_bias: Tensor
    optim_state: LocalOptimizerState

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        num_classes: int = 10,
        bias: bool = True,
        activation: str = "relu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        pool: str | None = None,
        local_head_grid: int = 4,
        label_smoothing: float = 0.0,
        normalize: str | None = None,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.out_channels = check_positive_int("out_channels", out_channels)
        self.groups = check_positive_int("groups", groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}, as in nn.Conv2d"
            )
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        self.stride = check_positive_int("stride", stride)
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding={padding!r} must be an int >= 0")
        self.padding = padding
        self.num_classes = check_num_classes(num_classes)
        self.activation = functional.check_activation(activation)
        if pool is not None:
            check_choice("pool", pool, functional.POOLS, " (or None for no pooling)")
        self.pool = pool
        self.local_head_grid = check_positive_int("local_head_grid", local_head_grid)
        self.label_smoothing = check_fraction("label_smoothing", label_smoothing)
        if normalize is not None:
            check_choice("normalize", normalize, ("batchnorm",), " (or None for no normalisation)")
        self.normalize = normalize
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, kernel_size, kernel_size, **kw))
        self.bias = nn.Parameter(torch.empty(out_channels, **kw)) if bias else None
        head_features = out_channels * self.local_head_grid**2
        self.register_buffer("head_weight", torch.empty(num_classes, head_features, **kw))
        self.register_buffer("head_bias", torch.empty(num_classes, **kw))
        self._init_batch_norm(normalize == "batchnorm", out_channels)
        self.reset_parameters()
        self.optim_state = self._new_optim_state()

    def reset_parameters(self) -> None:
        """``nn.Conv2d``'s initialisation, ``nn.Linear``'s for the local head and ``nn.BatchNorm2d``'s
        for the batch norm (if any)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.weight[0].numel())
            nn.init.uniform_(self.bias, -bound, bound)
        self._reset_local()
        self._reset_batch_norm()

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, num_classes={self.num_classes}, bias={self.bias is not None}, "
            f"activation={self.activation!r}, pool={self.pool!r}, local_head_grid={self.local_head_grid}"
            + (f", normalize={self.normalize!r}" if self.normalize else "")
            + (f", groups={self.groups}" if self.groups != 1 else "")
        )

    def check_input(self, inputs: Tensor, name: str = "inputs") -> None:
        """Raise ``TypeError``/``ValueError`` unless ``inputs`` is a floating (batch, in_channels, H, W) tensor."""
        if not inputs.dtype.is_floating_point:
            raise TypeError(f"{name} have dtype {inputs.dtype}; convert them with .float()")
        if inputs.dim() != 4 or inputs.shape[1] != self.in_channels:
            raise ValueError(
                f"{name} have shape {tuple(inputs.shape)}; expected (batch, {self.in_channels}, height, width) "
                f"to match in_channels={self.in_channels} of {type(self).__name__}"
            )

    def _conv(self, a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return nn.functional.conv2d(a, weight, bias, self.stride, self.padding, 1, self.groups)

    def _pool(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(o, arg)``: the 2 x 2 pool of ``h`` (``h`` itself without ``pool``); ``arg`` is the max
        pool's window code of each maximum (for its backward), else ``None``."""
        if self.pool == "max":
            # a 1-byte argmax: torch's backward reading int64 indices is slow (docs/design-kernels.md)
            return max_pool2x2(h)
        if self.pool == "avg":
            return nn.functional.avg_pool2d(h, 2), None
        return h, None

    def _unpool(self, d_out: Tensor, h: Tensor, arg: Tensor | None) -> Tensor:
        """The pooling's adjoint: ``d_h`` from ``d_out``."""
        if self.pool == "max":
            assert arg is not None
            return max_pool2x2_backward(d_out, arg, h.shape)
        if self.pool == "avg":
            return torch.ops.aten.avg_pool2d_backward(d_out, h, [2, 2], [2, 2], [0, 0], False, True, None)
        return d_out

    def forward(self, inputs: Tensor) -> Tensor:
        """``pool(act(conv2d(inputs, weight, bias)))``, batch-normalised before the activation if
        ``normalize`` (by the batch's statistics in training mode, the running ones in eval mode; the
        running statistics change only with a local update)."""
        z = self._conv(inputs, self.weight, self.bias)
        if self.normalize == "batchnorm":
            z = self._batch_norm(z, training=self.training)[0]
        return self._pool(functional.activation_forward(z, self.activation))[0]

    def local_head(self, hidden: Tensor) -> Tensor:
        """Local logits ``adaptive_avg_pool2d(hidden, grid).flatten(1) @ head_weight.T + head_bias``."""
        pooled = grid_pool(hidden, self.local_head_grid).flatten(1)
        return nn.functional.linear(pooled, self.head_weight.to(hidden.dtype), self.head_bias.to(hidden.dtype))

    @torch.no_grad()
    def local_gradients(
        self,
        inputs: Tensor,
        target: Tensor,
        compute_dtype: torch.dtype | None = None,
        workspace: dict[str, Tensor] | None = None,
        *,
        backend: str = "torch",
        output_ready: Callable[[], object] | None = None,
        reuse_input: bool = False,
    ) -> tuple[LocalStepResult, list[Tensor]]:
        """The layer's output, local loss and closed-form gradients, without updating anything.

        The math of :func:`torch_dad.functional.conv_local_loss_and_gradients`; the adjoints are
        backward kernels (:func:`~torch_dad.ops.pooling.max_pool2x2_backward`, torch's avg pool backward,
        convolution weight and bias gradient: ``aten.convolution_backward``, cuDNN/oneDNN), not autograd
        over a graph. Gradients
        come in the order of :meth:`trained_tensors` (``weight, [bias,] head_weight, head_bias,
        [norm_weight, norm_bias]``), in the master dtype. Under ``normalize="batchnorm"`` the batch
        statistics are kept for the update to fold into the running ones. No host syncs, no
        data-dependent shapes: the fused engine captures it. ``workspace``, ``backend`` and ``reuse_input`` are
        accepted for the trainer's protocol and unused (the max pool picks its own kernel). ``output_ready()``, if
        given, is called once the output's kernels are queued, before the head's and the gradients'.
        """
        dtype = compute_dtype or self.weight.dtype
        a = inputs.to(dtype)
        weight = self.weight.to(dtype)
        z = self._conv(a, weight, self.bias.to(dtype) if self.bias is not None else None)
        norm = None
        if self.normalize == "batchnorm":
            z, norm = self._batch_norm(z, training=True, keep=True)
        # relu and leaky relu overwrite z: their derivative is read off h (h > 0 where z > 0); the
        # temporaries are dropped as soon as they are used, since a layer's peak is several
        # tensors of the output's size
        reads_output = self.activation in _DERIVATIVE_FROM_OUTPUT
        h = _activate_(z, self.activation) if reads_output else functional.activation_forward(z, self.activation)
        pre_activation = None if reads_output else z
        del z
        out, arg = self._pool(h)
        if output_ready is not None:
            output_ready()
        result, d_out, head_grads = self._head_error(out, target, backend)
        d_h = self._unpool(d_out, h, arg)
        del out, arg, d_out
        d_z = activation_backward(d_h, h, pre_activation, self.activation, inplace=True)
        del h, d_h, pre_activation
        norm_grads: list[Tensor] = []
        if norm is not None:
            d_z, norm_grads = self._batch_norm_backward(d_z, norm)
        grads = self._conv_gradients(d_z, a, weight) + head_grads + norm_grads
        master = self.weight.dtype
        return result, [g if g.dtype == master else g.to(master) for g in grads]

    def _head_error(self, out: Tensor, target: Tensor, backend: str) -> tuple[LocalStepResult, Tensor, list[Tensor]]:
        """The local head on ``out``: ``(result, d_out, [g_head_weight, g_head_bias])``, by the local error of
        every DAD layer (:func:`~torch_dad.nn._local.dense_local_error`) on the pooled grid."""
        pooled = grid_pool(out, self.local_head_grid)
        assert self.head_weight is not None and self.head_bias is not None
        err = dense_local_error(pooled.flatten(1), None, self.head_weight, self.head_bias, target, "identity",
                                label_smoothing=self.label_smoothing, backend=backend)
        d_out = grid_pool_backward(err.d_z.reshape(pooled.shape), out, self.local_head_grid)
        return LocalStepResult(out, err.loss, err.logits), d_out, err.head_grads

    def _conv_gradients(self, d_z: Tensor, a: Tensor, weight: Tensor) -> list[Tensor]:
        """``[g_weight, [g_bias]]`` from ``d_z`` (``aten.convolution_backward``). Under batch norm the
        bias gradient is 0 (the mean subtraction cancels the bias): computed, it is rounding noise
        that AdamW would scale up to lr-sized steps."""
        has_bias = self.bias is not None
        bias_grad = has_bias and self.normalize != "batchnorm"
        _, grad_w, grad_b = torch.ops.aten.convolution_backward(
            d_z,
            a,
            weight,
            [self.out_channels] if bias_grad else None,
            [self.stride] * 2,
            [self.padding] * 2,
            [1, 1],
            False,
            [0, 0],
            self.groups,
            [False, True, bias_grad],
        )
        if not has_bias:
            return [grad_w]
        return [grad_w, grad_b if bias_grad else torch.zeros_like(grad_w[:, 0, 0, 0])]
