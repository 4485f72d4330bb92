"""Gram (recursive-least-squares) preconditioner and the stochastic Newton step of a DAD head.

A linear head ``logits = x @ W.T + b`` trained on the mean cross-entropy of a batch has the
gradient ``G = E^T X~ / B`` (``E = softmax(logits) - onehot(y)``, ``x~ = [x, 1]``) and the Hessian

    H = (1/N) sum_i A_i (x) x~_i x~_i^T,    A_i = diag(p_i) - p_i p_i^T,   0 <= A_i <= I/2.

Pooled transformer features are badly conditioned (``docs/hf.md``), so a first-order head crawls.
Replacing each ``A_i`` by the scalar curvature of the row along its own error,
``c_i = e_i^T A_i e_i / |e_i|^2`` (``1/K`` at a uniform prediction, ``2 eps`` when the true class
has ``1 - eps``), gives ``H ~ c * M`` with::

    S_t = sum over the rows seen so far of  x~ x~^T,   n_t = rows seen,   C_t = sum of c_i
    M_t = S_t / n_t + damping * v_t * I,     v_t = mean_j Var_t(x_j)  (centred, features only)
    rho_t  = (C_t / n_t) * damping * v_t
    step_t = B_t / (C_t + (d + 1) / 2) * ([G_W, G_b] + rho_t [W, b]) @ M_t^-1

and ``W <- W - lr * step_t``. Without the ``(d + 1) / 2`` this is ``(B_t / n_t)`` times the Newton
step ``G (c M)^-1`` with ``c = C_t / n_t``; the ``(d + 1) / 2`` is a prior of ``d + 1`` rows (as many
as parameters per class) at the curvature bound 1/2, so the first steps, taken while fewer rows
than features are seen, are no larger than majorisation (Boehning) steps instead of a full Newton
step on a handful of rows. ``rho_t [W, b]`` is the gradient of an L2 penalty whose Hessian is
the damping in ``c * M``, so the fixed point is the L2-regularised head rather than the
unregularised maximum-likelihood one (which overfits pooled features). This is the stochastic Newton method (recursive least squares for
a generalised linear model): the step is the Newton step ``G H^-1`` times ``B_t / n_t``, the
fraction of the data that this batch is. For a least-squares head (``A_i = I``) it *is*
recursive least squares, whose iterate after one pass is the ridge solution on every row seen.
The ``B_t / n_t`` factor is what makes ``lr = 1`` right: a constant-size Newton step amplifies
the batch noise in the low-variance directions by ``1 / (lambda + damping)``, while the shrinking
one averages it out, as an estimator from all ``n_t`` rows would. At ``lr = 1`` a step moves the
batch's logits by about ``-e_i / (c t)``, so its norm is O(1) and shrinks like ``1/t``; gradient
clipping at 1.0 (the ``Trainer`` default) only touches the first few steps. ``window`` (rows) forgets old rows with
weight ``exp(-B / window)`` per batch; then ``n_t`` levels off at ``window`` and the step at
``B / window`` of a Newton step. Early on, with fewer rows than features, the product stays in
the span of the rows seen (like normalised LMS).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._checks import check_positive_int

__all__ = ["PRECONDITIONERS", "GramPreconditioner", "check_precondition", "softmax_curvature"]

PRECONDITIONERS: tuple[str, ...] = ("gram",)


def check_precondition(precondition: str | None) -> str | None:
    """Return ``precondition`` if it is ``None`` or one of :data:`PRECONDITIONERS`, else raise."""
    if precondition is not None and precondition not in PRECONDITIONERS:
        raise ValueError(
            f"precondition={precondition!r} is not supported; pass None (plain gradient) or "
            f"one of {', '.join(repr(p) for p in PRECONDITIONERS)}"
        )
    return precondition


def softmax_curvature(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-row cross-entropy curvature along the row's error, ``e^T (diag p - p p^T) e / |e|^2``.

    ``p = softmax(logits)``, ``e = p - onehot(labels)``; ``logits`` (rows, K), ``labels`` (rows,)
    class ids. In ``(0, 1/2]``; ``1/K`` at a uniform prediction. Float64.
    """
    p = torch.softmax(logits.detach().to(torch.float64), dim=-1)
    err = p.clone()
    err[torch.arange(p.shape[0], device=p.device), labels] -= 1.0
    pe = p * err
    curved = pe - p * pe.sum(-1, keepdim=True)  # (diag p - p p^T) e
    return (err * curved).sum(-1) / (err * err).sum(-1).clamp_min(1e-300)


