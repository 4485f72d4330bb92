"""``benchmarks/step_floor.py``: the share-of-peak formula, the floor's parts on a CPU, and its plot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_floor  # noqa: E402
from _gpu_common import TOPOLOGIES  # noqa: E402


@pytest.mark.parametrize("name, img_per_s, percent", [
    ("mnist-medium-3", 31.3e6, 23), ("fmnist-wide-2", 5.93e6, 60), ("cifar10-medium-3", 21.0e6, 40),
    ("deep-8x1024", 8.51e6, 45),
])
def test_model_flops_give_the_published_shares_of_peak(name, img_per_s, percent):
    # B=4096 throughputs of the four MLPs and their shares of peak in whole percent (cut):
    # img/s x model FLOPs per row / 790 TFLOP/s
    flops = step_floor.model_flops(*TOPOLOGIES[name])
    assert int(100 * img_per_s * flops / step_floor.PEAK_FLOPS) == percent


def test_floor_parts_and_step_on_a_cpu(tmp_path):
    row = step_floor.measure("mnist-medium-3", 8, torch.device("cpu"), steps=1, repeats=1)
    for part in step_floor.PARTS:
        assert row[f"{part}_us"] > 0
    assert 0 < row["share_of_peak"] < row["share_at_floor"] * 10
    pytest.importorskip("matplotlib")
    run = {"environment": {"device": "cpu", "torch": torch.__version__}, "config": {}, "results": [row, row]}
    assert step_floor.plot([run], tmp_path / "floor.png")
    assert not step_floor.plot([], tmp_path / "empty.png")
