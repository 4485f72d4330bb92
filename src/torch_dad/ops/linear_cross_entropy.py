"""Fused linear cross-entropy: loss and gradients of an LM head without the full logits.

For an LM head (vocab ``V`` of 32k-256k) the costs of a training step are the (tokens x V)
logits and the V x D gradient plus its optimizer state. :func:`linear_cross_entropy` computes
the loss, ``dL/dW`` and (optionally) ``dL/dhidden`` of ``CE(hidden @ W.T + b, target)`` in
token chunks, so only one chunk's logits ever exist
(:class:`torch_dad.nn.lm_head.DADLMHead` runs it as a causal LM's ``lm_head``).

The math is :func:`torch_dad.functional.head_loss_and_gradients` (the float64 oracle the
tests compare with); here it is rearranged per chunk::

    logits_c = h_c @ W.T + b                         (chunk of rows c, compute dtype)
    lse_c    = logsumexp(logits_c)                   (float32)
    log p_c  = logits_c[y_c] - lse_c                 (per-token log-likelihood)
    d_c      = (softmax(logits_c) - onehot(y_c)) * scale   (0 on ignored rows)
    dL/dW   += d_c.T @ h_c   (float32 accumulator)   dL/db += d_c.sum(0)
    dL/dh_c  = d_c @ W

``scale`` is ``1 / num_valid`` (``reduction="mean"``) or 1 (``"sum"``). The middle three lines
are :func:`torch_dad.ops.cross_entropy.cross_entropy_rows_`: a Triton row kernel
(``backend="triton"``) or its PyTorch twin (``backend="torch"``), in one shared chunk loop.
``backend="liger"`` / ``"cce"`` hand the whole step to another library (:mod:`.external`).

Two more orders never hold a V x D gradient. :func:`vocab_slice_backward` sweeps the vocabulary
``R`` rows at a time, where ``dL/dW[s] = d[:, s].T @ h`` is final per slice and can be applied at
once. It takes ``d`` either whole, from ``grad_logits=True`` (this function stops after the middle
lines, all rows in one chunk: N x V held in the compute dtype, the smaller of the two when
``N * itemsize <= 4 * D``), or recomputes each slice from ``lse``, which ``log_sum_exp=True`` returns
(one more logits GEMM, and nothing of size N x V or V x D held)::

    d[:, s] = exp(h @ W[s].T + b[s] - lse) - onehot(y)[:, s]

On CUDA that line, and the slices' ``lse`` before it, are Triton kernels (:mod:`torch_dad.kernels.logits`) whose
GEMM tiles never write the logits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import functional
from .._checks import HALF_DTYPES
from . import external
from .cross_entropy import cross_entropy_rows_, logit_grad_from_lse_
from .gram import accumulate_mm

__all__ = [
    "BACKENDS",
    "CHUNK_BYTES",
    "CUDA_PREFERENCE",
    "HALF_DTYPES",
    "TRITON_CHUNK_BYTES",
    "UNUSABLE",
    "LinearCrossEntropyResult",
    "TokenLabelCheck",
    "autocast_dtype",
    "check_token_labels",
    "check_token_layout",
    "default_chunk_size",
    "default_slice_rows",
    "linear_cross_entropy",
    "next_token_targets",
    "resolve_backend",
    "shift_labels",
    "start_token_label_check",
    "vocab_slice_backward",
]

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", *external.LIBRARIES)
# Bytes of transient logits one chunk may hold (compute-dtype logits + their float32 softmax): a small
# chunk keeps the twin's peak low; larger ones trade memory for speed (docs/design-kernels.md).
CHUNK_BYTES = 64 * 2**20
# Bytes of the logits chunk for backend="triton", which keeps only the compute-dtype logits (its row
# kernel writes the gradient over them; no float32 copy): large enough that the float32 dW accumulator
# is read and written only a few times a step (docs/design-kernels.md).
TRITON_CHUNK_BYTES = 192 * 2**20
# Bytes of one float32 weight-gradient slice of vocab_slice_backward (its bf16 weight cast is half of
# that): 8192 rows at D=4096, the whole vocabulary at D=576. Each slice is a GEMM of 8192 x N x D,
# large enough to run at full rate, and the slices' temporaries stay small next to d.
SLICE_BYTES = 128 * 2**20
# Preference on CUDA when backend="auto". "triton" (ours) and liger-kernel both keep the logits
# chunk in the compute dtype and turn it into the gradient in place with one row kernel (two
# reads, one write); ours uses 2048-row chunks (large GEMMs) where liger picks ~128 rows. The
# torch twin needs ~6 float32 passes per chunk. benchmarks/lm_head.py measures them.
CUDA_PREFERENCE: tuple[str, ...] = ("triton", "liger", "torch")
# backends that failed to import or run on this machine: backend="auto" skips them (name -> reason)
UNUSABLE: dict[str, str] = {}


@dataclass
class LinearCrossEntropyResult:
    """What one fused step returns; every gradient is that of ``loss``.

    ``loss`` = ``scale * sum_valid CE`` (float32, 0-dim). ``grad_weight``/``grad_bias`` are
    float32 (float64 for float64 inputs); ``grad_input`` has ``hidden``'s dtype. The
    per-token fields are float32 (``is_top1`` bool) over all rows, 0 on ignored rows.
    ``backend`` names the implementation that ran. ``grad_logits`` (asked for with
    ``grad_logits=True``): ``dL/dlogits`` (N, V) in the compute dtype, 0 on ignored rows.
    ``log_sum_exp`` (``log_sum_exp=True``): each row's ``logsumexp(logits)``, float32 (float64 for float64).
    """

    loss: Tensor
    grad_weight: Tensor | None
    grad_bias: Tensor | None
    grad_input: Tensor | None
    log_probs: Tensor | None
    entropy: Tensor | None
    is_top1: Tensor | None
    num_valid: int
    backend: str
    grad_logits: Tensor | None = None
    log_sum_exp: Tensor | None = None


def default_slice_rows(hidden: int, recompute_tokens: int = 0, itemsize: int = 2) -> int:
    """Vocabulary rows per slice of :func:`vocab_slice_backward` (multiple of 16): the float32
    gradient slice ``rows x hidden`` fits :data:`SLICE_BYTES`, and where the slice's logits of
    ``recompute_tokens`` rows are recomputed, they (``itemsize`` bytes each) fit half of it."""
    rows = SLICE_BYTES // (4 * hidden)
    if recompute_tokens:
        rows = min(rows, SLICE_BYTES // 2 // (recompute_tokens * itemsize))
    return max(16, rows // 16 * 16)


def default_chunk_size(vocab: int, compute_dtype: torch.dtype, token_stats: bool = False,
                       backend: str = "torch", hidden: int | None = None) -> int:
    """Rows per chunk (multiple of 16): one chunk's logits + float32 softmax fit :data:`CHUNK_BYTES`;
    for ``backend="triton"`` the compute-dtype logits alone fit
    ``max(TRITON_CHUNK_BYTES, vocab * hidden * 4 // 2)`` (half the float32 ``dW`` when ``hidden`` is given)."""
    size = torch.empty((), dtype=compute_dtype).element_size()
    if backend == "triton":
        # each chunk reads and writes the float32 dW accumulator (8*V*D bytes) around a GEMM of
        # 2*rows*V*D FLOP: 4/rows bytes per FLOP whatever D is, so a large head needs large chunks
        # (docs/design-lm-head.md)
        budget = max(TRITON_CHUNK_BYTES, vocab * (hidden or 0) * 4 // 2)
        per_row = vocab * size
    else:
        per_row, budget = vocab * (size + 4 + (4 if token_stats else 0)), CHUNK_BYTES
    rows = budget // max(per_row, 1)
    return max(16, rows // 16 * 16)


def shift_labels(labels: Tensor, ignore_index: int = functional.IGNORE_INDEX) -> Tensor:
    """Next-token targets as HF causal LMs use them: ``cat(labels[..., 1:], ignore)``, same shape."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def check_token_labels(
    target: Tensor, rows_shape: tuple[int, ...], vocab: int, ignore_index: int = functional.IGNORE_INDEX, *,
    name: str = "labels",
) -> int:
    """Raise unless ``target`` holds integer ids of shape ``rows_shape`` in ``[0, vocab)`` or ``ignore_index``.

    Returns the number of non-ignored entries, read in the same host sync as the range check.
    """
    return start_token_label_check(target, rows_shape, vocab, ignore_index, name=name).result()


class TokenLabelCheck:
    """The range check and count of :func:`check_token_labels`, its kernels queued but not waited for:
    :meth:`result` waits for those kernels alone (not for work queued after them) and raises or counts.
    ``counts`` holds the number of ``target`` entries out of range, then the count. Made during a CUDA graph's
    capture, it reads the counts of the graph's latest replay."""

    def __init__(self, target: Tensor, vocab: int, ignore_index: int, name: str, counts: Tensor) -> None:
        self._target, self._vocab, self._ignore_index, self._name = target, vocab, ignore_index, name
        self._counts = counts
        self._done: torch.cuda.Event | None = None
        if counts.is_cuda:
            # into pinned memory behind an event: the host reads it once these kernels are done
            self._counts = torch.empty(2, dtype=counts.dtype, pin_memory=True).copy_(counts, non_blocking=True)
            # inside a graph's capture the event becomes a node of its own: the host that replays the graph can
            # wait for these kernels alone, not for the whole graph
            self._done = torch.cuda.Event(external=torch.cuda.is_current_stream_capturing())
            self._done.record()

    def result(self) -> int:
        """The count; raises ``ValueError`` if an id lies outside ``[0, vocab)`` and is not ``ignore_index``."""
        if self._done is not None:
            self._done.synchronize()
        n_bad, n_valid = (int(v) for v in self._counts.tolist())
        if n_bad:
            target, vocab, ignore_index, name = self._target, self._vocab, self._ignore_index, self._name
            values = target[_out_of_range(target, vocab, target != ignore_index)]
            raise ValueError(
                f"{name} must lie in [0, {vocab}) (the vocabulary size) or equal ignore_index={ignore_index}; "
                f"{n_bad} entries do not (values in [{int(values.min())}, {int(values.max())}]). Mask padding with "
                f"{ignore_index}, or resize the head if the tokenizer grew"
            )
        return n_valid


def _out_of_range(target: Tensor, vocab: int, valid: Tensor) -> Tensor:
    """The entries of ``target`` that are not ignored (``valid``) and lie outside ``[0, vocab)``."""
    # a narrow integer dtype cannot hold vocab - 1 (clamp refuses it): then only negative ids are out of range
    return valid & (target.clamp(0, min(vocab - 1, torch.iinfo(target.dtype).max)) != target)


def _label_counts(target: Tensor, vocab: int, ignore_index: int, count: Tensor) -> Tensor:
    """``[entries of target out of range, true entries of count]``."""
    # one sum over both flags: each sum of a bool tensor is a cast and a reduction
    flags = [_out_of_range(target, vocab, target != ignore_index), count]
    return torch.stack([f.reshape(-1) for f in flags]).sum(1)


def start_token_label_check(
    target: Tensor, rows_shape: tuple[int, ...], vocab: int, ignore_index: int = functional.IGNORE_INDEX, *,
    name: str = "labels",
) -> TokenLabelCheck:
    """:func:`check_token_labels` in two halves: the layout is checked now (``TypeError``/``ValueError``), the
    range check and count are queued on the device, and ``.result()`` gives them. Work queued in between (a
    captured forward) does not wait for the host to read them."""
    check_token_layout(target, rows_shape, ignore_index, name)
    return next_token_targets(target, vocab, ignore_index, shift=False, name=name)[2]


def next_token_targets(labels: Tensor, vocab: int, ignore_index: int = functional.IGNORE_INDEX, *, shift: bool,
                       name: str = "labels") -> tuple[Tensor, Tensor, TokenLabelCheck]:
    """``(targets, mask, check)`` of ``labels`` whose layout is checked (:func:`check_token_layout`): ``targets =
    shift_labels(labels)`` if ``shift`` (HF's causal-LM shift), else ``labels``; ``mask = targets !=
    ignore_index``; ``check`` the labels' range check and the count of ``mask``, queued on the device. One Triton
    kernel on CUDA (int32/int64 labels), torch ops elsewhere."""
    shift = shift and labels.dim() > 0
    if labels.numel() and labels.dtype in (torch.int32, torch.int64) and _triton_runnable(labels.device) is None:
        from ..kernels import labels as kernels

        targets, mask, counts = kernels.next_token_targets(labels.contiguous(), vocab, ignore_index, shift)
    else:
        targets = shift_labels(labels, ignore_index) if shift else labels
        mask = targets != ignore_index
        counts = _label_counts(labels, vocab, ignore_index, mask)
    return targets, mask, TokenLabelCheck(labels, vocab, ignore_index, name, counts)


def check_token_layout(target: Tensor, rows_shape: tuple[int, ...], ignore_index: int, name: str) -> None:
    """Raise unless ``target`` is an integer tensor of shape ``rows_shape`` (no host sync)."""
    if not isinstance(target, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"{name} have dtype {target.dtype}; pass integer token ids (e.g. {name}.long())")
    if tuple(target.shape) != tuple(rows_shape):
        raise ValueError(
            f"{name} have shape {tuple(target.shape)} but the hidden states have {tuple(rows_shape)} tokens; "
            f"pass one token id (or {ignore_index} to ignore) per position, shape {tuple(rows_shape)}"
        )


def _check_hidden_weight(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {t.dtype}; convert it with .float()")
    if weight.dim() != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (vocab, hidden)")
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)}; expected (tokens, {weight.shape[1]}) to match weight "
            f"{tuple(weight.shape)} (flatten batch and sequence with hidden.reshape(-1, {weight.shape[1]}))"
        )
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"bias has shape {got}; expected ({weight.shape[0]},) or None")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """``torch.get_autocast_dtype(device.type)`` while autocast is on for that device type, else ``None``."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _triton_runnable(device: torch.device) -> str | None:
    """``None`` if our Triton kernels can run on ``device`` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    from ..kernels import interpreting, triton_available

    if "triton" in UNUSABLE:
        return UNUSABLE["triton"]
    # the device first: on CPU the answer must not depend on whether triton happens to be installed
    if device.type != "cuda" and not interpreting():
        return f"runs on CUDA only (or on CPU under TRITON_INTERPRET=1), not on {device.type}"
    if not triton_available():
        return "triton is not importable (install torch-dad[gpu])"
    return None


