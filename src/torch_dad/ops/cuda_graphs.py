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

__all__ = ["capture", "capture_stream", "no_garbage_collection", "on_stream"]

T = TypeVar("T")

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for captures that also run their warm-up steps on it.

    cuBLAS keeps a workspace per stream (64 MiB on the H200). A warm-up on the current stream and a
    capture on another would hold two; warming up where the capture runs holds one.
    """
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


@contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Run the block's kernels on ``stream``, ordered after everything queued on the current stream and
    before anything queued on it afterwards (so tensors may pass between the two in either direction)."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


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


def capture(run: Callable[[], T], pool: Any, stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``(graph, run())`` with ``run``'s kernels captured into ``graph`` (memory from ``pool``), not executed.

    The capture runs on ``stream`` (default: torch's capture stream) and may be started from autograd's
    backward thread: only that thread's CUDA calls are checked for capture safety
    (``capture_error_mode="thread_local"``).
    """
    graph = torch.cuda.CUDAGraph()
    with no_garbage_collection(), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                   capture_error_mode="thread_local"):
        out = run()
    return graph, out
