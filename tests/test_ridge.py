"""Streaming ridge: statistics equal the batch computation; GCV equals brute force."""

import math
import warnings

import pytest
import torch

from torch_dad import functional
from torch_dad.ridge import GramAccumulator, gcv_curve, logit_scale

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


def test_gcv_curve_equals_brute_force_with_fewer_rows_than_features():
    """For n <= p the hat matrix has rank n - 1: the score stays finite and exact down to tiny lambda."""
    n, d, k = 40, 60, 4
    h = torch.randn(n, d, dtype=torch.float64) * torch.linspace(0.1, 3, d, dtype=torch.float64)
    y = torch.nn.functional.one_hot(torch.arange(n) % k, k).double()
    hc, yc = h - h.mean(0), y - y.mean(0)
    gram, cross = hc.T @ hc, hc.T @ yc
    s, v = torch.linalg.eigh(gram)
    lambdas = torch.tensor([1e-3, 0.1, 10.0], dtype=torch.float64)
    curve = gcv_curve(s, v.T @ cross, float((yc**2).sum()), n, lambdas)
    # as lambda -> 0: n * sum_i ||u_i^T Yc||^2 / s_i^2 / (sum_i 1 / s_i)^2 over the n - 1 singular values
    u, sigma, _ = torch.linalg.svd(hc, full_matrices=False)
    s_nonzero, q = sigma[: n - 1] ** 2, ((u[:, : n - 1].T @ yc) ** 2).sum(1)
    limit = n * float((q / s_nonzero**2).sum()) / float((1 / s_nonzero).sum()) ** 2
    tiny = gcv_curve(s, v.T @ cross, float((yc**2).sum()), n, torch.tensor([1e-9], dtype=torch.float64))
    assert abs(float(tiny) - limit) < 1e-4 * limit
    for lam, got in zip(lambdas, curve):
        # the fit in the n-dimensional sample space: Hc (Hc^T Hc + l I)^-1 Hc^T = K (K + l I)^-1
        kernel = hc @ hc.T
        hat = kernel @ torch.linalg.solve(kernel + lam * torch.eye(n, dtype=torch.float64), torch.eye(n, dtype=torch.float64))
        rss = float(((yc - hat @ yc) ** 2).sum())
        df = 1 + float(torch.trace(hat))
        assert abs(float(got) - n * rss / (n - df) ** 2) < 1e-6 * float(got)


def _class_clusters(n, p, k, spread, decay, seed):
    """Gaussian class means plus unit noise, coordinate ``j`` scaled by ``(j + 1)^-decay``, offset 0.5."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.arange(1, p + 1, dtype=torch.float32) ** -decay
    means = torch.randn(k, p, generator=g) * spread

    def draw(rows):
        y = torch.arange(rows) % k
        return (means[y] + torch.randn(rows, p, generator=g)) * scales + 0.5, y

    return draw(n), draw(1000)


@pytest.mark.parametrize(
    "n, p, k, spread, decay",
    [
        (100, 384, 20, 0.5, 0.5),  # n < p
        (300, 384, 20, 0.3, 0.5),  # the shape of a few-shot sentence-embedding head
        (384, 384, 20, 0.3, 0.5),  # n = p
        (390, 384, 20, 0.6, 1.0),  # n just above p, rounding noise at the scale of the small eigenvalues
        (80, 200, 5, 0.3, 0.5),
    ],
)
def test_auto_lambda_is_near_the_best_grid_lambda_when_rows_do_not_outnumber_features(n, p, k, spread, decay):
    (x, y), (x_test, y_test) = _class_clusters(n, p, k, spread, decay, seed=n)
    acc = GramAccumulator(p, k)
    acc.update(x, y)

    def accuracy(sol):
        return float(((x_test.double() @ sol.weight.T + sol.bias).argmax(1) == y_test).float().mean())

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        auto = acc.solve("auto")
        again = acc.solve(auto.lambda_reg)  # the chosen lambda also solves by Cholesky without jitter
    assert auto.jitter == 0.0 and again.jitter == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the smallest grid lambdas need jitter
        grid = [accuracy(acc.solve(lam)) for lam in torch.logspace(-6, 3, 19).tolist()]
    assert accuracy(auto) >= max(grid) - 0.02
    assert accuracy(again) >= max(grid) - 0.02


# ------------------------------------------------------------------------------------------ logit_scale
def _cross_entropy(logits, labels):
    return float(torch.nn.functional.cross_entropy(logits, labels))


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_logit_scale_matches_a_log_grid_far_from_one(magnitude):
    g = torch.Generator().manual_seed(int(magnitude * 1000) % 97)
    logits = torch.randn(400, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (400,), generator=g)
    labels[:250] = logits[:250].argmax(1)
    logits = logits * magnitude  # the best scale moves by 1 / magnitude
    scale = logit_scale(logits.float(), labels)
    grid = torch.logspace(-6, 6, 4801, dtype=torch.float64)
    losses = torch.tensor([_cross_entropy(s * logits, labels) for s in grid])
    best = float(grid[losses.argmin()])
    assert abs(math.log(scale / best)) < 0.01  # the grid steps by 0.6 % in s
    assert _cross_entropy(scale * logits, labels) <= _cross_entropy(logits, labels)
    assert torch.equal((scale * logits).argmax(1), logits.argmax(1))


@pytest.mark.parametrize("case", ["all right", "all wrong", "constant", "one class", "one row"])
def test_logit_scale_is_finite_and_positive_where_no_interior_optimum_exists(case):
    logits = torch.randn(50, 4, generator=torch.Generator().manual_seed(3))
    labels = {"all right": logits.argmax(1), "all wrong": logits.argmin(1)}.get(case, torch.zeros(50, dtype=torch.long))
    if case == "constant":
        logits = torch.full((50, 4), 2.5)
    elif case == "one class":
        logits = logits[:, :1]
    elif case == "one row":
        logits, labels = logits[:1], logits[:1].argmax(1)
    scale = logit_scale(logits, labels)
    assert math.isfinite(scale) and scale > 0
    assert _cross_entropy(scale * logits.double(), labels) <= _cross_entropy(logits.double(), labels) + 1e-12
