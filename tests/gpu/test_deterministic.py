"""``torch.use_deterministic_algorithms(True)``: two DAD trainings from one seed end bitwise equal on CUDA.

Without it the local-error kernel adds partial sums atomically for small batches of wide layers, so two runs
differ in the last bits (the accuracy study measured 0.15 points of validation accuracy between such runs).
"""

from __future__ import annotations

import os

import pytest
import torch

import torch_dad as td
from tests.gpu.conftest import requires_cuda

pytestmark = requires_cuda


class _Mlp(td.DADModel):
    def __init__(self) -> None:
        super().__init__()
        # 128 rows of 1024-wide layers: the launch configuration that splits the columns
        self.l1 = td.DADLinear(784, 1024, num_classes=10)
        self.l2 = td.DADLinear(1024, 1024, num_classes=10, normalize="batchnorm")
        self.l3 = td.DADLinear(1024, 256, num_classes=10)
        self.classifier = torch.nn.Linear(256, 10)


def _train(backend: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    trainer = td.DADTrainer(_Mlp(), device="cuda", backend=backend, amp_dtype=torch.bfloat16, dropout=0.1,
                            dropout_seed=3, on_nonfinite="ignore")
    assert trainer.uses_engine
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)
        trainer.step(x.cuda(), y.cuda())
    torch.cuda.synchronize()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("backend", ["fused", "cuda-graph"])
def test_two_runs_are_bitwise_equal(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first, second = _train(backend), _train(backend)
    finally:
        torch.use_deterministic_algorithms(was)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
