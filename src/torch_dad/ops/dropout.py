"""Counter-based dropout: a mask that is a pure function of (seed, step, layer, element).

:func:`counter_dropout` computes ``out = where(keep, x / (1 - p), 0)`` where element ``e`` of
``x`` (row-major) is kept when the top 24 bits of word ``e mod 4`` of Philox-4x32-10, keyed by
``seed`` with counter ``(e // 4, layer, step mod 2**32, step >> 32)``, are at least
``round(p * 2**24)``. No torch generator is read: the same mask comes back in the eager and the
fused step, on CPU and CUDA, after a resume from the step count alone, and inside a CUDA graph,
where ``step`` is a device tensor the graph reads. The generator is that of the input sample's
device draws (:mod:`torch_dad.ops.reservoir`); :func:`philox4x32` is its PyTorch twin.

On CUDA this is one Triton launch (:mod:`torch_dad.kernels.dropout`); elsewhere the twin below.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

from ..kernels import use_triton
from .reservoir import check_seed

__all__ = ["counter_dropout", "philox4x32"]

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # its key increments (Weyl sequence)
_WORD = 0xFFFFFFFF
_BITS = 24  # a keep decision compares 24 random bits with round(p * 2**24)


def _mulhilo(multiplier: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """The high and low 32-bit words of ``multiplier * x`` (``x`` int64 in ``[0, 2**32)``), in int64
    without overflow: the constant is split into 16-bit halves."""
    high_half, low_half = multiplier >> 16, multiplier & 0xFFFF
    t = x * low_half  # < 2**48
    s = x * high_half  # < 2**48
    return (s + (t >> 16)) >> 16, (((s & 0xFFFF) << 16) + t) & _WORD


def philox4x32(seed: int, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, rounds: int = 10) -> list[Tensor]:
    """Philox-4x32 (Salmon et al., 2011) on int64 tensors holding 32-bit counters, key ``(seed mod
    2**32, seed >> 32)``: the four output words, as ``triton.language.random.philox`` returns them.

    Per round: ``(c0, c1, c2, c3) <- (hi(B c2) ^ c1 ^ k0, lo(B c2), hi(A c0) ^ c3 ^ k1, lo(A c0))``,
    then the key advances by the Weyl constants.
    """
    check_seed(seed)
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _WORD, (k1 + _KEY_B) & _WORD
    return [c0, c1, c2, c3]


def _check(x: Tensor, p: float, seed: int, step: Tensor | int, layer: int) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be a float in [0, 1)")
    check_seed(seed)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= _WORD:
        raise ValueError(f"layer={layer!r} must be an int in [0, 2**32)")
    if isinstance(step, Tensor):
        if step.dim() != 0 or step.dtype != torch.int64:
            raise ValueError(f"step must be an int or a 0-dim int64 tensor, got {step.dim()}-dim {step.dtype}")
    elif isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise ValueError(f"step={step!r} must be an int in [0, 2**63)")
    if not x.is_floating_point() or x.numel() >= 4 * 2**32:
        raise ValueError(f"x must be a floating tensor of fewer than 2**34 elements, got {x.dtype}, {x.numel()}")


def counter_dropout(
    x: Tensor, p: float, seed: int, step: Tensor | int, layer: int, *, backend: str = "auto"
) -> Tensor:
    """``where(keep, x * (1 / (1 - p)), 0)`` (a new tensor) with the counter-based mask of the
    module docstring; ``step`` an int or a 0-dim int64 tensor (read on the device, no host sync)."""
    _check(x, p, seed, step, layer)
    if p == 0.0 or x.numel() == 0:
        return x.clone()
    threshold, scale = round(p * 2**_BITS), 1.0 / (1.0 - p)
    if isinstance(step, int):
        step = torch.tensor(step, dtype=torch.int64, device=x.device)
    if use_triton(x, backend):
        source = x.contiguous()
        out = torch.empty_like(source)
        _kernels().launch_dropout(source, out, step, seed, layer, threshold, scale)
        return out.view_as(x)
    return _dropout_torch(x, step, seed, layer, threshold, scale)


def _dropout_torch(x: Tensor, step: Tensor, seed: int, layer: int, threshold: int, scale: float) -> Tensor:
    """The twin: Philox over ``ceil(numel / 4)`` counters, word ``e mod 4`` for element ``e``."""
    n = x.numel()
    c0 = torch.arange(-(-n // 4), dtype=torch.int64, device=x.device)
    step = step.to(x.device)
    words = philox4x32(seed, c0, torch.full_like(c0, layer), (step & _WORD).expand_as(c0), (step >> 32).expand_as(c0))
    keep = (torch.stack(words, 1).reshape(-1)[:n] >> (32 - _BITS)) >= threshold
    dropped = torch.where(keep.view(x.shape), x.float() * scale, 0.0)
    return dropped.to(x.dtype)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from ..kernels import dropout as kernels  # imports triton: on the first launch only

    return kernels
