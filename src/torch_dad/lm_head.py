"""Fused linear cross-entropy and the DAD language-model head.

For an LM head (vocab ``V`` of 32k-256k) the costs of a training step are the (tokens x V)
logits and the V x D gradient plus its optimizer state. :func:`linear_cross_entropy` computes
the loss, ``dL/dW`` and (optionally) ``dL/dhidden`` of ``CE(hidden @ W.T + b, target)`` in
token chunks, so only one chunk's logits ever exist. :class:`DADLMHead` is a causal LM's
``lm_head`` that runs that fused step in its forward and applies the update in backward
("optimizer in backward"): no ``.grad`` of size V x D is kept and the user's optimizer never
holds moments for it.

The math is :func:`torch_dad.functional.head_loss_and_gradients` (the float64 oracle the
tests compare with); here it is rearranged per chunk::

    logits_c = h_c @ W.T + b                         (chunk of rows c, compute dtype)
    lse_c    = logsumexp(logits_c)                   (float32)
    log p_c  = logits_c[y_c] - lse_c                 (per-token log-likelihood)
    d_c      = (softmax(logits_c) - onehot(y_c)) * scale   (0 on ignored rows)
    dL/dW   += d_c.T @ h_c   (float32 accumulator)   dL/db += d_c.sum(0)
    dL/dh_c  = d_c @ W

``scale`` is ``1 / num_valid`` (``reduction="mean"``) or 1 (``"sum"``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import functional as F
from .optim import LocalOptimizerState, OptimizerConfig

__all__ = [
    "CUDA_PREFERENCE",
    "IMPLS",
    "UNUSABLE",
    "DADLMHead",
    "LMHeadOutput",
    "LinearCrossEntropyResult",
    "TRITON_CHUNK_BYTES",
    "check_token_labels",
    "default_chunk_size",
    "linear_cross_entropy",
    "resolve_impl",
    "shift_labels",
]

IMPLS: tuple[str, ...] = ("auto", "torch", "triton", "compile", "liger", "cce")
UPDATES: tuple[str, ...] = ("inplace", "grad")
# Bytes of transient logits one chunk may hold (compute-dtype logits + their float32 softmax).
# At V=49152 this is 256 rows: 75 MiB a chunk, against 300 MiB for the 1024-row naive chunk
# whose step peaked at 1,039 MiB on the H200 (shared/baseline/lmhead_probe.py).
CHUNK_BYTES = 64 * 2**20
# Bytes of the logits chunk for impl="triton", which keeps only the compute-dtype logits (its row
# kernel writes the gradient over them; no float32 copy). At V=49152 bf16 this is 2048 rows
# (192 MiB): the dW GEMM then has K=2048 and the float32 dW accumulator (113 MiB at D=576) is read
# and written 4 times for 8192 tokens instead of 32. The step's other memory at that shape (float32
# weight, AdamW moments, dW, bf16 weight copy) is ~560 MiB, so the peak stays near 760 MiB, under
# the 962 MiB target (1/6 of the unfused step). benchmarks/lm_head.py also times 512 and 1024 rows.
TRITON_CHUNK_BYTES = 192 * 2**20
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class LinearCrossEntropyResult:
    """What one fused step returns; every gradient is that of ``loss``.

    ``loss`` = ``scale * sum_valid CE`` (float32, 0-dim). ``grad_weight``/``grad_bias`` are
    float32 (float64 for float64 inputs); ``grad_input`` has ``hidden``'s dtype. The
    per-token fields are float32 (``is_top1`` bool) over all rows, 0 on ignored rows.
    """

    loss: Tensor
    grad_weight: Tensor | None
    grad_bias: Tensor | None
    grad_input: Tensor | None
    log_probs: Tensor | None
    entropy: Tensor | None
    is_top1: Tensor | None
    num_valid: int
    impl: str


def default_chunk_size(vocab: int, compute_dtype: torch.dtype, token_stats: bool = False, impl: str = "torch") -> int:
    """Rows per chunk (multiple of 16): one chunk's logits + float32 softmax fit :data:`CHUNK_BYTES`;
    for ``impl="triton"`` the compute-dtype logits alone fit :data:`TRITON_CHUNK_BYTES`."""
    size = torch.empty((), dtype=compute_dtype).element_size()
    if impl == "triton":
        per_row, budget = vocab * size, TRITON_CHUNK_BYTES
    else:
        per_row, budget = vocab * (size + 4 + (4 if token_stats else 0)), CHUNK_BYTES
    rows = budget // max(per_row, 1)
    return max(16, rows // 16 * 16)


def shift_labels(labels: Tensor, ignore_index: int = F.IGNORE_INDEX) -> Tensor:
    """Next-token targets as HF causal LMs use them: ``cat(labels[..., 1:], ignore)``, same shape."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def check_token_labels(
    target: Tensor, rows_shape: tuple[int, ...], vocab: int, ignore_index: int = F.IGNORE_INDEX, *, name: str = "labels"
) -> int:
    """Raise unless ``target`` holds integer ids of shape ``rows_shape`` in ``[0, vocab)`` or ``ignore_index``.

    Returns the number of non-ignored entries (one host sync for the range check and the count).
    """
    if not isinstance(target, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"{name} have dtype {target.dtype}; pass integer token ids (e.g. {name}.long())")
    if tuple(target.shape) != tuple(rows_shape):
        raise ValueError(
            f"{name} have shape {tuple(target.shape)} but the hidden states have {tuple(rows_shape)} tokens; "
            f"pass one token id (or {ignore_index} to ignore) per position, shape {tuple(rows_shape)}"
        )
    if target.numel() == 0:
        return 0
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    n_bad, n_valid = (int(v) for v in torch.stack([bad.sum(), valid.sum()]).tolist())
    if n_bad:
        values = target[bad]
        raise ValueError(
            f"{name} must lie in [0, {vocab}) (the vocabulary size) or equal ignore_index={ignore_index}; "
            f"{n_bad} entries do not (values in [{int(values.min())}, {int(values.max())}]). Mask padding with "
            f"{ignore_index}, or resize the head if the tokenizer grew"
        )
    return n_valid


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


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _liger_forward() -> Callable[..., Any]:
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    return fused_linear_cross_entropy_forward


