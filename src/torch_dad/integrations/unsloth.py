"""Unsloth ``FastLanguageModel`` + DAD LM head: ``patch(model)``.

Unsloth needs a CUDA GPU and its own pinned stack (unsloth, unsloth_zoo, bitsandbytes), which the
test suite does not install. The test suite covers the generic path this function uses, on plain
transformers causal LMs: :func:`~torch_dad.integrations.causal_lm.replace_lm_head` (see
``docs/lm_head.md``). With Unsloth itself, ``benchmarks/sft_gpu.py --systems unsloth unsloth-dad``
trains a LoRA model or a full fine-tune (``full_finetuning=True``) on a CUDA GPU.

How it works: Unsloth patches the *class* forwards of the backbone (fast attention, RoPE, RMSNorm
kernels) and, for LoRA and QLoRA, of the causal LM. ``patch`` sets an *instance* ``forward`` on the
causal LM, which in training calls the (Unsloth-patched) backbone for the hidden states and then the
DAD head's fused step, so Unsloth's fast forward meets the backprop-free head; evaluation and
generation go through Unsloth's own forward, which reads ``lm_head.weight`` as before.

A bf16 full fine-tune keeps the norms' weights in float32 beside bf16 projections and wraps the model's
class ``forward`` in ``torch.autocast(bfloat16)``, so that a float32 norm output meets a bf16 matmul
under autocast. The instance ``forward`` set here shadows that wrapper, so ``patch`` reads its dtype
and the training path runs the backbone under the same autocast (:func:`unsloth_autocast_dtype`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..nn.lm_head import DADLMHead
from .causal_lm import replace_lm_head, trunk_trains, unwrap_model

__all__ = ["patch", "is_unsloth_model", "unsloth_autocast_dtype"]


def is_unsloth_model(model: nn.Module) -> bool:
    """Whether ``model`` (or the model under its PEFT wrapper) was loaded by Unsloth: its config carries
    ``unsloth_version``, or its causal-LM forward is Unsloth's."""
    base = unwrap_model(model)
    # A full fine-tune (full_finetuning=True) keeps transformers' causal-LM forward and patches only
    # the modules below it, so the class forward alone would refuse it; every Unsloth loader stamps
    # its version into the config.
    if getattr(getattr(base, "config", None), "unsloth_version", None):
        return True
    for cls in type(base).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None:
            return "unsloth" in (getattr(forward, "__module__", "") or "")
    return False


def unsloth_autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the autocast that Unsloth's training preparation wrapped ``model``'s class forward in
    (unsloth_zoo marks the model ``_unsloth_bf16_autocast_wrapped`` and the class ``_unsloth_autocast_dtype``),
    else None."""
    base = unwrap_model(model)
    if not getattr(base, "_unsloth_bf16_autocast_wrapped", False):
        return None
    dtype = getattr(type(base), "_unsloth_autocast_dtype", torch.bfloat16)
    return dtype if isinstance(dtype, torch.dtype) else None


def patch(
    model: nn.Module,
    *,
    untie_embeddings: bool = False,
    master_dtype: torch.dtype | None = torch.float32,
    require_unsloth: bool = True,
    **head_kwargs: Any,
) -> DADLMHead:
    """Give a ``FastLanguageModel`` model (PEFT-wrapped or not) a :class:`DADLMHead`; returns the head.

    ``master_dtype`` keeps the head's weights and AdamW moments in float32 (Unsloth loads the head in
    bf16/fp16; the fused step still computes in the activations' dtype). ``backprop_gradients`` defaults
    to whether anything below the head trains (LoRA adapters, or a full fine-tune), so it keeps learning.
    ``require_unsloth=False`` allows any transformers causal LM. Unsloth's ``SFTConfig`` defaults to
    ``gradient_accumulation_steps=2``; the head (``update="inplace"``) then steps at every micro-batch, and
    ``update="grad"`` leaves its gradient to the trainer's optimizer instead.
    """
    if require_unsloth and not is_unsloth_model(model):
        raise ValueError(
            f"{type(unwrap_model(model)).__name__} does not run an Unsloth-patched forward; load it with "
            "unsloth.FastLanguageModel.from_pretrained, or pass require_unsloth=False for a plain transformers model"
        )
    base = unwrap_model(model)
    # without dL/dhidden trainable adapters or a trainable trunk would get no gradient at all
    head_kwargs.setdefault("backprop_gradients", trunk_trains(model))
    head = replace_lm_head(base, untie_embeddings=untie_embeddings, autocast_dtype=unsloth_autocast_dtype(base),
                           **head_kwargs)
    if master_dtype is not None and head.weight.dtype != master_dtype:
        head.to(dtype=master_dtype)
    head.weight.requires_grad_(True)  # a backward must reach the head even when PEFT froze it
    return head
