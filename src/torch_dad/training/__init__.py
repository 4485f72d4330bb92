"""Training: the trainer, its step (eager loop and fused/graphed engine), data parallelism and the pipeline."""

from __future__ import annotations

from . import schedules
from .data_parallel import DataParallelTrainer
from .options import EngineOptions
from .pipeline import Pipeline
from .step import Batch, GradientReducer, StepOutput
from .trainer import DADTrainer

__all__ = [
    "Batch", "DADTrainer", "DataParallelTrainer", "EngineOptions", "GradientReducer", "Pipeline", "StepOutput",
    "schedules",
]
