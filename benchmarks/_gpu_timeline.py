"""Kernel timeline of one training step from a torch.profiler chrome trace (for docs/design-engine.md).

The trace must cover ``steps`` identical steps (e.g. 5 graph replays), as written by
``prof.export_chrome_trace`` around them. The GPU events are split into ``steps`` equal runs, and one of them is
printed: start, duration and end in µs from the step's first event, the stream, and the kernel. Such a timeline of
fmnist-wide-2 at B=1024 showed each row-block GEMM waiting for the previous block's AdamW to dispatch.

Run: python benchmarks/_gpu_timeline.py TRACE[.json|.json.gz] [--steps 5] [--step 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict]:
    """The trace's GPU events, sorted by start time."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("cat") in GPU_CATEGORIES]
    return sorted(events, key=lambda e: e["ts"])


def step_timeline(events: list[dict], steps: int, step: int) -> list[tuple[float, float, int, str]]:
    """``(start_us, duration_us, stream, name)`` of step ``step`` (0-based) of ``steps`` equal runs of events."""
    if steps < 1 or not 0 <= step < steps:
        raise ValueError(f"step={step} must lie in [0, steps={steps})")
    if len(events) % steps:
        raise ValueError(f"{len(events)} GPU events do not split into {steps} equal steps; pass the right --steps")
    per = len(events) // steps
    chunk = events[step * per:(step + 1) * per]
    t0 = chunk[0]["ts"]
    return [(e["ts"] - t0, e["dur"], int(e["args"].get("stream", -1)), e["name"]) for e in chunk]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=5, help="identical steps in the trace (default 5)")
    parser.add_argument("--step", type=int, default=3, help="which one to print, 0-based (default 3)")
    args = parser.parse_args()
    rows = step_timeline(load_events(args.trace), args.steps, args.step)
    print(f"{'start':>8} {'dur':>7} {'end':>8}  stream  kernel")
    for start, dur, stream, name in rows:
        print(f"{start:8.1f} {dur:7.1f} {start + dur:8.1f}  {stream:6d}  {name[:80]}")
    busy: dict[int, float] = {}
    for _, dur, stream, _ in rows:
        busy[stream] = busy.get(stream, 0.0) + dur
    span = max(s + d for s, d, _, _ in rows)
    print(f"step span {span:.1f} us; busy per stream: " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(busy.items())))


if __name__ == "__main__":
    main()
