"""``DADTrainer(backend=...)`` on CPU: validation, the fused step's PyTorch twins vs eager, lean import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error


class Net(td.DADModel):
    def __init__(self, activation: str = "relu") -> None:
        super().__init__()
        self.a = td.DADLinear(23, 19, num_classes=5, activation=activation)
        self.b = td.DADLinear(19, 13, num_classes=5, activation=activation)
        self.classifier = torch.nn.Linear(13, 5)


def test_unknown_backend_raises_naming_it():
    with pytest.raises(ValueError, match="backend='gpu'"):
        td.DADTrainer(Net(), backend="gpu")


def test_cuda_graph_on_cpu_and_unsupported_models_raise():
    with pytest.raises(ValueError, match="cuda-graph.*CUDA"):
        td.DADTrainer(Net(), device="cpu", backend="cuda-graph")
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        td.DADTrainer(Net(), backend="fused", optimizer="sgd")
    with pytest.raises(ValueError, match="activation='gelu'"):
        td.DADTrainer(Net("gelu"), backend="fused")


def test_fused_backend_with_nonfinite_guard_warns_and_runs_eager():
    with pytest.warns(UserWarning, match="on_nonfinite='raise'.*eager"):
        trainer = td.DADTrainer(Net(), backend="fused")  # CPU: value checks on, guard "raise"
    assert trainer._engine is not None and not trainer._engine_applies()


def test_auto_on_cpu_is_eager():
    assert td.DADTrainer(Net(), backend="auto")._engine is None


@pytest.mark.parametrize("chunked", [False, True, 2, "fused", "heads-together"])
@pytest.mark.parametrize("amp,tol", [(None, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_cpu_step_matches_eager(amp, tol, chunked, monkeypatch):
    if chunked == "heads-together":  # every head's AdamW in one torch._fused_adamw_ at the end
        from torch_dad.engine import FusedStep

        monkeypatch.setattr(FusedStep, "head_updates_per_layer", False)
    elif chunked == "fused":  # the twin of the one-kernel weight gradient + AdamW (weight_update.py)
        from torch_dad.engine import FusedStep

        monkeypatch.setattr(FusedStep, "fused_weight_update", True)
    elif chunked:  # every layer's weight gradient and AdamW in row blocks (19 and 13 rows: ragged)
        from torch_dad.engine import FusedStep

        monkeypatch.setattr(FusedStep, "update_chunk_numel", 1)
        if chunked is not True:  # 2 blocks, the default above 2048 rows
            monkeypatch.setattr(FusedStep, "update_chunks", chunked)
    torch.manual_seed(0)
    ref, new = Net(), Net()
    new.load_state_dict(ref.state_dict())
    eager = td.DADTrainer(ref, backend="eager", amp_dtype=amp)
    # on CPU the non-finite guard defaults to "raise", which only the eager layer loop runs
    fused = td.DADTrainer(new, backend="fused", amp_dtype=amp, on_nonfinite="ignore")
    assert fused._engine_applies()
    for _ in range(4):
        x, y = torch.randn(37, 23), torch.randint(0, 5, (37,))
        l1, s1 = eager.step(x, y)
        l2, s2 = fused.step(x, y)
        assert relative_error(l2, l1) <= tol
        assert abs(float(s1) - float(s2)) <= tol
    for key, want in eager.state_dict()["model"].items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(fused.state_dict()["model"][key], want) <= 5 * tol, key
    with pytest.raises(ValueError, match="labels"):
        fused.step(torch.randn(4, 23), torch.tensor([0, 1, 2, 9]))
    assert fused.step_count == 4


def test_update_chunks_default_depends_on_batch(monkeypatch):
    from torch_dad.engine import UPDATE_CHUNKS_SMALL_BATCH, FusedStep

    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore")._engine
    assert fused.update_chunks is None
    assert fused._update_chunks(1) == fused._update_chunks(UPDATE_CHUNKS_SMALL_BATCH) == 4
    assert fused._update_chunks(UPDATE_CHUNKS_SMALL_BATCH + 1) == 2
    monkeypatch.setattr(FusedStep, "update_chunks", 3)
    assert fused._update_chunks(1) == fused._update_chunks(10**6) == 3


def test_stream_priorities_default_depends_on_layer_size(monkeypatch):
    from torch_dad.engine import FusedStep

    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore")._engine
    assert fused.stream_priorities is None and fused._stream_priorities()
    largest = max(layer.weight.numel() for layer in fused.trainer.model.dad_layers)
    monkeypatch.setattr(FusedStep, "update_chunk_numel", largest)  # now one layer updates in row blocks
    assert not fused._stream_priorities()
    monkeypatch.setattr(FusedStep, "stream_priorities", True)
    assert fused._stream_priorities()


def test_import_does_not_import_triton_or_engine():
    code = "import sys, torch_dad; print('triton' in sys.modules, 'torch_dad.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
