"""Fused linear cross-entropy kernels of other libraries (optional extras, CUDA only).

``backend="liger"`` runs liger-kernel's ``fused_linear_cross_entropy_forward`` and
``backend="cce"`` cut-cross-entropy's ``linear_cross_entropy``. Each adapter returns, for
``CE(hidden @ weight.T + bias, target)`` with no reduction::

    (token_loss (N,), dL/dhidden, dL/dW, dL/db)   gradients of token_loss.sum(), None if not asked

:func:`torch_dad.ops.linear_cross_entropy.linear_cross_entropy` scales them and masks ignored
rows. The libraries are imported on first use only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["CCE_HALF_GRAD_INPUT", "LIBRARIES", "cce_step", "import_error", "liger_step"]

# backend name -> the package that provides it
LIBRARIES: dict[str, str] = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}
# refused: cut-cross-entropy's bf16 dL/dhidden misses the tolerance every other backend meets (docs/design-lm-head.md)
CCE_HALF_GRAD_INPUT = (
    "backend='cce' is not used for dL/dhidden (grad_input=True / backprop_gradients=True) in bf16/fp16: "
    "cut-cross-entropy's half-precision dL/dhidden is less accurate than the unfused bf16 step (2.1% off "
    "float64 at 4097x576x49152). Use backend='triton' or 'torch' (or 'auto'), or grad_input=False with "
    "backend='cce'"
)

Step = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]


def _liger_forward() -> Callable[..., Any]:
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    return fused_linear_cross_entropy_forward


def _cce_function() -> Callable[..., Any]:
    from cut_cross_entropy import linear_cross_entropy as cce

    return cce


_IMPORTERS: dict[str, Callable[[], Callable[..., Any]]] = {"liger": _liger_forward, "cce": _cce_function}


def import_error(name: str) -> str | None:
    """``None`` if the library behind backend ``name`` imports, else why not."""
    try:
        _IMPORTERS[name]()
    except (ImportError, AttributeError, RuntimeError) as exc:  # a wheel built for another torch/triton
        return f"{type(exc).__name__}: {exc}"
    return None


def liger_step(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int,
               want_gw: bool, want_gi: bool) -> Step:
    """liger-kernel's fused step (``hidden``, ``weight``, ``bias`` in the compute dtype)."""
    # reduction="none": per-token losses, and the gradients are those of their sum;
    # accum_dtype=float32 keeps dW exact across liger's chunks (it then casts dW to weight's dtype)
    out = _liger_forward()(hidden, weight, target, bias=bias, ignore_index=ignore_index, reduction="none",
                           accum_dtype=torch.float32, compute_gradients=True, weight_requires_grad=want_gw)
    token_loss, gi, gw, gb = out[0], out[-3], out[-2], out[-1]
    return token_loss, gi if want_gi else None, gw if want_gw else None, gb if want_gw else None


def cce_step(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, want_gw: bool,
             want_gi: bool) -> Step:
    """cut-cross-entropy's step through autograd (it takes no bias)."""
    with torch.enable_grad():
        e = hidden.detach().requires_grad_(want_gi)
        c = weight.detach().requires_grad_(want_gw)
        # filter_eps=None: no gradient filtering, so the gradients are exact
        token_loss = _cce_function()(e, c, target, ignore_index=ignore_index, reduction="none", filter_eps=None)
        wanted = [x for x in (e, c) if x.requires_grad]
        grads = list(torch.autograd.grad(token_loss.sum(), wanted)) if wanted else []
    gi = grads.pop(0) if want_gi else None
    gw = grads.pop(0) if want_gw else None
    return token_loss.detach(), gi, gw, None
