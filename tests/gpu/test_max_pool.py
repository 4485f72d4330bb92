"""The Triton 2 x 2 max pool (``torch_dad.kernels.max_pool``) against aten and a float64 oracle.

``out`` and ``d_h`` must equal aten's ``max_pool2d_with_indices`` and its backward (run on CPU) bit
for bit, NaN included, and ``arg`` must name the element aten's flat index names: random inputs on
odd shapes, in fp32, bf16 and fp16, with many ties. Runs on CUDA; on CPU only with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE, requires_kernels
from tests.test_max_pool_torch_path import DTYPES, KINDS, SHAPES, assert_matches_aten, make_input, nan_windows
from torch_dad.ops.pooling import max_pool2x2, max_pool2x2_backward

pytestmark = requires_kernels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_aten(shape, dtype, kind):  # type: ignore[no-untyped-def]
    assert_matches_aten(make_input(shape, dtype, kind, DEVICE), backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_nan_like_aten(dtype):  # type: ignore[no-untyped-def]
    assert_matches_aten(nan_windows(dtype, DEVICE), backend="triton")


def test_kernels_take_strided_input():  # type: ignore[no-untyped-def]
    assert_matches_aten(make_input((2, 5, 6, 9), torch.float32, "relu", DEVICE).transpose(2, 3), backend="triton")


def _oracle(h: torch.Tensor, d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, arg, d_h)`` in float64 by a loop over the windows: the first of the window's maxima."""
    h, d_out = h.double().cpu(), d_out.double().cpu()
    n, c, height, width = h.shape
    out = torch.empty(n, c, height // 2, width // 2, dtype=torch.float64)
    arg = torch.empty(out.shape, dtype=torch.uint8)
    d_h = torch.zeros(h.shape, dtype=torch.float64)
    for p in range(n * c):
        s, ch = divmod(p, c)
        for i in range(height // 2):
            for j in range(width // 2):
                window = [float(h[s, ch, 2 * i + a, 2 * j + b]) for a in (0, 1) for b in (0, 1)]
                k = window.index(max(window))
                out[s, ch, i, j], arg[s, ch, i, j] = window[k], k
                d_h[s, ch, 2 * i + k // 2, 2 * j + k % 2] = d_out[s, ch, i, j]
    return out, arg, d_h


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 2, 6, 3)])
def test_kernels_match_float64_oracle(shape, kind):  # type: ignore[no-untyped-def]
    h = make_input(shape, torch.float32, kind, DEVICE)
    out, arg = max_pool2x2(h, backend="triton")
    d_out = torch.randn(out.shape).to(DEVICE)
    d_h = max_pool2x2_backward(d_out, arg, h.shape, backend="triton")
    want_out, want_arg, want_d_h = _oracle(h, d_out)
    assert torch.equal(out.double().cpu(), want_out)
    assert torch.equal(arg.cpu(), want_arg)
    assert torch.equal(d_h.double().cpu(), want_d_h)


@pytest.mark.parametrize("shape", [(2, 8, 10, 6), (3, 5, 7, 9)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_channels_last_input_gives_a_channels_last_output(dtype, shape):  # type: ignore[no-untyped-def]
    """As torch's pooling does, read in place: the next layer then reads one layout; values, codes and backward
    equal the contiguous kernel's, odd edges included, and a code of the other layout still gives the same d_h."""
    h = make_input(shape, dtype, "relu", DEVICE)
    out, arg = max_pool2x2(h, backend="triton")
    out_cl, arg_cl = max_pool2x2(h.to(memory_format=torch.channels_last), backend="triton")
    assert out_cl.is_contiguous(memory_format=torch.channels_last) and not out_cl.is_contiguous()
    assert torch.equal(out_cl, out) and torch.equal(arg_cl, arg)
    d_out = torch.randn(out.shape, device=DEVICE).to(dtype)
    want = max_pool2x2_backward(d_out, arg, h.shape, backend="triton")
    for code in (arg_cl, arg):
        d_h_cl = max_pool2x2_backward(d_out.to(memory_format=torch.channels_last), code, h.shape, backend="triton")
        assert d_h_cl.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(d_h_cl, want)
    assert torch.equal(max_pool2x2_backward(d_out, arg_cl, h.shape, backend="triton"), want)
