"""precondition="gram": the Gram right-preconditioner against a float64 reference built here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_dad import DADAutogradLinear
from torch_dad.nn.precondition import GramPreconditioner


def reference_ridge(x: torch.Tensor, damping: float) -> torch.Tensor:
    """``damping`` times the features' mean (population) variance."""
    return damping * x.double().var(0, correction=0).mean()


def reference_matrix(x: torch.Tensor, damping: float, bias: bool = True) -> torch.Tensor:
    """``[x,1]^T [x,1] / n + damping * mean_j Var(x_j) * I`` (bias) or the same without the ones column."""
    x = x.double()
    xa = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
    second = xa.T @ xa / x.shape[0]
    m = second + reference_ridge(x, damping) * torch.eye(xa.shape[1], dtype=torch.float64)
    return m if bias else m[:-1, :-1]


def reference_newton(
    x: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, params: torch.Tensor, batch: int
) -> torch.Tensor:
    """``B / (C + (d+1)/2) (grad + rho params) @ M^-1`` with ``C`` = sum of ``e^T (diag p - p p^T) e / |e|^2``
    over ``logits`` (all rows seen), ``rho = (C / n) damping mean_j Var(x_j)``, damping 0.1."""
    damping = 0.1
    p = torch.softmax(logits.double(), 1)
    e = p - nn.functional.one_hot(y, p.shape[1]).double()
    hessian_e = torch.einsum("nij,nj->ni", torch.diag_embed(p) - p[:, :, None] * p[:, None, :], e)
    curvature = ((e * hessian_e).sum(1) / (e * e).sum(1)).sum()
    rho = curvature / x.shape[0] * reference_ridge(x, damping)
    m = reference_matrix(x, damping, bias=params.shape[1] == x.shape[1] + 1)
    return batch / (curvature + (x.shape[1] + 1) / 2) * (grad + rho * params) @ torch.linalg.inv(m)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_preconditioner_matches_reference_over_batches(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    # badly conditioned inputs: column scales spread over 4 orders of magnitude
    scales = torch.logspace(-2, 2, 37, dtype=torch.float64)
    batches = [(torch.randn(n, 37, generator=g, dtype=torch.float64) * scales + 0.3).to(dtype) for n in (23, 11, 5)]
    pre = GramPreconditioner(37, damping=1e-3)
    for b in batches:
        pre.update(b)
    grad_w = torch.randn(5, 37, generator=g, dtype=torch.float64).to(dtype)
    grad_b = torch.randn(5, generator=g, dtype=torch.float64).to(dtype)
    new_w, new_b = pre.precondition(grad_w, grad_b)
    m = reference_matrix(torch.cat(batches), 1e-3)
    expected = torch.cat([grad_w, grad_b[:, None]], 1).double() @ torch.linalg.inv(m)
    assert new_w.dtype == dtype and new_b is not None and new_b.dtype == dtype
    assert rel_err(new_w, expected[:, :37]) < tol
    assert rel_err(new_b, expected[:, 37]) < tol
    no_bias, none = pre.precondition(grad_w, None)
    assert none is None
    # without a bias the constant column is dropped; the damping is the same
    m_full = reference_matrix(torch.cat(batches), 1e-3)
    expected_nb = grad_w.double() @ torch.linalg.inv(m_full[:-1, :-1])
    assert rel_err(no_bias, expected_nb) < tol


def test_damping_follows_the_variance_not_the_mean() -> None:
    # pooled features far from the origin: shifting every row changes S/n but not the damping,
    # and scaling the rows scales the damping with the variance
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 9, generator=g, dtype=torch.float64) * 0.04
    ridges = []
    for rows in (x, x + 1.0, 10 * x):
        pre = GramPreconditioner(9, damping=0.1)
        pre.update(rows)
        ridges.append(float(pre.ridge()))
        assert abs(ridges[-1] - float(reference_ridge(rows, 0.1))) <= 1e-12 * ridges[-1]
    assert abs(ridges[1] - ridges[0]) <= 1e-9 * ridges[0]
    assert abs(ridges[2] - 100 * ridges[0]) <= 1e-9 * ridges[2]