class GramPreconditioner(nn.Module):
    """Running float64 Gram matrix of ``[x, 1]`` and the right-preconditioner built from it.

    Buffers (saved in ``state_dict``, so checkpoint/resume keeps the statistics): ``gram``
    (d+1, d+1) float64, ``count`` and ``curvature`` (the sum of the rows' :func:`softmax_curvature`). ``window`` (in rows) optionally forgets old rows with
    weight ``exp(-B / window)`` per batch, for inputs that drift (an unfrozen backbone).
    """

    def __init__(self, num_features: int, *, damping: float = 0.1, window: float | None = None, device=None) -> None:
        super().__init__()
        check_positive_int("num_features", num_features)
        if not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping <= 0:
            raise ValueError(f"precondition_damping={damping!r} must be a finite float > 0 (e.g. 0.1)")
        if window is not None and not (isinstance(window, (int, float)) and window > 0):
            raise ValueError(f"precondition_window={window!r} must be a positive number of rows or None")
        self.num_features = num_features
        self.damping = float(damping)
        self.window = window
        f64 = {"dtype": torch.float64, "device": device}
        self.gram: Tensor
        self.count: Tensor
        self.curvature: Tensor
        self.register_buffer("gram", torch.zeros(num_features + 1, num_features + 1, **f64))
        self.register_buffer("count", torch.zeros((), **f64))
        self.register_buffer("curvature", torch.zeros((), **f64))

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, damping={self.damping}, window={self.window}"

    @torch.no_grad()
    def update(self, inputs: Tensor, curvature: Tensor | None = None) -> None:
        """``gram += [x, 1]^T [x, 1]; count += rows; curvature += curvature.sum()`` (``inputs``:
        (rows, num_features); ``curvature``: (rows,) from :func:`softmax_curvature`, or ``None``)."""
        x = inputs.detach()
        if x.dim() != 2 or x.shape[1] != self.num_features:
            raise ValueError(f"inputs must have shape (rows, {self.num_features}), got {tuple(x.shape)}")
        if curvature is not None and curvature.shape != (x.shape[0],):
            raise ValueError(f"curvature must have shape ({x.shape[0]},) (one per row), got {tuple(curvature.shape)}")
        if self.window is not None:
            decay = math.exp(-x.shape[0] / self.window)
            self.gram.mul_(decay)
            self.count.mul_(decay)
            self.curvature.mul_(decay)
        if curvature is not None:
            self.curvature.add_(curvature.detach().to(self.curvature.dtype).sum())
        d = self.num_features
        # fp32 GEMM per batch, accumulated in float64 (the same trade-off as ridge.GramAccumulator)
        xf = x if x.dtype == torch.float64 else x.float()
        total = xf.sum(0).to(self.gram.dtype)
        self.gram[:d, :d].add_((xf.T @ xf).to(self.gram.dtype))
        self.gram[:d, d].add_(total)
        self.gram[d, :d].add_(total)
        self.gram[d, d].add_(x.shape[0])
        self.count.add_(x.shape[0])

    def ridge(self) -> Tensor:
        """``damping * mean_j Var(x_j)``: the damping added to ``S/n`` (0-dim, float64).

        Relative to the features' mean variance, not to their second moment: pooled transformer
        features sit far from the origin, so ``mean(diag(S/n))``, which also holds the squared means
        and the constant column's 1, would over-damp the head (docs/hf.md)."""
        d = self.num_features
        n = self.count.clamp_min(1e-300)
        mean = self.gram[:d, d] / n
        variance = (self.gram.diagonal()[:d] / n - mean * mean).mean()
        return (variance.clamp_min(0.0) * self.damping).clamp_min(1e-12)

    def matrix(self) -> Tensor:
        """``M = S/n + ridge() * I`` (float64); the identity before any row."""
        size = self.num_features + 1
        eye = torch.eye(size, dtype=torch.float64, device=self.gram.device)
        n = self.count.clamp_min(1e-300)
        second = self.gram / n
        scale = self.ridge()
        empty = torch.as_tensor(self.count <= 0).to(torch.float64)
        # before the first row the preconditioner is the identity (plain gradient)
        return second * (1 - empty) + eye * (scale * (1 - empty) + empty)

    @torch.no_grad()
    def precondition(self, grad_weight: Tensor, grad_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``[g_W, g_b] @ M^-1`` by a float64 Cholesky solve; returned in the input dtypes.

        Without a bias the Gram's constant column is dropped: ``g_W @ M[:d, :d]^-1``.
        """
        d = self.num_features
        matrix = self.matrix()
        if grad_bias is None:
            matrix = matrix[:d, :d]
            stacked = grad_weight.to(torch.float64)
        else:
            stacked = torch.cat([grad_weight, grad_bias.unsqueeze(1)], dim=1).to(torch.float64)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:  # M is PSD plus a positive diagonal; only NaN/Inf inputs get here
            raise ValueError(
                "the Gram preconditioner is not positive definite (NaN/Inf in the inputs?); "
                "reset it with layer.preconditioner.reset() and check the data"
            )
        solved = torch.cholesky_solve(stacked.T, factor).T
        new_weight = solved[:, :d].to(grad_weight.dtype)
        new_bias = None if grad_bias is None else solved[:, d].to(grad_bias.dtype)
        return new_weight, new_bias

    @torch.no_grad()
    def newton_step(
        self,
        inputs: Tensor,
        curvature: Tensor,
        grads: tuple[Tensor, Tensor | None],
        params: tuple[Tensor, Tensor | None],
    ) -> tuple[Tensor, Tensor | None]:
        """Add the batch to the statistics, then ``B / (C + (d+1)/2) * ([g_W, g_b] + rho [W, b]) @ M^-1``.

        ``rho = (C / n) * ridge()``: the damping of ``M`` is the Hessian
        of the penalty ``rho/2 |[W, b]|^2``, so the iteration's fixed point is the L2-regularised
        head (module docstring). ``inputs`` (B, d) the labelled rows, ``curvature`` (B,) their
        :func:`softmax_curvature`, ``grads`` of the batch's mean loss, ``params`` = ``(W, b)``.
        With no row, ``grads`` is returned.
        """
        grad_weight, grad_bias = grads
        if inputs.shape[0] == 0:
            return grad_weight, grad_bias
        self.update(inputs, curvature)
        n = self.count.clamp_min(1e-300)
        mean_curvature = (self.curvature / n).clamp_min(1e-300)
        rho = mean_curvature * self.ridge()
        weight, bias = params
        grad_weight = grad_weight + (rho * weight.detach().to(torch.float64)).to(grad_weight.dtype)
        if grad_bias is not None and bias is not None:
            grad_bias = grad_bias + (rho * bias.detach().to(torch.float64)).to(grad_bias.dtype)
        new_weight, new_bias = self.precondition(grad_weight, grad_bias)
        # d + 1 prior rows at the curvature bound 1/2: the first steps stay majorisation (Boehning) steps
        scale = inputs.shape[0] / (self.curvature + (self.num_features + 1) / 2)
        new_weight = new_weight * scale.to(new_weight.dtype)
        return new_weight, None if new_bias is None else new_bias * scale.to(new_bias.dtype)

    def reset(self) -> None:
        """Forget every row seen so far."""
        self.gram.zero_()
        self.count.zero_()
        self.curvature.zero_()
