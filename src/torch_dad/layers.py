"""DAD layers: ``DADLinear`` (a dense layer that trains itself from a local head) and ``DADModel``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from . import functional as F
from .optim import LocalOptimizerState, OptimizerConfig

__all__ = ["DADLinear", "DADModel", "LocalStepResult", "check_labels"]


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def check_labels(target: Tensor, batch: int, num_classes: int, *, check_values: bool = True) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``target`` is (batch,) int64-compatible ids in range."""
    if not isinstance(target, Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class ids, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"labels have dtype {target.dtype}; pass integer class ids (e.g. labels.long())"
        )
    if target.dim() != 1 or target.shape[0] != batch:
        raise ValueError(
            f"labels have shape {tuple(target.shape)} but the batch has {batch} rows; "
            f"pass one class id per row, shape ({batch},)"
        )
    if check_values and target.numel():
        low, high = int(target.min()), int(target.max())
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"labels must lie in [0, {num_classes}) (num_classes={num_classes}); "
                f"got values in [{low}, {high}]"
            )


def check_inputs(inputs: Tensor, in_features: int, *, check_values: bool = True, name: str = "inputs") -> None:
    """Raise unless ``inputs`` is a non-empty floating (batch, in_features) tensor (finite if checked)."""
    if not isinstance(inputs, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inputs).__name__}")
    if not inputs.dtype.is_floating_point:
        raise TypeError(f"{name} have dtype {inputs.dtype}; convert them with .float()")
    if inputs.dim() != 2 or inputs.shape[1] != in_features:
        raise ValueError(
            f"{name} have shape {tuple(inputs.shape)}; expected (batch, {in_features}) "
            f"to match in_features={in_features}"
        )
    if inputs.shape[0] == 0:
        raise ValueError(f"{name} are an empty batch; pass at least one row")
    # a NaN/Inf anywhere makes the sum non-finite: one reduction instead of isfinite().all(),
    # which cost 2.5% of a CPU step at B=1024
    if check_values and not bool(torch.isfinite(inputs.sum())) and not bool(torch.isfinite(inputs).all()):
        raise ValueError(f"{name} contain NaN or Inf; clean the data before training")


class LocalStepResult:
    """What one local step returns: the layer output (pre-update weights), loss, local logits,
    and whether the update was skipped because its gradients were not finite."""

    __slots__ = ("output", "loss", "logits", "skipped")

    def __init__(self, output: Tensor, loss: Tensor, logits: Tensor) -> None:
        self.output, self.loss, self.logits = output, loss, logits
        self.skipped = False


def gradients_are_finite(grads: list[Tensor]) -> bool:
    """``all(isfinite(g).all() for g in grads)``, via one sum per gradient (NaN/Inf propagate)."""
    total = torch.stack([g.float().sum() for g in grads]).sum()
    if bool(torch.isfinite(total)):
        return True
    # a finite but huge gradient can overflow the sum: confirm elementwise before failing
    return all(bool(torch.isfinite(g).all()) for g in grads)