def test_window_forgets_old_rows() -> None:
    g = torch.Generator().manual_seed(1)
    old, new = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    pre = GramPreconditioner(6, window=10.0)
    pre.update(old)
    pre.update(new)
    # rows seen 4 rows ago (the new batch's size) weigh exp(-4 / window)
    decay = torch.exp(torch.tensor(-0.4, dtype=torch.float64))
    oa = torch.cat([old, torch.ones(8, 1, dtype=torch.float64)], 1)
    na = torch.cat([new, torch.ones(4, 1, dtype=torch.float64)], 1)
    assert torch.allclose(pre.gram, oa.T @ oa * decay + na.T @ na, rtol=1e-12)
    assert torch.allclose(pre.count, 8 * decay + 4, rtol=1e-12)


def test_identity_before_any_row_and_errors() -> None:
    pre = GramPreconditioner(4)
    w, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    new_w, new_b = pre.precondition(w, b)
    assert torch.equal(new_w, w) and torch.equal(new_b, b)
    with pytest.raises(ValueError, match="precondition_damping"):
        GramPreconditioner(4, damping=0.0)
    with pytest.raises(ValueError, match="precondition_window"):
        GramPreconditioner(4, window=-1)
    with pytest.raises(ValueError, match=r"shape \(rows, 4\)"):
        pre.update(torch.randn(3, 5))
    assert int(pre.count) == 0
    with pytest.raises(ValueError, match="precondition='adam'"):
        DADAutogradLinear(4, 3, precondition="adam")


@pytest.mark.parametrize("bias", [True, False])
def test_head_grad_is_stochastic_newton_step(bias: bool) -> None:
    g = torch.Generator().manual_seed(2)
    layer = DADAutogradLinear(13, 4, bias=bias, role="head", update="grad", precondition="gram", dtype=torch.float64)
    linear = nn.Linear(13, 4, bias=bias, dtype=torch.float64)
    linear.load_state_dict(layer.state_dict(), strict=False)
    seen, labels = [], []
    for rows in (9, 6):
        x = torch.randn(rows, 13, generator=g, dtype=torch.float64) * torch.linspace(0.01, 3, 13, dtype=torch.float64)
        y = torch.randint(0, 4, (rows,), generator=g)
        y[0] = -100  # ignored rows stay out of the statistics
        seen.append(x[1:])
        labels.append(y[1:])
        layer.zero_grad()
        layer.set_y_context(y)
        layer(x).sum().backward()  # the upstream loss is irrelevant to a DAD head's own update
        linear.zero_grad()
        nn.functional.cross_entropy(linear(x), y).backward()
    grad = torch.cat([linear.weight.grad, linear.bias.grad[:, None]], 1) if bias else linear.weight.grad
    params = torch.cat([linear.weight, linear.bias[:, None]], 1) if bias else linear.weight
    rows_x = torch.cat(seen)
    with torch.no_grad():  # the weights never moved (no optimizer step), so one logits pass serves both batches
        expected = reference_newton(rows_x, linear(rows_x), torch.cat(labels), grad, params.detach(), 5)
    curvature_sum = float(layer.preconditioner.curvature)
    assert rel_err(layer.weight.grad, expected[:, :13]) < 1e-10
    if bias:
        assert rel_err(layer.bias.grad, expected[:, 13]) < 1e-10
    assert int(layer.preconditioner.count) == 13
    assert 0 < curvature_sum <= 13 / 2  # each row's curvature is in (0, 1/2]


