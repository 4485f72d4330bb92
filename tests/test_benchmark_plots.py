"""Every benchmark draws its committed record: its ``plot(runs, path)`` writes a PNG from ``results/<name>.json``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import RESULTS, read_runs  # noqa: E402

BENCHMARKS = [
    "autograd_overhead", "checkpoint_cost", "conv", "cpu_floor", "cpu_throughput", "distributed", "dropin_mnist",
    "gpu_memory", "gpu_scaling", "gpu_throughput", "hf_head", "hf_head_20ng", "lm_head_slice_kernel",
    "local_error_tiles", "localloss", "max_pool", "sft_smollm2", "text_blocks",
]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_committed_record_is_drawn(name: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    module = importlib.import_module(name)
    path = tmp_path / f"{name}.png"
    assert module.plot(read_runs(RESULTS / f"{name}.json"), path)
    assert path.stat().st_size > 1000
    assert not module.plot([], tmp_path / "empty.png")  # no run: nothing drawn
