"""torch-dad: Decoupled Analytical Dense (DAD) target propagation for PyTorch.

Layout, bottom to top: ``kernels`` (Triton kernels) < ``functional`` / ``optim`` / ``ridge``
(reference math, optimizer state, closed-form solve) < ``ops`` (fused operations with PyTorch
twins) < ``nn`` (the DAD layers) < ``training`` (trainer, engine, distributed) <
``integrations`` (transformers, trl, unsloth). ``import torch_dad`` needs only torch and numpy:
triton and the integrations' packages are imported on first use.
"""

from __future__ import annotations

from . import functional
from .nn.autograd import DADAutogradLinear, label_context
from .nn.linear import DADLinear, DADModel
from .nn.lm_head import DADLMHead
from .ops.linear_cross_entropy import linear_cross_entropy
from .optim import OptimizerConfig
from .ridge import GramAccumulator, RidgeSolution
from .training import schedules
from .training.trainer import DADTrainer

__version__ = "0.1.0"

__all__ = [
    "DADAutogradLinear",
    "DADLMHead",
    "DADLinear",
    "DADModel",
    "DADTrainer",
    "GramAccumulator",
    "OptimizerConfig",
    "RidgeSolution",
    "__version__",
    "functional",
    "label_context",
    "linear_cross_entropy",
    "schedules",
]
