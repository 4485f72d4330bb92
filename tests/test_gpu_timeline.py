"""``benchmarks/_gpu_timeline.py``: the per-step kernel timeline read from a profiler trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _gpu_timeline import load_events, step_timeline  # noqa: E402


def _trace(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_steps_split_in_time_order_with_offsets(tmp_path: Path) -> None:
    # two steps of (gemm on stream 1, adamw on stream 2), listed out of order, plus a CPU op that must be ignored
    events = [
        {"cat": "kernel", "name": "adamw", "ts": 112.0, "dur": 5.0, "args": {"stream": 2}},
        {"cat": "kernel", "name": "gemm", "ts": 100.0, "dur": 10.0, "args": {"stream": 1}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 99.0, "dur": 30.0, "args": {}},
        {"cat": "kernel", "name": "gemm", "ts": 200.0, "dur": 11.0, "args": {"stream": 1}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 215.0, "dur": 1.0, "args": {"stream": 7}},
        {"cat": "kernel", "name": "adamw", "ts": 213.0, "dur": 6.0, "args": {"stream": 2}},
    ]
    with pytest.raises(ValueError, match="equal steps"):
        step_timeline(load_events(_trace(tmp_path, events)), 2, 1)
    events.append({"cat": "gpu_memset", "name": "Memset", "ts": 120.0, "dur": 1.0, "args": {"stream": 7}})
    loaded = load_events(_trace(tmp_path, events))
    assert [e["name"] for e in loaded][:3] == ["gemm", "adamw", "Memset"]
    assert step_timeline(loaded, 2, 1) == [(0.0, 11.0, 1, "gemm"), (13.0, 6.0, 2, "adamw"), (15.0, 1.0, 7, "Memcpy DtoD")]
    with pytest.raises(ValueError, match="step=2"):
        step_timeline(loaded, 2, 2)


def test_committed_h200_trace_has_identical_steps() -> None:
    """Device call 38's trace (fmnist-wide-2, B=1024, 5 graph replays): every step launches the same kernels
    (in an order that may differ where streams run side by side)."""
    events = load_events(ROOT / "notes" / "gpu-2026-11-30" / "call38-trace-fmnist-wide-2-1024.json.gz")
    names = [sorted(name for _, _, _, name in step_timeline(events, 5, k)) for k in range(5)]
    assert all(n == names[0] for n in names[1:])
    assert sum("adamw_kernel" == n for n in names[0]) == 5  # layer 1 + layer 2's four row blocks
    spans = [max(s + d for s, d, _, _ in step_timeline(events, 5, k)) for k in range(1, 5)]
    assert all(250.0 < span < 450.0 for span in spans), spans
