"""``torch_dad.ops.small_products`` on CUDA: small products take the broadcast path, large ones torch's GEMM;
both match float64."""

from __future__ import annotations

import pytest
import torch

from torch_dad.ops import small_products

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch differs only on CUDA")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(256, 64, 10), (3, 5, 7), (1024, 2048, 10)])
def test_linear_on_cuda_matches_float64(shape, dtype, tolerance):  # type: ignore[no-untyped-def]
    m, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    weight, bias = torch.randn(n, k, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    got = small_products.linear(x, weight, bias)
    want = x.double() @ weight.double().T + bias.double()
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= tolerance * want.abs().max()
    if m * k * n <= small_products.SMALL_PRODUCT:
        assert torch.equal(got, small_products.broadcast_linear(x, weight) + bias)