def _library_refusal(name: str, *, bias: bool, token_stats: bool, cce_refused: bool) -> str | None:
    """Why library backend ``name`` cannot run this call (``None`` if it can); device already CUDA."""
    if name == "cce" and bias:
        return "backend='cce' takes no bias; use backend='triton', 'torch' or 'liger' for a head with a bias"
    if name == "cce" and cce_refused:
        return external.CCE_HALF_GRAD_INPUT
    if token_stats:
        return f"backend={name!r} returns no per-token entropy; use backend='triton' or 'torch' for token_stats=True"
    reason = UNUSABLE.get(name) or external.import_error(name)
    if reason is not None:
        return (f"backend={name!r} needs a working {external.LIBRARIES[name]} package ({reason}); install it or "
                "use backend='triton' or 'torch'")
    return None


def resolve_backend(
    backend: str,
    device: torch.device,
    *,
    bias: bool = False,
    token_stats: bool = False,
    grad_input: bool = False,
    dtype: torch.dtype | None = None,
) -> str:
    """The backend ``backend`` stands for on ``device``: ``auto`` = the first usable of
    :data:`CUDA_PREFERENCE` on CUDA, ``torch`` elsewhere; an explicit one that cannot run raises.

    ``grad_input``/``dtype`` describe the call: cut-cross-entropy is refused for ``dL/dhidden`` in
    bf16/fp16 (see :data:`torch_dad.ops.external.CCE_HALF_GRAD_INPUT`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {', '.join(BACKENDS)}")
    cce_refused = grad_input and dtype in HALF_DTYPES
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        for name in CUDA_PREFERENCE:
            if name == "torch":
                break
            if name == "triton":
                reason = _triton_runnable(device)
            else:
                reason = _library_refusal(name, bias=bias, token_stats=token_stats, cce_refused=cce_refused)
            if reason is None:
                return name
        return "torch"
    if backend == "triton":
        reason = _triton_runnable(device)
        if reason is not None:
            raise ValueError(f"backend='triton' {reason}; use backend='torch' (or 'auto')")
    elif backend != "torch":
        if device.type != "cuda":
            raise ValueError(f"backend={backend!r} runs on CUDA only; use backend='torch' (or 'auto') on {device.type}")
        reason = _library_refusal(backend, bias=bias, token_stats=token_stats, cce_refused=cce_refused)
        if reason is not None:
            raise ValueError(reason)
    return backend


def _check_options(reduction: str, chunk_size: int | None, compute_dtype: torch.dtype | None,
                   weight_chunk_size: int | None = None) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    for name, value, default in (("chunk_size", chunk_size, "automatic"),
                                 ("weight_chunk_size", weight_chunk_size, "one copy of the whole weight")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int or None ({default})")
    if compute_dtype is not None and (not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype={compute_dtype!r} must be a floating torch.dtype or None")


@dataclass
class _Step:
    """One call's inputs after validation: what every backend runs on."""

    hidden: Tensor
    weight: Tensor
    target: Tensor
    bias: Tensor | None
    ignore_index: int
    scale: float
    want_gw: bool
    want_gi: bool
    want_gl: bool
    want_lse: bool
    token_stats: bool
    dtype: torch.dtype
    num_valid: int


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = functional.IGNORE_INDEX,
    reduction: str = "mean",
    grad_weight: bool = True,
    grad_input: bool = True,
    token_stats: bool = False,
    chunk_size: int | None = None,
    backend: str = "auto",
    compute_dtype: torch.dtype | None = None,
    num_valid: int | None = None,
    weight_chunk_size: int | None = None,
    grad_logits: bool = False,
    log_sum_exp: bool = False,
) -> LinearCrossEntropyResult:
    """Loss and gradients of ``CE(hidden @ weight.T + bias, target)`` without the full logits.

    ``hidden`` (N, D), ``weight`` (V, D), ``target`` (N,) ids or ``ignore_index``. Equals
    :func:`torch_dad.functional.head_loss_and_gradients` (+ ``dL/dhidden = d_logits @ W``) up to
    the compute dtype's rounding. ``compute_dtype`` defaults to the autocast dtype when autocast
    is on, else ``promote_types(hidden, weight)``. ``token_stats`` adds per-token ``entropy`` and
    ``is_top1``. ``backend`` is one of :data:`BACKENDS` (see :func:`resolve_backend`). ``num_valid``,
    the number of targets that are not ``ignore_index``, is for a caller that has checked the ids
    itself: it skips the range check and its host sync. ``weight_chunk_size`` (``"torch"`` and
    ``"triton"`` backends, when ``weight`` is not in the compute dtype): cast that many rows of
    ``weight`` at a time into one buffer instead of making one V x D copy in the compute dtype, which
    saves that copy's memory and costs a cast per token chunk. ``grad_logits`` (``"torch"`` and
    ``"triton"``; ``grad_weight``/``grad_input`` must be False): return ``dL/dlogits`` of all rows
    (one chunk, the weight cast :func:`default_slice_rows` rows at a time unless ``weight_chunk_size``
    says otherwise) for :func:`vocab_slice_backward`. ``log_sum_exp`` (``"torch"`` and ``"triton"``):
    also return each row's log-sum-exp, for :func:`vocab_slice_backward` to recompute ``d`` from. Asked
    for alone (no gradient, no ``token_stats``) the pass walks vocabulary slices of ``weight_chunk_size``
    rows (default :func:`default_slice_rows`) over all tokens: one slice's logits at a time and no V x D
    copy of the weight. Otherwise the default chunk holds no more logits than ``3 * D`` bytes a row
    (``hidden`` D), so that with the weight's compute-dtype copy this pass stays under the float32 V x D
    gradient plus that copy, what the one-pass order holds. Runs without autograd; the inputs are not modified.
    """
    _check_hidden_weight(hidden, weight, bias)
    _check_options(reduction, chunk_size, compute_dtype, weight_chunk_size)
    if num_valid is None:
        num_valid = check_token_labels(target, (hidden.shape[0],), weight.shape[0], ignore_index, name="target")
    else:
        check_token_layout(target, (hidden.shape[0],), ignore_index, "target")
        if isinstance(num_valid, bool) or not isinstance(num_valid, int) or not 0 <= num_valid <= target.numel():
            raise ValueError(
                f"num_valid={num_valid!r} must be the number of targets that are not ignore_index, an int in "
                f"[0, {target.numel()}]; pass None to have it counted"
            )
    dtype = compute_dtype or autocast_dtype(hidden.device) or torch.promote_types(hidden.dtype, weight.dtype)
    name = resolve_backend(backend, hidden.device, bias=bias is not None, token_stats=token_stats,
                           grad_input=grad_input, dtype=dtype)
    if grad_logits and (grad_weight or grad_input):
        raise ValueError("grad_logits=True returns dL/dlogits in place of dL/dW and dL/dhidden; pass "
                         "grad_weight=False and grad_input=False and get them from vocab_slice_backward")
    if grad_logits or log_sum_exp:
        name = _own_backend(backend, name, "grad_logits=True" if grad_logits else "log_sum_exp=True")
    if grad_logits:
        weight_chunk_size = weight_chunk_size or default_slice_rows(weight.shape[1])
    if log_sum_exp:
        if chunk_size is None and name == "triton":
            itemsize = torch.empty((), dtype=dtype).element_size()
            chunk_size = max(16, 3 * weight.shape[1] // itemsize // 16 * 16)
    scale = (1.0 / num_valid if num_valid else 0.0) if reduction == "mean" else 1.0
    step = _Step(hidden, weight, target, bias, ignore_index, scale, grad_weight, grad_input, grad_logits, log_sum_exp,
                 token_stats, dtype, num_valid)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        if log_sum_exp and not (grad_weight or grad_input or grad_logits or token_stats):
            return _sliced_log_sum_exp(step, name, weight_chunk_size)
        if name == "torch":
            return _chunked(step, "torch", chunk_size, weight_chunk_size)
        try:
            if name == "triton":
                return _chunked(step, "triton", chunk_size, weight_chunk_size)
            return _library(step, name)
        except Exception as exc:  # backend="auto" must always work: fall back to the torch twin, say why once
            if backend != "auto":
                raise
            UNUSABLE[name] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"backend={name!r} failed here ({UNUSABLE[name]}); backend='auto' uses 'torch' from now on",
                          RuntimeWarning, stacklevel=2)
        return _chunked(step, "torch", chunk_size, weight_chunk_size)


