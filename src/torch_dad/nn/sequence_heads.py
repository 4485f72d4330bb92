"""Token-level local heads: a block's local loss at every position, as a causal language model needs.

A :class:`TokenHead` maps a block's ``(batch, T, width)`` output to vocabulary logits ``(batch, T, vocab)``
(its ``forward``, what evaluation reads) and computes its own cross-entropy on token labels
``(batch, T)`` (``ignore_index=-100`` marks positions without a label) with closed-form gradients
(:meth:`TokenHead.step`): the head's parameters' and ``dL/dhidden``, which
:class:`~torch_dad.DADBlock` hands to autograd inside its block. The designs, by :data:`TOKEN_HEADS` name:

- ``"full"``: :class:`VocabHead`, ``logits = h @ W.T + b`` over the whole vocabulary, the logits formed;
- ``"fused"``: the same head through :func:`~torch_dad.ops.linear_cross_entropy.linear_cross_entropy`, in
  token chunks: the ``N x vocab`` logits are never held at once;
- ``"lowrank"``: :class:`LowRankHead`, ``h -> h @ P.T`` (``rank`` features) then the fused vocabulary head;
- ``"bucket"``: :class:`BucketHead`, a fixed hash of the vocabulary into ``buckets`` classes; the
  loss is the bucket's cross-entropy, and its vocabulary logits spread each bucket's probability
  evenly over the bucket's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import functional
from .._checks import check_positive_int
from ..ops.gram import mm_fp32
from ..ops.linear_cross_entropy import check_token_layout, linear_cross_entropy

__all__ = ["TOKEN_HEADS", "BucketHead", "LowRankHead", "TokenHead", "TokenHeadStep", "VocabHead", "make_token_head"]

#: the token-level head designs :func:`make_token_head` builds by name (``DADBlock(local_head=<name>)``)
TOKEN_HEADS: tuple[str, ...] = ("full", "fused", "lowrank", "bucket")
#: the defaults of a head built by name
DEFAULT_RANK, DEFAULT_BUCKETS = 64, 1024


@dataclass
class TokenHeadStep:
    """One step of a token head on ``N`` rows: ``loss`` (the mean cross-entropy over the labelled rows),
    ``grad_hidden`` (N, width) in the rows' dtype, ``grads`` of the head's parameters in ``parameters()``
    order (loss and grads float32, float64 for float64 rows), and ``logits`` (N, classes), or (N, 0) where a
    design never forms them."""

    loss: Tensor
    grad_hidden: Tensor
    grads: list[Tensor]
    logits: Tensor


class TokenHead(nn.Module):
    """A local head that scores every position of a ``(..., width)`` hidden state against token labels.

    ``forward(hidden)`` gives vocabulary logits ``(..., vocab_size)``; :meth:`step` the loss and its
    closed-form gradients on flattened rows. Subclasses set ``width`` and ``vocab_size``.
    """

    width: int
    vocab_size: int
    ignore_index: int = functional.IGNORE_INDEX

    def step(self, rows: Tensor, labels: Tensor, *, backend: str = "torch") -> TokenHeadStep:
        """Loss and gradients on ``rows`` (N, width), in their dtype, for ``labels`` (N,) token ids or
        ``ignore_index``. ``backend="triton"`` lets a fused design run its Triton kernels (CUDA)."""
        check_token_layout(labels, (rows.shape[0],), self.ignore_index, "labels")
        if rows.dim() != 2 or rows.shape[1] != self.width:
            raise ValueError(
                f"{type(self).__name__} takes rows of width {self.width}; got hidden states of shape "
                f"{tuple(rows.shape)}. Build the head with the block's output width"
            )
        return self._step(rows, labels, backend)

    def _step(self, rows: Tensor, labels: Tensor, backend: str) -> TokenHeadStep:
        raise NotImplementedError


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a head's loss and parameter gradients come in: float64 for float64 rows, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weight_grad(d_out: Tensor, rows: Tensor) -> Tensor:
    """``d_out.T @ rows`` accumulated and returned in :func:`_wide` of the rows' dtype."""
    return d_out.T @ rows if rows.dtype == torch.float64 else mm_fp32(d_out.T, rows)


def _lce_backend(backend: str, device: torch.device) -> str:
    """The fused cross-entropy's backend for a step's ``backend``: its Triton kernels on CUDA, else torch."""
    if backend == "triton" and device.type == "cuda":
        from ..kernels import triton_available

        if triton_available():
            return "triton"
    return "torch"


