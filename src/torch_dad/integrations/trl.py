"""TRL ``SFTTrainer`` with a DAD LM head (extra ``trl``; tested with trl 1.16).

``SFTTrainer`` installs its own fused LM head on the model in ``__init__`` (``model(...,
fused_lm_head=True)`` returns per-token log-probs), and trains ``lm_head`` by backprop through
it. :func:`patch_trainer` runs after that and puts a :class:`~torch_dad.nn.lm_head.DADLMHead` in
its place, answering the same ``fused_lm_head=True`` protocol (``log_probs``, ``entropy``,
``is_top1``, ``label_mask``), so TRL's loss, metrics and evaluation code run unchanged.
Evaluation with ``compute_metrics`` still gets full logits (the model's own forward).

    trainer = DADSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                            dad_head={"lr": 1e-4, "untie_embeddings": True})
    trainer.train()
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..nn.lm_head import DADLMHead
from .causal_lm import replace_lm_head, trunk_trains, unwrap_model

__all__ = ["patch_trainer"]  # + DADSFTTrainer (lazy: it subclasses trl.SFTTrainer)


def patch_trainer(trainer: Any, **head_kwargs: Any) -> DADLMHead:
    """Give ``trainer.model`` (an ``SFTTrainer``'s, PEFT or not) a DAD LM head; returns the head.

    ``head_kwargs`` go to :func:`~torch_dad.integrations.causal_lm.replace_lm_head` (``untie_embeddings``,
    ``lr``, ``update``, ``backprop_gradients`` ...). ``backprop_gradients`` defaults to whether anything
    below the head trains (a parameter outside ``lm_head`` requires grad: a full fine-tune, or PEFT
    adapters), so those parameters keep learning from the true ``dL/dhidden``; with a frozen backbone
    only the head trains.
    """
    model = getattr(trainer, "model", None)
    if not isinstance(model, nn.Module):
        raise TypeError(f"trainer must have a .model (an SFTTrainer), got {type(trainer).__name__}")
    base = unwrap_model(model)
    if "backprop_gradients" not in head_kwargs:
        # without dL/dhidden a trainable trunk would get no gradient at all, silently
        head_kwargs["backprop_gradients"] = trunk_trains(model)
    head = replace_lm_head(base, **head_kwargs)
    accumulation = getattr(getattr(trainer, "args", None), "gradient_accumulation_steps", 1) or 1
    if head.update == "inplace" and accumulation > 1:
        warnings.warn(
            f"gradient_accumulation_steps={accumulation}: the DAD head (update='inplace') takes its AdamW step at "
            f"every micro-batch, {accumulation} per optimizer step of the rest of the model; pass "
            "dad_head={'update': 'grad'} for the trainer's optimizer to step it with the accumulated gradient",
            UserWarning, stacklevel=2,
        )
    if head.update == "inplace":
        # the head updates itself in backward; it must require grad to get a backward at all,
        # and holds no .grad, so the trainer's optimizer (built later, lazily) skips it
        head.weight.requires_grad_(True)
        if head.bias is not None:
            head.bias.requires_grad_(True)
    return head


def _trainer_class() -> type:
    from trl import SFTTrainer

    class DADSFTTrainer(SFTTrainer):  # type: ignore[misc]
        """``trl.SFTTrainer`` whose model gets a DAD LM head; ``dad_head`` = kwargs of :func:`patch_trainer`."""

        def __init__(self, *args: Any, dad_head: dict[str, Any] | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.dad_head = patch_trainer(self, **(dad_head or {}))

    return DADSFTTrainer


_CACHE: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "DADSFTTrainer":
        if name not in _CACHE:
            _CACHE[name] = _trainer_class()
        return _CACHE[name]
    raise AttributeError(name)
