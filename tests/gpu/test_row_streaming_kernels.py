"""Row-streamed ``DADLinear`` steps on the local-error kernel against the float64 reference (CUDA, or the
Triton interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE, requires_kernels
from torch_dad import functional
from torch_dad.nn import linear as linear_module
from torch_dad.nn.linear import DADLinear

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@requires_kernels
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), ("low", 3e-2)])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_streamed_kernel_step_equals_the_float64_reference(monkeypatch, dtype, tol, activation):
    dtype = LOW if dtype == "low" else dtype
    n, d, classes = 301, 48, 10
    monkeypatch.setattr(linear_module, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(linear_module, "STREAM_BLOCK_BYTES", 64 * d * torch.empty((), dtype=dtype).element_size())
    g = torch.Generator().manual_seed(0)
    layer = DADLinear(d, d, classes, activation=activation, device=DEVICE)
    x = torch.randn(n, d, generator=g).to(DEVICE)
    y = torch.randint(0, classes, (n,), generator=g).to(DEVICE)
    ref = functional.local_loss_and_gradients(x.double(), layer.weight.double(), layer.bias.double(),
                                              layer.head_weight.double(), layer.head_bias.double(), y, activation)
    inputs = x.to(dtype)
    result, grads = layer.local_gradients(inputs, y, dtype, backend="triton", reuse_input=True)
    assert result.output.data_ptr() == inputs.data_ptr()  # written over the dead input, block by block
    assert rel(result.output, ref.output) <= tol and rel(result.logits, ref.logits) <= tol
    assert abs(float(result.loss) - float(ref.loss)) <= tol * float(ref.loss)
    for got, want in zip(grads, [ref.grad_weight, ref.grad_bias, ref.grad_head_weight, ref.grad_head_bias]):
        assert got.dtype == torch.float32 and rel(got, want) <= tol
