"""The PyTorch twin of the 2 x 2 max pool (``torch_dad.ops.pooling.max_pool2x2``), on CPU, no triton.

Its ``out`` and ``d_h`` must equal aten's ``max_pool2d_with_indices`` and its backward bit for bit,
its ``arg`` code must name the element aten's flat index names, on odd shapes and on inputs with
many ties; bad arguments are refused with the argument's name. The functions here also serve the
kernel tests (``tests/gpu/test_max_pool.py``).
"""

from __future__ import annotations

import pytest
import torch

from torch_dad.ops.pooling import max_pool2x2, max_pool2x2_backward

SHAPES = [(2, 3, 5, 7), (1, 1, 2, 2), (3, 4, 9, 8), (2, 16, 28, 28), (1, 2, 3, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: randn; relu(randn), whose windows of zeros tie; randn rounded to 5 values, ties of equal values
KINDS = ["randn", "relu", "rounded"]


def make_input(shape: tuple[int, ...], dtype: torch.dtype, kind: str, device: str = "cpu") -> torch.Tensor:
    x = torch.randn(shape)
    if kind == "relu":
        x = x.relu()
    elif kind == "rounded":
        x = x.round().clamp(-2, 2)
    return x.to(device, dtype)


def aten_pool(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aten's ``(out, flat indices)``, on CPU; aten refuses an empty output, so that one is built here."""
    n, c, height, width = h.shape
    if height < 2 or width < 2:
        empty = (n, c, height // 2, width // 2)
        return h.new_empty(empty).cpu(), torch.empty(empty, dtype=torch.int64)
    return torch.ops.aten.max_pool2d_with_indices(h.cpu(), [2, 2], [2, 2])


def aten_unpool(d_out: torch.Tensor, h: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    if d_out.numel() == 0:
        return torch.zeros(h.shape, dtype=d_out.dtype)
    return torch.ops.aten.max_pool2d_with_indices_backward(
        d_out.cpu(), h.cpu(), [2, 2], [2, 2], [0, 0], [1, 1], False, flat
    )


def code_of(flat: torch.Tensor, width: int) -> torch.Tensor:
    """aten's flat index ``(2i + a) * W + 2j + b`` as the code ``2a + b``, by a loop over the windows."""
    code = torch.empty(flat.shape, dtype=torch.uint8)
    n, c, out_h, out_w = flat.shape
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in (n, c, out_h, out_w))).tolist():
        a, b = divmod(int(flat[tuple(idx)]), width)
        code[tuple(idx)] = 2 * (a - 2 * idx[2]) + (b - 2 * idx[3])
    return code


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns on CPU: equal bits are equal values, NaN payload and the sign of zero included."""
    return t.cpu().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_matches_aten(h: torch.Tensor, backend: str) -> None:
    """``out``, ``arg`` and ``d_h`` (for a random ``d_out``) of the op equal aten's, bit for bit."""
    out, arg = max_pool2x2(h, backend=backend)
    want_out, flat = aten_pool(h)
    assert out.dtype == h.dtype and arg.dtype == torch.uint8 and out.device == h.device
    assert torch.equal(bits(out), bits(want_out))
    if flat.numel() <= 4096:  # the loop is slow on large shapes; d_h below checks the routing there
        assert torch.equal(arg.cpu(), code_of(flat, h.shape[-1]))
    d_out = torch.randn(out.shape).to(h.device, h.dtype)
    d_h = max_pool2x2_backward(d_out, arg, h.shape, backend=backend)
    assert d_h.shape == h.shape and d_h.dtype == h.dtype
    assert torch.equal(bits(d_h), bits(aten_unpool(d_out, h, flat)))


def nan_windows(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """One (1, 1, 2, 2 * 9) row of windows with NaN, inf and -inf at various places (plus an odd column)."""
    nan, inf = float("nan"), float("inf")
    windows = [
        (nan, 1, 2, 3), (1, nan, 2, 3), (1, 2, 3, nan), (nan, 5, nan, 1), (nan, nan, nan, nan),
        (inf, nan, 1, 2), (-inf, -inf, -inf, -inf), (1, inf, inf, 0), (0.0, -0.0, 0.0, -1),
    ]
    top = [v for w in windows for v in w[:2]] + [7.0]
    bottom = [v for w in windows for v in w[2:]] + [7.0]
    return torch.tensor([[top, bottom]], dtype=dtype, device=device)[None]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_path_matches_aten(shape, dtype, kind):  # type: ignore[no-untyped-def]
    assert_matches_aten(make_input(shape, dtype, kind), backend="torch")


def test_torch_path_float64_and_strided():  # type: ignore[no-untyped-def]
    assert_matches_aten(make_input((2, 3, 7, 6), torch.float64, "rounded"), backend="torch")
    assert_matches_aten(make_input((2, 5, 6, 9), torch.float32, "relu").transpose(2, 3), backend="torch")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_nan_like_aten(dtype):  # type: ignore[no-untyped-def]
    assert_matches_aten(nan_windows(dtype), backend="torch")


def test_auto_without_kernels_is_the_torch_path(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_matches_aten(make_input((2, 3, 5, 7), torch.float32, "relu"), backend="auto")


def test_bad_inputs_name_the_argument():  # type: ignore[no-untyped-def]
    h = torch.randn(2, 3, 4, 4)
    before = h.clone()
    with pytest.raises(ValueError, match="h has shape"):
        max_pool2x2(h[0])
    with pytest.raises(TypeError, match="h has dtype"):
        max_pool2x2(h.to(torch.int64))
    with pytest.raises(TypeError, match="h must be a tensor"):
        max_pool2x2(h.tolist())  # type: ignore[arg-type]
    assert torch.equal(h, before)
    out, arg = max_pool2x2(h, backend="torch")
    with pytest.raises(TypeError, match="d_out has dtype"):
        max_pool2x2_backward(arg, arg, h.shape)
    with pytest.raises(ValueError, match="d_out has shape"):
        max_pool2x2_backward(out[0], arg, h.shape)
    with pytest.raises(ValueError, match="arg must be"):
        max_pool2x2_backward(out, arg.long(), h.shape)
    with pytest.raises(ValueError, match="arg must be"):
        max_pool2x2_backward(out, arg[:1], h.shape)
    with pytest.raises(ValueError, match="h_shape"):
        max_pool2x2_backward(out, arg, (2, 3, 6, 4))
    with pytest.raises(ValueError, match="h_shape"):
        max_pool2x2_backward(out, arg, (2, 3, 4))
    with pytest.raises(ValueError, match="backend"):
        max_pool2x2(h, backend="cuda")
