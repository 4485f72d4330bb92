"""torch-dad: Decoupled Analytical Dense (DAD) target propagation for PyTorch.

Layout, bottom to top: ``kernels`` (Triton kernels) < ``functional`` / ``optim`` / ``ridge``
(reference math, optimizer state, closed-form solve) < ``ops`` (fused operations with PyTorch
twins) < ``nn`` (the DAD layers) < ``training`` (trainer, engine, distributed) <
``integrations`` (transformers, trl, unsloth). ``import torch_dad`` needs only torch and numpy:
triton and the integrations' packages are imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from . import data as data  # re-exported, imported on first access
    from . import integrations as integrations

# submodules that `import torch_dad` leaves unimported (data reads files, integrations import other libraries),
# reachable as attributes all the same: `torch_dad.data.mnist()`
_LAZY_SUBMODULES = ("data", "integrations")

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


if not TYPE_CHECKING:  # type checkers see the imports above; at run time the import waits for the first access

    def __getattr__(name: str) -> ModuleType:
        if name in _LAZY_SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY_SUBMODULES})
