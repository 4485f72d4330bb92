"""``benchmarks/text_blocks.py``: both systems train one architecture; each system's best lr and DAD's comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import text_blocks  # noqa: E402


def test_backprop_runs_the_dad_models_modules() -> None:
    torch.manual_seed(0)
    model = text_blocks.TextBlocks(vocab=30, width=16, heads=2, ffn=24, seq=7, blocks=3)
    network = model.backprop_model()
    ids = torch.randint(0, 30, (5, 7))
    # the same modules, so the same initial weights and outputs; the local heads stay out of backprop's network
    assert torch.equal(model(ids), network(ids)) and model(ids).shape == (5, text_blocks.CLASSES)
    heads = {id(p) for block in model.blocks for p in block.head.parameters()}
    assert {id(p) for p in network.parameters()} == {id(p) for p in model.parameters()} - heads
    assert model.blocks[-1](model.blocks[1](model.blocks[0](ids))).shape == (5, 16)  # the last block pools


def test_summarise_marks_each_systems_best_and_compares_dad() -> None:
    rows = [
        {"system": "dad", "lr": 1e-3, "accuracy": 0.70, "step_ms": 4.0, "total_mib": 300.0, "peak_reserved_mib": 400.0},
        {"system": "dad", "lr": 3e-3, "accuracy": 0.72, "step_ms": 5.0, "total_mib": 320.0, "peak_reserved_mib": 420.0},
        {"system": "backprop-graphed", "lr": 1e-3, "accuracy": 0.73, "step_ms": 6.0, "total_mib": 640.0,
         "peak_reserved_mib": 700.0},
        {"system": "backprop-eager", "lr": 1e-3, "error": "out of memory"},
    ]
    text_blocks.summarise(rows)
    assert [row["best"] for row in rows] == [False, True, True, False]
    versus = rows[1]["versus"]
    assert list(versus) == ["backprop-graphed"]
    assert versus["backprop-graphed"] == pytest.approx(
        {"speedup": 6.0 / 5.0, "accuracy_gap_pp": -1.0, "total_ratio": 0.5, "peak_reserved_ratio": 0.6})
