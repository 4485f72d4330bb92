"""The DAD language-model head: a causal LM's ``lm_head`` that trains itself.

:class:`DADLMHead` runs the fused step :func:`torch_dad.ops.linear_cross_entropy.linear_cross_entropy`
in its forward and applies the update in backward ("optimizer in backward"): no ``.grad`` of size
V x D is kept and the user's optimizer never holds moments for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import HALF_DTYPES, check_bool, check_choice, check_int, check_positive_int
from ..ops.linear_cross_entropy import (
    BACKENDS,
    LinearCrossEntropyResult,
    TokenLabelCheck,
    autocast_dtype,
    check_token_layout,
    linear_cross_entropy,
    next_token_targets,
    resolve_backend,
    vocab_slice_backward,
)
from ..optim import OptimizerConfig
from ._lm_head_graphs import GraphedStep, Pending, RecomputeGraphs
from ._local import LocalLayer, check_update

T = TypeVar("T")

__all__ = ["AUTO_GRAPHS_MAX_PRODUCT", "SWEEPS", "DADLMHead", "LMHeadOutput", "auto_sweep", "linear_cross_entropy"]

#: ``sweep=`` of :class:`DADLMHead`: how a training step walks the tokens x vocabulary product
SWEEPS: tuple[str, ...] = ("auto", "tokens", "vocab", "recompute")

#: the largest ``tokens * vocab_size * in_features`` whose step ``sweep="auto"`` replays from CUDA graphs: below it
#: the eager steps are bound by the host's launches (the SmolLM2 head, 49152 x 576, up to ~9,700 tokens)
AUTO_GRAPHS_MAX_PRODUCT = 2**38


def auto_sweep(tokens: int, vocab_size: int, in_features: int, itemsize: int, triton: bool) -> str:
    """The sweep ``sweep="auto"`` picks for a step of ``tokens`` rows in a dtype of ``itemsize`` bytes.

    ``"vocab"`` where the Triton row kernel runs and the batch's ``dL/dlogits`` is no larger than the float32
    V x D gradient it replaces (``tokens * itemsize <= 4 * in_features``); else ``"recompute"`` (replayed from
    CUDA graphs once a batch shape repeats) where the Triton kernels run and ``tokens * vocab_size * in_features
    <= AUTO_GRAPHS_MAX_PRODUCT``; else ``"tokens"``.
    """
    if not triton or tokens == 0:
        return "tokens"
    if tokens * itemsize <= 4 * in_features:
        return "vocab"
    return "recompute" if tokens * vocab_size * in_features <= AUTO_GRAPHS_MAX_PRODUCT else "tokens"


@dataclass
class LMHeadOutput:
    """What :meth:`DADLMHead.fused_loss` returns; per-token fields have the labels' shape, 0 where ignored."""

    loss: Tensor
    log_probs: Tensor
    entropy: Tensor | None
    is_top1: Tensor | None
    label_mask: Tensor


def _uniform_token_weight(grad_log_probs: Tensor) -> float:
    """The one weight ``-dL/dlog p_t`` the upstream loss gives every token (``update="grad"``).

    ``.grad`` can only hold a weight gradient that is the same sum over tokens as the head's
    own, so a loss that weights tokens differently is refused.
    """
    weights = -grad_log_probs
    lo, hi = (float(v) for v in torch.stack([weights.min(), weights.max()]).tolist())
    if not math.isclose(lo, hi, rel_tol=1e-4, abs_tol=0.0):
        raise ValueError(
            "DADLMHead(update='grad') needs the loss to weight every token alike (mean or sum of the "
            f"token log-likelihoods); got per-token weights in [{lo:.3g}, {hi:.3g}]. Use update='inplace'"
        )
    return float(weights.mean())


@dataclass
class _GraphedForward:
    """What the forward graph of the CUDA graphs leaves in its buffers: the fused step's ``result`` on the
    shifted ``targets`` (flat), the labels' ``mask`` and their ``check`` (see :meth:`DADLMHead._prepare_labels`)."""

    result: LinearCrossEntropyResult
    targets: Tensor
    mask: Tensor
    check: TokenLabelCheck


@dataclass
class _GraphsCall:
    """A training step of the CUDA graphs: its signature ``key`` and, where that is captured, its forward
    graph's replay (``None``: the step runs eagerly and its backward marks ``key`` warm). Every position is
    scored, so the count of scored tokens comes from the labels' check after the forward was queued:
    :meth:`DADLMHead.fused_loss` fills ``num_valid`` before backward."""

    key: tuple[Any, ...]
    replayed: tuple[GraphedStep, Pending] | None = None
    num_valid: int = 0


