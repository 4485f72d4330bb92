"""The conv and transformer-block examples run end to end in ``--smoke`` mode on CPU, and their
``--save`` checkpoints restore to the same test metrics."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import torch_dad as td

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"torch_dad_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # the timings the examples quote were taken with one thread; keep the tests as light
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_smoke(
    module: ModuleType, script: str, save: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> dict[str, float]:
    """``main()`` as the command line ``python <script> --smoke --device cpu --save <save>`` runs it."""
    monkeypatch.setattr(sys, "argv", [script, "--smoke", "--device", "cpu", "--save", str(save)])
    results = module.main()
    printed = capsys.readouterr().out
    assert "test accuracy: trained classifier" in printed and "after solve_head()" in printed, printed
    assert save.is_file()
    return results


@pytest.mark.parametrize("name, load_data", [("conv_mnist", "load_images"), ("transformer_blocks", "load_sequences")])
def test_example_smoke_and_checkpoint(
    name: str, load_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _load(name)
    path = tmp_path / f"{name}.safetensors"
    results = _run_smoke(example, f"{name}.py", path, monkeypatch, capsys)
    assert results["accuracy"] > 0.5, results  # the synthetic classes are well separated; chance is 0.1
    _, test = getattr(example, load_data)(smoke=True, train_size=384)
    trained = _metrics_after_loading(example.make_trainer("cpu"), path, test)
    assert (trained["accuracy"], trained["loss"]) == (results["accuracy"], results["loss"])


def _metrics_after_loading(trainer: td.DADTrainer, path: Path, test: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """``evaluate(test)`` of a freshly built trainer after ``load_checkpoint(path)``, checked against
    the same trainer before loading so that a no-op load cannot pass."""
    before = trainer.evaluate(test)
    trainer.load_checkpoint(path)
    after = trainer.evaluate(test)
    assert after["loss"] != before["loss"]
    return after


def test_sft_trl_smoke_loss_falls(tmp_path: Path) -> None:
    """``examples/sft_trl.py --smoke``: DADSFTTrainer on a tiny random Llama learns the counting pattern and saves."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    example = _load("sft_trl")
    results = example.main(["--smoke", "--save", str(tmp_path / "model")])
    assert results["last_loss"] < 0.5 * results["first_loss"], results
    assert (tmp_path / "model" / "config.json").is_file()


@pytest.mark.slow
def test_causal_lm_blocks_smoke_both_modes_learn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``examples/causal_lm_blocks.py --smoke``: DAD and backprop both learn the generated text (uniform: log 64)."""
    example = _load("causal_lm_blocks")
    path = tmp_path / "runs.json"
    records = example.main(["--smoke", "--device", "cpu", "--json", str(path)])
    assert [r["mode"] for r in records] == ["dad", "backprop"]
    for record in records:
        curve = record["curve"]
        assert curve[0]["tokens"] == 0 and curve[-1]["tokens"] == record["tokens"] == 8 * 16 * 60
        assert record["val_loss"] < curve[0]["val_loss"] - 0.5, record
    assert records[0]["curve"][0] == records[1]["curve"][0]  # the same initial weights and validation windows
    args = example.parse_args(["--smoke"])
    x = torch.randint(0, args.vocab, (2, args.seq))
    reference = example.make_model(args)(x)
    for head in ("full", "bucket"):  # the other blocks' heads leave the model's initial weights as they are
        args.local_head = head
        assert torch.equal(example.make_model(args)(x), reference)
    assert "dad: validation loss per word" in capsys.readouterr().out
    assert [r["val_loss"] for r in json.loads(path.read_text())] == [r["val_loss"] for r in records]
