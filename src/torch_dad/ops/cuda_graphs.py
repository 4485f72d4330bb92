"""Capturing fused steps as CUDA graphs: the training engine's whole step and ``DADLMHead``'s sweeps.

A graph replays a fixed sequence of kernels with one launch, so a step made of many small launches
stops being bound by the host's time to issue them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = ["capture", "no_garbage_collection"]

T = TypeVar("T")


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """No collection during capture: collecting an unreachable trainer's graph resets a CUDAGraph
    mid-capture, which invalidates this capture ("operation not permitted when stream is
    capturing"), seen after several trainers were built in one process."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def capture(run: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """``(graph, run())`` with ``run``'s kernels captured into ``graph`` (memory from ``pool``), not executed.

    The capture runs on its own stream and may be started from autograd's backward thread: only that
    thread's CUDA calls are checked for capture safety (``capture_error_mode="thread_local"``).
    """
    graph = torch.cuda.CUDAGraph()
    with no_garbage_collection(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out
