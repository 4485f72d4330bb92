"""Checkpoint in one process, resume in a fresh one: bitwise equal to an uninterrupted run."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import torch_dad as td
    from torch_dad import data

    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(16, 24, num_classes=3)
            self.l2 = td.DADLinear(24, 12, num_classes=3, activation="tanh")
            self.classifier = torch.nn.Linear(12, 3)

    mode, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    (x, y), _ = data.synthetic(num_train=480, num_features=16, num_classes=3, seed=7)
    batches = list(data.batches(x, y, 48, seed=1))
    torch.manual_seed(0)
    trainer = td.DADTrainer(Net())
    if mode == "first-half":
        for bx, by in batches[:5]:
            trainer.step(bx, by)
        torch.save(trainer.state_dict(), path)
    elif mode == "second-half":
        torch.manual_seed(123)
        trainer = td.DADTrainer(Net())
        trainer.load_state_dict(torch.load(path))
        for bx, by in batches[5:]:
            trainer.step(bx, by)
        torch.save(trainer.state_dict(), out)
    else:
        for bx, by in batches:
            trainer.step(bx, by)
        torch.save(trainer.state_dict(), out)
    """
)


def _run(tmp_path: Path, *args: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, str(script), *args], check=True, env=None)


def _flatten(state, prefix=""):
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def test_resume_in_fresh_process_is_bitwise_identical(tmp_path):
    ckpt, resumed, straight = (str(tmp_path / n) for n in ("ckpt.pt", "resumed.pt", "straight.pt"))
    _run(tmp_path, "first-half", ckpt, "-")
    _run(tmp_path, "second-half", ckpt, resumed)
    _run(tmp_path, "straight", "-", straight)
    a, b = torch.load(resumed), torch.load(straight)
    assert a["step_count"] == b["step_count"] == 10
    fa, fb = _flatten(a), _flatten(b)
    assert fa.keys() == fb.keys() and len(fa) > 10
    for key in fa:
        assert torch.equal(fa[key], fb[key]), key
