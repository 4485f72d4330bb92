"""torch-dad: Decoupled Analytical Dense (DAD) target propagation for PyTorch.

Public API only. Integrations (transformers, peft, trl, unsloth) and Triton kernels are
imported lazily from their own modules; ``import torch_dad`` needs only torch and numpy.
"""

from __future__ import annotations

from . import functional, schedules
from .autograd import DADAutogradLinear, label_context
from .layers import DADLinear, DADModel
from .lm_head import DADLMHead, linear_cross_entropy
from .optim import OptimizerConfig
from .ridge import GramAccumulator, RidgeSolution
from .trainer import DADTrainer

__version__ = "0.1.0"

__all__ = [
    "DADAutogradLinear",
    "DADLinear",
    "DADLMHead",
    "DADModel",
    "DADTrainer",
    "GramAccumulator",
    "OptimizerConfig",
    "RidgeSolution",
    "functional",
    "label_context",
    "linear_cross_entropy",
    "schedules",
    "__version__",
]
