"""Closed-form classifier heads: streaming Gram statistics and a float64 ridge solve.

For features ``H`` (n, d) and one-hot targets ``Y`` (n, k) the head is
``W^T = (Hc^T Hc + lambda I)^-1 Hc^T Yc``, ``b = mean(Y) - W mean(H)`` with centred
``Hc, Yc`` (the intercept is not penalised). Only ``n, sum H, sum Y, H^T H, H^T Y`` and
``sum Y^2`` are needed, so they accumulate in one pass over the data.

``lambda_reg="auto"`` picks lambda by generalised cross-validation from a single
eigendecomposition ``Hc^T Hc = V diag(s) V^T``: for every candidate lambda,
the residual sum of squares and degrees of freedom are closed forms over the nonzero
eigenvalues (see :func:`gcv_curve`), which stay defined when ``n <= d`` and the ridge fit with a
small lambda interpolates the labels.

With fewer rows than features (``n < d``) the same head comes from the dual: the ``n x n``
matrix ``K = Hc Hc^T`` has the Gram's nonzero eigenvalues, and
``W^T = Hc^T (K + lambda I)^-1 Yc``, so a ``GramAccumulator(keep_rows=True)`` that holds the rows
themselves solves from ``K``, and never builds the ``d x d`` Gram, while ``n < d``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["GramAccumulator", "RidgeSolution", "gcv_curve", "logit_scale", "sample_space_rank", "solve_ridge_from_gram"]

#: columns of the rows converted to float64 at a time by the dual solve
_COLUMN_BLOCK = 1024


@dataclass
class RidgeSolution:
    """A solved head: ``logits = features @ weight.T + bias``, and how it was chosen."""

    weight: Tensor
    bias: Tensor
    lambda_reg: float
    num_samples: int
    gcv: float | None = None
    jitter: float = 0.0


class GramAccumulator(torch.nn.Module):
    """Streaming float64 sufficient statistics for ridge regression onto one-hot labels.

    With ``window`` set, every update first multiplies the statistics by
    ``exp(-B / window)``, so features computed with stale weights fade out while the
    network trains (see ``DADTrainer(classifier_statistics_window=...)``).

    ``update(h, y)`` adds ``n += B; sum_h += h.sum(0); sum_y += bincount(y);
    hth += h^T h; hty[:, c] += sum of rows of h with label c``. All are buffers, so they
    are saved in ``state_dict`` and can be all-reduced across processes.

    With ``keep_rows=True`` (no ``window``) the rows themselves are held, and no Gram allocated,
    while there are fewer of them than ``num_features``: :meth:`solve` then solves in the dual,
    with ``n^2`` memory instead of ``d^2``. The update that brings
    ``n`` to ``num_features`` folds the rows into the Gram, which then streams as without. Reading
    ``gram`` or ``buffers()`` folds them too, so a reduction across processes sums Gram statistics.
    """

    count: Tensor
    sum_features: Tensor
    sum_targets: Tensor
    gram: Tensor
    cross: Tensor

    def __init__(
        self, num_features: int, num_classes: int, device=None, window: float | None = None, *, keep_rows: bool = False
    ) -> None:
        super().__init__()
        if window is not None and not window > 0:
            raise ValueError(f"window={window!r} must be a positive number of samples or None")
        if keep_rows and window is not None:
            raise ValueError("keep_rows=True holds the rows unweighted: pass window=None, or keep_rows=False")
        self.window = window
        if num_features < 1 or num_classes < 2:
            raise ValueError(
                f"GramAccumulator needs num_features >= 1 and num_classes >= 2, got {num_features}, {num_classes}"
            )
        self.num_features = num_features
        self.num_classes = num_classes
        self.keep_rows = keep_rows
        self._rows: list[Tensor] = []
        self._row_labels: list[Tensor] = []
        f64 = {"dtype": torch.float64, "device": device}
        self.register_buffer("count", torch.zeros((), **f64))
        self.register_buffer("sum_features", torch.zeros(num_features, **f64))
        self.register_buffer("sum_targets", torch.zeros(num_classes, **f64))
        # None while rows are held: allocated when they are folded in
        self.register_buffer("gram", None if keep_rows else torch.zeros(num_features, num_features, **f64))
        self.register_buffer("cross", torch.zeros(num_features, num_classes, **f64))

    @property
    def holds_rows(self) -> bool:
        """Whether the rows themselves are held instead of the Gram (``keep_rows``, fewer than ``num_features``)."""
        return "gram" in self._buffers and self._buffers["gram"] is None

    def fold_rows(self) -> None:
        """Allocate the Gram from the held rows and forget them (nothing to do when none are held)."""
        if not self.holds_rows:
            return
        gram = torch.zeros(self.num_features, self.num_features, dtype=torch.float64, device=self.count.device)
        for h in self._rows:
            gram.add_((h.T @ h).double())
        self._buffers["gram"] = gram  # not setattr: nn.Module's reads the attribute, which folds
        self._rows, self._row_labels = [], []

    def __getattr__(self, name: str) -> Tensor | torch.nn.Module:
        if name == "gram":
            self.fold_rows()
        return super().__getattr__(name)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        """``nn.Module.named_buffers`` (and so ``buffers()``) after :meth:`fold_rows`."""
        self.fold_rows()
        return super().named_buffers(*args, **kwargs)

    @torch.no_grad()
    def update(self, features: Tensor, target: Tensor) -> None:
        """Add a batch: ``features`` (B, d) and integer ``target`` (B,) in [0, num_classes)."""
        if features.dim() != 2 or features.shape[1] != self.num_features:
            raise ValueError(
                f"features must have shape (batch, {self.num_features}), got {tuple(features.shape)}"
            )
        # One fp32 GEMM per batch, accumulated in float64: on the 2-core CPU a float64
        # GEMM of 1024x256 costs 2.1x the fp32 one, and per-batch fp32 sums lose nothing
        # the ridge solve can see (relative error ~1e-7 per batch).
        h = features if features.dtype == torch.float64 else features.float()
        if self.window is not None:
            # exponential forgetting: a sample seen `window` samples ago weighs 1/e
            decay = math.exp(-h.shape[0] / self.window)
            for buffer in self.buffers():
                buffer.mul_(decay)
        per_class = torch.zeros(self.num_classes, self.num_features, dtype=h.dtype, device=h.device)
        per_class.index_add_(0, target, h)
        self.count.add_(h.shape[0])
        self.sum_features.add_(h.sum(0).double())
        # index_add_ instead of bincount: bincount sizes its output from max(target), a host sync on CUDA
        self.sum_targets.index_add_(0, target, torch.ones_like(target, dtype=torch.float64))
        self.cross.add_(per_class.T.double())
        if not self.holds_rows:
            self.gram.add_((h.T @ h).double())
            return
        # a copy: the caller may reuse its tensor
        self._rows.append(h.clone() if h.data_ptr() == features.data_ptr() else h)
        self._row_labels.append(target.clone())
        if sum(rows.shape[0] for rows in self._rows) >= self.num_features:
            self.fold_rows()

    def reset(self) -> None:
        """Forget every batch seen so far (``keep_rows``: the Gram too, until ``num_features`` rows)."""
        self._rows, self._row_labels = [], []
        if self.keep_rows:
            self._buffers["gram"] = None
        for buffer in self._buffers.values():
            if buffer is not None:
                buffer.zero_()

    @property
    def num_samples(self) -> int:
        """How many rows were accumulated (reads the device: a host sync on CUDA)."""
        return int(self.count.item())

    def centred(self) -> tuple[Tensor, Tensor, float, float]:
        """``(Hc^T Hc, Hc^T Yc, tr(Yc^T Yc), n)`` from the raw sums (held rows are folded in first)."""
        n = float(self.count.item())
        mean_h = self.sum_features / n
        mean_y = self.sum_targets / n
        gram_c = self.gram - n * torch.outer(mean_h, mean_h)
        cross_c = self.cross - n * torch.outer(mean_h, mean_y)
        return gram_c, cross_c, self._target_spread(n), n

    def _target_spread(self, n: float) -> float:
        """``tr(Yc^T Yc)``: the sum of squares of one-hot targets equals their sum."""
        mean_y = self.sum_targets / n
        return float((self.sum_targets - n * mean_y * mean_y).sum())

    def solve(self, lambda_reg: float | str = "auto") -> RidgeSolution:
        """Ridge head from the accumulated statistics (see module docstring): in the dual from the
        held rows (fewer than ``num_features``), else from the Gram."""
        n = self.num_samples
        if n == 0:
            raise ValueError(
                "no Gram statistics accumulated yet: call update()/DADTrainer.step() first, "
                "or pass loader= to solve_head()"
            )
        mean_h = self.sum_features / n
        mean_y = self.sum_targets / n
        if self.holds_rows:
            labels = torch.cat(self._row_labels)
            targets = torch.nn.functional.one_hot(labels, self.num_classes).double() - mean_y
            solution = _solve_ridge_from_rows(self._rows, targets, mean_h, self._target_spread(n), lambda_reg)
        else:
            gram_c, cross_c, yty_c, _ = self.centred()
            solution = solve_ridge_from_gram(gram_c, cross_c, yty_c, n, lambda_reg)
        solution.bias = mean_y - solution.weight @ mean_h
        return solution


def sample_space_rank(eigenvalues: Tensor, n: float, order: int | None = None) -> int:
    """How many eigenvalues of the centred Gram matrix are told apart from zero.

    ``r = min(#{s_i > tol}, n - 1)`` with ``tol = max(d * eps * max(s), -min(s))``, ``d`` the Gram's
    ``order`` (default: the number of ``eigenvalues``; the dual passes the feature count):
    centring leaves at most ``n - 1`` independent rows, so for ``n <= d`` the smallest
    ``d - n + 1`` eigenvalues are zero, and an exact Gram matrix has no negative eigenvalue, so
    ``-min(s)`` measures the rounding of the accumulation (float32 GEMMs per batch: about
    ``1e-7 * n * mean(h)^2``): an eigenvalue within that of zero may be one.
    """
    s_max = float(eigenvalues.max().clamp_min(0))
    d = eigenvalues.shape[0] if order is None else order
    tol = max(d * torch.finfo(eigenvalues.dtype).eps * s_max, -float(eigenvalues.min()))
    numerical = int((eigenvalues > tol).sum())
    return max(0, min(numerical, math.ceil(n) - 1))


def gcv_curve(
    eigenvalues: Tensor, projected_cross: Tensor, yty: float, n: float, lambdas: Tensor, rank: int | None = None
) -> Tensor:
    """GCV score ``n * RSS(l) / (n - df(l))^2`` for every ``l`` in ``lambdas``; ``inf`` where undefined.

    With ``Hc = U diag(sqrt(s)) V^T`` (rank ``r``, see :func:`sample_space_rank`) the fit is
    ``Yc_hat = U diag(s/(s+l)) U^T Yc`` and ``q_i = ||u_i^T Yc||^2 = ||(V^T C)_i||^2 / s_i``, so
    ``RSS = rss_0 + sum_i q_i (l/(s_i+l))^2`` with ``rss_0 = yty - sum_i q_i`` (the part of ``Yc``
    outside the span of ``U``; 0 when ``r = n - 1``) and
    ``n - df = (n - 1 - r) + sum_i l/(s_i+l)`` (``df = 1 + sum_i s_i/(s_i+l)``, the 1 counts the
    intercept); the sums run over the ``r`` nonzero eigenvalues only. Written this way neither
    ``RSS`` nor ``n - df`` is a difference of nearly equal numbers, so for ``n <= d`` the score
    keeps its finite limit ``n * sum q_i/s_i^2 / (sum 1/s_i)^2`` as ``l -> 0`` instead of ``0/0``.
    ``rank`` defaults to :func:`sample_space_rank` of ``eigenvalues``.
    """
    if rank is None:
        rank = sample_space_rank(eigenvalues, n)
    s = eigenvalues[eigenvalues.shape[0] - rank :].unsqueeze(0)
    q = (projected_cross[projected_cross.shape[0] - rank :] ** 2).sum(1).unsqueeze(0) / s
    rss_0 = 0.0 if rank >= n - 1 else max(yty - float(q.sum()), 0.0)
    shrink = lambdas.unsqueeze(1) / (s + lambdas.unsqueeze(1))
    rss = rss_0 + (q * shrink * shrink).sum(1)
    resid_df = (n - 1 - rank) + shrink.sum(1)
    score = n * rss / resid_df.clamp_min(1e-300) ** 2
    return torch.where(resid_df > 0, score, torch.full_like(score, math.inf))


def _cholesky_solve_with_jitter(matrix: Tensor, rhs: Tensor) -> tuple[Tensor, float]:
    """Solve ``matrix X = rhs`` by Cholesky, adding growing diagonal jitter if it fails."""
    scale = float(matrix.diagonal().abs().mean().clamp_min(1e-300))
    jitter = 0.0
    eye = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
    for attempt in range(12):
        factor, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if int(info) == 0:
            if jitter:
                warnings.warn(
                    f"ridge system was not positive definite; solved with diagonal jitter {jitter:.3g}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return torch.cholesky_solve(rhs, factor), jitter
        jitter = scale * 10.0 ** (attempt - 10)
    warnings.warn("Cholesky failed even with jitter; falling back to lstsq", RuntimeWarning, stacklevel=3)
    return torch.linalg.lstsq(matrix, rhs).solution, jitter


def _check_lambda(lambda_reg: float | str) -> float | None:
    """The fixed lambda, or ``None`` for ``"auto"``; ``ValueError`` for anything else."""
    if isinstance(lambda_reg, str):
        if lambda_reg != "auto":
            raise ValueError(f"lambda_reg={lambda_reg!r}: pass a float >= 0 or 'auto'")
        return None
    chosen = float(lambda_reg)
    if not math.isfinite(chosen) or chosen < 0:
        raise ValueError(f"lambda_reg={lambda_reg!r} must be a finite float >= 0 or 'auto'")
    return chosen


def _gcv_lambda(
    eigenvalues: Tensor, projected: Tensor, yty: float, n: float, order: int, rank: int
) -> tuple[float, float]:
    """``(lambda, score)`` minimising :func:`gcv_curve` over 49 log-spaced values spanning ``1e-7 .. 1e1``
    times the mean eigenvalue of the ``order x order`` Gram (``eigenvalues``: its nonzero ones at least)."""
    mean_eig = float((eigenvalues.clamp_min(0).sum() / order).clamp_min(1e-300))
    lambdas = mean_eig * torch.logspace(-7, 1, 49, dtype=torch.float64, device=eigenvalues.device)
    scores = gcv_curve(eigenvalues, projected, yty, n, lambdas, rank)
    best = int(torch.argmin(scores))
    return float(lambdas[best]), float(scores[best])


def _check_finite(*tensors: Tensor) -> None:
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError(
            "the accumulated features contain NaN/Inf; reset the statistics "
            "(trainer.reset_classifier_statistics()) or solve from a loader"
        )


def _solution(weight_t: Tensor, lambda_reg: float, n: int, gcv: float | None, jitter: float) -> RidgeSolution:
    """A :class:`RidgeSolution` of ``W^T`` (d, k), bias 0; ``ValueError`` if it is not finite."""
    if not torch.isfinite(weight_t).all():
        raise ValueError("ridge solve produced non-finite weights; increase lambda_reg")
    bias = torch.zeros(weight_t.shape[1], dtype=torch.float64, device=weight_t.device)
    return RidgeSolution(weight_t.T.contiguous(), bias, lambda_reg, int(n), gcv, jitter)


def solve_ridge_from_gram(
    gram_c: Tensor, cross_c: Tensor, yty_c: float, n: int, lambda_reg: float | str = "auto"
) -> RidgeSolution:
    """Float64 ridge ``W^T = (G + lambda I)^-1 C`` on centred statistics; bias left at 0.

    ``lambda_reg="auto"`` minimises :func:`gcv_curve` over 49 log-spaced values spanning
    ``1e-7 .. 1e1`` times the mean eigenvalue of ``G`` and solves in its eigenbasis,
    ``W^T = sum_{i <= r} v_i (v_i^T C) / (s_i + lambda)`` over the ``r`` nonzero eigenvalues
    (:func:`sample_space_rank`).
    """
    gram_c = gram_c.to(torch.float64)
    cross_c = cross_c.to(torch.float64)
    _check_finite(gram_c, cross_c)
    fixed = _check_lambda(lambda_reg)
    if fixed is not None:
        eye = torch.eye(gram_c.shape[0], dtype=torch.float64, device=gram_c.device)
        weight_t, jitter = _cholesky_solve_with_jitter(gram_c + fixed * eye, cross_c)
        return _solution(weight_t, fixed, n, None, jitter)
    eigenvalues, vectors = torch.linalg.eigh(gram_c)
    projected = vectors.T @ cross_c
    rank = sample_space_rank(eigenvalues, n)
    chosen, gcv_value = _gcv_lambda(eigenvalues, projected, yty_c, float(n), gram_c.shape[0], rank)
    # solve in the eigenbasis over the nonzero eigenvalues only: C lies in the row space of
    # Hc, so this is the ridge solution, and the rounding noise in the null space (which can
    # make G + lambda I indefinite for small lambda when n <= d) never enters
    kept = eigenvalues.shape[0] - rank
    weight_t = vectors[:, kept:] @ (projected[kept:] / (eigenvalues[kept:] + chosen).unsqueeze(1))
    return _solution(weight_t, chosen, n, gcv_value, 0.0)


def _column_blocks(rows: list[Tensor], mean: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """``(columns, Hc[:, columns])`` in float64, a block of columns of the centred rows at a time."""
    for start in range(0, mean.shape[0], _COLUMN_BLOCK):
        columns = slice(start, start + _COLUMN_BLOCK)
        yield columns, torch.cat([h[:, columns] for h in rows]).double() - mean[columns]


def _solve_ridge_from_rows(
    rows: list[Tensor], targets_c: Tensor, mean: Tensor, yty_c: float, lambda_reg: float | str = "auto"
) -> RidgeSolution:
    """The ridge head of :func:`solve_ridge_from_gram` from ``n < d`` feature rows, in the dual; bias left at 0.

    ``rows``: batches of rows (each ``(B, d)``) with column means ``mean``; ``targets_c``: the centred
    one-hot targets ``Yc`` (n, k). With the centred rows ``Hc``, ``K = Hc Hc^T = U diag(s) U^T`` (n x n,
    float64) has the nonzero eigenvalues of ``G = Hc^T Hc``, and ``V^T C = diag(sqrt(s)) U^T Yc``: the
    same rank, GCV curve and lambda (the mean eigenvalue is taken over ``d``), and
    ``W^T = Hc^T U_r diag(1 / (s_r + lambda)) U_r^T Yc`` over the ``r`` nonzero eigenvalues, which is
    ``(G + lambda I)^-1 C``. Every lambda of the grid costs one ``n x k`` product, none a ``d x d`` one.
    """
    fixed = _check_lambda(lambda_reg)
    n, d = targets_c.shape[0], mean.shape[0]
    kernel = torch.zeros(n, n, dtype=torch.float64, device=mean.device)
    for _, block in _column_blocks(rows, mean.double()):
        kernel.addmm_(block, block.T)
    _check_finite(kernel)
    eigenvalues, vectors = torch.linalg.eigh(kernel)
    del kernel  # freed before the d x k products
    rank = sample_space_rank(eigenvalues, n, order=d)
    projected = vectors.T @ targets_c.double()
    chosen, gcv_value = fixed, None
    if chosen is None:
        root = eigenvalues.clamp_min(0).sqrt().unsqueeze(1)
        chosen, gcv_value = _gcv_lambda(eigenvalues, root * projected, yty_c, float(n), d, rank)
    kept = n - rank
    coefficients = vectors[:, kept:] @ (projected[kept:] / (eigenvalues[kept:] + chosen).unsqueeze(1))
    weight_t = torch.empty(d, targets_c.shape[1], dtype=torch.float64, device=mean.device)
    for columns, block in _column_blocks(rows, mean.double()):
        weight_t[columns] = block.T @ coefficients
    return _solution(weight_t, chosen, n, gcv_value, 0.0)


@torch.no_grad()
def logit_scale(logits: Tensor, labels: Tensor, *, iterations: int = 60) -> float:
    """The factor ``s > 0`` that minimises the mean cross-entropy of ``s * logits`` on ``labels``.

    The loss is convex in ``s`` and its derivative ``mean(E_softmax(s z)[z] - z_y)`` increases with
    ``s``, so its root is bracketed by doubling and found by bisection, in float64. Scaling leaves
    every row's argmax unchanged. A scale below ``1e-6`` (scores no better than chance) or above
    ``1e6`` (every row already right by a margin) is clamped to that bound.
    """
    if logits.dim() != 2 or labels.shape != (logits.shape[0],) or logits.shape[0] == 0:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must be (N, C) and (N,), N >= 1")
    z = logits.double()
    target = z.gather(1, labels.long().view(-1, 1)).squeeze(1)

    def slope(s: float) -> float:
        p = torch.softmax(s * z, dim=1)
        return float(((p * z).sum(1) - target).mean())

    low, high = 0.0, 1.0
    while slope(high) < 0 and high < 1e6:
        low, high = high, high * 2
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if slope(middle) < 0 else (low, middle)
    return min(max((low + high) / 2, 1e-6), 1e6)
