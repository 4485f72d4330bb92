"""GPU kernel tests: run on CUDA; on CPU only under ``TRITON_INTERPRET=1`` with triton installed."""

from __future__ import annotations

import os

import pytest
import torch


def _patch_interpreter() -> None:
    # triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            _patch_interpreter()
        except ImportError:
            return None
        return "cpu"
    return None


DEVICE = _device()
requires_kernels = pytest.mark.skipif(
    DEVICE is None, reason="needs CUDA (or TRITON_INTERPRET=1 with triton installed)"
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
