"""``torch-dad demo`` as a new user meets it, run through the entry point in a subprocess: help with defaults,
progress per epoch, and bad ``--json``/``--device`` values refused with the demo's usage before any training."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # a subprocess each
SMALL = ["--data", "synthetic", "--limit", "256", "--batch-size", "128", "--device", "cpu"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch_dad.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_help_describes_each_option_with_its_default():
    result = run("demo", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps to the terminal's width
    for expected in (
        "--epochs EPOCHS passes over the training images, for DAD and for backprop (default: 3)",
        "--batch-size BATCH_SIZE training images per step (default: 256)",
        "--lr LR AdamW learning rate of both trainings (default: 0.001)",
        "--seed SEED seed of the initial weights and of the data order (default: 0)",
    ):
        assert expected in text


@pytest.mark.parametrize("epochs", [1, 2])
def test_demo_reports_each_epoch_and_counts_epochs_in_words(epochs):
    result = run("demo", "--epochs", str(epochs), *SMALL)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith(", batch 128, 1 epoch" if epochs == 1 else f", batch 128, {epochs} epochs")
    table = next(i for i, line in enumerate(lines) if line.startswith("system "))
    for system in ("DAD", "backprop + AdamW"):
        reports = [i for i, line in enumerate(lines) if line.startswith(f"{system} epoch ")]
        assert [lines[i].split(":")[0] for i in reports] == [f"{system} epoch {e}/{epochs}" for e in range(1, epochs + 1)]
        assert all(" train loss " in lines[i] and lines[i].endswith(" s)") and i < table for i in reports)


@pytest.mark.parametrize("path, message", [
    ("/nonexistent/dir/x.json", "argument --json: the folder /nonexistent/dir does not exist; create it first or "
                                "pass a path in an existing folder"),
    (".", "argument --json: . is a folder; pass a file path such as ./mnist_demo.json"),
])
def test_unwritable_json_path_is_a_usage_error_before_training(path, message):
    result = run("demo", "--json", path, *SMALL)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: torch-dad demo")
    assert message in result.stderr
    assert result.stdout == ""  # no header, no training
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_missing_gpu_gives_the_demo_usage():
    result = run("demo", "--device", "cuda", "--data", "synthetic")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: torch-dad demo")
    assert "argument --device: device='cuda' was requested but CUDA is not available" in result.stderr
    assert result.stdout == ""