def _cce_function() -> Callable[..., Any]:
    from cut_cross_entropy import linear_cross_entropy as cce

    return cce


_IMPORTERS: dict[str, Callable[[], Callable[..., Any]]] = {"liger": _liger_forward, "cce": _cce_function}
# cut-cross-entropy 25.1.1's bf16 dL/dhidden was 2.1% off the float64 truth on the H200 at
# 4097 x 576 x 49152, beyond the unfused bf16 step's own error + 1e-2 that every other impl meets
# (tests/gpu/test_lm_head_gpu.py); its dL/dW and loss were within. So it is refused for that case.
_CCE_HALF_GRAD_INPUT = (
    "impl='cce' is not used for dL/dhidden (grad_input=True / backprop_gradients=True) in bf16/fp16: "
    "cut-cross-entropy's half-precision dL/dhidden is less accurate than the unfused bf16 step (2.1% off "
    "float64 at 4097x576x49152). Use impl='triton' or 'torch' (or 'auto'), or grad_input=False with impl='cce'"
)
# Preference on CUDA when impl="auto". "triton" (ours, kernels/cross_entropy.py) and liger-kernel
# both keep the logits chunk in the compute dtype and turn it into the gradient in place with one
# row kernel (two reads, one write); ours uses 2048-row chunks (large GEMMs) where liger picks
# ~128 rows. The torch path needs ~6 float32 passes per chunk. benchmarks/lm_head.py measures them.
CUDA_PREFERENCE: tuple[str, ...] = ("triton", "liger", "torch")
# libraries that failed to import or run on this machine: impl="auto" skips them (name -> reason)
UNUSABLE: dict[str, str] = {}


