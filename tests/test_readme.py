"""The README's quickstart block runs as written (on CPU when CUDA is absent)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_block_runs():
    text = README.read_text()
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README-quickstart", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.step_count == 8
    assert namespace["model"].classifier.weight.abs().sum() > 0


def test_readme_two_commands_exist():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/torch-dad demo" in text
    assert "bash scripts/test.sh" in text
    assert (README.parent / "scripts" / "test.sh").exists()
    assert "bash scripts/test.sh" in (README.parent / ".ci" / "run").read_text()
