"""DAD layers on one local-update core: trainer-driven dense, convolution and block layers, an autograd drop-in for ``nn.Linear`` and an LM head."""

from __future__ import annotations

from .autograd import DADAutogradLinear, label_context
from .block import DADBlock, MeanPoolHead
from .conv import DADConv2d
from .convert import to_dad
from .linear import DADLinear, DADModel
from .lm_head import DADLMHead
from .sequence_heads import BucketHead, LowRankHead, TokenHead, VocabHead

__all__ = [
    "BucketHead",
    "DADAutogradLinear",
    "DADBlock",
    "DADConv2d",
    "DADLMHead",
    "DADLinear",
    "DADModel",
    "LowRankHead",
    "MeanPoolHead",
    "TokenHead",
    "VocabHead",
    "label_context",
    "to_dad",
]
