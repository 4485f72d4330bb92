"""Put a :class:`~torch_dad.nn.lm_head.DADLMHead` on a Hugging Face causal LM (extra ``hf``).

:func:`replace_lm_head` swaps ``model.lm_head`` for a DAD head and wraps ``model.forward``:

- training with ``labels`` (HF ``Trainer``), or ``fused_lm_head=True`` (TRL's protocol): the
  backbone runs, then the head's fused step scores the shifted labels without building logits;
  backward updates the head (and, with ``backprop_gradients=True``, sends ``dL/dhidden`` upstream);
- anything else (evaluation, generation, ``compute_metrics``): the model's own forward, with
  full logits from the head's ``forward``.

``transformers`` is imported lazily, on the first call.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.lm_head import DADLMHead

__all__ = ["replace_lm_head", "patch_forward", "trunk_trains", "unwrap_model"]  # + DADCausalLMOutput (lazy)

_PATCH_FLAG = "_torch_dad_lm_head_forward"
# logit transforms the fused step does not apply; a model using one would train a different loss
_UNSUPPORTED_CONFIG = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                       "logits_scaling")


def _output_class() -> type:
    from transformers.utils import ModelOutput

    @dataclass
    class DADCausalLMOutput(ModelOutput):  # type: ignore[misc]
        """``loss`` + per-token fields (TRL's ``FusedCausalLMOutput`` layout); ``logits`` is ``None``."""

        loss: Tensor | None = None
        logits: Tensor | None = None
        log_probs: Tensor | None = None
        entropy: Tensor | None = None
        is_top1: Tensor | None = None
        label_mask: Tensor | None = None
        aux_loss: Tensor | None = None

    return DADCausalLMOutput


@functools.cache
def _dad_output_cls() -> type:
    return _output_class()


def __getattr__(name: str) -> Any:
    if name == "DADCausalLMOutput":
        return _dad_output_cls()
    raise AttributeError(name)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` under a PEFT wrapper (``get_base_model()``), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no .config; pass a transformers causal LM (e.g. LlamaForCausalLM)")
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _is_tied(model: Any, head: Any) -> bool:
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    return isinstance(weight, Tensor) and weight.data_ptr() == head.weight.data_ptr()


def _untie_config(model: Any) -> None:
    for config in {id(c): c for c in (model.config, _text_config(model))}.values():
        config.tie_word_embeddings = False
    if isinstance(getattr(model, "all_tied_weights_keys", None), dict):
        model.all_tied_weights_keys = {
            k: v for k, v in model.all_tied_weights_keys.items() if not k.endswith("lm_head.weight")
        }


def trunk_trains(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` outside its output embedding (``lm_head``, tied weights included)
    requires grad: a full fine-tune or PEFT adapters, which need ``dL/dhidden`` from a DAD head."""
    base: Any = unwrap_model(model)
    get_out = getattr(base, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    return any(p.requires_grad for p in model.parameters() if id(p) not in head_ids)


def replace_lm_head(model: nn.Module, *, untie_embeddings: bool = False, autocast_dtype: torch.dtype | None = None,
                    **head_kwargs: Any) -> DADLMHead:
    """Replace ``model``'s output embedding (``lm_head``) by a :class:`DADLMHead` with its weights; returns it.

    ``head_kwargs`` go to :class:`DADLMHead` (``lr``, ``update``, ``backprop_gradients``, ``backend`` ...).
    A head tied to the input embeddings raises unless ``untie_embeddings=True``, which gives the
    head its own copy and sets ``config.tie_word_embeddings=False``. ``autocast_dtype``: see :func:`patch_forward`.
    """
    base: Any = unwrap_model(model)
    get_out = getattr(base, "get_output_embeddings", None)
    old = get_out() if callable(get_out) else None
    if old is None:
        raise TypeError(
            f"{type(base).__name__} has no output embedding (get_output_embeddings() is None); "
            "pass a causal LM such as AutoModelForCausalLM"
        )
    if isinstance(old, DADLMHead):
        raise ValueError("this model already has a DADLMHead; configure that head instead of replacing it again")
    text_config = _text_config(base)
    for key in _UNSUPPORTED_CONFIG:
        value = getattr(text_config, key, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"config.{key}={value!r}: the model transforms its logits, which the fused DAD step does not; "
                "this model is not supported"
            )
    if _is_tied(base, old) and not untie_embeddings:
        raise ValueError(
            "lm_head.weight is tied to the input embeddings (config.tie_word_embeddings=True): a DAD head that "
            "updates itself would silently rewrite the embeddings too. Pass untie_embeddings=True to give the "
            "head its own copy of the weights (the embeddings then keep theirs)"
        )
    head = DADLMHead.from_linear(old, **head_kwargs)
    if untie_embeddings:
        _untie_config(base)
    base.set_output_embeddings(head)
    patch_forward(base, autocast_dtype=autocast_dtype)
    return head


def _backbone_autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """``torch.autocast(device.type, dtype)``, or a no-op for ``dtype=None`` or when an autocast is already on."""
    if dtype is None or torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def patch_forward(model: nn.Module, *, autocast_dtype: torch.dtype | None = None) -> None:
    """Wrap ``model.forward`` (an instance attribute) to route training losses through the DAD head.

    ``autocast_dtype``: the training path runs the backbone under ``torch.autocast(dtype)`` (unless one is already
    on) and hands the head ``hidden.to(dtype)``. For models whose own class ``forward`` autocasts (Unsloth's bf16
    full fine-tune keeps float32 norms beside bf16 projections): the instance forward set here shadows that one,
    and the training path calls the backbone directly.
    """
    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Tensor | None = None,
                shift_labels: Tensor | None = None, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        head = self.get_output_embeddings()
        training_loss = labels is not None and self.training and torch.is_grad_enabled()
        if not isinstance(head, DADLMHead) or not (fused_lm_head or training_loss):
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            if fused_lm_head:
                kwargs["fused_lm_head"] = fused_lm_head
            return original(*args, **kwargs)
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True needs labels= (or shift_labels=) to score")
        kwargs["use_cache"] = False
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        backbone = getattr(self, self.base_model_prefix)
        with _backbone_autocast(head.weight.device, autocast_dtype):
            out = backbone(*args, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # under autocast the model's own head matmul would run in autocast_dtype; a float32 norm emits float32
        hidden = hidden.to(head.weight.device, dtype=autocast_dtype or hidden.dtype)
        if shift_labels is not None:
            # labels already shifted (as TRL passes them under context / sequence parallelism)
            result = head.fused_loss(hidden, shift_labels, shift=False, num_items_in_batch=num_items_in_batch,
                                     token_stats=fused_lm_head)
            log_probs, entropy, top1, mask = result.log_probs, result.entropy, result.is_top1, result.label_mask
        else:
            assert labels is not None
            result = head.fused_loss(hidden, labels, shift=True, num_items_in_batch=num_items_in_batch,
                                     token_stats=fused_lm_head)
            # TRL's layout: position t scores labels[t + 1], shape (batch, seq - 1)
            log_probs, mask = result.log_probs[..., :-1], result.label_mask[..., :-1]
            entropy = None if result.entropy is None else result.entropy[..., :-1]
            top1 = None if result.is_top1 is None else result.is_top1[..., :-1]
        return _dad_output_cls()(loss=result.loss, log_probs=log_probs, entropy=entropy, is_top1=top1,
                                 label_mask=mask)

    setattr(forward, _PATCH_FLAG, True)
    model.forward = types.MethodType(forward, model)
