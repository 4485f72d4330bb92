"""The one backend vocabulary of torch-dad.

Every ``backend=`` argument (the trainer's, :class:`~torch_dad.DADAutogradLinear`'s,
:class:`~torch_dad.DADLMHead`'s and the ops') takes names from :data:`BACKENDS`, each component
the subset it implements:

=============  ==============================================================================
``auto``       the fastest path that can run on the device (resolved once, at construction)
``torch``      plain PyTorch ops: the reference path, and the one that runs on CPU
``triton``     torch-dad's Triton kernels (on CPU: their PyTorch twins, or the kernels themselves
               under ``TRITON_INTERPRET=1``)
``cuda-graph`` the Triton step captured into one CUDA graph per input shape (the trainer)
``liger``      Liger-Kernel's fused linear cross-entropy (the LM head)
``cce``        cut-cross-entropy's linear cross-entropy (the LM head)
=============  ==============================================================================
"""

from __future__ import annotations

__all__ = ["BACKENDS", "RENAMED", "check_backend"]

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "cuda-graph", "liger", "cce")
#: former names, still accepted: ``"eager"`` is ``"torch"``, ``"fused"`` is ``"triton"``
RENAMED: dict[str, str] = {"eager": "torch", "fused": "triton"}


def check_backend(value: object, accepted: tuple[str, ...], hint: str = "") -> str:
    """``value`` (a name of :data:`BACKENDS` or :data:`RENAMED`) as its current name if ``accepted``
    lists it, else ``ValueError`` naming the choices (and ``hint``)."""
    if not set(accepted) <= set(BACKENDS):
        raise AssertionError(f"{accepted} leaves the backend vocabulary {BACKENDS}")
    name = RENAMED.get(value, value) if isinstance(value, str) else value
    if name not in accepted:
        raise ValueError(f"backend={value!r} must be one of {', '.join(map(repr, accepted))}{hint}")
    assert isinstance(name, str)
    return name
