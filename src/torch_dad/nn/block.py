"""``DADBlock``: any ``nn.Module`` (a residual block, a transformer encoder block) trained by a local head."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import check_fraction, check_int, check_num_classes, check_positive_int
from ..ops.linear_cross_entropy import check_token_layout
from ..optim import LocalOptimizerState
from ._local import LocalLayer, dense_local_error
from .linear import LocalStepResult
from .sequence_heads import TOKEN_HEADS, TokenHead, make_token_head

__all__ = ["DADBlock", "MeanPoolHead"]


class MeanPoolHead(nn.Module):
    """``Linear(in_features -> num_classes)`` on the mean over every dimension but the batch and
    ``feature_dim``: ``(B, C, H, W)`` with ``feature_dim=1`` averages over space (global average
    pooling), ``(B, T, D)`` with ``feature_dim=-1`` over tokens; a ``(B, D)`` input is used as is.
    ``DADBlock`` trains it in closed form (the local error of every DAD layer, on the pooled features)."""

    def __init__(self, in_features: int, num_classes: int, feature_dim: int = 1) -> None:
        super().__init__()
        self.feature_dim = check_int("feature_dim", feature_dim)
        if feature_dim == 0:
            raise ValueError("feature_dim=0 is the batch dimension; pass the features' dimension (1 or -1)")
        self.linear = nn.Linear(check_positive_int("in_features", in_features), check_num_classes(num_classes))

    def forward(self, hidden: Tensor) -> Tensor:
        features = hidden.movedim(self.feature_dim, -1)
        if features.dim() > 2:
            features = features.mean(tuple(range(1, features.dim() - 1)))
        return self.linear(features)


def _build_head(
    local_head: nn.Module | str | None, num_classes: int | None, head_features: int | None, feature_dim: int
) -> nn.Module:
    """The local head ``DADBlock``'s arguments describe (see its docstring), checked."""
    if isinstance(local_head, TokenHead):
        if num_classes is not None and num_classes != local_head.vocab_size:
            raise ValueError(f"num_classes={num_classes}, but the token head's vocab_size is {local_head.vocab_size}; "
                             f"pass num_classes={local_head.vocab_size} or None")
        return local_head
    if isinstance(local_head, str):
        if local_head not in TOKEN_HEADS:
            raise ValueError(f"local_head={local_head!r} must be a module or one of {', '.join(map(repr, TOKEN_HEADS))}")
        if head_features is None or num_classes is None:
            raise TypeError(f"local_head={local_head!r} needs head_features= (the block's output width) and "
                            "num_classes= (the vocabulary size)")
        return make_token_head(local_head, head_features, check_num_classes(num_classes))
    if local_head is None:
        if head_features is None:
            raise TypeError(
                "DADBlock needs local_head= (a module giving (batch, num_classes) logits, or a token head's name) or "
                "head_features= (the block's output features, for a mean-pool + Linear head)"
            )
        return MeanPoolHead(head_features, check_num_classes(10 if num_classes is None else num_classes), feature_dim)
    if not isinstance(local_head, nn.Module):
        raise TypeError(f"local_head must be a torch.nn.Module or a token head's name, got {type(local_head).__name__}")
    return local_head


