"""Streaming ridge: statistics equal the batch computation; GCV equals brute force."""

import pytest
import torch

from torch_dad import functional
from torch_dad.ridge import GramAccumulator, gcv_curve

from .conftest import relative_error


def test_streamed_solution_equals_reference_for_several_lambdas():
    h = torch.randn(501, 9, dtype=torch.float64) * torch.linspace(0.1, 10, 9, dtype=torch.float64)
    y = torch.randint(0, 5, (501,))
    acc = GramAccumulator(9, 5)
    for chunk in range(0, 501, 97):
        acc.update(h[chunk : chunk + 97], y[chunk : chunk + 97])
    for lam in (0.0, 1e-3, 2.5, 100.0):
        sol = acc.solve(lam)
        w, b = functional.ridge_solve(h, torch.nn.functional.one_hot(y, 5).double(), lam)
        assert relative_error(sol.weight, w) < 1e-5  # batches summed in float32
        assert relative_error(sol.bias, b) < 1e-5


def test_gcv_curve_equals_brute_force():
    n, d, k = 120, 6, 3
    h = torch.randn(n, d, dtype=torch.float64)
    y = torch.nn.functional.one_hot(torch.randint(0, k, (n,)), k).double()
    hc, yc = h - h.mean(0), y - y.mean(0)
    gram, cross = hc.T @ hc, hc.T @ yc
    s, v = torch.linalg.eigh(gram)
    lambdas = torch.tensor([1e-3, 0.1, 1.0, 10.0], dtype=torch.float64)
    curve = gcv_curve(s, v.T @ cross, float((yc**2).sum()), n, lambdas)
    for lam, got in zip(lambdas, curve):
        hat = hc @ torch.linalg.solve(gram + lam * torch.eye(d, dtype=torch.float64), hc.T)
        rss = float(((yc - hat @ yc) ** 2).sum())
        df = 1 + float(torch.trace(hat))
        assert abs(float(got) - n * rss / (n - df) ** 2) < 1e-9 * max(1.0, float(got))


def test_rank_deficient_statistics_still_give_a_finite_head():
    h = torch.randn(50, 3)
    h = torch.cat([h, h[:, :1]], 1)  # a duplicated column: singular Gram
    acc = GramAccumulator(4, 2)
    acc.update(h, torch.randint(0, 2, (50,)))
    with pytest.warns(RuntimeWarning, match="jitter"):
        sol = acc.solve(0.0)
    assert torch.isfinite(sol.weight).all() and sol.jitter > 0
    assert torch.isfinite(acc.solve("auto").weight).all()


def test_bad_lambda_and_empty_statistics():
    acc = GramAccumulator(3, 2)
    with pytest.raises(ValueError, match="no Gram statistics"):
        acc.solve()
    acc.update(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="lambda_reg"):
        acc.solve("best")
    with pytest.raises(ValueError, match="lambda_reg"):
        acc.solve(-1.0)