class DADLinear(nn.Module):
    """A dense layer ``h = act(x @ weight.T + bias)`` trained by its own local classifier head.

    ``forward`` is the plain layer. :meth:`local_step` runs the layer on a batch, computes
    the closed-form gradients of ``CE(h @ head_weight.T + head_bias, y)`` (see
    :mod:`torch_dad.functional`) and updates ``weight``, ``bias`` and the head in place.

    The head (``head_weight``, ``head_bias``) and the optimizer moments are buffers: they
    are in ``state_dict`` but not in ``parameters()``, so a user's optimizer never sees them.

    ``local_loss`` picks the local rule (math in :func:`torch_dad.functional.local_rule_error`):
    ``"ce"`` (the seed's local head + cross-entropy), ``"predsim"`` (Nokland-Eidnes prediction
    + similarity matching, weight ``predsim_beta``) or ``"drtp"`` (head-free: regress ``h`` onto
    a fixed random projection of the one-hot target, kept in the ``target_projection`` buffer,
    drawn from ``projection_seed``; ``head_weight``/``head_bias`` are then ``None``).
    ``normalize="layernorm"`` makes the layer ``act(LN(x @ weight.T + bias))`` with a
    parameter-free LayerNorm, in training and inference alike.
    """

    # buffers; declared for type checkers (the head is None under "drtp", the projection otherwise)
    head_weight: Tensor
    head_bias: Tensor
    target_projection: Tensor
    bias: nn.Parameter | None

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
        predsim_beta: float = F.PREDSIM_BETA,
        projection_seed: int = 0,
        normalize: str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _check_positive_int("in_features", in_features)
        self.out_features = _check_positive_int("out_features", out_features)
        self.num_classes = _check_positive_int("num_classes", num_classes)
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes} must be >= 2")
        self.activation = F.check_activation(activation)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing!r} must lie in [0, 1)")
        self.label_smoothing = float(label_smoothing)
        F.check_local_loss(local_loss)
        _check_rule_options(predsim_beta, projection_seed)
        self.predsim_beta = float(predsim_beta)
        if normalize is not None and normalize not in F.NORMALIZATIONS:
            raise ValueError(f"normalize={normalize!r} must be None or one of {', '.join(F.NORMALIZATIONS)}")
        self.normalize = normalize
        self.projection_seed = projection_seed
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.local_loss = ""
        self.set_local_loss(local_loss)

    def set_local_loss(self, local_loss: str) -> None:
        """Switch the local rule: (re)creates the head or the projection and, if the rule
        changes, the optimizer state (layer weights are kept; moments restart from zero)."""
        F.check_local_loss(local_loss)
        if local_loss == self.local_loss:
            return
        kw: dict[str, Any] = {"device": self.weight.device, "dtype": self.weight.dtype}
        if local_loss == "drtp":
            self.register_buffer("head_weight", None)
            self.register_buffer("head_bias", None)
            self.register_buffer("target_projection", torch.empty(self.num_classes, self.out_features, **kw))
        else:
            self.register_buffer("target_projection", None)
            if self.local_loss in ("", "drtp"):
                self.register_buffer("head_weight", torch.empty(self.num_classes, self.out_features, **kw))
                self.register_buffer("head_bias", torch.empty(self.num_classes, **kw))
        first = self.local_loss == ""
        self.local_loss = local_loss
        if first:
            self.reset_parameters()
        else:
            self._reset_local()
        shapes = [p.shape for p in self._trained_tensors()]
        self.optim_state = LocalOptimizerState(shapes, **kw)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation for the layer and for its local head."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.in_features)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
        self._reset_local()

    @torch.no_grad()
    def _reset_local(self) -> None:
        if self.local_loss == "drtp":
            projection = F.target_projection(self.out_features, self.num_classes, self.projection_seed)
            self.target_projection.copy_(projection)
            return
        nn.init.kaiming_uniform_(self.head_weight, a=math.sqrt(5))
        nn.init.uniform_(self.head_bias, -1.0 / math.sqrt(self.out_features), 1.0 / math.sqrt(self.out_features))

    def _trained_tensors(self) -> list[Tensor]:
        tensors: list[Tensor] = [self.weight]
        if self.bias is not None:
            tensors.append(self.bias)
        if self.local_loss == "drtp":
            return tensors
        return [*tensors, self.head_weight, self.head_bias]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_classes={self.num_classes}, bias={self.bias is not None}, activation={self.activation!r}, "
            f"local_loss={self.local_loss!r}" + (f", normalize={self.normalize!r}" if self.normalize else "")
        )

    def forward(self, inputs: Tensor) -> Tensor:
        """``act(inputs @ weight.T + bias)``."""
        z = nn.functional.linear(inputs, self.weight, self.bias)
        if self.normalize is not None:
            z = F.layer_norm_forward(z)[0]
        return F.activation_forward(z, self.activation)

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
        workspace: dict[str, Tensor] | None = None,
    ) -> tuple[LocalStepResult, list[Tensor]]:
        """The layer's output, local loss and closed-form gradients, without updating anything.

        Same math as :func:`torch_dad.functional.local_loss_and_gradients` (the test oracle),
        arranged to reuse buffers: ``addmm`` for the biases, an in-place activation and an
        in-place ``softmax - onehot``. Gradients are returned in the order of the trained
        tensors: ``weight, [bias,] head_weight, head_bias``, in float32 master precision
        (no head gradients for the head-free ``"drtp"`` rule).

        ``workspace`` (a dict owned by the caller) keeps the three large buffers (``z``,
        ``d_z``, ``g_W``) alive between calls with the same shapes. On CPU, fresh multi-MB
        allocations are served by mmap and page-faulted on every step (0.48 ms vs 0.07 ms
        to fill a reused 4 MB buffer on the 2-core machine). The returned output then
        aliases ``workspace["z"]`` and is overwritten by the next call.
        """
        dtype = compute_dtype or self.weight.dtype
        ws = workspace if workspace is not None else {}

        def buffer(name: str, rows: int, cols: int) -> Tensor | None:
            if workspace is None:
                return None
            buf = ws.get(name)
            if buf is None or buf.shape != (rows, cols) or buf.dtype != dtype or buf.device != inputs.device:
                buf = ws[name] = torch.empty(rows, cols, dtype=dtype, device=inputs.device)
            return buf

        a = inputs.to(dtype)
        w = self.weight.to(dtype)
        batch = a.shape[0]
        z_buf = buffer("z", batch, self.out_features)
        if self.bias is not None:
            z = torch.addmm(self.bias.to(dtype), a, w.T, out=z_buf)
        else:
            z = torch.mm(a, w.T, out=z_buf)
        inv_std = None
        if self.normalize is not None:
            z, inv_std = F.layer_norm_forward(z)
        if self.activation == "relu":
            # z is not needed again (relu' is read off h) unless LayerNorm's backward needs it
            h = z.relu_() if inv_std is None else z.relu()
        else:
            h = F.activation_forward(z, self.activation)
        if self.local_loss != "ce":
            return self._rule_gradients(a, z, h, target, inv_std)
        w_head = self.head_weight.to(dtype)
        b_head = self.head_bias.to(dtype)
        logits = torch.addmm(b_head, h, w_head.T)
        if self.label_smoothing:
            loss, d_logits = F.cross_entropy_error(logits.float(), target, label_smoothing=self.label_smoothing)
            d_logits = d_logits.to(dtype)
        else:
            loss, d_logits = _fast_cross_entropy_error(logits, target)
        d_z = torch.mm(d_logits, w_head, out=buffer("d_z", batch, self.out_features))
        if self.activation == "relu":
            # one fused pass (autograd's own ReLU backward); masked_fill_(h <= 0) took 2
            # passes and 6% of the step on the 2-core CPU
            d_z = torch.ops.aten.threshold_backward.grad_input(d_z, h, 0, grad_input=d_z)
        else:
            d_z = d_z.mul_(F.activation_derivative(z, h, self.activation))
        if inv_std is not None:
            d_z = F.layer_norm_backward(d_z, z, inv_std)
        grads = [torch.mm(d_z.T, a, out=buffer("g_w", self.out_features, self.in_features))]
        if self.bias is not None:
            grads.append(d_z.sum(0))
        grads += [d_logits.T @ h, d_logits.sum(0)]
        master = self.weight.dtype
        grads = [g if g.dtype == master else g.to(master) for g in grads]
        return LocalStepResult(h, loss, logits), grads

    def _rule_gradients(
        self, a: Tensor, z: Tensor, h: Tensor, target: Tensor, inv_std: Tensor | None
    ) -> tuple[LocalStepResult, list[Tensor]]:
        # "predsim"/"drtp": the rule's error is computed by the functional oracle in at least
        # float32 (the B x B similarity matrix loses too much in bf16), the GEMMs in `dtype`
        dtype = h.dtype
        wide = h if dtype in (torch.float32, torch.float64) else h.float()
        head_w = self.head_weight.to(wide.dtype) if self.head_weight is not None else None
        head_b = self.head_bias.to(wide.dtype) if self.head_bias is not None else None
        rule = F.local_rule_error(
            self.local_loss, wide, target, head_w, head_b, projection=self.target_projection,
            beta=self.predsim_beta, label_smoothing=self.label_smoothing,
        )
        d_h = rule.grad_output.to(dtype)
        if self.activation == "relu":
            d_z = torch.ops.aten.threshold_backward(d_h, h, 0)
        else:
            d_z = d_h * F.activation_derivative(z, h, self.activation)
        if inv_std is not None:
            d_z = F.layer_norm_backward(d_z, z, inv_std)
        grads = [d_z.T @ a]
        if self.bias is not None:
            grads.append(d_z.sum(0))
        if rule.grad_head_weight is not None and rule.grad_head_bias is not None:
            grads += [rule.grad_head_weight, rule.grad_head_bias]
        logits = rule.logits if rule.logits is not None else self.local_head(h)
        master = self.weight.dtype
        grads = [g if g.dtype == master else g.to(master) for g in grads]
        return LocalStepResult(h, rule.loss, logits), grads

    @torch.no_grad()
    def local_step(
        self,
        inputs: Tensor,
        target: Tensor,
        config: OptimizerConfig | None = None,
        lr: float | Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
        reduce_gradients: Callable[[list[Tensor]], None] | None = None,
        workspace: dict[str, Tensor] | None = None,
        on_nonfinite: str = "ignore",
    ) -> LocalStepResult:
        """One decoupled step: forward, local error, in-place update of layer and head.

        Returns the output ``h`` computed with the weights *before* the update (what the
        next layer consumes, as in sequential training), the local loss and local logits.
        ``reduce_gradients`` (e.g. an all-reduce mean across processes) is applied in place
        to the gradient list before the update. ``on_nonfinite``: with ``"raise"`` or
        ``"skip"``, gradients containing NaN/Inf are detected (one reduction per gradient,
        a host sync on CUDA) and the update is not applied (``result.skipped`` is True);
        ``"raise"`` then raises ``FloatingPointError``.
        """
        result, grads = self.local_gradients(inputs, target, compute_dtype, workspace)
        if reduce_gradients is not None:
            reduce_gradients(grads)
        # NaN/Inf anywhere in d_z reaches the bias gradient d_z.sum(0), so with a bias the
        # (out x in) weight gradient need not be read again: that full pass cost 2% of a CPU step
        checked = grads[1:] if self.bias is not None else grads
        if on_nonfinite != "ignore" and not (bool(torch.isfinite(result.loss)) and gradients_are_finite(checked)):
            result.skipped = True
            if on_nonfinite == "raise":
                raise FloatingPointError(
                    f"non-finite local gradients in {self!r} (learning rate too high, or overflow in "
                    "half precision?); this layer was not updated. Lower lr, or pass "
                    "on_nonfinite='skip' to skip such updates and count them"
                )
            return result
        self.optim_state.apply_(self._trained_tensors(), grads, config or OptimizerConfig(), lr)
        return result


