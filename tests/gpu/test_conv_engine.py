"""DADConv2d / DADBlock models on the fused and CUDA-graph engines against the eager step (GPU, or interpreter)."""

from __future__ import annotations

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_cuda, requires_kernels
from torch_dad.training import EngineOptions

pytestmark = requires_kernels

CLASSES = 5


class _Residual(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.b = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b(torch.relu(self.a(x))))


class ConvNet(td.DADModel):
    """conv (max pool) - residual block - conv (avg pool, gelu) - dense - classifier on 3 x 16 x 16, the
    convolutions batch-normalised with ``normalize="batchnorm"``; without ``dense`` no ``DADLinear``, the
    classifier on the flattened conv output."""

    def __init__(self, normalize: str | None = None, dense: bool = True, smoothing: float = 0.0) -> None:
        super().__init__()
        self.c1 = td.DADConv2d(
            3, 16, 3, padding=1, num_classes=CLASSES, pool="max", normalize=normalize, label_smoothing=smoothing
        )
        self.block = td.DADBlock(_Residual(16), num_classes=CLASSES, head_features=16)
        self.c2 = td.DADConv2d(
            16, 24, 3, padding=1, num_classes=CLASSES, pool="avg", activation="gelu", normalize=normalize,
            label_smoothing=smoothing,
        )
        if dense:
            self.fc = td.DADLinear(24 * 4 * 4, 32, num_classes=CLASSES, label_smoothing=smoothing)
        self.classifier = torch.nn.Linear(32 if dense else 24 * 4 * 4, CLASSES)


def _pair(
    backend: str, amp: torch.dtype | None, normalize: str | None = None, dense: bool = True, smoothing: float = 0.0,
    dropout: float = 0.0, local_streams: int = 3,
) -> tuple[td.DADTrainer, td.DADTrainer]:
    torch.manual_seed(3)
    ref, new = ConvNet(normalize, dense, smoothing), ConvNet(normalize, dense, smoothing)
    new.load_state_dict(ref.state_dict())
    options = {"device": DEVICE, "amp_dtype": amp, "on_nonfinite": "ignore", "dropout": dropout, "dropout_seed": 5}
    engine_options = EngineOptions(local_streams=local_streams)
    fused = td.DADTrainer(new, backend=backend, engine_options=engine_options, **options)
    assert fused.uses_engine
    return td.DADTrainer(ref, backend="eager", **options), fused


BACKENDS = ["fused"] + (["cuda-graph"] if DEVICE == "cuda" else [])
AMPS = [None] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", AMPS)
@pytest.mark.parametrize("normalize", [None, "batchnorm"])
@pytest.mark.parametrize("dense", [True, False])  # without a DADLinear the step forks no side stream
def test_conv_and_block_model_matches_eager(
    backend: str, amp: torch.dtype | None, normalize: str | None, dense: bool
) -> None:
    _check_matches_eager(backend, amp, normalize, *_pair(backend, amp, normalize, dense))


@pytest.mark.slow
@requires_cuda
@pytest.mark.parametrize("amp", AMPS)
@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("local_streams", [0, 1, 4])
def test_local_stream_counts_match_eager(amp: torch.dtype | None, dense: bool, local_streams: int) -> None:
    """``EngineOptions(local_streams=...)``: the captured step with local layers on the main stream (0) or on one
    or four side streams matches the eager step."""
    pair = _pair("cuda-graph", amp, "batchnorm", dense, local_streams=local_streams)
    _check_matches_eager("cuda-graph", amp, "batchnorm", *pair)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", AMPS)
def test_conv_recipe_with_smoothing_and_dropout_matches_eager(backend: str, amp: torch.dtype | None) -> None:
    """The conv cells' selected recipe (batch norm, label smoothing 0.1) with the menu's dropout 0.1 on the
    engine: no eager fallback, the same masks and updates as the eager step."""
    _check_matches_eager(backend, amp, "batchnorm", *_pair(backend, amp, "batchnorm", True, 0.1, 0.1))


def _check_matches_eager(
    backend: str, amp: torch.dtype | None, normalize: str | None, eager: td.DADTrainer, fused: td.DADTrainer
) -> None:
    tol = 1e-4 if amp is None else 3e-2
    generator = torch.Generator().manual_seed(0)
    for i in range(5):
        batch = 32 if i < 4 else 9  # repeated shapes are captured under "cuda-graph"; a ragged one is not
        x = torch.randn(batch, 3, 16, 16, generator=generator).to(DEVICE)
        y = torch.randint(0, CLASSES, (batch,), generator=generator).to(DEVICE)
        logits_e, loss_e = eager.step(x, y)
        logits_f, loss_f = fused.step(x, y)
        assert relative_error(loss_f, loss_e) <= tol
        assert relative_error(logits_f, logits_e) <= 5 * tol
    if backend == "cuda-graph":
        assert fused.engine is not None and fused.engine.num_graphs >= 1
    for (key, a), b in zip(eager.model.state_dict().items(), fused.model.state_dict().values()):
        assert relative_error(b, a) <= 10 * tol, key  # with the batch norms' running statistics
    if normalize is not None:
        assert bool(fused.model.c2.running_mean.any())
    assert relative_error(torch.tensor(fused.running_loss), torch.tensor(eager.running_loss)) <= tol


@requires_cuda
def test_conv_model_solve_head_and_checkpoint_on_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, trainer = _pair("cuda-graph", torch.bfloat16)
    x = torch.randn(96, 3, 16, 16, device="cuda")
    y = torch.randint(0, CLASSES, (96,), device="cuda")
    trainer.fit((x, y), epochs=2, batch_size=32, progress=False)
    # the sample draws from every row seen: 2 epochs of 96 rows, all kept below its capacity
    assert trainer.classifier_sample is not None and trainer.classifier_sample.size == 2 * 96
    trainer.solve_head(lambda_reg=1e-2)
    trainer.save_checkpoint(tmp_path / "conv.safetensors")
    _, fresh = _pair("cuda-graph", torch.bfloat16)
    fresh.load_checkpoint(tmp_path / "conv.safetensors")
    assert fresh.evaluate((x, y)) == trainer.evaluate((x, y))