class _DADLMHeadFunction(torch.autograd.Function):
    """``(log p(y_t), entropy, is_top1)`` per valid token (the last two empty without ``token_stats``); backward =
    the head's update (+ ``dL/dhidden`` if asked).

    ``apply(hidden, weight, bias, head, target, token_stats, graphs_call)`` with ``hidden`` (n, D) holding only
    valid rows (every row for a ``_GraphsCall``, whose replayed forward replaces ``target``). Forward runs the
    fused step once (loss, summed ``dW``, per-row ``dh``, or what the vocabulary sweeps keep) and keeps it on
    ``ctx``; backward scales the gradients by the incoming per-token gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: DADLMHead, target: Tensor | None,
        token_stats: bool, graphs_call: _GraphsCall | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        want_gi = bool(ctx.needs_input_grad[0]) and head.backprop_gradients
        ctx.head, ctx.used, ctx.want_gi, ctx.graphs_call = head, False, want_gi, graphs_call
        ctx.graph_key = None if graphs_call is None else graphs_call.key
        ctx.graphed = None if graphs_call is None else graphs_call.replayed
        if ctx.graphed is not None:
            step = ctx.graphed[0]
            res, sweep = step.outputs.result, "recompute"
            ctx.sliced = (step.hidden, step.outputs.targets)
            # the graph's buffers are overwritten by its next replay: autograd gets copies
            log_probs, entropy, top1 = (None if t is None else t.clone() for t in (res.log_probs, res.entropy,
                                                                                    res.is_top1))
        else:
            assert target is not None
            sweep, dtype, run = head._fused_step(hidden, want_gi, token_stats, graphed=graphs_call is not None)

            def eager() -> tuple[LinearCrossEntropyResult, tuple[Tensor, Tensor] | None]:
                # with what the vocabulary sweeps read again in backward
                return run(hidden, target), None if sweep == "tokens" else (hidden.to(dtype), target)

            res, ctx.sliced = _eager(head, ctx, hidden.device, eager)
            log_probs, entropy, top1 = res.log_probs, res.entropy, res.is_top1
        ctx.res = res
        head.last_backend, head.last_sweep = res.backend, sweep
        assert log_probs is not None
        # without token_stats nobody reads them: empty tensors cost no kernel, zeros would cost two per step
        entropy = entropy if entropy is not None else log_probs.new_empty(0)
        top1 = top1 if top1 is not None else torch.empty(0, dtype=torch.bool, device=log_probs.device)
        ctx.mark_non_differentiable(entropy, top1)
        return log_probs, entropy.to(log_probs.dtype), top1

    @staticmethod
    def backward(ctx: Any, grad_log_probs: Tensor, _g_entropy: Tensor, _g_top1: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        head: DADLMHead = ctx.head
        res: LinearCrossEntropyResult = ctx.res
        if ctx.used:
            raise RuntimeError(
                "DADLMHead: a second backward through the same forward; the head was already updated from it. "
                "Run a fresh forward before each backward"
            )
        ctx.used = True
        if ctx.sliced is not None:
            grad_hidden = _vocab_sweep_backward(head, ctx, grad_log_probs)
            ctx.res = ctx.sliced = ctx.graphed = None
            return grad_hidden, None, None, None, None, None, None
        grad_hidden = None
        if res.grad_input is not None:
            # d log p_t / d h_t = -(p_t - onehot_t) @ W = -grad_input_t (summed reduction)
            grad_hidden = res.grad_input * (-grad_log_probs).to(res.grad_input.dtype).unsqueeze(1)
        grads = [g for g in (res.grad_weight, res.grad_bias) if g is not None]
        handed = None
        if head._trains() and res.num_valid and grads:
            # "inplace": the head's own objective, the mean CE over this batch's valid tokens;
            # "grad": the upstream loss's gradient
            scale = 1.0 / res.num_valid if head.update == "inplace" else _uniform_token_weight(grad_log_probs)
            handed = head._local_update([g.mul_(scale) for g in grads])
        ctx.res = None
        grad_weight, grad_bias = head._grads_by_slot(handed, ctx.needs_input_grad[1:3])[:2]
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _eager(head: DADLMHead, ctx: Any, device: torch.device, run: Callable[[], T]) -> T:
    """``run()``, an eager step: a head with CUDA graphs runs it where they are captured (one cuBLAS workspace for
    the eager steps and the graphs), any other head where it is called."""
    return head._graphs.eager(device, run) if ctx.graph_key is not None else run()


def _slice_sweep(head: DADLMHead, res: LinearCrossEntropyResult, hidden: Tensor, target: Tensor, want_gi: bool,
                 num_valid: int, lr: Tensor | None = None, weight_scale: Tensor | None = None) -> Tensor | None:
    """The weight updates of ``sweep="vocab"`` / ``"recompute"`` (``hidden`` in the compute dtype): each vocabulary
    slice's gradient (mean CE over the batch's ``num_valid`` scored tokens, as ``update="inplace"`` always uses; or
    the summed CE's times ``weight_scale``, a device tensor the AdamW kernel reads) is applied as soon as it is
    final, with ``lr`` (default ``config.lr``). Returns ``-d sum_t log p_t / dh`` (pre-update weights, float32), or
    ``None``."""
    if not num_valid:
        return None
    if lr is None and hidden.is_cuda:
        # one device lr for the whole sweep: the AdamW kernel reads it from memory, and a launch per slice to
        # make it would add to a launch-bound step
        lr = torch.full((), head.config.lr, dtype=torch.float32, device=hidden.device)

    def on_slice(start: int, stop: int, grad_weight: Tensor, grad_bias: Tensor | None) -> None:
        grads = [grad_weight] if grad_bias is None else [grad_weight, grad_bias]
        head._local_update_rows(start, stop, grads, first=start == 0, lr=lr, grad_multiplier=weight_scale)

    # a host scale rides on the gradient GEMM's alpha; a device one on the AdamW kernel (no kernel of its own)
    return vocab_slice_backward(
        hidden, head.weight.detach(), on_slice, grad_logits=res.grad_logits, log_sum_exp=res.log_sum_exp,
        target=target, bias=None if head.bias is None else head.bias.detach(), ignore_index=head.ignore_index,
        grad_input=want_gi, weight_scale=1.0 / num_valid if weight_scale is None else 1.0,
        slice_rows=head.weight_chunk_size, backend=res.backend,
    )


def _vocab_sweep_backward(head: DADLMHead, ctx: Any, grad_log_probs: Tensor) -> Tensor | None:
    """The backward of the vocabulary sweeps, eager or replayed from the head's graphs: the updates of
    :func:`_slice_sweep`, then ``dL/dhidden`` scaled by the incoming per-token gradient, or ``None``."""
    hidden, target = ctx.sliced
    # a graphed head scores every position and learns the count only after its forward was queued
    num_valid = ctx.res.num_valid if ctx.graphs_call is None else ctx.graphs_call.num_valid
    if ctx.graphed is not None:
        step = ctx.graphed[0]
        grad_hidden = None if not num_valid else head._graphs.backward(
            step, head.config.lr, 1.0 / num_valid,
            lambda s: _slice_sweep(head, s.outputs.result, s.hidden, s.outputs.targets, ctx.want_gi, 1, lr=s.lr,
                                   weight_scale=s.scale))
    else:
        grad_hidden = _eager(head, ctx, hidden.device,
                             lambda: _slice_sweep(head, ctx.res, hidden, target, ctx.want_gi, num_valid))
        if ctx.graph_key is not None and num_valid:
            head._graphs.mark_warm(ctx.graph_key)
    if grad_hidden is None:
        return None
    # d log p_t / d h_t = -(p_t - onehot_t) @ W (summed reduction); a graph's buffer is copied out
    grad_hidden = grad_hidden.mul_((-grad_log_probs).to(grad_hidden.dtype).unsqueeze(1))
    return grad_hidden.to(hidden.dtype, copy=ctx.graphed is not None)


def _check_sweep(sweep: object, update: str, backend: str) -> str:
    """``sweep`` if it is one of :data:`SWEEPS` and can run with ``update`` and ``backend``, else ``ValueError``."""
    check_choice("sweep", sweep, SWEEPS, " ('tokens': token chunks, one V x D gradient; 'vocab', 'recompute': "
                 "weight slices)")
    if sweep in ("vocab", "recompute") and update != "inplace":
        raise ValueError(f"sweep={sweep!r} applies each weight slice's gradient in backward and keeps no V x D "
                         "gradient, so it needs update='inplace'; use sweep='tokens' (or 'auto') with update='grad'")
    if sweep in ("vocab", "recompute") and backend not in ("auto", "triton", "torch"):
        raise ValueError(f"sweep={sweep!r} runs its own softmax over weight slices, which backend={backend!r} does "
                         "not; use backend='triton' (or 'auto'), or sweep='tokens'")
    return str(sweep)


class DADLMHead(LocalLayer):
    """A causal LM's ``lm_head``: ``logits = hidden @ weight.T (+ bias)`` that trains itself.

    ``forward(hidden)`` returns logits (evaluation, generation, ``compute_metrics``).
    :meth:`fused_loss` (training) runs :func:`linear_cross_entropy` on the valid tokens and returns
    per-token log-likelihoods whose backward updates the head: ``update="inplace"`` applies AdamW
    (state in buffers) to the mean next-token CE of the batch; ``update="grad"`` accumulates the
    upstream loss's gradient into ``.grad``. With ``backprop_gradients=True`` the backward also
    returns the true ``dL/dhidden`` (pre-update weights) so LoRA adapters or the backbone train.
    ``backend`` picks the fused step's implementation and ``chunk_size`` / ``weight_chunk_size`` its
    memory (see :func:`~torch_dad.ops.linear_cross_entropy.linear_cross_entropy`); ``last_backend``
    says which backend ran (``last_sweep``: which sweep). ``sweep`` orders the step: ``"tokens"``, token
    chunks that sum one float32 V x D gradient, applied at once; ``"vocab"`` (``update="inplace"``), the
    batch's ``dL/dlogits`` (N x V, compute dtype) held from forward to backward, where each slice of
    ``weight_chunk_size`` vocabulary rows gets its final gradient and its AdamW step in turn: no V x D
    gradient and no V x D copy of the weight; ``"recompute"`` (``update="inplace"``), the same slices with
    each slice's logits recomputed in backward from the forward's log-sum-exp (one more GEMM; nothing of
    size N x V or V x D held); ``"auto"``, the choice of :func:`auto_sweep`. ``cuda_graphs=True`` (with
    ``sweep="recompute"``, on CUDA) replays that sweep from CUDA graphs per batch shape, scoring every position
    (ignored ones at zero weight) so that the graphs do not depend on the labels' mask; ``None`` (default) does so
    where ``sweep="auto"`` picks the recomputing sweep and the batch shape repeats; ``False`` never.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        bias: bool = False,
        *,
        backprop_gradients: bool = False,
        update: str = "inplace",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        ignore_index: int = functional.IGNORE_INDEX,
        chunk_size: int | None = None,
        weight_chunk_size: int | None = None,
        backend: str = "auto",
        sweep: str = "auto",
        cuda_graphs: bool | None = None,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = check_positive_int("in_features", in_features)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.update = check_update(update)
        self.backprop_gradients = check_bool("backprop_gradients", backprop_gradients)
        self.ignore_index = check_int("ignore_index", ignore_index)
        self.backend = check_choice("backend", backend, BACKENDS)
        self.sweep = _check_sweep(sweep, update, backend)
        if cuda_graphs is not None:
            check_bool("cuda_graphs", cuda_graphs)
        self.cuda_graphs = cuda_graphs
        if cuda_graphs and sweep != "recompute":
            raise ValueError(f"cuda_graphs=True captures the recomputing sweep, not sweep={sweep!r}; pass "
                             "sweep='recompute', or cuda_graphs=False")
        self._graphs = RecomputeGraphs()
        self._last_key: tuple[Any, ...] | None = None  # the signature of the last step, for sweep="auto"
        for name, value in (("chunk_size", chunk_size), ("weight_chunk_size", weight_chunk_size)):
            if value is not None:
                check_positive_int(name, value)
        if compute_dtype is not None and (not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point):
            raise TypeError(f"compute_dtype={compute_dtype!r} must be a floating torch.dtype or None")
        self.chunk_size, self.weight_chunk_size, self.compute_dtype = chunk_size, weight_chunk_size, compute_dtype
        self.config = OptimizerConfig(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)  # type: ignore[arg-type]
        self.last_backend: str | None = None
        self.last_sweep: str | None = None
        self._init_linear(in_features, vocab_size, bias, device, dtype)
        self.reset_parameters()
        self.optim_state = self._new_optim_state() if update == "inplace" else None

    def reset_parameters(self) -> None:
        """``weight ~ N(0, 1 / in_features)``, ``bias = 0``."""
        nn.init.normal_(self.weight, std=self.in_features**-0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
                f"update={self.update!r}, backprop_gradients={self.backprop_gradients}, backend={self.backend!r}, "
                f"sweep={self.sweep!r}, cuda_graphs={self.cuda_graphs}")

    @property
    def out_features(self) -> int:
        """``vocab_size``, as ``nn.Linear`` names it."""
        return self.vocab_size

    def _sweep_for(self, hidden: Tensor, want_gi: bool, token_stats: bool, graphed: bool = False) -> str:
        """The sweep this training step runs: ``"recompute"`` for a ``graphed`` step; ``sweep`` if given;
        ``"tokens"`` for a head that does not train in place. Under ``"auto"``, :func:`auto_sweep`'s choice, where
        its ``"recompute"`` (graphed only) runs as ``"tokens"``."""
        if not self._trains():
            return "tokens"
        if graphed:
            return "recompute"
        if self.sweep != "auto":
            return self.sweep
        if self.update != "inplace":
            return "tokens"
        return "vocab" if self._auto_sweep(hidden, want_gi, token_stats) == "vocab" else "tokens"

    def _auto_sweep(self, rows: Tensor, want_gi: bool, token_stats: bool) -> str:
        """:func:`auto_sweep` for a step on ``rows`` (N, D): whether the Triton kernels run decides with N."""
        dtype = self._step_dtype(rows)
        backend = resolve_backend(self.backend, rows.device, bias=self.bias is not None, token_stats=token_stats,
                                  grad_input=want_gi, dtype=dtype)
        return auto_sweep(rows.shape[0], self.vocab_size, self.in_features,
                          dtype.itemsize, backend == "triton")

    def _graphs_call(self, hidden: Tensor, labels: Tensor, shift: bool, token_stats: bool) -> _GraphsCall | None:
        """The graphed step this training call runs, or ``None`` (an eager step). ``cuda_graphs=True``: every
        training step on CUDA. ``None`` with ``sweep="auto"``: a step :func:`auto_sweep` gives the recomputing
        sweep, once its signature repeats the previous step's (a batch shape seen once runs the token sweep)."""
        if self.cuda_graphs is False or not (hidden.is_cuda and hidden.numel() > 0 and self.training
                                             and torch.is_grad_enabled() and self._trains()):
            return None
        if self.cuda_graphs is None and (self.sweep != "auto" or self.update != "inplace"):
            return None
        want_gi = hidden.requires_grad and self.backprop_gradients
        rows = hidden.reshape(-1, self.in_features)
        key = self._graph_key(rows, labels, shift, self._step_dtype(rows), want_gi, token_stats)
        if self.cuda_graphs:
            return _GraphsCall(key)
        if self._auto_sweep(rows, want_gi, token_stats) != "recompute":
            return None
        repeated = key == self._last_key or self._graphs.knows(key)
        self._last_key = key
        return _GraphsCall(key) if repeated else None

    @property
    def num_cuda_graphs(self) -> int:
        """CUDA graphs captured and kept (a forward and a backward per batch shape)."""
        return self._graphs.num_graphs

    def _graph_key(self, rows: Tensor, labels: Tensor, shift: bool, dtype: torch.dtype, want_gi: bool,
                   token_stats: bool) -> tuple[Any, ...]:
        """What a captured step depends on: input layout, options, and the addresses the graphs read and write
        (a moved or reassigned weight or optimizer state gets new graphs)."""
        bias, state, config = self.bias, self.optim_state, self.config
        addresses = (self.weight.data_ptr(), None if bias is None else bias.data_ptr(),
                     None if state is None else state.data_ptrs())
        # the learning rate is not part of it: the graphs read it from a device tensor filled per step
        return (rows.shape, rows.dtype, rows.device, labels.shape, labels.dtype, shift, dtype, want_gi, token_stats,
                self.chunk_size, self.weight_chunk_size, self.backend, self.ignore_index, config.name, config.betas,
                config.eps, config.weight_decay, addresses)

    def _fused_step(self, rows: Tensor, want_gi: bool, token_stats: bool, graphed: bool = False
                    ) -> tuple[str, torch.dtype, Callable[[Tensor, Tensor], LinearCrossEntropyResult]]:
        """``(sweep, compute dtype, run)`` of a training step on ``rows`` (``graphed``: one of the CUDA graphs'
        steps): ``run(rows, targets)`` is its fused forward, :func:`linear_cross_entropy` with what that sweep keeps
        for backward."""
        sweep, dtype = self._sweep_for(rows, want_gi, token_stats, graphed), self._step_dtype(rows)
        weight, bias, tokens = self.weight, self.bias, sweep == "tokens"

        def run(rows: Tensor, targets: Tensor) -> LinearCrossEntropyResult:
            return linear_cross_entropy(
                rows, weight, targets, bias, ignore_index=self.ignore_index, reduction="sum",
                grad_weight=self._trains() and tokens, grad_input=want_gi and tokens, grad_logits=sweep == "vocab",
                log_sum_exp=sweep == "recompute", token_stats=token_stats, chunk_size=self.chunk_size,
                weight_chunk_size=self.weight_chunk_size, backend=self.backend, compute_dtype=dtype,
                num_valid=targets.numel(),
            )

        return sweep, dtype, run

    def _prepare_labels(self, labels: Tensor, shift: bool) -> tuple[Tensor, Tensor, TokenLabelCheck]:
        """``(targets, mask, check)`` of :func:`~torch_dad.ops.linear_cross_entropy.next_token_targets`."""
        return next_token_targets(labels, self.vocab_size, self.ignore_index, shift=shift)

    def _step_dtype(self, hidden: Tensor) -> torch.dtype:
        """The dtype a training step's GEMMs run in: :meth:`_compute_dtype`, else ``hidden``'s and the weight's."""
        return self._compute_dtype(hidden) or torch.promote_types(hidden.dtype, self.weight.dtype)

    def _compute_dtype(self, hidden: Tensor) -> torch.dtype | None:
        """``compute_dtype``, else the autocast dtype, else bf16/fp16 if ``hidden`` is (mixed precision
        with float32 master weights: the activations' dtype decides), else ``None`` (promote)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        return autocast_dtype(hidden.device) or (hidden.dtype if hidden.dtype in HALF_DTYPES else None)

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits ``hidden @ weight.T (+ bias)``, as ``nn.Linear`` (no update, labels not needed).

        Outside autocast, float32 master weights meet bf16/fp16 hidden states in the hidden dtype.
        """
        weight: Tensor = self.weight
        bias: Tensor | None = self.bias
        if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        return nn.functional.linear(hidden, weight, bias)

    def _valid_rows(
        self, hidden: Tensor, targets: Tensor, mask: Tensor, num_valid: int
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(rows, targets, index)`` of the scored positions: padding and prompt tokens cost no GEMM.
        ``index`` (positions in the flattened ``mask``) is ``None`` when every position is scored. The valid
        positions come first in a stable sort of the mask, whose size ``num_valid`` is already known:
        ``nonzero()`` would wait for the device to count them."""
        flat_rows, flat_targets, flat_mask = hidden.reshape(-1, self.in_features), targets.reshape(-1), mask.reshape(-1)
        if num_valid == flat_mask.numel():
            return flat_rows, flat_targets, None
        index = torch.argsort((~flat_mask).to(torch.uint8), stable=True)[:num_valid]
        return flat_rows.index_select(0, index), flat_targets.index_select(0, index), index

    def _graphed_rows(self, hidden: Tensor, labels: Tensor, shift: bool, token_stats: bool,
                      call: _GraphsCall) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
        """A training step of the CUDA graphs (``call``): every position is scored (ignored ones at zero weight), so the
        forward graph's shape is known before the labels are read. The labels are copied in and the graph replayed
        first: it shifts and checks them (:meth:`_prepare_labels`) ahead of its GEMMs, and the host reads that
        check while the device runs the rest. Returns per-position outputs, the count and the labels' mask."""
        want_gi = hidden.requires_grad and self.backprop_gradients

        def graphed_forward(static_rows: Tensor, static_labels: Tensor) -> _GraphedForward:
            # called only to capture: a replayed step does not build the fused step again
            run = self._fused_step(static_rows, want_gi, token_stats, graphed=True)[2]
            targets, mask, check = self._prepare_labels(static_labels, shift)
            return _GraphedForward(run(static_rows, targets.reshape(-1)), targets.reshape(-1), mask, check)

        # outside autograd: the copies into the graph's buffers are not part of the model, and the replay is
        # issued before autograd's bookkeeping, which the host then does while the device runs the forward
        with torch.no_grad():
            flat = hidden.reshape(-1, self.in_features)
            dtype = self._step_dtype(flat)
            call.replayed = self._graphs.forward(call.key, flat, labels, dtype, graphed_forward)
        rows = hidden.reshape(-1, self.in_features)
        if call.replayed is None:
            targets, mask, check = self._prepare_labels(labels, shift)
            lp, ent, top1 = _DADLMHeadFunction.apply(rows, self.weight, self.bias, self, targets.reshape(-1),
                                                     token_stats, call)
        else:
            graphed: _GraphedForward = call.replayed[0].outputs
            mask, check = graphed.mask.clone(), graphed.check
            lp, ent, top1 = _DADLMHeadFunction.apply(rows, self.weight, self.bias, self, None, token_stats, call)
        try:
            call.num_valid = check.result()
        except ValueError:
            call.replayed = None
            del lp, ent, top1  # frees the step's graph buffers for the next call
            raise
        return lp, ent, top1, call.num_valid, mask

    def _scored_rows(self, rows: Tensor, targets: Tensor, num_valid: int,
                     token_stats: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``log p``, entropy and top-1 flags of the scored ``rows``; in training, backward updates the head."""
        if self.training and torch.is_grad_enabled():
            return _DADLMHeadFunction.apply(rows, self.weight, self.bias, self, targets, token_stats, None)
        with torch.no_grad():
            res = linear_cross_entropy(rows, self.weight, targets, self.bias, ignore_index=self.ignore_index,
                                       reduction="sum", grad_weight=False, grad_input=False, token_stats=True,
                                       chunk_size=self.chunk_size, weight_chunk_size=self.weight_chunk_size,
                                       backend="torch", compute_dtype=self._compute_dtype(rows), num_valid=num_valid)
        assert res.log_probs is not None and res.entropy is not None and res.is_top1 is not None
        return res.log_probs, res.entropy, res.is_top1

    def fused_loss(
        self,
        hidden: Tensor,
        labels: Tensor,
        *,
        shift: bool = True,
        num_items_in_batch: int | Tensor | None = None,
        token_stats: bool = False,
    ) -> LMHeadOutput:
        """Next-token loss of ``hidden`` (..., D) against ``labels`` (...) without full logits.

        ``shift=True`` scores position t against ``labels[..., t+1]`` (as HF causal LMs do);
        ``shift=False`` takes ``labels`` as already shifted. ``loss = -sum(log p) / num_items_in_batch``
        (default: the number of valid tokens). In training with autograd on, backward updates the
        head; an all-ignored batch leaves it unchanged.
        """
        if not isinstance(hidden, Tensor):
            raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dim() < 1 or hidden.shape[-1] != self.in_features:
            raise ValueError(
                f"hidden has shape {tuple(hidden.shape)}; the last dim must be in_features={self.in_features}"
            )
        if isinstance(labels, Tensor) and labels.device != hidden.device:
            labels = labels.to(hidden.device)
        check_token_layout(labels, tuple(hidden.shape[:-1]), self.ignore_index, "labels")
        index: Tensor | None = None
        graphs_call = self._graphs_call(hidden, labels, shift, token_stats)
        if graphs_call is not None:
            lp, ent, top1, num_valid, mask = self._graphed_rows(hidden, labels, shift, token_stats, graphs_call)
        else:
            targets, mask, check = self._prepare_labels(labels, shift)
            num_valid = check.result()  # the step's only sync
            rows, valid_targets, index = self._valid_rows(hidden, targets, mask, num_valid)
            lp, ent, top1 = self._scored_rows(rows, valid_targets, num_valid, token_stats)

        def scatter(values: Tensor) -> Tensor:
            """Per scored row -> per position (0 where ignored), in ``mask``'s shape."""
            full = values if index is None else values.new_zeros(mask.numel()).index_copy(0, index, values)
            return full.reshape(mask.shape)

        log_probs = scatter(lp)
        entropy = scatter(ent) if token_stats else None
        is_top1 = scatter(top1) if token_stats else None
        denom = num_valid if num_items_in_batch is None else num_items_in_batch
        if isinstance(denom, Tensor):
            loss = -log_probs.sum() / denom.to(log_probs.device).clamp(min=1)
        else:
            # dividing by the negated count: one kernel fewer each way than negating the sum
            loss = log_probs.sum() / -max(int(denom), 1)
        return LMHeadOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)
