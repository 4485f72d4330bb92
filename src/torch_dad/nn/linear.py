"""DAD layers: ``DADLinear`` (a dense layer that trains itself from a local head) and ``DADModel``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import check_fraction, check_int, check_num_classes, check_positive_int
from ..ops.gram import accumulate_mm
from ..ops.normalization import NormalizationSaved, normalization_backward, normalization_forward
from ..optim import LocalOptimizerState, OptimizerConfig
from ._batchnorm import BatchNormLayer
from ._local import DenseError, LocalLayer, activation_backward, dense_local_error

__all__ = ["DADLinear", "DADModel", "LocalStepResult", "stream_rows"]

Workspace = dict[str, Tensor]

#: a local step whose output (rows x out_features in the compute dtype) is larger than this runs in row blocks
STREAM_MIN_BYTES = 64 * 2**20
#: the output of one row block: at most this many bytes
STREAM_BLOCK_BYTES = 8 * 2**20


def stream_rows(rows: int, cols: int, itemsize: int) -> int | None:
    """Rows per block of a local step whose output is ``rows x cols`` of ``itemsize`` bytes, or ``None`` (the
    whole batch at once): a step streams where its output exceeds ``STREAM_MIN_BYTES``, in blocks of at most
    ``STREAM_BLOCK_BYTES``."""
    if rows * cols * itemsize <= STREAM_MIN_BYTES:
        return None
    return max(1, STREAM_BLOCK_BYTES // (cols * itemsize))


class LocalStepResult:
    """What one local step returns: the layer output (pre-update weights), loss, local logits,
    and whether the update was skipped because its gradients were not finite."""

    __slots__ = ("output", "loss", "logits", "skipped")

    def __init__(self, output: Tensor, loss: Tensor, logits: Tensor) -> None:
        self.output, self.loss, self.logits = output, loss, logits
        self.skipped = False


class DADLinear(BatchNormLayer):
    """A dense layer ``h = act(x @ weight.T + bias)`` trained by its own local head.

    ``forward`` is the plain layer. :meth:`local_step` runs the layer on a batch, computes
    the closed-form gradients of ``CE(h @ head_weight.T + head_bias, y)`` (see
    :mod:`torch_dad.functional`) and updates ``weight``, ``bias`` and the local head in place.

    The local head (``head_weight``, ``head_bias``) and the optimizer moments are buffers: they
    are in ``state_dict`` but not in ``parameters()``, so a user's optimizer never sees them.

    ``local_loss`` picks the local rule (math in :func:`torch_dad.functional.local_rule_error`):
    ``"ce"`` (local head + cross-entropy, the default), ``"predsim"`` (Nokland-Eidnes prediction
    + similarity matching, weight ``predsim_beta``) or ``"drtp"`` (head-free: regress ``h`` onto
    a fixed random projection of the one-hot target, kept in the ``target_projection`` buffer,
    drawn from ``projection_seed``; ``head_weight``/``head_bias`` are then ``None``).
    ``normalize="layernorm"`` makes the layer ``act(LN(x @ weight.T + bias))`` with a
    parameter-free LayerNorm, in training and inference alike. ``normalize="batchnorm"`` makes it
    ``act(BN(x @ weight.T + bias))`` as ``nn.BatchNorm1d``: batch statistics in training, the
    ``running_mean``/``running_var`` buffers (momentum 0.1, eps 1e-5) in eval mode, and the affine
    ``norm_weight``/``norm_bias`` (parameters) trained by the local loss. The running statistics
    advance with each applied local update (:meth:`apply_local_update`), so a skipped update
    leaves them unchanged. ``activation="leaky_relu"`` has torch's negative slope 0.01.
    """

    # buffers; declared for type checkers (the head is None under "drtp", the projection otherwise)
    head_weight: Tensor
    head_bias: Tensor
    target_projection: Tensor
    optim_state: LocalOptimizerState
    _small_batch_fix = "normalize='layernorm'"
    local_losses = functional.LOCAL_LOSSES

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_classes: int = 10,
        bias: bool = True,
        activation: str = "relu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        label_smoothing: float = 0.0,
        local_loss: str = "ce",
        predsim_beta: float = functional.PREDSIM_BETA,
        projection_seed: int = 0,
        normalize: str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.num_classes = check_num_classes(num_classes)
        self.activation = functional.check_activation(activation)
        self.label_smoothing = check_fraction("label_smoothing", label_smoothing)
        functional.check_local_loss(local_loss)
        self.predsim_beta = check_fraction("predsim_beta", predsim_beta, closed=True, hint=" (the paper uses 0.99)")
        if check_int("projection_seed", projection_seed) < 0:
            raise ValueError(f"projection_seed={projection_seed!r} must be an int >= 0")
        if normalize is not None and normalize not in functional.NORMALIZATIONS:
            raise ValueError(f"normalize={normalize!r} must be None or one of {', '.join(functional.NORMALIZATIONS)}")
        self.normalize = normalize
        self.projection_seed = projection_seed
        self._init_linear(in_features, out_features, bias, device, dtype)
        self._init_batch_norm(normalize == "batchnorm", out_features)
        self.local_loss = ""
        self.set_local_loss(local_loss)

    def set_local_loss(self, local_loss: str) -> None:
        """Switch the local rule: (re)creates the local head or the projection and, if the rule
        changes, the optimizer state (layer weights are kept; moments restart from zero)."""
        functional.check_local_loss(local_loss)
        if local_loss == self.local_loss:
            return
        drtp = local_loss == "drtp"
        self._init_local_head(None if drtp else self.num_classes)
        projection = torch.empty(self.num_classes, self.out_features, device=self.weight.device, dtype=self.weight.dtype)
        self.register_buffer("target_projection", projection if drtp else None)
        first = self.local_loss == ""
        self.local_loss = local_loss
        if first:
            self.reset_parameters()
        else:
            self._reset_local()
        self.optim_state = self._new_optim_state()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, and ``nn.BatchNorm1d``'s for the batch norm (if any)."""
        super().reset_parameters()
        self._reset_batch_norm()

    @torch.no_grad()
    def _reset_local(self) -> None:
        if self.local_loss == "drtp":
            projection = functional.target_projection(self.out_features, self.num_classes, self.projection_seed)
            self.target_projection.copy_(projection)
        else:
            super()._reset_local()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_classes={self.num_classes}, bias={self.bias is not None}, activation={self.activation!r}, "
            f"local_loss={self.local_loss!r}" + (f", normalize={self.normalize!r}" if self.normalize else "")
        )

    def forward(self, inputs: Tensor) -> Tensor:
        """``act(inputs @ weight.T + bias)``, normalised before the activation if ``normalize``
        (batch norm: by the batch's statistics in training mode, the running ones in eval mode;
        the running statistics change only with a local update). Inputs with more than two
        dimensions (e.g. a convolution's (B, C, H, W) output) are flattened to (B, -1) first."""
        if inputs.dim() > 2:
            inputs = inputs.flatten(1)
        z = nn.functional.linear(inputs, self.weight, self.bias)
        if self.normalize == "layernorm":
            z = functional.layer_norm_forward(z)[0]
        elif self.normalize == "batchnorm":
            z = self._batch_norm(z, training=self.training)[0]
        return functional.activation_forward(z, self.activation)

    def local_head(self, hidden: Tensor) -> Tensor:
        """Local logits ``hidden @ head_weight.T + head_bias``.

        Head-free ``"drtp"``: ``-||hidden - P[c]||^2 / 2`` up to a per-row constant, i.e.
        ``hidden @ P.T - ||P[c]||^2 / 2`` (argmax = the nearest fixed target).
        """
        if self.local_loss == "drtp":
            proj = self.target_projection.to(hidden.dtype)
            return nn.functional.linear(hidden, proj, -0.5 * proj.pow(2).sum(1))
        return nn.functional.linear(hidden, self.head_weight, self.head_bias)

    @torch.no_grad()
    def local_gradients(
        self,
        inputs: Tensor,
        target: Tensor,
        compute_dtype: torch.dtype | None = None,
        workspace: Workspace | None = None,
        *,
        backend: str = "torch",
        reuse_input: bool = False,
        weights: tuple[Tensor, Tensor | None] | None = None,
    ) -> tuple[LocalStepResult, list[Tensor]]:
        """The layer's output, local loss and closed-form gradients, without updating anything.

        Same math as :func:`torch_dad.functional.local_loss_and_gradients` (the test oracle):
        :meth:`step_forward`, :meth:`step_error`, then ``g_W = d_z.T @ a``. Gradients are returned in
        the order of :meth:`trained_tensors`: ``weight, [bias,] head_weight, head_bias, [norm_weight,
        norm_bias]``, in float32 master precision (no local-head gradients for the head-free ``"drtp"``
        rule). Under ``normalize="batchnorm"`` the batch statistics are kept for the update to fold
        into the running ones. Free of host syncs and of data-dependent shapes (capturable).

        ``backend``: ``"torch"`` (PyTorch ops) or ``"triton"`` (the fused local-error kernel where it
        applies). ``workspace`` (a dict owned by the caller) keeps the large buffers (``z``, ``d_z``,
        ``g_W``) between calls with the same shapes, because on CPU fresh multi-MB allocations are
        page-faulted on every step; the returned output then aliases ``workspace["z"]``. Inputs with
        more than two dimensions are flattened to (B, -1), as in :meth:`forward`.

        A large step (:meth:`streams`) runs in row blocks (:meth:`_streamed_gradients`): nothing of the
        output's size exists beside the output, and with ``reuse_input`` (the caller no longer needs ``inputs``)
        the output is written over ``inputs`` where their shapes and dtypes allow. ``weights``: ``(weight, bias)``
        already in ``compute_dtype`` (copies a caller keeps), read instead of casting the masters.
        """
        dtype = compute_dtype or self.weight.dtype
        rows = inputs.flatten(1) if inputs.dim() > 2 else inputs
        block = self._stream_block(rows.shape[0], dtype)
        if block is not None:
            return self._streamed_gradients(rows, target, dtype, block, backend, reuse_input, weights)
        a = rows.to(dtype)
        weight, bias = weights or (None, None)
        z, h, norm = self.step_forward(a, weight, bias, workspace=workspace)
        err = self.step_error(h, z, norm, target, backend=backend, workspace=workspace)
        g_w = _buffer(workspace, "g_w", self.weight, dtype=dtype, device=a.device)
        grads = [torch.mm(err.d_z.T, a, out=g_w)]
        if self.bias is not None:
            grads.append(err.grad_bias)
        master = self.weight.dtype
        grads = [g if g.dtype == master else g.to(master) for g in grads + err.head_grads]
        return LocalStepResult(h, err.loss, err.logits), grads

    def streams(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether :meth:`local_gradients` on ``rows`` rows in ``dtype`` runs in row blocks: where
        :func:`stream_rows` says so and the rule is row-wise (``"ce"``, no batch norm)."""
        return self._stream_block(rows, dtype) is not None

    def _stream_block(self, rows: int, dtype: torch.dtype) -> int | None:
        """The rows per block of a streamed step (:meth:`streams`), or ``None``."""
        if self.local_loss != "ce" or self.normalize == "batchnorm":
            return None
        return stream_rows(rows, self.out_features, dtype.itemsize)

    def _streamed_gradients(self, rows: Tensor, target: Tensor, dtype: torch.dtype, block: int, backend: str,
                            reuse_input: bool, weights: tuple[Tensor, Tensor | None] | None
                            ) -> tuple[LocalStepResult, list[Tensor]]:
        """:meth:`local_gradients` in blocks of ``block`` rows: each block's forward and local error, its share of
        the gradients accumulated in the master dtype (scaled by its share of the rows, so the sums are the
        batch's means), then its output rows written (over its input rows when ``reuse_input`` allows)."""
        n, master = rows.shape[0], self.weight.dtype
        weight, bias = weights or (self.weight.to(dtype), self.bias.to(dtype) if self.bias is not None else None)
        same_layout = rows.shape[1] == self.out_features and rows.dtype == dtype and rows.is_contiguous()
        output = rows if reuse_input and same_layout else rows.new_empty((n, self.out_features), dtype=dtype)
        g_w = torch.empty_like(self.weight)
        sums: list[Tensor] = []
        logits: Tensor | None = None
        losses: list[Tensor] = []
        for start in range(0, n, block):
            stop = min(n, start + block)
            share = (stop - start) / n
            a = rows[start:stop].to(dtype)
            z, h, norm = self.step_forward(a, weight, bias)
            err = self.step_error(h, z, norm, target[start:stop], backend=backend)
            accumulate_mm(g_w, err.d_z.T, a, first=start == 0, alpha=share)
            parts = ([err.grad_bias] if self.bias is not None else []) + err.head_grads
            sums = [p.to(master) * share for p in parts] if not sums else [s.add_(p.to(master), alpha=share)
                                                                            for s, p in zip(sums, parts)]
            if logits is None:
                logits = err.logits.new_empty((n, err.logits.shape[1]))
            logits[start:stop] = err.logits
            losses.append(err.loss * share)
            output[start:stop] = h  # after the block's input rows were last read: they may be these rows
            del a, z, h, err, parts  # before the next block's: one block's temporaries at a time
        assert logits is not None
        return LocalStepResult(output, torch.stack(losses).sum(), logits), [g_w, *sums]

    def step_forward(
        self, a: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, workspace: Workspace | None = None
    ) -> tuple[Tensor, Tensor, NormalizationSaved | None]:
        """``(z, h, norm)`` of a local step on rows ``a``: the pre-activation (normalised if
        ``normalize``), the output and what the normalisation's backward reads (or ``None``).

        ``weight``/``bias`` are copies in ``a``'s dtype (default: the masters, cast). An activation
        whose derivative is read off ``h`` is applied in place (``z`` is then ``h``); ReLU without a
        normalisation or a workspace rides in the GEMM's epilogue (one launch).
        """
        if weight is None:
            weight = self.weight.to(a.dtype)
            bias = self.bias.to(a.dtype) if self.bias is not None else None
        if workspace is None and bias is not None and self.activation == "relu" and self.normalize is None:
            h = torch._addmm_activation(bias, a, weight.T)
            return h, h, None
        z_buf = _buffer(workspace, "z", a, cols=self.out_features)
        z = torch.addmm(bias, a, weight.T, out=z_buf) if bias is not None else torch.mm(a, weight.T, out=z_buf)
        norm = None
        if self.normalize == "layernorm":
            z, norm = normalization_forward("layernorm", z)
        elif self.normalize == "batchnorm":
            z, norm = self._batch_norm(z, training=True, keep=True)
        if self.activation == "relu":
            return z, z.relu_(), norm
        if self.activation == "leaky_relu":
            return z, nn.functional.leaky_relu_(z, functional.LEAKY_RELU_SLOPE), norm
        if self.activation == "tanh":
            return z, z.tanh_(), norm
        return z, functional.activation_forward(z, self.activation), norm

    def step_error(
        self, h: Tensor, z: Tensor, norm: NormalizationSaved | None, target: Tensor, *, backend: str = "torch",
        workspace: Workspace | None = None,
    ) -> DenseError:
        """The local error of :meth:`step_forward`'s output under the layer's rule: ``d_z`` (taken back
        through the normalisation), the bias gradient, and the gradients of the local head and the
        batch norm's affine (:meth:`trained_tensors` order). ``backend`` as in :meth:`local_gradients`."""
        if self.local_loss != "ce":
            result, d_h, head_grads = self._rule_error(h, target)
            d_z = activation_backward(d_h, h, z, self.activation, inplace=True)
            err = DenseError(result.logits, result.loss, d_z, d_z.sum(0), head_grads)
        else:
            err = dense_local_error(
                h, z, self.head_weight, self.head_bias, target, self.activation, label_smoothing=self.label_smoothing,
                backend=backend, d_h_out=_buffer(workspace, "d_z", h),
            )
        if norm is None:
            return err
        d_z, norm_grads = normalization_backward(err.d_z, norm, self.norm_weight)
        # under batch norm the bias gradient is 0 (the mean subtraction cancels the bias): computed,
        # it is rounding noise that AdamW would scale up to lr-sized steps
        grad_bias = d_z.new_zeros(d_z.shape[1]) if self.normalize == "batchnorm" else d_z.sum(0, dtype=err.grad_bias.dtype)
        return err._replace(d_z=d_z, grad_bias=grad_bias, head_grads=err.head_grads + norm_grads)

    def _rule_error(self, h: Tensor, target: Tensor) -> tuple[LocalStepResult, Tensor, list[Tensor]]:
        """``"predsim"``/``"drtp"``: ``(result, d_h, local-head gradients)`` from the functional
        oracle, in at least float32 (the B x B similarity matrix loses too much in bf16)."""
        wide = h if h.dtype in (torch.float32, torch.float64) else h.float()
        head_w = self.head_weight.to(wide.dtype) if self.head_weight is not None else None
        head_b = self.head_bias.to(wide.dtype) if self.head_bias is not None else None
        rule = functional.local_rule_error(
            self.local_loss, wide, target, head_w, head_b, projection=self.target_projection,
            beta=self.predsim_beta, label_smoothing=self.label_smoothing,
        )
        head_grads = []
        if rule.grad_head_weight is not None and rule.grad_head_bias is not None:
            head_grads = [rule.grad_head_weight, rule.grad_head_bias]
        logits = rule.logits if rule.logits is not None else self.local_head(h)
        return LocalStepResult(h, rule.loss, logits), rule.grad_output.to(h.dtype), head_grads

    def nonfinite_witnesses(self, grads: list[Tensor]) -> list[Tensor]:
        # with finite inputs, a NaN/Inf anywhere in d_z reaches the bias gradient d_z.sum(0): the
        # (out x in) weight gradient need not be read
        return grads[1:] if self.bias is not None else grads

    @torch.no_grad()
    def local_step(
        self,
        inputs: Tensor,
        target: Tensor,
        config: OptimizerConfig | None = None,
        lr: float | Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
        reduce_gradients: Callable[[list[Tensor]], None] | None = None,
        workspace: Workspace | None = None,
        on_nonfinite: str = "ignore",
    ) -> LocalStepResult:
        """One decoupled step: :meth:`local_gradients`, then :meth:`apply_local_update`.

        Returns the output ``h`` computed with the weights *before* the update (what the
        next layer consumes, as in sequential training), the local loss and local logits.
        ``reduce_gradients`` (e.g. an all-reduce mean across processes) is applied in place
        to the gradient list before the update. ``on_nonfinite``: with ``"raise"`` or
        ``"skip"``, a non-finite loss or gradient leaves the layer unchanged
        (``result.skipped`` is True); ``"raise"`` then raises ``FloatingPointError``.
        """
        result, grads = self.local_gradients(inputs, target, compute_dtype, workspace)
        if reduce_gradients is not None:
            reduce_gradients(grads)
        config = config or OptimizerConfig()
        result.skipped = not self.apply_local_update(grads, config, lr, on_nonfinite=on_nonfinite, loss=result.loss)
        return result


def _buffer(
    workspace: Workspace | None,
    name: str,
    like: Tensor,
    *,
    cols: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> Tensor | None:
    """``workspace[name]``, (re)allocated as ``like``'s rows x ``cols`` (default: like's shape),
    dtype and device; ``None`` without a workspace (the GEMM then allocates)."""
    if workspace is None:
        return None
    shape = (like.shape[0], cols if cols is not None else like.shape[1])
    dtype, device = dtype or like.dtype, device or like.device
    buf = workspace.get(name)
    if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
        buf = workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


class DADModel(nn.Module):
    """Base class for models built from DAD layers: :class:`DADLinear`, :class:`~torch_dad.DADConv2d`
    and :class:`~torch_dad.DADBlock`, in any mix.

    ``model(x)`` runs the layers in registration order on ``x`` as given (a :class:`DADLinear`
    flattens a (B, C, H, W) input itself), then ``self.classifier`` on the last output flattened to
    (B, -1) if the model has one, otherwise the last layer's local head.
    Subclasses only declare layers in ``__init__``.
    """

    @property
    def local_layers(self) -> list[LocalLayer]:
        """Every layer the trainer trains, in registration order: each :class:`LocalLayer` submodule
        with a ``local_gradients`` method (a :class:`DADLinear`, ``DADConv2d`` or ``DADBlock``); the
        modules inside such a layer (e.g. a ``DADBlock``'s block) are not searched."""
        found: list[LocalLayer] = []

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if isinstance(child, LocalLayer) and callable(getattr(child, "local_gradients", None)):
                    found.append(child)
                else:
                    visit(child)

        visit(self)
        return found

    @property
    def dad_layers(self) -> list[Any]:
        """:attr:`local_layers` (the name from when every DAD layer was a :class:`DADLinear`)."""
        return self.local_layers

    def get_classifier(self) -> nn.Linear | None:
        """``self.classifier`` (the model's output layer) if the model declares one, else ``None``;
        ``TypeError`` if it is not an ``nn.Linear``."""
        classifier = getattr(self, "classifier", None)
        if classifier is None:
            return None
        if not isinstance(classifier, nn.Linear):
            raise TypeError(
                f"model.classifier must be a torch.nn.Linear, got {type(classifier).__name__}"
            )
        return classifier

    @property
    def num_classes(self) -> int:
        """Number of classes: the classifier's outputs, or the last layer's local head's."""
        classifier = self.get_classifier()
        if classifier is not None:
            return classifier.out_features
        return self.require_layers()[-1].num_classes

    def require_layers(self) -> list[Any]:
        """:attr:`local_layers`, or ``ValueError`` if the model has none."""
        layers = self.local_layers
        if not layers:
            raise ValueError(
                f"{type(self).__name__} has no DADLinear layers (nor DADConv2d / DADBlock); register at least one"
            )
        return layers

    def iter_features(self, inputs: Tensor) -> Iterator[Tensor]:
        """Yield each DAD layer's output in turn, starting from ``inputs`` as given."""
        h = inputs
        for layer in self.require_layers():
            h = layer(h)
            yield h

    def last_output(self, inputs: Tensor) -> Tensor:
        """Output of the last DAD layer in its own shape: what its local head reads."""
        h = inputs
        for output in self.iter_features(inputs):
            h = output
        return h

    def features(self, inputs: Tensor) -> Tensor:
        """Output of the last DAD layer flattened to (B, -1): what ``classifier`` sees."""
        return self.last_output(inputs).flatten(1)

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits: ``classifier(features(x))`` if a classifier exists, else the last local head."""
        classifier = self.get_classifier()
        if classifier is not None:
            return classifier(self.features(inputs))
        return self.local_head_logits(inputs)

    def forward_inference(self, inputs: Tensor) -> Tensor:
        """Alias of :meth:`forward`: inference is just a forward pass."""
        return self.forward(inputs)

    def local_head_logits(self, inputs: Tensor) -> Tensor:
        """Logits of the last DAD layer's local head (ignores ``classifier``)."""
        return self.require_layers()[-1].local_head(self.last_output(inputs))