def _check_rule_options(predsim_beta: float, projection_seed: int) -> None:
    if isinstance(predsim_beta, bool) or not isinstance(predsim_beta, (int, float)) or not 0.0 <= predsim_beta <= 1.0:
        raise ValueError(f"predsim_beta={predsim_beta!r} must be a float in [0, 1] (the paper uses 0.99)")
    if isinstance(projection_seed, bool) or not isinstance(projection_seed, int) or projection_seed < 0:
        raise ValueError(f"projection_seed={projection_seed!r} must be an int >= 0")


def _fast_cross_entropy_error(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``(mean CE, (softmax(logits) - onehot(target)) / B)`` with every label valid.

    The in-place twin of :func:`torch_dad.functional.cross_entropy_error`; half-precision
    logits are widened to float32 for the softmax.
    """
    batch = logits.shape[0]
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    log_probs = torch.log_softmax(wide, dim=-1)
    loss = -log_probs.gather(1, target.unsqueeze(1)).mean()
    d_logits = log_probs.exp_()
    d_logits.scatter_add_(1, target.unsqueeze(1), torch.full_like(d_logits[:, :1], -1.0))
    d_logits.mul_(1.0 / batch)
    return loss, d_logits.to(logits.dtype)


class DADModel(nn.Module):
    """Base class for models built from :class:`DADLinear` layers.

    ``model(x)`` flattens ``x`` to (B, -1), runs the DAD layers in registration order,
    then ``self.classifier`` if the model has one, otherwise the last layer's local head.
    Subclasses only declare layers in ``__init__``, as in the seed quickstart.
    """

    @property
    def dad_layers(self) -> list[DADLinear]:
        """Every :class:`DADLinear` in the model, in registration order."""
        return [m for m in self.modules() if isinstance(m, DADLinear)]

    @property
    def head(self) -> nn.Linear | None:
        """``self.classifier`` if it is an ``nn.Linear``, else ``None``."""
        head = getattr(self, "classifier", None)
        if head is None:
            return None
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"model.classifier must be a torch.nn.Linear, got {type(head).__name__}"
            )
        return head

    @property
    def num_classes(self) -> int:
        """Number of classes: the classifier's outputs, or the last layer's local head's."""
        head = self.head
        if head is not None:
            return head.out_features
        return self._require_layers()[-1].num_classes

    def _require_layers(self) -> list[DADLinear]:
        layers = self.dad_layers
        if not layers:
            raise ValueError(f"{type(self).__name__} has no DADLinear layers; register at least one")
        return layers

    def iter_features(self, inputs: Tensor) -> Iterator[Tensor]:
        """Yield each DAD layer's output in turn, starting from ``inputs.flatten(1)``."""
        h = inputs.reshape(inputs.shape[0], -1)
        for layer in self._require_layers():
            h = layer(h)
            yield h

    def features(self, inputs: Tensor) -> Tensor:
        """Output of the last DAD layer: what ``classifier`` (or the local head) sees."""
        h = inputs
        for output in self.iter_features(inputs):
            h = output
        return h

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits: ``classifier(features(x))`` if a classifier exists, else the last local head."""
        h = self.features(inputs)
        head = self.head
        if head is not None:
            return head(h)
        return self.dad_layers[-1].local_head(h)

    def forward_inference(self, inputs: Tensor) -> Tensor:
        """Alias of :meth:`forward`: inference is just a forward pass."""
        return self.forward(inputs)

    def local_head_logits(self, inputs: Tensor) -> Tensor:
        """Logits of the last DAD layer's local head (ignores ``classifier``)."""
        return self.dad_layers[-1].local_head(self.features(inputs))