class VocabHead(TokenHead):
    """``logits = h @ weight.T + bias``: every position scored over the whole vocabulary.

    With ``fused=False`` :meth:`step` forms the ``(N, vocab)`` logits (and returns them); with
    ``fused=True`` it runs :func:`~torch_dad.ops.linear_cross_entropy.linear_cross_entropy`, which
    walks the tokens in chunks and never holds them all, and returns no logits. The same gradients either way.
    """

    def __init__(self, width: int, vocab_size: int, *, bias: bool = True, fused: bool = False) -> None:
        super().__init__()
        self.width = check_positive_int("width", width)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.fused = bool(fused)
        self.linear = nn.Linear(width, vocab_size, bias=bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear(hidden)

    def _step(self, rows: Tensor, labels: Tensor, backend: str) -> TokenHeadStep:
        weight = self.linear.weight.detach()
        bias = self.linear.bias.detach() if self.linear.bias is not None else None
        if self.fused:
            return self._fused_step(rows, labels, weight, bias, backend)
        dtype = rows.dtype
        logits = rows @ weight.to(dtype).T
        if bias is not None:
            logits = logits + bias.to(dtype)
        loss, d_logits = functional.cross_entropy_error(logits, labels, ignore_index=self.ignore_index)
        grads = [_weight_grad(d_logits, rows)] + ([d_logits.to(_wide(dtype)).sum(0)] if bias is not None else [])
        return TokenHeadStep(loss.to(_wide(dtype)), d_logits @ weight.to(dtype), grads, logits)

    def _fused_step(
        self, rows: Tensor, labels: Tensor, weight: Tensor, bias: Tensor | None, backend: str
    ) -> TokenHeadStep:
        # a sum over the labelled rows, divided by their count on the device: no host sync, so it
        # runs inside a captured CUDA graph (num_valid only skips the range check: the caller made it)
        count = (labels != self.ignore_index).sum().clamp_min(1)
        res = linear_cross_entropy(
            rows, weight, labels, bias, ignore_index=self.ignore_index, reduction="sum", num_valid=labels.numel(),
            backend=_lce_backend(backend, rows.device), compute_dtype=rows.dtype,
        )
        assert res.grad_weight is not None and res.grad_input is not None
        wide = _wide(rows.dtype)
        scale = 1.0 / count.to(wide)
        grads = [res.grad_weight.to(wide) * scale]
        if bias is not None:
            assert res.grad_bias is not None
            grads.append(res.grad_bias.to(wide) * scale)
        grad_hidden = (res.grad_input.to(wide) * scale).to(rows.dtype)
        return TokenHeadStep(res.loss.to(wide) * scale, grad_hidden, grads, rows.new_empty(rows.shape[0], 0))


class LowRankHead(TokenHead):
    """``logits = (h @ project.T) @ weight.T + bias``: ``width -> rank -> vocab``, the vocabulary part a
    fused :class:`VocabHead` on the ``rank`` features (no ``(N, vocab)`` logits held at once)."""

    def __init__(self, width: int, vocab_size: int, rank: int = DEFAULT_RANK, *, bias: bool = True) -> None:
        super().__init__()
        self.width = check_positive_int("width", width)
        self.rank = check_positive_int("rank", rank)
        self.project = nn.Linear(width, rank, bias=False)
        self.vocab = VocabHead(rank, vocab_size, bias=bias, fused=True)
        self.vocab_size = self.vocab.vocab_size

    def forward(self, hidden: Tensor) -> Tensor:
        return self.vocab(self.project(hidden))

    def _step(self, rows: Tensor, labels: Tensor, backend: str) -> TokenHeadStep:
        project = self.project.weight.detach().to(rows.dtype)
        inner = self.vocab.step(rows @ project.T, labels, backend=backend)
        d_low = inner.grad_hidden
        grads = [_weight_grad(d_low, rows), *inner.grads]
        return TokenHeadStep(inner.loss, d_low @ project, grads, inner.logits)


class BucketHead(TokenHead):
    """Predicts each token's bucket among ``buckets``: a fixed, seeded, balanced hash of the vocabulary.

    :meth:`step` is the cross-entropy of ``Linear(width -> buckets)`` on the labels' buckets (the
    bucket logits are formed: ``buckets`` is small). ``forward`` gives vocabulary logits
    ``bucket_logit[bucket(v)] - log |bucket(v)|``: each bucket's probability spread evenly over its
    tokens, so a vocabulary cross-entropy of them is the bucket loss plus the log of the bucket's size.
    """

    bucket_of: Tensor
    log_size: Tensor

    def __init__(self, width: int, vocab_size: int, buckets: int = DEFAULT_BUCKETS, *, bias: bool = True,
                 seed: int = 0) -> None:
        super().__init__()
        self.width = check_positive_int("width", width)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        buckets = check_positive_int("buckets", buckets)
        if buckets > vocab_size:
            raise ValueError(f"buckets={buckets} must be at most vocab_size={vocab_size}; pass fewer buckets")
        self.buckets = buckets
        self.classes = VocabHead(width, buckets, bias=bias)
        # a seeded permutation cut round-robin: bucket sizes differ by at most one
        order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        bucket_of = torch.empty(vocab_size, dtype=torch.int64)
        bucket_of[order] = torch.arange(vocab_size) % buckets
        # derived from the seed: not saved in checkpoints
        self.register_buffer("bucket_of", bucket_of, persistent=False)
        sizes = torch.bincount(bucket_of, minlength=buckets).double()
        self.register_buffer("log_size", sizes.log().float(), persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.classes(hidden)
        return logits[..., self.bucket_of] - self.log_size[self.bucket_of].to(logits.dtype)

    def bucket_labels(self, labels: Tensor) -> Tensor:
        """Each target's bucket; ``ignore_index`` stays."""
        ignored = labels == self.ignore_index
        return torch.where(ignored, labels, self.bucket_of[labels.masked_fill(ignored, 0)])

    def _step(self, rows: Tensor, labels: Tensor, backend: str) -> TokenHeadStep:
        return self.classes.step(rows, self.bucket_labels(labels), backend=backend)


def make_token_head(name: str, width: int, vocab_size: int) -> TokenHead:
    """The :data:`TOKEN_HEADS` design ``name`` for a block of ``width`` features, with its defaults
    (``rank=64``, ``buckets=min(1024, vocab_size)``); build the classes directly for other settings."""
    if name not in TOKEN_HEADS:
        raise ValueError(f"local_head={name!r} must be a module or one of {', '.join(map(repr, TOKEN_HEADS))}")
    if name in ("full", "fused"):
        return VocabHead(width, vocab_size, fused=name == "fused")
    if name == "lowrank":
        return LowRankHead(width, vocab_size, min(DEFAULT_RANK, width))
    return BucketHead(width, vocab_size, min(DEFAULT_BUCKETS, vocab_size))