def test_hidden_role_preconditions_layer_not_local_head() -> None:
    g = torch.Generator().manual_seed(3)
    plain = DADAutogradLinear(7, 11, num_classes=3, update="grad", dtype=torch.float64)
    pre = DADAutogradLinear(7, 11, num_classes=3, update="grad", precondition="gram", dtype=torch.float64)
    pre.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(10, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    for layer in (plain, pre):
        layer.set_y_context(y)
        layer(x).sum().backward()
    m = reference_matrix(x, 0.1)
    expected = torch.cat([plain.weight.grad, plain.bias.grad[:, None]], 1) @ torch.linalg.inv(m)
    assert rel_err(pre.weight.grad, expected[:, :7]) < 1e-10
    assert torch.equal(pre.head_weight.grad, plain.head_weight.grad)
    assert torch.equal(pre.head_bias.grad, plain.head_bias.grad)


def test_state_dict_round_trip_and_linear_load() -> None:
    layer = DADAutogradLinear(5, 2, role="head", precondition="gram")
    layer.set_y_context(torch.tensor([0, 1, 1]))
    layer(torch.randn(3, 5)).sum().backward()
    state = layer.state_dict()
    assert "preconditioner.gram" in state and float(state["preconditioner.count"]) == 3
    other = DADAutogradLinear(5, 2, role="head", precondition="gram")
    other.load_state_dict(state)
    assert torch.equal(other.preconditioner.gram, layer.preconditioner.gram)
    # an nn.Linear state dict loads strictly; the preconditioner keeps its statistics
    other.load_state_dict(nn.Linear(5, 2).state_dict())
    assert torch.equal(other.preconditioner.gram, layer.preconditioner.gram)


def test_gram_head_converges_on_ill_conditioned_features() -> None:
    """150 steps at batch 32, linear decay: the preconditioned head with SGD lr 1 gets within 0.03 of the
    optimal loss; the plain gradient with AdamW stays far from it."""
    g = torch.Generator().manual_seed(4)
    n, d = 512, 20
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    x = (torch.randn(n, d, generator=g) * torch.logspace(-2, 1, d)) @ basis.T + 2.0  # cond ~1e6
    # the label depends on the low-variance directions, as with the pooled MiniLM features
    score = (x - 2.0) @ basis[:, :4] @ torch.randn(4, generator=g) * 100
    y = (torch.rand(n, generator=g) < torch.sigmoid(score)).long()
    best = nn.Linear(d, 2, dtype=torch.float64)
    opt = torch.optim.LBFGS(best.parameters(), max_iter=300, line_search_fn="strong_wolfe", tolerance_grad=1e-9)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(best(x.double()), y)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        optimum = float(nn.functional.cross_entropy(best(x.double()), y))
    losses = {}
    for precondition in (None, "gram"):
        torch.manual_seed(0)
        # damping below the smallest signal variance (1e-4 of the largest here)
        layer = DADAutogradLinear(d, 2, role="head", update="grad", precondition=precondition, precondition_damping=1e-7)
        if precondition == "gram":  # a Gauss-Newton-like step: plain SGD, unit learning rate
            optimizer: torch.optim.Optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
        else:
            optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.0)
        # linear decay to 0, as Trainer's default schedule
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 150)
        for _ in range(150):
            idx = torch.randint(0, n, (32,), generator=g)
            optimizer.zero_grad()
            layer.set_y_context(y[idx])
            layer(x[idx]).sum().backward()
            optimizer.step()
            schedule.step()
        with torch.no_grad():
            losses[precondition] = float(nn.functional.cross_entropy(layer(x), y))
    assert losses["gram"] < optimum + 0.03
    assert losses[None] > optimum + 0.2


def test_inplace_preconditioned_step_is_sgd_on_preconditioned_grad() -> None:
    g = torch.Generator().manual_seed(5)
    layer = DADAutogradLinear(
        9, 3, role="head", update="inplace", precondition="gram", lr=0.7, weight_decay=0.01, dtype=torch.float64
    )
    reference = DADAutogradLinear(9, 3, role="head", update="grad", precondition="gram", dtype=torch.float64)
    reference.load_state_dict(layer.state_dict(), strict=False)  # the grad-mode twin has no optimizer state
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(12, 9, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    for module in (layer, reference):
        module.set_y_context(y)
        module(x).sum().backward()
    assert layer.weight.grad is None  # applied in place, nothing left for an optimizer
    expected_w = w0 * (1 - 0.7 * 0.01) - 0.7 * reference.weight.grad
    expected_b = b0 * (1 - 0.7 * 0.01) - 0.7 * reference.bias.grad
    assert rel_err(layer.weight.detach(), expected_w) < 1e-12
    assert rel_err(layer.bias.detach(), expected_b) < 1e-12
