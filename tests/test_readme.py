"""The README's quickstart block runs as written (on CPU when CUDA is absent)."""

import re
from pathlib import Path

import torch

from torch_dad import DADAutogradLinear

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_block_runs():
    text = README.read_text()
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README-quickstart", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.step_count == 8
    assert namespace["model"].classifier.weight.abs().sum() > 0



def test_drop_in_block_runs():
    text = README.read_text()
    block = re.search(r"## The autograd drop-in.*?```python\n(.*?)```", text, re.S).group(1)
    torch.manual_seed(0)
    loader = [(torch.randn(32, 784), torch.randint(0, 10, (32,))) for _ in range(3)]  # the reader's data
    namespace: dict = {"loader": loader}
    exec(compile(block, "README-drop-in", "exec"), namespace)
    layers = [m for m in namespace["model"].modules() if isinstance(m, DADAutogradLinear)]
    assert [(m.role, m.activation) for m in layers] == [("hidden", "relu"), ("hidden", "relu"), ("head", "identity")]
    assert all(float(m.optim_state.step) == 3 for m in layers)  # every layer trained on every batch

def test_readme_two_commands_exist():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/torch-dad demo" in text
    assert "bash scripts/test.sh" in text
    assert (README.parent / "scripts" / "test.sh").exists()
    assert "bash scripts/test.sh" in (README.parent / ".ci" / "run").read_text()
