"""Triton kernels for the GPU fast path (CUDA only) and their launchers.

Each module of this package (``local_error``, ``adamw``, ``cross_entropy``, ``logits``, ``labels``, ...)
holds ``@triton.jit`` kernels and the functions that launch them, imports triton at the top and
nothing from ``torch_dad`` except this package. This file imports no triton, so
``import torch_dad`` stays torch+numpy: the ops of :mod:`torch_dad.ops` (argument checks,
the choice of path, the PyTorch twin) import a kernel module on their first launch only.

``backend="auto"`` runs the Triton kernel for CUDA tensors when triton is importable, and
the PyTorch twin (the CPU path) otherwise. Setting ``TRITON_INTERPRET=1`` before the first
call also runs the kernels on CPU tensors (slowly), which the kernel tests use where no GPU
exists.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["cdiv", "interpreting", "next_pow2", "triton_available", "use_triton"]


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """``True`` if ``import triton`` works (imported on first call only)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """``True`` when ``TRITON_INTERPRET=1``: kernels then run on CPU tensors too."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"



def use_triton(tensor: torch.Tensor, backend: str) -> bool:
    """Decide between the Triton kernel and its PyTorch twin for ``tensor``'s device."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'triton' or 'torch'")
    if backend == "torch":
        return False
    runnable = triton_available() and (tensor.is_cuda or interpreting())
    if backend == "triton" and not runnable:
        raise ValueError(
            "backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1); "
            "install torch-dad[gpu] or pass backend='torch'"
        )
    return runnable


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (a Triton block size)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints ``a >= 0``, ``b > 0`` (a launch grid's size)."""
    return -(-a // b)
