"""Training: the trainer, its step (eager loop and fused/graphed engine), data parallelism and the pipeline.

``DataParallelTrainer`` and ``Pipeline`` need ``torch.distributed``; they are imported on first use.
"""

from __future__ import annotations

from typing import Any

from . import schedules
from .step import Batch, GradientReducer, StepOutput
from .trainer import DADTrainer

__all__ = [
    "Batch", "DADTrainer", "DataParallelTrainer", "EngineOptions", "GradientReducer", "Pipeline", "StepOutput",
    "schedules",
]

_LAZY = {
    "DataParallelTrainer": ".data_parallel",
    "Pipeline": ".pipeline",
    "EngineOptions": ".engine",
}


def __getattr__(name: str) -> Any:
    # the engine imports the kernel dispatch, and the distributed classes torch.distributed: only on use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
