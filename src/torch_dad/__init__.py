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
from .nn.block import DADBlock
from .nn.conv import DADConv2d
from .nn.convert import to_dad
from .nn.linear import DADLinear, DADModel
from .nn.lm_head import DADLMHead
from .ops.linear_cross_entropy import linear_cross_entropy
from .optim import OptimizerConfig
from .ridge import GramAccumulator, RidgeSolution
from .training import schedules
from .training.trainer import DADTrainer

# calendar versioning (year.month.patch): it sorts after the published torch-dad 2026.5.24 on PyPI,
# so pip never takes that package for an upgrade of this one (README, Install)
__version__ = "2026.12.0"

__all__ = [
    "DADAutogradLinear",
    "DADBlock",
    "DADConv2d",
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
    "to_dad",
]
