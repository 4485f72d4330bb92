"""The closed-form gradients in ``functional`` equal autograd's on the same local loss (float64)."""

import pytest
import torch

from torch_dad import functional

from .conftest import relative_error

ACTS = list(functional.ACTIVATIONS)


def _autograd_local(a, w, b, wl, bl, y, act, smoothing=0.0):
    w, wl, bl = (t.clone().requires_grad_(True) for t in (w, wl, bl))
    b = b.clone().requires_grad_(True) if b is not None else None
    z = a @ w.T + (b if b is not None else 0)
    h = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "identity": lambda t: t,
         "leaky_relu": torch.nn.functional.leaky_relu}[act](z)
    loss = torch.nn.functional.cross_entropy(h @ wl.T + bl, y, label_smoothing=smoothing)
    loss.backward()
    return loss.detach(), w.grad, (b.grad if b is not None else None), wl.grad, bl.grad


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [1, 7, 1000])
@pytest.mark.parametrize("width", [1, 3, 257])
def test_local_gradients_match_autograd(act, bias, batch, width):
    d_in, classes = 5, 4
    a = torch.randn(batch, d_in, dtype=torch.float64)
    w = torch.randn(width, d_in, dtype=torch.float64)
    b = torch.randn(width, dtype=torch.float64) if bias else None
    wl = torch.randn(classes, width, dtype=torch.float64)
    bl = torch.randn(classes, dtype=torch.float64)
    y = torch.randint(0, classes, (batch,))
    got = functional.local_loss_and_gradients(a, w, b, wl, bl, y, act)
    loss, gw, gb, gwl, gbl = _autograd_local(a, w, b, wl, bl, y, act)
    assert relative_error(got.loss, loss) < 1e-10
    assert relative_error(got.grad_weight, gw) < 1e-10
    assert relative_error(got.grad_head_weight, gwl) < 1e-10
    assert relative_error(got.grad_head_bias, gbl) < 1e-10
    if bias:
        assert relative_error(got.grad_bias, gb) < 1e-10
    else:
        assert got.grad_bias is None


def test_label_smoothing_matches_autograd():
    a = torch.randn(33, 6, dtype=torch.float64)
    w, wl = torch.randn(9, 6, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    b, bl = torch.randn(9, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    y = torch.randint(0, 5, (33,))
    got = functional.local_loss_and_gradients(a, w, b, wl, bl, y, "gelu", label_smoothing=0.1)
    loss, gw, gb, *_ = _autograd_local(a, w, b, wl, bl, y, "gelu", smoothing=0.1)
    assert relative_error(got.loss, loss) < 1e-10
    assert relative_error(got.grad_weight, gw) < 1e-10


def test_ignore_index_rows_get_no_gradient():
    logits = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, -100, 2, 1, -100, 0])
    loss, d = functional.cross_entropy_error(logits.detach(), y)
    ref = torch.nn.functional.cross_entropy(logits, y, ignore_index=-100)
    ref.backward()
    assert relative_error(loss, ref.detach()) < 1e-12
    assert relative_error(d, logits.grad) < 1e-12
    all_ignored = torch.full((6,), -100)
    loss0, d0 = functional.cross_entropy_error(logits.detach(), all_ignored)
    assert float(loss0) == 0.0 and float(d0.abs().sum()) == 0.0


@pytest.mark.parametrize("bias", [True, False])
def test_head_gradients_equal_backprop(bias):
    a = torch.randn(17, 11, dtype=torch.float64)
    w = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, 7, (17,))
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(a, w, b), y).backward()
    got = functional.head_loss_and_gradients(a, w.detach(), b.detach() if bias else None, y)
    assert relative_error(got.grad_weight, w.grad) < 1e-10
    if bias:
        assert relative_error(got.grad_bias, b.grad) < 1e-10


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation='swish'.*relu"):
        functional.check_activation("swish")


