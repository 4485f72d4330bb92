"""Local heads' small products without a GEMM library (``torch_dad.ops.small_products``) against float64."""

from __future__ import annotations

import pytest
import torch

from torch_dad.ops import small_products

#: relative tolerance per input dtype: float32 accumulation, the result rounded once to the dtype
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [(1, 1, 1), (7, 13, 3), (256, 64, 10), (33, 257, 20)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().max().clamp_min(1e-30)
    assert (got.double() - want).abs().max() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
def test_the_broadcast_product_and_its_gradients_match_float64(shape, dtype):  # type: ignore[no-untyped-def]
    m, k, n = shape
    torch.manual_seed(m * k + n)
    a = torch.randn(m, k, dtype=dtype, requires_grad=True)
    b = torch.randn(k, n, dtype=dtype, requires_grad=True)
    out = small_products.broadcast_matmul(a, b)
    assert out.dtype == dtype and out.shape == (m, n)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    want = a64 @ b64
    _close(out, want, dtype)
    grad = torch.randn(m, n, dtype=torch.float64)
    out.backward(grad.to(dtype))
    want.backward(grad)
    _close(a.grad, a64.grad, dtype)  # type: ignore[arg-type]
    _close(b.grad, b64.grad, dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_the_broadcast_linear_matches_float64_and_gives_the_weight_a_gradient_in_its_layout(dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    x = torch.randn(9, 17, dtype=dtype)
    weight = torch.randn(5, 17, dtype=dtype, requires_grad=True)
    out = small_products.broadcast_linear(x, weight)
    _close(out, x.double() @ weight.detach().double().T, dtype)
    out.sum().backward()
    assert weight.grad is not None and weight.grad.stride() == weight.stride()  # torch._fused_adamw_ needs it
    _close(weight.grad, x.double().sum(0).expand(5, 17), dtype)


def test_linear_adds_the_bias_and_promotes_like_a_product():  # type: ignore[no-untyped-def]
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    weight, bias = torch.randn(3, 6), torch.randn(3)
    got = small_products.broadcast_linear(x, weight) + bias
    want = x.double() @ weight.double().T + bias.double()
    assert got.dtype == torch.float32
    _close(got, want, torch.float32)
    # off CUDA every product is torch's own
    assert torch.equal(small_products.linear(x.float(), weight, bias), torch.nn.functional.linear(x.float(), weight, bias))
    assert torch.equal(small_products.matmul(x.float(), weight.T), x.float() @ weight.T)