class DADBlock(LocalLayer):
    """A block ``out = module(x)`` trained by its own local head, with autograd inside the block only.

    :meth:`local_gradients` runs ``module`` under ``torch.enable_grad()`` on the detached input,
    ``logits = local_head(out)``, ``loss = CE(logits, y)`` and returns
    ``torch.autograd.grad(loss, trained_tensors())``: the block's and then the head's trainable
    parameters, in registration order. The output handed to the next layer is detached, so no
    gradient crosses blocks (DGL / InfoPro-style block-local training). The update comes from
    :class:`~torch_dad.nn._local.LocalLayer` (the layer's own AdamW/SGD state), like every DAD layer.

    ``local_head`` is any module mapping the block's output to ``(batch, num_classes)`` logits.
    Without one, pass ``head_features`` (the block's output features) for a
    :class:`MeanPoolHead` (mean over all but the batch and ``feature_dim``, then a Linear). The head
    is built up front, never lazily, so the optimizer state and checkpoints have fixed shapes.
    Unlike :class:`~torch_dad.DADLinear`'s, its parameters are in ``parameters()``. Buffers of
    ``module`` (e.g. batch-norm running statistics) advance in its forward, as in backprop training.

    **Token-level heads** (a causal LM's blocks): ``local_head`` a
    :class:`~torch_dad.nn.sequence_heads.TokenHead`, or one of the names in
    :data:`~torch_dad.nn.sequence_heads.TOKEN_HEADS` (``"full"``, ``"fused"``, ``"lowrank"``, ``"bucket"``)
    with ``head_features`` the block's width and ``num_classes`` the vocabulary size. The block then
    maps ``(batch, T, ...)`` to ``(batch, T, width)`` and its labels are ``(batch, T)`` token ids, ``-100``
    where a position has none; the head computes its loss and gradients in closed form and autograd runs
    inside the block only, from ``dL/d out``. ``num_classes=None`` means 10 for a class head, the head's
    vocabulary for a token head.
    """

    optim_state: LocalOptimizerState
    normalize = None

    def __init__(
        self,
        module: nn.Module,
        local_head: nn.Module | str | None = None,
        num_classes: int | None = None,
        *,
        head_features: int | None = None,
        feature_dim: int = 1,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.label_smoothing = check_fraction("label_smoothing", label_smoothing)
        head = _build_head(local_head, num_classes, head_features, feature_dim)
        classes = head.vocab_size if isinstance(head, TokenHead) else 10 if num_classes is None else num_classes
        self.num_classes = check_num_classes(classes)
        if isinstance(head, TokenHead) and self.label_smoothing:
            raise ValueError(f"label_smoothing={label_smoothing} applies to a class head; a token-level local_head "
                             "takes none (pass label_smoothing=0.0)")
        # the width the head reads, checked against the block's first output (None: a head of the user's own)
        self._unchecked_width: int | None = head.width if isinstance(head, TokenHead) else (
            head_features if local_head is None else None)
        self.block = module
        self.head = head
        if not self.trained_tensors():
            raise ValueError("the block and its local head have no parameter that requires grad; nothing to train")
        self.optim_state = self._new_optim_state()

    @property
    def token_level(self) -> bool:
        """Whether the local head scores every position (labels ``(batch, T)``) rather than the whole input."""
        return isinstance(self.head, TokenHead)

    def trained_tensors(self) -> list[Tensor]:
        """Every parameter of the block that requires grad, then every one of the local head's."""
        modules = (self.block, self.head)
        return [p for module in modules for p in module.parameters() if p.requires_grad]

    def check_input(self, inputs: Tensor, name: str = "inputs") -> None:
        """Blocks take any shape with a batch dimension; the block itself raises on a wrong one. Until an
        output has been checked against ``head_features``, :meth:`check_width` runs too (as in :meth:`forward`
        and :meth:`local_gradients`)."""
        if inputs.dim() < 2:
            raise ValueError(
                f"{name} have shape {tuple(inputs.shape)}; expected (batch, ...) for {type(self).__name__}"
            )
        if self._unchecked_width is not None:
            self.check_width(inputs)

    def check_width(self, inputs: Tensor) -> None:
        """``ValueError`` naming ``head_features`` and the block's output width if they differ, found by
        running the block on the first two rows of ``inputs`` in eval mode without grad: no buffer
        (batch-norm statistics) changes. A no-op for a ``local_head`` of the user's own."""
        if self._unchecked_width is None:
            return
        reference = self.trained_tensors()[0]
        x = inputs[:2].to(reference.device)
        if x.dtype.is_floating_point:
            x = x.to(reference.dtype)
        modes = [(module, module.training) for module in self.block.modules()]
        self.block.eval()
        try:
            with torch.no_grad():
                out = self.block(x)
        finally:
            for module, training in modes:
                module.training = training
        # a token head reads the last dimension
        feature_dim = self.head.feature_dim if isinstance(self.head, MeanPoolHead) else -1
        expected = self._unchecked_width
        width = out.shape[feature_dim] if -out.dim() <= feature_dim < out.dim() and out.dim() >= 2 else None
        if width != expected:
            shape = ", ".join(["batch", *map(str, out.shape[1:])])
            if width is None:
                raise ValueError(
                    f"DADBlock: the block's output has shape ({shape}), with no dimension feature_dim={feature_dim} "
                    f"for the head_features={expected} head; make the block return (batch, features, ...), or pass "
                    "a local_head= of your own"
                )
            raise ValueError(
                f"DADBlock: head_features={expected}, but the block's output has shape ({shape}): {width} features "
                f"along feature_dim={feature_dim}; pass head_features={width}, or a local_head= of your own"
            )
        self._unchecked_width = None  # one output checked: the block's width does not change

    def forward(self, inputs: Tensor) -> Tensor:
        """``module(inputs)``."""
        if self._unchecked_width is not None:
            self.check_width(inputs)
        return self.block(inputs)

    def local_head(self, hidden: Tensor) -> Tensor:
        """Local logits ``local_head(hidden)``."""
        return self.head(hidden)

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
        """``(LocalStepResult(out.detach(), loss, logits), grads)`` with
        ``grads = torch.autograd.grad(CE(local_head(module(x)), y), trained_tensors())`` (zeros for
        a tensor the loss does not reach), in the parameters' dtype. A half ``compute_dtype`` runs the
        block under ``torch.autocast``. ``workspace`` and ``reuse_input`` are accepted for the trainer's protocol and
        unused.

        With a token-level head ``y`` is ``(batch, T)``: the head's loss and gradients come in closed form
        (:meth:`~torch_dad.nn.sequence_heads.TokenHead.step` on the output's rows in the compute dtype;
        ``backend="triton"`` lets a fused head run its kernels), then ``torch.autograd.grad(out, block
        parameters, dL/d out)``; ``logits`` are ``(batch, T, classes)``, ``(batch, T, 0)`` for a head that never forms them.

        ``output_ready()``, if given, is called once the output's kernels are queued and before the head's and
        the gradients' are (the engine marks there when the next layer may start).
        """
        params = self.trained_tensors()
        master = params[0].dtype
        autocast: Any = nullcontext()
        if compute_dtype is not None and compute_dtype != master:
            autocast = torch.autocast(inputs.device.type, dtype=compute_dtype)
        x = inputs.detach()
        if x.dtype.is_floating_point and isinstance(autocast, nullcontext):
            x = x.to(master)
        if self._unchecked_width is not None:
            self.check_width(x)
        if isinstance(self.head, TokenHead):
            return self._token_gradients(x, target, autocast, compute_dtype or master, backend, output_ready)
        if isinstance(self.head, MeanPoolHead) and all(p.requires_grad for p in self.head.parameters()):
            return self._mean_pool_gradients(x, target, autocast, backend, output_ready)
        with torch.enable_grad():
            with autocast:
                out = self.block(x)
                if output_ready is not None:
                    output_ready()
                logits = self.head(out)
            wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
            loss = nn.functional.cross_entropy(wide, target, label_smoothing=self.label_smoothing)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads_list = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
        return LocalStepResult(out.detach(), loss.detach(), logits.detach()), grads_list

    def _mean_pool_gradients(
        self, x: Tensor, target: Tensor, autocast: Any, backend: str, output_ready: Callable[[], object] | None,
    ) -> tuple[LocalStepResult, list[Tensor]]:
        """:meth:`local_gradients` with a :class:`MeanPoolHead`: its loss and gradients in closed form (the
        local error of every DAD layer, :func:`~torch_dad.nn._local.dense_local_error`, on the pooled
        features in float32), then ``torch.autograd.grad(out, block parameters, dL/d out)``."""
        head = self.head
        assert isinstance(head, MeanPoolHead)
        out = self._block_output(x, autocast, output_ready)
        features = out.detach().movedim(head.feature_dim, -1)
        wide = torch.promote_types(out.dtype, torch.float32)
        pooled_dims = tuple(range(1, features.dim() - 1))
        pooled = features.mean(pooled_dims, dtype=wide) if pooled_dims else features.to(wide)
        err = dense_local_error(pooled, None, head.linear.weight, head.linear.bias, target, "identity",
                                label_smoothing=self.label_smoothing, backend=backend)
        # the mean's adjoint: each pooled position gets d_pooled / its count
        d_pooled = (err.d_z * (pooled.shape[0] * pooled.shape[1] / features.numel())).to(out.dtype)
        shape = (features.shape[0], *(1 for _ in pooled_dims), features.shape[-1])
        d_out = d_pooled.reshape(shape).expand(features.shape).movedim(-1, head.feature_dim)
        grads = self._block_gradients(out, d_out)
        head_grads = [g.to(p.dtype) for p, g in zip(head.parameters(), err.head_grads)]
        return LocalStepResult(out.detach(), err.loss.detach(), err.logits.detach()), grads + head_grads

    def _block_output(self, x: Tensor, autocast: Any, output_ready: Callable[[], object] | None) -> Tensor:
        """``block(x)`` with autograd on (under ``autocast``), then ``output_ready()`` if given."""
        with torch.enable_grad(), autocast:
            out = self.block(x)
        if output_ready is not None:
            output_ready()
        return out

    def _block_gradients(self, out: Tensor, d_out: Tensor) -> list[Tensor]:
        """``dL/dp`` of the block's trained parameters from ``dL/d out`` (zeros where the loss does not reach)."""
        block_params = [p for p in self.block.parameters() if p.requires_grad]
        block_grads: tuple[Tensor | None, ...] = (None,) * len(block_params)
        if block_params and out.requires_grad:
            block_grads = torch.autograd.grad(out, block_params, d_out, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(block_params, block_grads)]

    def _token_gradients(
        self, x: Tensor, target: Tensor, autocast: Any, dtype: torch.dtype, backend: str,
        output_ready: Callable[[], object] | None,
    ) -> tuple[LocalStepResult, list[Tensor]]:
        """:meth:`local_gradients` with a token-level head (labels ``(batch, T)``)."""
        head = self.head
        assert isinstance(head, TokenHead)
        out = self._block_output(x, autocast, output_ready)
        check_token_layout(target, tuple(out.shape[:-1]), head.ignore_index, "labels")
        rows = out.detach().reshape(-1, out.shape[-1]).to(dtype)
        step = head.step(rows, target.reshape(-1), backend=backend)
        grads = self._block_gradients(out, step.grad_hidden.view(out.shape).to(out.dtype))
        grads += [g.to(p.dtype) for p, g in zip(head.parameters(), step.grads) if p.requires_grad]
        logits = step.logits.view(*out.shape[:-1], -1)
        return LocalStepResult(out.detach(), step.loss.detach(), logits), grads