def test_ridge_solve_minimises_the_objective():
    h = torch.randn(200, 6, dtype=torch.float64)
    y = torch.nn.functional.one_hot(torch.randint(0, 3, (200,)), 3).double()
    w, b = functional.ridge_solve(h, y, 0.5)
    # gradient of ||H W^T + b - Y||^2 + lam ||W||^2 vanishes at the optimum
    r = h @ w.T + b - y
    assert float((2 * r.T @ h + 2 * 0.5 * w).abs().max()) < 1e-9
    assert float(r.sum(0).abs().max()) < 1e-9


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cross_entropy_error_matches_torch_autograd(smoothing, dtype):
    """Loss and d_logits in every dtype equal torch's own cross-entropy and its autograd gradient."""
    logits = (torch.randn(53, 11, dtype=torch.float64) * 3).requires_grad_(True)
    target = torch.randint(0, 11, (53,))
    target[::7] = -100
    want_loss = torch.nn.functional.cross_entropy(logits, target, label_smoothing=smoothing)
    (want_grad,) = torch.autograd.grad(want_loss, logits)
    loss, grad = functional.cross_entropy_error(logits.detach().to(dtype), target, label_smoothing=smoothing)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert grad.dtype == dtype
    assert relative_error(grad, want_grad) < tol
    assert relative_error(loss, want_loss.detach()) < tol
    assert torch.equal(grad[::7], torch.zeros_like(grad[::7]))


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_error_without_ignore_index_is_the_unmasked_mean(smoothing):
    """``ignore_index=None``: no mask, the same values as the default when no row is ignored."""
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    target = torch.randint(0, 7, (3, 5))
    loss, grad = functional.cross_entropy_error(logits, target, label_smoothing=smoothing, ignore_index=None)
    want_loss, want_grad = functional.cross_entropy_error(logits, target, label_smoothing=smoothing)
    assert torch.allclose(loss, want_loss, rtol=1e-14) and torch.allclose(grad, want_grad, rtol=1e-14)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), label_smoothing=smoothing)
    assert relative_error(loss, ref) < 1e-12


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_oracle_matches_autograd(act, affine):
    """``normalize="batchnorm"``: loss and every gradient (layer, local head, affine) against autograd
    through ``nn.functional.batch_norm`` in training mode (B=37, 23 -> 19, C=7)."""
    torch.manual_seed(11)
    a = torch.randn(37, 23, dtype=torch.float64)
    tensors = [torch.randn(19, 23, dtype=torch.float64) * 0.3, torch.randn(19, dtype=torch.float64),
               torch.randn(7, 19, dtype=torch.float64), torch.randn(7, dtype=torch.float64),
               torch.rand(19, dtype=torch.float64) + 0.5, torch.randn(19, dtype=torch.float64)]
    w, b, wl, bl, gamma, beta = (t.requires_grad_(True) for t in tensors)
    y = torch.randint(0, 7, (37,))
    z = torch.nn.functional.batch_norm(a @ w.T + b, None, None, gamma if affine else None,
                                       beta if affine else None, training=True, eps=functional.BATCH_NORM_EPS)
    h = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "identity": lambda t: t,
         "leaky_relu": torch.nn.functional.leaky_relu}[act](z)
    loss = torch.nn.functional.cross_entropy(h @ wl.T + bl, y)
    auto = torch.autograd.grad(loss, [w, wl, bl, gamma, beta] if affine else [w, wl, bl])
    got = functional.local_loss_and_gradients(
        a, w.detach(), b.detach(), wl.detach(), bl.detach(), y, act, normalize="batchnorm",
        norm_weight=gamma.detach() if affine else None, norm_bias=beta.detach() if affine else None,
    )
    assert abs(float(got.loss) - float(loss.detach())) < 1e-12
    mine = [got.grad_weight, got.grad_head_weight, got.grad_head_bias]
    mine += [got.grad_norm_weight, got.grad_norm_bias] if affine else []
    for g_mine, g_auto in zip(mine, auto, strict=True):
        assert relative_error(g_mine, g_auto) < 1e-10
    assert float(got.grad_bias.abs().max()) < 1e-12  # the mean subtraction cancels the bias


def test_batch_norm_forward_with_running_statistics_is_batchnorm1d_eval():
    z = torch.randn(9, 5, dtype=torch.float64)
    mean, var = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.1
    gamma, beta = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    out, _, _ = functional.batch_norm_forward(z, gamma, beta, mean, var)
    want = torch.nn.functional.batch_norm(z, mean, var, gamma, beta, training=False, eps=1e-5)
    assert relative_error(out, want) < 1e-14
    batch_mean, batch_var = functional.batch_norm_statistics(z)
    assert torch.allclose(batch_var[0], z.var(0, unbiased=False)) and torch.allclose(batch_mean[0], z.mean(0))
