"""The fused engine's scheduling options: :class:`EngineOptions` (a plain dataclass; the engine
itself, which imports the kernel dispatch, is loaded only when a trainer builds one)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STREAM_PRIORITIES", "EngineOptions"]

#: the CUDA stream priority per role under ``EngineOptions.stream_priorities`` (lower is more
#: urgent; ``torch.cuda.Stream.priority_range()`` gives the device's range)
STREAM_PRIORITIES: dict[str, int] = {"critical": -2, "gemm": -1, "sample": 0, "background": 0}


@dataclass(frozen=True)
class EngineOptions:
    """How the fused step schedules its kernels. ``docs/design-engine.md`` gives the measurements
    behind each default and the command that repeats them; on another GPU a user may tune them.

    Args:
        overlap: under ``"cuda-graph"``, run each layer's weight gradient and AdamW on side
            streams beside the next layer's forward.
        update_chunk_numel: a layer with at least this many weights computes its weight gradient
            and AdamW in row blocks, each block's AdamW beside the next block's GEMM.
        update_chunks: the number of row blocks; ``None``: 4 up to ``small_batch`` rows, else 2
            (a longer GEMM runs faster in fewer, larger blocks).
        small_batch: the batch size up to which ``update_chunks=None`` means 4 blocks.
        stream_priorities: capture with stream priorities (forwards and local errors first,
            weight-gradient GEMMs next, AdamW last); ``None``: on unless a layer updates in row
            blocks, whose AdamW chain is then the critical path.
        local_error_off_main: run each local error on its own stream beside the next forward;
            ``None``: on when no DAD layer is wider than ``local_error_max_width`` (beside a
            4096 x 4096 forward GEMM the error kernels slow it more than they save).
        local_error_max_width: see ``local_error_off_main``.
        max_graphs: captured graphs kept (one per input shape and dtype) before all are dropped.
        local_streams: under ``overlap`` (one process), the side streams that local layers (``DADConv2d``,
            ``DADBlock``) take in turn for their step and AdamW, so that their gradients run beside the next
            layers' forwards. Each stream holds one layer's working memory: more streams run faster where a
            layer's kernels leave the GPU idle, at that cost (``docs/conv-and-blocks.md`` gives both); ``0``: on
            the main stream, the leanest.
    """

    overlap: bool = True
    update_chunk_numel: int = 8 * 2**20
    update_chunks: int | None = None
    small_batch: int = 2048
    stream_priorities: bool | None = None
    local_error_off_main: bool | None = None
    local_error_max_width: int = 1024
    max_graphs: int = 8
    local_streams: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool):
            raise TypeError(f"EngineOptions(overlap={self.overlap!r}): must be True or False")
        if isinstance(self.local_streams, bool) or not isinstance(self.local_streams, int) or self.local_streams < 0:
            raise ValueError(f"EngineOptions(local_streams={self.local_streams!r}): must be an int >= 0 (0: the main stream)")
        for name in ("update_chunk_numel", "small_batch", "local_error_max_width", "max_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineOptions({name}={value!r}): must be a positive int")
        if self.update_chunks is not None and (
            isinstance(self.update_chunks, bool) or not isinstance(self.update_chunks, int) or self.update_chunks < 1
        ):
            raise ValueError(f"EngineOptions(update_chunks={self.update_chunks!r}): must be a positive int or None")