def _own_backend(backend: str, name: str, option: str) -> str:
    """The backend of a call with ``option`` (``grad_logits`` / ``log_sum_exp``): ours only, since the
    libraries hand out neither ``dL/dlogits`` nor the log-sum-exp; ``"auto"`` falls back to the twin."""
    if name in ("torch", "triton"):
        return name
    if backend != "auto":
        raise ValueError(f"backend={backend!r} cannot run {option}; use backend='triton' or 'torch'")
    return "torch"


def _uninitialized(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty``, for a buffer whose every element is written before it is read."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class _ChunkSums:
    """The outputs :func:`_chunked` fills chunk by chunk: ``dW`` (V, D), ``db`` (V,), ``dh`` (N, D),
    per-token log-likelihood, entropy and top-1 flags (each ``None`` when not asked for). ``dW`` and ``dh``
    are left uninitialised when every chunk writes them (``written``), zeros otherwise."""

    grad_weight: Tensor | None
    grad_bias: Tensor | None
    grad_input: Tensor | None
    log_probs: Tensor
    entropy: Tensor | None
    is_top1: Tensor | None

    @classmethod
    def allocate(cls, step: _Step, acc: torch.dtype, written: bool) -> _ChunkSums:
        (n, d), vocab = step.hidden.shape, step.weight.shape[0]
        device = step.hidden.device
        want_gw, stats = step.want_gw, step.token_stats
        grads = _uninitialized if written else torch.zeros
        return cls(
            grad_weight=grads((vocab, d), dtype=acc, device=device) if want_gw else None,
            grad_bias=torch.zeros(vocab, dtype=acc, device=device) if want_gw and step.bias is not None else None,
            grad_input=grads((n, d), dtype=step.hidden.dtype, device=device) if step.want_gi else None,
            log_probs=torch.zeros(n, dtype=acc, device=device),
            entropy=torch.zeros(n, dtype=acc, device=device) if stats else None,
            is_top1=torch.zeros(n, dtype=torch.bool, device=device) if stats else None,
        )


class _ComputeWeight:
    """``weight`` (V, D) in the compute ``dtype`` for the chunk loop: one V x D copy made once
    (``slice_rows`` None, or ``weight`` already in ``dtype``), or ``slice_rows`` rows at a time cast
    into one reused buffer, so no full copy exists (each product then casts the weight again)."""

    def __init__(self, weight: Tensor, dtype: torch.dtype, slice_rows: int | None) -> None:
        self.weight, self.dtype = weight, dtype
        self.full: Tensor | None = None
        self.buffer: Tensor | None = None
        self.slice_rows = min(slice_rows or weight.shape[0], weight.shape[0])
        if weight.dtype == dtype or self.slice_rows == weight.shape[0]:
            self.full = weight if weight.dtype == dtype else weight.to(dtype)
        else:
            self.buffer = torch.empty(self.slice_rows, weight.shape[1], dtype=dtype, device=weight.device)

    def slices(self) -> Iterator[tuple[int, int, Tensor]]:
        """``(start, stop, W[start:stop])`` in the compute dtype, ``slice_rows`` rows at a time (views of the
        copy, or cast into the one buffer: each yielded slice is overwritten by the next)."""
        vocab = self.weight.shape[0]
        for start in range(0, vocab, self.slice_rows):
            stop = min(start + self.slice_rows, vocab)
            if self.full is not None:
                yield start, stop, self.full[start:stop]
            else:
                assert self.buffer is not None
                yield start, stop, self.buffer[: stop - start].copy_(self.weight[start:stop])

    def logits(self, h: Tensor, bias: Tensor | None) -> Tensor:
        """``h @ W.T + b`` (N_c, V) in the compute dtype."""
        if self.full is not None:
            return h @ self.full.T if bias is None else torch.addmm(bias, h, self.full.T)
        out = torch.empty(h.shape[0], self.weight.shape[0], dtype=self.dtype, device=h.device)
        for start, stop, w in self.slices():
            if bias is None:
                torch.mm(h, w.T, out=out[:, start:stop])
            else:
                torch.addmm(bias[start:stop], h, w.T, out=out[:, start:stop])
        return out

    def left_mul(self, d: Tensor) -> Tensor:
        """``d @ W`` (N_c, D); accumulated in float32 (float64 for float64) across slices."""
        if self.full is not None:
            return d @ self.full
        acc = _uninitialized((d.shape[0], self.weight.shape[1]), torch.promote_types(d.dtype, torch.float32),
                             d.device)
        for start, stop, w in self.slices():
            accumulate_mm(acc, d[:, start:stop], w, first=start == 0)
        return acc


def _chunk_logits(hidden: Tensor, weight: _ComputeWeight, bias: Tensor | None, rows: int,
                  dtype: torch.dtype) -> Iterator[tuple[int, int, Tensor, Tensor]]:
    """``(start, stop, h, h @ W.T + b)`` for each chunk of ``rows`` rows, in the compute ``dtype``."""
    b = None if bias is None else bias.to(dtype)
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        h = hidden[start:stop]
        h = h if h.dtype == dtype else h.to(dtype)
        yield start, stop, h, weight.logits(h, b)


def _chunked(step: _Step, backend: str, chunk_size: int | None,
             weight_chunk_size: int | None = None) -> LinearCrossEntropyResult:
    """The chunk loop of ``backend="torch"`` and ``"triton"``: per chunk, logits in the compute
    dtype (cuBLAS), :func:`cross_entropy_rows_` turns them into ``d_c`` in place, then
    ``dW += d_c.T @ h_c``, ``db += d_c.sum(0)``, ``dh_c = d_c @ W``."""
    dtype = step.dtype
    rows = chunk_size or default_chunk_size(step.weight.shape[0], dtype, step.token_stats, backend,
                                             hidden=step.weight.shape[1])
    if step.want_gl:  # dL/dlogits of every row is the result: one chunk
        rows = max(step.hidden.shape[0], 1)
    # backend="triton" still runs the twin where the kernel does not apply (float64 logits)
    rows_backend = "auto" if backend == "triton" else "torch"
    w = _ComputeWeight(step.weight, dtype, weight_chunk_size)
    target = step.target.contiguous()
    need_grad = (step.want_gw or step.want_gi or step.want_gl) and step.num_valid > 0
    sums = _ChunkSums.allocate(step, torch.float64 if dtype == torch.float64 else torch.float32, need_grad)
    grad_logits = None
    lse = torch.empty_like(sums.log_probs) if step.want_lse else None
    for start, stop, h, logits in _chunk_logits(step.hidden, w, step.bias, rows, dtype):
        cross_entropy_rows_(
            logits, target[start:stop], sums.log_probs[start:stop], ignore_index=step.ignore_index,
            scale=step.scale, write_grad=need_grad, backend=rows_backend,
            entropy=None if sums.entropy is None else sums.entropy[start:stop],
            is_top1=None if sums.is_top1 is None else sums.is_top1[start:stop],
            lse=None if lse is None else lse[start:stop],
        )
        # logits now holds d_c = (softmax - onehot) * scale, 0 on ignored rows
        if need_grad and step.want_gl:
            grad_logits = logits
        elif need_grad:
            _chunk_gradients(sums, logits, h, w, start, stop)
        # dropped before the generator makes the next chunk: else two chunks would be alive at once
        del logits
    loss = -sums.log_probs.sum() * step.scale
    return LinearCrossEntropyResult(
        loss=loss if loss.dtype == torch.float64 else loss.float(), grad_weight=sums.grad_weight,
        grad_bias=sums.grad_bias, grad_input=sums.grad_input, log_probs=sums.log_probs, entropy=sums.entropy,
        is_top1=sums.is_top1, num_valid=step.num_valid, backend=backend, grad_logits=grad_logits, log_sum_exp=lse,
    )


def _slice_logits(h: Tensor, w_slice: Tensor, bias: Tensor | None, start: int, stop: int,
                  scratch: Tensor | None = None) -> Tensor:
    """``h @ W[start:stop].T + b[start:stop]`` (N, stop - start), given that slice of the weight; written into the
    front of the flat buffer ``scratch`` if given."""
    if scratch is None:
        return h @ w_slice.T if bias is None else torch.addmm(bias[start:stop], h, w_slice.T)
    out = scratch[: h.shape[0] * (stop - start)].view(h.shape[0], stop - start)
    return torch.mm(h, w_slice.T, out=out) if bias is None else torch.addmm(bias[start:stop], h, w_slice.T, out=out)


def _sliced_log_sum_exp(step: _Step, backend: str, slice_rows: int | None) -> LinearCrossEntropyResult:
    """``log_sum_exp=True`` alone, over vocabulary slices of all rows at once: per slice ``s`` each row's
    ``logsumexp(h @ W[s].T + b[s])`` (one per column tile of ``s`` where the fused kernel runs), merged over the
    slices into ``lse``; ``log p(y) = logit(y) - lse``. One slice's logits exist at a time (:func:`default_slice_rows`,
    the slices :func:`vocab_slice_backward` recomputes) and no V x D copy of the weight: token chunks would hold a
    chunk of every vocabulary row plus that copy.

    Where :func:`_logits_kernels` apply, one Triton kernel per slice reduces its logits tiles in registers (they
    never reach memory), and one more merges the tiles and takes each target's logit as ``h[r] @ W[y[r]] + b[y[r]]``.
    Elsewhere cuBLAS writes the slice's logits and the row kernel reads back their log-sum-exp and the target logits
    in the slice (as the GEMM rounded them to the compute dtype)."""
    dtype, target, ignore = step.dtype, step.target.contiguous(), step.ignore_index
    (n, d), acc, vocab = step.hidden.shape, torch.promote_types(step.dtype, torch.float32), step.weight.shape[0]
    h = step.hidden if step.hidden.dtype == dtype else step.hidden.to(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    w = _ComputeWeight(step.weight, dtype, slice_rows or default_slice_rows(d, n, itemsize))
    b = None if step.bias is None else step.bias.to(dtype)
    kernels = _logits_kernels(h, backend)
    widths = [min(w.slice_rows, vocab - start) for start in range(0, vocab, w.slice_rows)]
    # one row per slice from the row kernel, one per column tile from the fused kernel
    parts = _uninitialized((len(widths) if kernels is None else sum(map(kernels.log_sum_exp_tiles, widths)), n),
                           acc, h.device)
    lse, log_probs = _uninitialized((n,), acc, h.device), _uninitialized((n,), acc, h.device)
    # without the kernels every scored row's target falls in exactly one slice, which writes its logit
    target_logit = None if kernels is not None else _uninitialized((n,), acc, h.device)
    used = 0
    for start, stop, w_slice in w.slices():
        if kernels is not None and kernels.tma_compatible(w_slice):
            used += kernels.tile_log_sum_exp(h, w_slice, None if b is None else b[start:stop], parts, used)
            continue
        logits = _slice_logits(h, w_slice, b, start, stop)
        cross_entropy_rows_(logits, target, log_probs, ignore_index=ignore, scale=1.0, write_grad=False,
                            lse=parts[used], target_logit=target_logit, col_offset=start,
                            backend="auto" if backend == "triton" else "torch")
        used += 1
        del logits
    if kernels is not None:
        weight = step.weight if step.weight.stride(-1) == 1 else step.weight.contiguous()
        kernels.log_probs(parts[:used], h, weight, b, target, lse, log_probs, ignore)
    else:
        assert target_logit is not None
        lse = torch.logsumexp(parts, dim=0)
        log_probs = torch.where(target != ignore, target_logit - lse, 0.0)
    loss = -log_probs.sum() * step.scale
    return LinearCrossEntropyResult(
        loss=loss, grad_weight=None, grad_bias=None, grad_input=None, log_probs=log_probs, entropy=None,
        is_top1=None, num_valid=step.num_valid, backend=backend, log_sum_exp=lse,
    )


def _logits_kernels(h: Tensor, backend: str) -> Any:
    """:mod:`torch_dad.kernels.logits` where its kernels run on ``h``, else ``None``: a backend other than
    ``"torch"``, fp16/bf16 ``h`` where Triton runs, ``h`` fit for TMA (:func:`~torch_dad.kernels.logits.tma_compatible`)."""
    if backend == "torch" or h.dtype not in HALF_DTYPES or _triton_runnable(h.device) is not None:
        return None
    from ..kernels import logits as kernels  # imports triton

    return kernels if kernels.tma_compatible(h) else None


def _chunk_gradients(sums: _ChunkSums, grad_logits: Tensor, h: Tensor, w: _ComputeWeight, start: int,
                     stop: int) -> None:
    """One chunk's share: ``dW += d_c.T @ h_c``, ``db += d_c.sum(0)``, ``dh_c = d_c @ W``."""
    if sums.grad_weight is not None:
        accumulate_mm(sums.grad_weight, grad_logits.T, h, first=start == 0)
        if sums.grad_bias is not None:
            sums.grad_bias += grad_logits.sum(0, dtype=sums.grad_bias.dtype)
    if sums.grad_input is not None:
        sums.grad_input[start:stop] = w.left_mul(grad_logits)


class _RecomputedSlices:
    """``d[:, s] = exp(h @ W[s].T + b[s] - lse) - onehot(y)[:, s]`` (0 on ignored rows) of one slice ``s`` at a
    time, written into ``scratch``. One Triton kernel (:mod:`torch_dad.kernels.logits`) computes the logits tile by
    tile and writes only ``d`` where it runs: a backend other than ``"torch"``, fp16/bf16 ``h`` and float32 ``lse``
    where Triton runs, rows fit for TMA. Elsewhere cuBLAS writes the logits and the row kernel turns them over."""

    def __init__(self, h: Tensor, bias: Tensor | None, target: Tensor, log_sum_exp: Tensor, scratch: Tensor,
                 ignore_index: int, backend: str) -> None:
        self.h, self.bias, self.scratch, self.ignore_index, self.backend = h, bias, scratch, ignore_index, backend
        self.target, self.log_sum_exp = target.contiguous(), log_sum_exp.contiguous()
        self.kernels = _logits_kernels(h, backend) if log_sum_exp.dtype == torch.float32 else None

    def grad(self, start: int, stop: int, w_slice: Tensor) -> Tensor:
        """``d[:, start:stop]`` (N, stop - start), given ``W[start:stop]`` in ``h``'s dtype; a view of ``scratch``."""
        h, bias, kernels = self.h, self.bias, self.kernels
        n, itemsize = h.shape[0], h.element_size()
        # rows padded to 16 bytes, as TMA needs; the GEMMs that read d take its row stride as given
        padded = -(-(stop - start) * itemsize // 16) * 16 // itemsize
        if kernels is not None and n * padded <= self.scratch.numel() and kernels.tma_compatible(w_slice):
            d = self.scratch[: n * padded].view(n, padded)[:, : stop - start]
            kernels.logit_grad(h, w_slice, None if bias is None else bias[start:stop], self.target, self.log_sum_exp,
                               d, start, self.ignore_index)
            return d
        d = _slice_logits(h, w_slice, bias, start, stop, self.scratch)
        logit_grad_from_lse_(d, self.target, self.log_sum_exp, col_offset=start, ignore_index=self.ignore_index,
                             backend=self.backend)
        return d


def _recompute_inputs(log_sum_exp: Tensor | None, target: Tensor | None, rows: int) -> tuple[Tensor, Tensor]:
    """``(log_sum_exp, target)``; raises unless both are given, ``log_sum_exp`` a float tensor and ``target`` an
    integer tensor, both ``(rows,)``."""
    if log_sum_exp is None or target is None:
        raise ValueError("vocab_slice_backward needs grad_logits, or log_sum_exp and target to recompute it from")
    if not log_sum_exp.dtype.is_floating_point or target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"log_sum_exp ({log_sum_exp.dtype}) must be floating point and target ({target.dtype}) "
                        "integer ids, as linear_cross_entropy(log_sum_exp=True) returns and takes them")
    if log_sum_exp.shape != (rows,) or target.shape != (rows,):
        raise ValueError(f"log_sum_exp has shape {tuple(log_sum_exp.shape)} and target {tuple(target.shape)}; both "
                         f"must be ({rows},), one value per row of hidden")
    return log_sum_exp, target


def vocab_slice_backward(
    hidden: Tensor,
    weight: Tensor,
    on_slice: Callable[[int, int, Tensor, Tensor | None], None],
    *,
    grad_logits: Tensor | None = None,
    log_sum_exp: Tensor | None = None,
    target: Tensor | None = None,
    bias: Tensor | None = None,
    ignore_index: int = functional.IGNORE_INDEX,
    grad_input: bool = False,
    weight_scale: float = 1.0,
    slice_rows: int | None = None,
    backend: str = "auto",
) -> Tensor | None:
    """The weight and hidden gradients of the logits' gradient ``d`` (N, V), one vocabulary slice at a time.

    ``d`` is ``grad_logits`` (from ``linear_cross_entropy(grad_logits=True)``), or, given ``log_sum_exp``
    and ``target`` instead, recomputed per slice in ``hidden``'s dtype: ``d[:, s] = exp(hidden @ W[s].T +
    bias[s] - log_sum_exp) - onehot(target)[:, s]`` (the summed CE's gradient; 0 on ignored rows).
    For each slice ``s`` of ``slice_rows`` rows (default :func:`default_slice_rows`), in order:
    ``dh += d[:, s] @ W[s]`` (if ``grad_input``), then ``on_slice(start, stop, gw, gb)`` with
    ``gw = weight_scale * d[:, s].T @ hidden`` and ``gb = weight_scale * d[:, s].sum(0)`` (``None``
    without ``bias``), float32 (float64 for float64). ``gw`` is final: ``on_slice`` may update
    ``W[s]`` in place, since ``dh`` has already read it, and must not keep ``gw`` (its buffer is reused).
    ``backend`` (``"auto"``, ``"triton"``, ``"torch"``) runs the recomputed slice: on CUDA with fp16/bf16
    ``hidden`` whose rows are 16-byte aligned, one Triton kernel for its logits and their gradient (the logits never
    reach memory), else cuBLAS's logits and the row kernel (``"torch"``: its PyTorch twin).
    Returns ``dh`` (N, D) in that float dtype, or ``None``. No V x D tensor is allocated.
    """
    (n, d), vocab = hidden.shape, weight.shape[0]
    recompute = grad_logits is None
    recompute_from = _recompute_inputs(log_sum_exp, target, n) if recompute else None
    if grad_logits is not None and grad_logits.shape != (n, vocab):
        raise ValueError(f"grad_logits has shape {tuple(grad_logits.shape)}; expected ({n}, {vocab}) "
                         "(tokens of hidden, rows of weight)")
    dtype = hidden.dtype if grad_logits is None else grad_logits.dtype
    acc = torch.promote_types(dtype, torch.float32)
    h = hidden if hidden.dtype == dtype else hidden.to(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = min(slice_rows or default_slice_rows(d, n if recompute else 0, itemsize), vocab)
    # the recomputed slices' buffer is allocated first: it is the largest, and so takes the block the forward's
    # slice logits left free, where a CUDA graph's pool would otherwise add a second block of that size
    scratch = torch.empty(n * rows, dtype=dtype, device=hidden.device) if recompute else None
    w = _ComputeWeight(weight, dtype, rows)
    b = None if bias is None else bias.to(dtype)
    slices = None
    if recompute_from is not None and scratch is not None:
        slices = _RecomputedSlices(h, b, recompute_from[1], recompute_from[0], scratch, ignore_index, backend)
    grad_hidden = _uninitialized((n, d), acc, hidden.device) if grad_input else None
    grad_slice = _uninitialized((w.slice_rows, d), acc, hidden.device)
    with torch.no_grad():
        for start, stop, w_slice in w.slices():
            if slices is not None:
                d_slice = slices.grad(start, stop, w_slice)
            else:
                assert grad_logits is not None
                d_slice = grad_logits[:, start:stop]
            if grad_hidden is not None:
                accumulate_mm(grad_hidden, d_slice, w_slice, first=start == 0)
            gw = grad_slice[: stop - start]
            accumulate_mm(gw, d_slice.T, h, first=True, alpha=weight_scale)
            gb = None if bias is None else d_slice.sum(0, dtype=acc).mul_(weight_scale)
            on_slice(start, stop, gw, gb)
    return grad_hidden


def _library(step: _Step, name: str) -> LinearCrossEntropyResult:
    """Backend ``liger`` or ``cce`` (:mod:`.external`) behind the same contract (CUDA)."""
    hidden, scale, device = step.hidden, step.scale, step.hidden.device
    (n, d), vocab = hidden.shape, step.weight.shape[0]
    target = step.target.long().contiguous()
    log_probs = torch.zeros(n, dtype=torch.float32, device=device)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    gi = gw = gb = None
    if step.num_valid == 0:  # the libraries' mean over no token is undefined: the zeros directly
        if step.want_gw:
            gw = torch.zeros(vocab, d, dtype=torch.float32, device=device)
            gb = None if step.bias is None else torch.zeros(vocab, dtype=torch.float32, device=device)
        gi = torch.zeros_like(hidden) if step.want_gi else None
    else:
        h = hidden.to(step.dtype).contiguous()
        w = step.weight.to(step.dtype)
        if name == "liger":
            b = None if step.bias is None else step.bias.to(step.dtype)
            token_loss, gi, gw, gb = external.liger_step(h, w, b, target, step.ignore_index, step.want_gw,
                                                         step.want_gi)
        else:
            token_loss, gi, gw, gb = external.cce_step(h, w, target, step.ignore_index, step.want_gw, step.want_gi)
        # the adapters return gradients of the token losses' sum: scale once here
        gi = None if gi is None else gi.mul_(scale).to(hidden.dtype)
        gw = None if gw is None else gw.float().mul_(scale)
        gb = None if gb is None else gb.float().mul_(scale)
        log_probs = (-token_loss.float()).masked_fill(target == step.ignore_index, 0.0)
        loss = -log_probs.sum() * scale
    return LinearCrossEntropyResult(
        loss=loss, grad_weight=gw, grad_bias=gb, grad_input=gi, log_probs=log_probs, entropy=None, is_top1=None,
        num_valid=step.num_valid, backend=name,
    )
