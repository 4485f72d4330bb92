"""The local heads of ``DADBlock`` (mean pool + Linear) and ``DADConv2d`` (grid pool + Linear) on the
local-error kernel (``backend="triton"``) against the float64 reference (the same layer in float64, PyTorch
ops), on random inputs and odd shapes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_kernels
from tests.test_conv import Residual

pytestmark = requires_kernels

CLASSES = 7
#: relative error of a float32 step against float64: the head's products and softmax run in float32
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _layers(kind: str, smoothing: float) -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "residual block":
        layer: Any = td.DADBlock(Residual(6), num_classes=CLASSES, head_features=6, label_smoothing=smoothing)
        x = torch.randn(5, 6, 5, 3)
    elif kind == "token block":
        encoder = torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh())
        layer = td.DADBlock(encoder, num_classes=CLASSES, head_features=11, feature_dim=-1, label_smoothing=smoothing)
        x = torch.randn(5, 3, 9)
    else:
        layer = td.DADConv2d(3, 6, 3, padding=1, num_classes=CLASSES, pool="max", label_smoothing=smoothing)
        x = torch.randn(5, 3, 7, 9)
    return layer, x


@pytest.mark.parametrize("kind", ["residual block", "token block", "conv"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_local_head_on_the_kernel_matches_float64(kind: str, smoothing: float, dtype: torch.dtype) -> None:
    layer, x = _layers(kind, smoothing)
    y = torch.randint(0, CLASSES, (x.shape[0],))
    reference = copy.deepcopy(layer).double()
    with torch.no_grad():
        want, want_grads = reference.local_gradients(x.double(), y)
        layer = layer.to(DEVICE)
        got, grads = layer.local_gradients(x.to(DEVICE), y.to(DEVICE), None if dtype == torch.float32 else dtype,
                                           backend="triton")
    tolerance = TOLERANCE[dtype]
    assert relative_error(got.loss.double().cpu(), want.loss) <= tolerance
    assert relative_error(got.logits.double().cpu(), want.logits) <= tolerance
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.float32
        assert relative_error(g.double().cpu(), w) <= tolerance