def _triton_runnable(device: torch.device) -> str | None:
    """``None`` if our Triton kernels can run on ``device`` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    from .kernels import _interpreting, triton_available

    if "triton" in UNUSABLE:
        return UNUSABLE["triton"]
    # the device first: on CPU the answer must not depend on whether triton happens to be installed
    if device.type != "cuda" and not _interpreting():
        return f"runs on CUDA only (or on CPU under TRITON_INTERPRET=1), not on {device.type}"
    if not triton_available():
        return "triton is not importable (install torch-dad[gpu])"
    return None


def _importable(name: str) -> str | None:
    """``None`` if library ``name`` imports, else why not."""
    if name in UNUSABLE:
        return UNUSABLE[name]
    try:
        _IMPORTERS[name]()
    except (ImportError, AttributeError, RuntimeError) as exc:  # a wheel built for another torch/triton
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_impl(
    impl: str,
    device: torch.device,
    *,
    bias: bool = False,
    token_stats: bool = False,
    grad_input: bool = False,
    dtype: torch.dtype | None = None,
) -> str:
    """The implementation ``impl`` stands for on ``device``: ``auto`` = :data:`CUDA_PREFERENCE` on CUDA, torch elsewhere.

    ``grad_input``/``dtype`` describe the call: cut-cross-entropy is refused for ``dL/dhidden`` in
    bf16/fp16 (see :data:`_CCE_HALF_GRAD_INPUT`).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported; choose one of {', '.join(IMPLS)}")
    cce_refused = grad_input and dtype in _HALF
    if impl == "auto":
        if device.type != "cuda":
            return "torch"
        for name in CUDA_PREFERENCE:
            if name == "torch":
                return name
            if name == "triton":
                if _triton_runnable(device) is None:
                    return name
                continue
            if token_stats:
                continue  # the libraries do not return per-token entropy
            if (name == "cce" and (bias or cce_refused)) or _importable(name) is not None:
                continue
            return name
        return "torch"
    if impl == "torch":
        return impl
    if impl == "triton":
        reason = _triton_runnable(device)
        if reason is not None:
            raise ValueError(f"impl='triton' {reason}; use impl='torch' (or 'auto')")
        return impl
    if device.type != "cuda":
        raise ValueError(f"impl={impl!r} runs on CUDA only; use impl='torch' (or 'auto') on {device.type}")
    if impl == "compile":
        if token_stats:
            raise ValueError("impl='compile' returns no per-token entropy; use impl='triton' or 'torch' for "
                             "token_stats=True")
        return impl
    if impl == "cce" and bias:
        raise ValueError("impl='cce' takes no bias; use impl='triton', 'torch' or 'liger' for a head with a bias")
    if impl == "cce" and cce_refused:
        raise ValueError(_CCE_HALF_GRAD_INPUT)
    if token_stats:
        raise ValueError(f"impl={impl!r} returns no per-token entropy; use impl='triton' or 'torch' for "
                         "token_stats=True")
    reason = _importable(impl)
    if reason is not None:
        package = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}[impl]
        raise ValueError(f"impl={impl!r} needs a working {package} package ({reason}); install it or use "
                         "impl='triton' or 'torch'")
    return impl


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = F.IGNORE_INDEX,
    reduction: str = "mean",
    grad_weight: bool = True,
    grad_input: bool = True,
    token_stats: bool = False,
    chunk_size: int | None = None,
    impl: str = "auto",
    compute_dtype: torch.dtype | None = None,
) -> LinearCrossEntropyResult:
    """Loss and gradients of ``CE(hidden @ weight.T + bias, target)`` without the full logits.

    ``hidden`` (N, D), ``weight`` (V, D), ``target`` (N,) ids or ``ignore_index``. Equals
    :func:`torch_dad.functional.head_loss_and_gradients` (+ ``dL/dhidden = d_logits @ W``) up to
    the compute dtype's rounding. ``compute_dtype`` defaults to the autocast dtype when autocast
    is on, else ``promote_types(hidden, weight)``. ``token_stats`` adds per-token ``entropy`` and
    ``is_top1``. Runs without autograd; the inputs are not modified.
    """
    _check_hidden_weight(hidden, weight, bias)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None (automatic)")
    if compute_dtype is not None and (not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype={compute_dtype!r} must be a floating torch.dtype or None")
    num_valid = check_token_labels(target, (hidden.shape[0],), weight.shape[0], ignore_index, name="target")
    dtype = compute_dtype or _autocast_dtype(hidden.device) or torch.promote_types(hidden.dtype, weight.dtype)
    name = resolve_impl(impl, hidden.device, bias=bias is not None, token_stats=token_stats, grad_input=grad_input,
                        dtype=dtype)
    scale = (1.0 / num_valid if num_valid else 0.0) if reduction == "mean" else 1.0
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        if name == "compile":
            rows = chunk_size or default_chunk_size(weight.shape[0], dtype)
            return _compiled_linear_cross_entropy(
                hidden, weight, target, bias, ignore_index, scale, grad_weight, grad_input, rows, dtype, num_valid
            )
        if name == "torch":
            rows = chunk_size or default_chunk_size(weight.shape[0], dtype, token_stats)
            return _torch_linear_cross_entropy(
                hidden, weight, target, bias, ignore_index, scale, grad_weight, grad_input, token_stats, rows, dtype,
                num_valid,
            )
        try:
            if name == "triton":
                rows = chunk_size or default_chunk_size(weight.shape[0], dtype, impl="triton")
                return _triton_linear_cross_entropy(
                    hidden, weight, target, bias, ignore_index, scale, grad_weight, grad_input, token_stats, rows,
                    dtype, num_valid,
                )
            return _library_linear_cross_entropy(
                name, hidden, weight, target, bias, ignore_index, scale, grad_weight, grad_input, dtype, num_valid
            )
        except Exception as exc:  # impl="auto" must always work: fall back to the torch path, say why once
            if impl != "auto":
                raise
            UNUSABLE[name] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"impl={name!r} failed here ({UNUSABLE[name]}); impl='auto' uses 'torch' from now on",
                          RuntimeWarning, stacklevel=2)
        rows = chunk_size or default_chunk_size(weight.shape[0], dtype, token_stats)
        return _torch_linear_cross_entropy(
            hidden, weight, target, bias, ignore_index, scale, grad_weight, grad_input, token_stats, rows, dtype,
            num_valid,
        )


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` kept in its (wider) dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):
        # cuBLAS reads bf16/fp16 and accumulates into the float32 buffer directly: no
        # parameter-sized temporary per chunk (torch >= 2.8)
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@dataclass
class _ChunkSums:
    """The outputs :func:`_torch_linear_cross_entropy` and :func:`_triton_linear_cross_entropy` fill
    chunk by chunk: zeroed ``dW`` (V, D), ``db`` (V,), ``dh`` (N, D), per-token log-likelihood,
    entropy and top-1 flags (each ``None`` when not asked for)."""

    grad_weight: Tensor | None
    grad_bias: Tensor | None
    grad_input: Tensor | None
    log_probs: Tensor
    entropy: Tensor | None
    is_top1: Tensor | None

    @classmethod
    def zeros(cls, hidden: Tensor, vocab: int, has_bias: bool, want_gw: bool, want_gi: bool, token_stats: bool,
              acc: torch.dtype) -> _ChunkSums:
        n, d = hidden.shape
        device = hidden.device
        return cls(
            grad_weight=torch.zeros(vocab, d, dtype=acc, device=device) if want_gw else None,
            grad_bias=torch.zeros(vocab, dtype=acc, device=device) if want_gw and has_bias else None,
            grad_input=torch.zeros(n, d, dtype=hidden.dtype, device=device) if want_gi else None,
            log_probs=torch.zeros(n, dtype=acc, device=device),
            entropy=torch.zeros(n, dtype=acc, device=device) if token_stats else None,
            is_top1=torch.zeros(n, dtype=torch.bool, device=device) if token_stats else None,
        )

    def result(self, scale: float, num_valid: int, impl: str) -> LinearCrossEntropyResult:
        """``loss = -scale * sum(log p)`` (float32 unless float64) with these sums."""
        loss = -self.log_probs.sum() * scale
        return LinearCrossEntropyResult(
            loss=loss if loss.dtype == torch.float64 else loss.float(), grad_weight=self.grad_weight,
            grad_bias=self.grad_bias, grad_input=self.grad_input, log_probs=self.log_probs, entropy=self.entropy,
            is_top1=self.is_top1, num_valid=num_valid, impl=impl,
        )


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: int,
                  dtype: torch.dtype) -> Iterator[tuple[int, int, Tensor, Tensor]]:
    """``(start, stop, h, h @ W.T + b)`` for each chunk of ``rows`` rows, in the compute ``dtype``
    (pass ``weight`` already in it: a cast here would be a second V x D copy)."""
    w = weight if weight.dtype == dtype else weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        h = hidden[start:stop]
        h = h if h.dtype == dtype else h.to(dtype)
        yield start, stop, h, (h @ w.T if b is None else torch.addmm(b, h, w.T))


def _add_chunk_gradient(
    grad_logits: Tensor, h: Tensor, w: Tensor, gw: Tensor | None, gb: Tensor | None, gi: Tensor | None,
    start: int, stop: int,
) -> None:
    """One chunk's products from its logit gradient ``g``: ``dW += g.T @ h``, ``db += g.sum(0)``,
    ``dh[start:stop] = g @ W`` (``g`` may carry zero padding rows past ``stop - start``)."""
    if gw is not None:
        _accumulate_mm(gw, grad_logits.T, h)
        if gb is not None:
            gb += grad_logits.sum(0, dtype=gb.dtype)
    if gi is not None:
        gi[start:stop] = grad_logits[: stop - start] @ w


def _torch_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    scale: float,
    want_gw: bool,
    want_gi: bool,
    token_stats: bool,
    rows: int,
    dtype: torch.dtype,
    num_valid: int,
) -> LinearCrossEntropyResult:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    w = weight if weight.dtype == dtype else weight.to(dtype)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
    sums = _ChunkSums.zeros(hidden, weight.shape[0], bias is not None, want_gw, want_gi, token_stats, acc)
    need_grad = (want_gw or want_gi) and num_valid > 0
    for start, stop, h, logits in _chunk_logits(hidden, w, bias, rows, dtype):
        # softmax in float32 for half inputs (as F.cross_entropy on autocast logits.float())
        wide = logits.float() if dtype in _HALF else logits
        m = valid[start:stop]
        t = safe[start:stop]
        lse = torch.logsumexp(wide, dim=1)
        sums.log_probs[start:stop] = (wide.gather(1, t).squeeze(1) - lse).masked_fill_(~m, 0)
        if sums.is_top1 is not None:
            sums.is_top1[start:stop] = (wide.argmax(1) == t.squeeze(1)) & m
        if not (need_grad or token_stats):
            continue
        probs = wide.sub_(lse.unsqueeze(1)).exp_()  # in place: the chunk's only float32 buffer
        if sums.entropy is not None:
            sums.entropy[start:stop] = torch.special.entr(probs).sum(1).masked_fill_(~m, 0)
        if not need_grad:
            continue
        mf = m.to(probs.dtype).unsqueeze(1)
        probs.scatter_add_(1, t, -mf)  # - onehot(y) on valid rows
        probs.mul_(mf * scale)  # ignored rows -> 0
        if probs.dtype != dtype:
            grad_logits = logits.copy_(probs)  # reuse the compute-dtype logits buffer
            del probs, wide
        else:
            grad_logits = probs
        _add_chunk_gradient(grad_logits, h, w, sums.grad_weight, sums.grad_bias, sums.grad_input, start, stop)
    return sums.result(scale, num_valid, "torch")


def _triton_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    scale: float,
    want_gw: bool,
    want_gi: bool,
    token_stats: bool,
    rows: int,
    dtype: torch.dtype,
    num_valid: int,
) -> LinearCrossEntropyResult:
    """Per chunk: cuBLAS logits in the compute dtype, one Triton row kernel (loss terms + gradient in
    place, kernels/cross_entropy.py), then the dW / db / dh products from that buffer."""
    from .kernels.cross_entropy import cross_entropy_rows_

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    w = weight if weight.dtype == dtype else weight.to(dtype)
    tgt = target.contiguous()
    sums = _ChunkSums.zeros(hidden, weight.shape[0], bias is not None, want_gw, want_gi, token_stats, acc)
    need_grad = (want_gw or want_gi) and num_valid > 0
    for start, stop, h, logits in _chunk_logits(hidden, w, bias, rows, dtype):
        cross_entropy_rows_(
            logits, tgt[start:stop], sums.log_probs[start:stop], ignore_index=ignore_index, scale=scale,
            write_grad=need_grad, entropy=None if sums.entropy is None else sums.entropy[start:stop],
            is_top1=None if sums.is_top1 is None else sums.is_top1[start:stop],
        )
        if not need_grad:
            continue
        # the logits buffer now holds (softmax - onehot) * scale, 0 on ignored rows
        _add_chunk_gradient(logits, h, w, sums.grad_weight, sums.grad_bias, sums.grad_input, start, stop)
        del logits
    return sums.result(scale, num_valid, "triton")


def _ce_grad_chunk(logits: Tensor, target: Tensor, valid: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """``((softmax(logits) - onehot(target)) * valid * scale, log p(target) * valid)`` for one chunk.

    The loop body of :func:`_torch_linear_cross_entropy` written out of place so that
    ``torch.compile`` fuses it: one reduction over the vocabulary and one pass that writes the
    gradient in the logits' dtype, instead of ~6 float32 passes.
    """
    wide = logits.float()
    lse = torch.logsumexp(wide, dim=1, keepdim=True)
    log_p = (wide.gather(1, target.unsqueeze(1)) - lse).squeeze(1)
    cols = torch.arange(wide.shape[1], device=wide.device)
    onehot = (cols.unsqueeze(0) == target.unsqueeze(1)).float()
    row_scale = valid.float().unsqueeze(1) * scale
    grad = ((torch.exp(wide - lse) - onehot) * row_scale).to(logits.dtype)
    return grad, torch.where(valid, log_p, torch.zeros_like(log_p))


_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    scale: float,
    want_gw: bool,
    want_gi: bool,
    rows: int,
    dtype: torch.dtype,
    num_valid: int,
) -> LinearCrossEntropyResult:
    """:func:`_torch_linear_cross_entropy` with the chunk body compiled; every chunk is padded to one shape."""
    if "chunk" not in _COMPILED:
        _COMPILED["chunk"] = torch.compile(_ce_grad_chunk, dynamic=False)
    fused = _COMPILED["chunk"]
    n, d = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    rows = min(rows, max(16, -(-n // 16) * 16))
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    gw = torch.zeros(vocab, d, dtype=torch.float32, device=device) if want_gw else None
    gb = torch.zeros(vocab, dtype=torch.float32, device=device) if want_gw and bias is not None else None
    gi = torch.zeros(n, d, dtype=hidden.dtype, device=device) if want_gi else None
    log_probs = torch.zeros(n, dtype=torch.float32, device=device)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=device)  # a tensor: no recompile per value
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        k = stop - start
        h, t, m = hidden[start:stop].to(dtype), safe[start:stop], valid[start:stop]
        if k < rows:  # padded rows have valid=False: zero gradient, no recompilation for the tail
            h = nn.functional.pad(h, (0, 0, 0, rows - k))
            t = nn.functional.pad(t, (0, rows - k))
            m = nn.functional.pad(m, (0, rows - k))
        logits = h @ w.T if b is None else torch.addmm(b, h, w.T)
        grad, log_p = fused(logits, t, m, scale_t)
        del logits
        log_probs[start:stop] = log_p[:k]
        _add_chunk_gradient(grad, h, w, gw, gb, gi, start, stop)
    loss = -log_probs.sum() * scale
    return LinearCrossEntropyResult(
        loss=loss, grad_weight=gw, grad_bias=gb, grad_input=gi, log_probs=log_probs, entropy=None, is_top1=None,
        num_valid=num_valid, impl="compile",
    )


def _library_linear_cross_entropy(
    name: str,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    scale: float,
    want_gw: bool,
    want_gi: bool,
    dtype: torch.dtype,
    num_valid: int,
) -> LinearCrossEntropyResult:
    """liger-kernel's or cut-cross-entropy's fused kernels behind the same contract (CUDA)."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    h = hidden.to(dtype).contiguous()
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    target = target.long().contiguous()
    gw = gb = gi = None
    log_probs = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    if num_valid == 0:
        if want_gw:
            gw = torch.zeros(vocab, d, dtype=torch.float32, device=hidden.device)
            gb = None if bias is None else torch.zeros(vocab, dtype=torch.float32, device=hidden.device)
        if want_gi:
            gi = torch.zeros_like(hidden)
    elif name == "liger":
        forward = _liger_forward()
        # reduction="none": per-token losses, and liger's gradients are then those of their sum
        # (scaled once below); accum_dtype=float32 keeps dW exact across its chunks (liger then
        # casts it to w's dtype, widened again here for the float32 update)
        out = forward(h, w, target, bias=b, ignore_index=ignore_index, reduction="none", accum_dtype=torch.float32,
                      compute_gradients=True, weight_requires_grad=want_gw)
        token_loss, gi, gw, gb = out[0].float(), out[-3], out[-2], out[-1]
        log_probs = -token_loss
        if gw is not None:
            gw = gw.float().mul_(scale) if want_gw else None
        if gb is not None:
            gb = gb.float().mul_(scale) if want_gw else None
        gi = gi.mul_(scale).to(hidden.dtype) if want_gi else None
    else:
        cce = _cce_function()
        with torch.enable_grad():
            e = h.detach().requires_grad_(want_gi)
            c = w.detach().requires_grad_(want_gw)
            # filter_eps=None: no gradient filtering, so the gradients are exact
            token_loss = cce(e, c, target, ignore_index=ignore_index, reduction="none", filter_eps=None)
            wanted = [x for x in (e, c) if x.requires_grad]
            grads = list(torch.autograd.grad(token_loss.sum(), wanted)) if wanted else []
        log_probs = -token_loss.detach().float()
        if want_gi:
            gi = grads.pop(0).mul_(scale).to(hidden.dtype)
        if want_gw:
            gw = grads.pop(0).float().mul_(scale)
    if num_valid:
        log_probs = log_probs.masked_fill(target == ignore_index, 0.0)
        loss = -log_probs.sum() * scale
    return LinearCrossEntropyResult(
        loss=loss, grad_weight=gw, grad_bias=gb, grad_input=gi, log_probs=log_probs, entropy=None, is_top1=None,
        num_valid=num_valid, impl=name,
    )


@dataclass
class LMHeadOutput:
    """What :meth:`DADLMHead.fused_loss` returns; per-token fields have the labels' shape, 0 where ignored."""

    loss: Tensor
    log_probs: Tensor
    entropy: Tensor | None
    is_top1: Tensor | None
    label_mask: Tensor


class _DADLMHeadFunction(torch.autograd.Function):
    """``log p(y_t)`` per valid token; backward = the head's update (+ ``dL/dhidden`` if asked).

    ``apply(hidden, weight, bias, head, target, token_stats)`` with ``hidden`` (n, D) holding only
    valid rows. Forward runs the fused step once (loss, summed ``dW``, per-row ``dh``) and keeps the
    gradients on ``ctx``; backward scales them by the incoming per-token gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: DADLMHead, target: Tensor,
        token_stats: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        trains = head._trains()
        want_gi = bool(ctx.needs_input_grad[0]) and head.backprop_gradients
        res = linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=head.ignore_index, reduction="sum",
            grad_weight=trains, grad_input=want_gi, token_stats=token_stats, chunk_size=head.chunk_size,
            impl=head.impl, compute_dtype=head._compute_dtype(hidden),
        )
        ctx.head, ctx.res, ctx.used = head, res, False
        head.last_impl = res.impl
        log_probs = res.log_probs
        assert log_probs is not None
        entropy = res.entropy if res.entropy is not None else torch.zeros_like(log_probs)
        top1 = res.is_top1 if res.is_top1 is not None else torch.zeros(log_probs.shape, dtype=torch.bool,
                                                                         device=log_probs.device)
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
        grad_hidden = None
        if res.grad_input is not None:
            # d log p_t / d h_t = -(p_t - onehot_t) @ W = -grad_input_t (summed reduction)
            grad_hidden = res.grad_input * (-grad_log_probs).to(res.grad_input.dtype).unsqueeze(1)
        n = res.num_valid
        grads = [g for g in (res.grad_weight, res.grad_bias) if g is not None]
        out_w = out_b = None
        if head._trains() and n and grads:
            if head.update == "inplace":
                # the head's own objective: mean CE over this batch's valid tokens
                head._apply_local([g.mul_(1.0 / n) for g in grads])
            else:
                weight_per_token = -grad_log_probs
                lo, hi = (float(v) for v in torch.stack([weight_per_token.min(), weight_per_token.max()]).tolist())
                if not math.isclose(lo, hi, rel_tol=1e-4, abs_tol=0.0):
                    raise ValueError(
                        "DADLMHead(update='grad') needs the loss to weight every token alike (mean or sum of the "
                        f"token log-likelihoods); got per-token weights in [{lo:.3g}, {hi:.3g}]. Use update='inplace'"
                    )
                scale = float(weight_per_token.mean())
                out_w = res.grad_weight.mul_(scale).to(head.weight.dtype) if res.grad_weight is not None else None
                if res.grad_bias is not None and head.bias is not None:
                    out_b = res.grad_bias.mul_(scale).to(head.bias.dtype)
        ctx.res = None
        return grad_hidden, out_w, out_b, None, None, None


class DADLMHead(nn.Module):
    """A causal LM's ``lm_head``: ``logits = hidden @ weight.T (+ bias)`` that trains itself.

    ``forward(hidden)`` returns logits (evaluation, generation, ``compute_metrics``).
    :meth:`fused_loss` (training) runs :func:`linear_cross_entropy` on the valid tokens and returns
    per-token log-likelihoods whose backward updates the head: ``update="inplace"`` applies AdamW
    (state in buffers) to the mean next-token CE of the batch; ``update="grad"`` accumulates the
    upstream loss's gradient into ``.grad``. With ``backprop_gradients=True`` the backward also
    returns the true ``dL/dhidden`` (pre-update weights) so LoRA adapters or the backbone train.
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
        ignore_index: int = F.IGNORE_INDEX,
        chunk_size: int | None = None,
        impl: str = "auto",
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if update not in UPDATES:
            raise ValueError(f"update={update!r} must be 'inplace' (own AdamW in backward) or 'grad' (fill .grad)")
        if not isinstance(backprop_gradients, bool):
            raise TypeError(f"backprop_gradients must be a bool, got {type(backprop_gradients).__name__}")
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} is not supported; choose one of {', '.join(IMPLS)}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None (automatic)")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
        self.in_features, self.vocab_size = in_features, vocab_size
        self.config = OptimizerConfig(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)  # type: ignore[arg-type]
        self.update, self.backprop_gradients, self.ignore_index = update, backprop_gradients, ignore_index
        self.chunk_size, self.impl, self.compute_dtype = chunk_size, impl, compute_dtype
        self.last_impl: str | None = None
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(vocab_size, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(vocab_size, **kw)) if bias else None
        nn.init.normal_(self.weight, std=in_features**-0.5)
        self.optim_state: LocalOptimizerState | None = None
        if update == "inplace":
            self.optim_state = LocalOptimizerState([t.shape for t in self._trained_tensors()], device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Module, **kwargs: Any) -> DADLMHead:
        """A head with ``linear``'s weight (and bias) copied (not shared), on its device and dtype."""
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise TypeError(f"from_linear needs a module with a 2-D .weight (an nn.Linear), got {type(linear).__name__}")
        bias = getattr(linear, "bias", None)
        head = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype,
                   **kwargs)
        with torch.no_grad():
            head.weight.copy_(weight)
            if bias is not None and head.bias is not None:
                head.bias.copy_(bias)
        return head

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
                f"update={self.update!r}, backprop_gradients={self.backprop_gradients}, impl={self.impl!r}")

    @property
    def out_features(self) -> int:
        """``vocab_size``, as ``nn.Linear`` names it."""
        return self.vocab_size

    def _trains(self) -> bool:
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)

    def _trained_tensors(self) -> list[Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def _compute_dtype(self, hidden: Tensor) -> torch.dtype | None:
        """``compute_dtype``, else the autocast dtype, else bf16/fp16 if ``hidden`` is (mixed precision
        with float32 master weights: the activations' dtype decides), else ``None`` (promote)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        return _autocast_dtype(hidden.device) or (hidden.dtype if hidden.dtype in _HALF else None)

    def _apply_local(self, grads: list[Tensor]) -> None:
        assert self.optim_state is not None
        params = [t.detach() for t in self._trained_tensors()]
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
        with torch.no_grad():
            self.optim_state.apply_(params, grads, self.config)

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
        rows_shape = tuple(hidden.shape[:-1])
        if isinstance(labels, Tensor) and labels.device != hidden.device:
            labels = labels.to(hidden.device)
        check_token_labels(labels, rows_shape, self.vocab_size, self.ignore_index)
        targets = shift_labels(labels, self.ignore_index) if shift and labels.dim() > 0 else labels
        mask = targets != self.ignore_index
        flat_mask = mask.reshape(-1)
        index = flat_mask.nonzero().squeeze(1)
        num_valid = index.numel()
        # score only valid positions: padding and prompt tokens cost no GEMM
        rows = hidden.reshape(-1, self.in_features).index_select(0, index)
        weight = self.weight
        if self.training and torch.is_grad_enabled():
            lp, ent, top1 = _DADLMHeadFunction.apply(rows, weight, self.bias, self, targets.reshape(-1)[index],
                                                     token_stats)
        else:
            with torch.no_grad():
                res = linear_cross_entropy(rows, weight, targets.reshape(-1)[index], self.bias,
                                           ignore_index=self.ignore_index, reduction="sum", grad_weight=False,
                                           grad_input=False, token_stats=True, chunk_size=self.chunk_size,
                                           impl="torch", compute_dtype=self._compute_dtype(hidden))
            assert res.log_probs is not None and res.entropy is not None and res.is_top1 is not None
            lp, ent, top1 = res.log_probs, res.entropy, res.is_top1
        n_rows = flat_mask.numel()
        log_probs = lp.new_zeros(n_rows).index_copy(0, index, lp).reshape(mask.shape)
        entropy = ent.new_zeros(n_rows).index_copy(0, index, ent).reshape(mask.shape) if token_stats else None
        is_top1 = top1.new_zeros(n_rows).index_copy(0, index, top1).reshape(mask.shape) if token_stats else None
        denom = num_valid if num_items_in_batch is None else num_items_in_batch
        if isinstance(denom, Tensor):
            denom = denom.to(log_probs.device).clamp(min=1)
        else:
            denom = max(int(denom), 1)
        loss = -log_probs.sum() / denom
        return LMHeadOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)
