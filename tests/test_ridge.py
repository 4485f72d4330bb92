"""Streaming ridge: statistics equal the batch computation; GCV equals brute force; the dual solve equals the primal."""

import json
import math
import subprocess
import sys
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


# ------------------------------------------------------------------------------------------ the dual solve
def _wide_rows(n, d, k, offset, seed):
    """``n`` float64 rows of ``d`` features (column scales 0.1 .. 3, all shifted by ``offset``), labels < k."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, d, dtype=torch.float64) + offset
    return h, torch.arange(n) % k


def _both(h, y, k, batch=37):
    """A plain accumulator (the primal Gram) and a ``keep_rows`` one (the rows) fed the same batches."""
    primal, dual = GramAccumulator(h.shape[1], k), GramAccumulator(h.shape[1], k, keep_rows=True)
    for start in range(0, h.shape[0], batch):
        primal.update(h[start : start + batch], y[start : start + batch])
        dual.update(h[start : start + batch], y[start : start + batch])
    return primal, dual


@pytest.mark.parametrize("n, d, k", [(3, 5, 2), (40, 60, 4), (100, 384, 20), (257, 700, 10)])
@pytest.mark.parametrize("offset", [0.0, 3.0])  # centred features, and an intercept far from zero
@pytest.mark.parametrize("lambda_reg", ["auto", 0.1, 10.0])
def test_dual_solve_equals_the_primal_with_fewer_rows_than_features(n, d, k, offset, lambda_reg):
    h, y = _wide_rows(n, d, k, offset, seed=n + d)
    primal, dual = _both(h, y, k)
    assert dual.holds_rows and dual._buffers["gram"] is None and not primal.holds_rows
    want, got = primal.solve(lambda_reg), dual.solve(lambda_reg)
    assert dual.holds_rows  # solving folded nothing in
    assert got.lambda_reg == pytest.approx(want.lambda_reg, rel=1e-12)  # the same grid point
    assert (got.gcv is None) == (want.gcv is None)
    if want.gcv is not None:
        assert got.gcv == pytest.approx(want.gcv, rel=1e-9)
    assert got.num_samples == want.num_samples == n and got.jitter == 0.0
    assert relative_error(got.weight, want.weight) <= 1e-6
    assert relative_error(got.bias, want.bias) <= 1e-6


def test_dual_at_lambda_zero_is_the_minimum_norm_interpolant():
    """The primal's Cholesky needs jitter at lambda=0 with n < d; the dual gives the limit exactly: pinv(Hc) Yc."""
    h, y = _wide_rows(30, 80, 3, 1.0, seed=5)
    _, dual = _both(h, y, 3)
    got = dual.solve(0.0)
    hc = h - h.mean(0)
    yc = torch.nn.functional.one_hot(y, 3).double()
    yc = yc - yc.mean(0)
    assert relative_error(got.weight.T, torch.linalg.pinv(hc) @ yc) <= 1e-8
    assert relative_error(hc @ got.weight.T, yc) <= 1e-8  # it interpolates the centred targets


def test_keep_rows_folds_into_the_gram_at_num_features_rows():
    h, y = _wide_rows(70, 50, 4, 0.5, seed=7)
    primal, dual = _both(h[:49], y[:49], 4, batch=20)
    assert dual.holds_rows
    dual.update(h[49:], y[49:])  # the 50th row: the rows become the Gram
    primal.update(h[49:], y[49:])
    assert not dual.holds_rows and dual._rows == []
    assert relative_error(dual.gram, primal.gram) <= 1e-15
    assert relative_error(dual.solve("auto").weight, primal.solve("auto").weight) <= 1e-12
    dual.reset()  # back to holding rows, the Gram freed
    assert dual.holds_rows and dual._buffers["gram"] is None and dual.num_samples == 0


def test_buffers_and_gram_fold_the_rows_for_a_reduction():
    """A reduction across processes (``all_reduce_statistics``) sums ``buffers()``: the Gram statistics."""
    h, y = _wide_rows(20, 45, 3, 0.0, seed=8)
    _, dual = _both(h, y, 3)
    rows_solution = dual.solve(1.0)
    shapes = [tuple(b.shape) for b in dual.buffers()]
    assert (45, 45) in shapes and not dual.holds_rows
    assert relative_error(dual.solve(1.0).weight, rows_solution.weight) <= 1e-6
    _, other = _both(h, y, 3)
    assert other.gram.shape == (45, 45) and not other.holds_rows


