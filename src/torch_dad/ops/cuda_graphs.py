"""Capturing fused steps as CUDA graphs: the training engine's whole step and ``DADLMHead``'s sweeps.

A graph replays a fixed sequence of kernels with one launch, so a step made of many small launches
stops being bound by the host's time to issue them.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = ["capture", "capture_stream", "no_garbage_collection", "on_capture_thread", "on_stream"]

T = TypeVar("T")

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
_CAPTURE_THREAD: ThreadPoolExecutor | None = None
_CAPTURE_THREAD_NAME = "torch_dad-capture"
_CAPTURE_THREAD_LOCK = threading.Lock()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for captures that also run their warm-up steps on it (see
    :func:`on_capture_thread`)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


def on_capture_thread(device: torch.device, run: Callable[[], T]) -> T:
    """``run()`` on one worker thread shared by every caller, on ``device``'s :func:`capture_stream`, ordered
    after the caller's current stream and before anything the caller queues afterwards; grad mode is the
    caller's. Blocks until ``run`` has queued its kernels (not until they finish); its exception is raised here.

    cuBLAS keeps a workspace per (thread, stream) pair, held for the life of the process
    (``docs/design-lm-head.md``). A head's forward runs on the caller's thread and its backward on autograd's, so warm-up steps
    and captures made where they are called would hold two workspaces on the capture stream; made here, they
    hold one. Replays need no cuBLAS handle and run where they are called.
    """
    global _CAPTURE_THREAD
    device = torch.device(device)
    current = torch.cuda.current_stream(device)
    grad_enabled = torch.is_grad_enabled()

    def job() -> T:
        stream = capture_stream(device)
        with torch.cuda.device(device), torch.set_grad_enabled(grad_enabled), on_stream(stream, current):
            return run()

    if threading.current_thread().name.startswith(_CAPTURE_THREAD_NAME):
        return job()  # called from a job: waiting for the one worker would wait forever
    with _CAPTURE_THREAD_LOCK:
        if _CAPTURE_THREAD is None:
            _CAPTURE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_CAPTURE_THREAD_NAME)
    return _CAPTURE_THREAD.submit(job).result()


@contextmanager
def on_stream(stream: torch.cuda.Stream, current: torch.cuda.Stream | None = None) -> Iterator[None]:
    """Run the block's kernels on ``stream``, ordered after everything queued on ``current`` (default: the
    current stream) and before anything queued on it afterwards (so tensors may pass between the two in either
    direction)."""
    current = torch.cuda.current_stream(stream.device) if current is None else current
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
