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