def test_keep_rows_checks_its_arguments_and_inputs():
    with pytest.raises(ValueError, match="keep_rows=True .* window=None"):
        GramAccumulator(10, 2, window=100.0, keep_rows=True)
    acc = GramAccumulator(10, 2, keep_rows=True)
    h = torch.randn(4, 10, dtype=torch.float64)
    acc.update(h, torch.tensor([0, 1, 0, 1]))
    h.fill_(float("nan"))  # the rows are copied: the caller's buffer may be reused
    for bad in ("best", -1.0, float("inf")):
        with pytest.raises(ValueError, match="lambda_reg"):
            acc.solve(bad)
    assert torch.isfinite(acc.solve().weight).all()
    acc.update(torch.full((2, 10), float("nan"), dtype=torch.float64), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="NaN/Inf"):
        acc.solve()


_ACCEPTANCE_SCRIPT = """
import json, resource, sys, torch
from torch_dad.ridge import GramAccumulator
torch.set_num_threads(1)  # per-thread buffers of BLAS/LAPACK would make the peak depend on the machine
n, d, k = 4096, 12544, 10
g = torch.Generator().manual_seed(0)
labels = torch.randint(0, k, (n,), generator=g)
def peak():
    # Linux keeps ru_maxrss across exec (a child of a large pytest starts at its parent's peak); VmHWM is this
    # process image's own high-water mark
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
acc = GramAccumulator(d, k, keep_rows=True)
start = peak()
for i in range(0, n, 1024):  # the rows arrive in batches, as solve_head() recomputes them
    acc.update(torch.randn(1024, d, generator=g, dtype=torch.float64), labels[i : i + 1024])
rows = peak()
solution = acc.solve("auto")
end = peak()
assert acc.holds_rows
h = torch.cat(acc._rows)
hc = h - h.mean(0)
y = torch.nn.functional.one_hot(labels, k).double()
cross = hc.T @ (y - y.mean(0))
w = solution.weight.T
residual = hc.T @ (hc @ w) + solution.lambda_reg * w - cross
print(json.dumps({"rows": rows - start, "solve": end - start, "residual": float(residual.norm()),
                  "weight": float(w.norm()), "lambda": solution.lambda_reg,
                  "bias": float((solution.bias - (y.mean(0) - solution.weight @ h.mean(0))).norm())}))
"""


@pytest.mark.slow  # a fresh Python process and 4,096 x 12,544 float64 rows: about half a minute
@pytest.mark.skipif(sys.platform == "win32", reason="reads the peak resident memory through the resource module")
def test_dual_at_the_acceptance_size_needs_less_memory_than_the_gram():
    """4,096 rows x 12,544 features, float64: the input sample of a classifier on a 64 x 14 x 14 conv output.

    Memory: in a fresh process (one thread), the growth of the peak resident memory over ``update()`` of the
    rows and ``solve()``, the rows themselves included, stays below the Gram's 12,544^2 x 8 bytes (1.26 GB),
    which the primal allocates before its eigendecomposition needs twice as much again.

    Accuracy: the primal at this size needs a 12,544^2 eigendecomposition (minutes on a CI CPU), so its
    agreement is checked at smaller sizes above; here the dual's weights are checked against the primal
    system itself, ``(Hc^T Hc + lambda I) W^T = Hc^T Yc``, through products with ``Hc`` only. Its exact
    solution ``W*`` has ``||W - W*|| <= ||residual|| / lambda``: that bound is held to 1e-6 of ``||W||``.
    """
    result = subprocess.run([sys.executable, "-c", _ACCEPTANCE_SCRIPT], capture_output=True, text=True, check=True)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    gram_bytes = 12544**2 * 8
    rows_bytes = 4096 * 12544 * 8
    assert rows_bytes <= out["rows"] < out["solve"] < gram_bytes, (out, gram_bytes)
    assert out["lambda"] > 0 and out["residual"] / out["lambda"] <= 1e-6 * out["weight"], out
    assert out["bias"] <= 1e-12 * out["weight"]


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
