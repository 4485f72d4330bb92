"""DAD layers on one local-update core: a trainer-driven layer, an autograd drop-in for ``nn.Linear`` and an LM head."""

from __future__ import annotations

from .autograd import DADAutogradLinear, label_context
from .convert import to_dad
from .linear import DADLinear, DADModel
from .lm_head import DADLMHead

__all__ = ["DADAutogradLinear", "DADLMHead", "DADLinear", "DADModel", "label_context", "to_dad"]
