"""Gram (recursive-least-squares) right-preconditioner for a DAD layer's weight gradient.

A linear layer ``out = x @ W.T + b`` whose gradient is ``[g_W, g_b] = d.T @ [x, 1]``
converges at a rate set by the conditioning of its inputs' second moment. Pooled transformer
features are badly conditioned (all-MiniLM-L6-v2 on Rotten Tomatoes: condition number about
1.9e6), so a first-order head crawls. Right-multiplying the gradient by the inverse of the
running input Gram matrix removes that dependence, as recursive least squares and the
Gram-inverse preconditioner of normalised DFA do::

    S_t = sum over every training row seen so far of  x~ x~^T        (x~ = [x, 1])
    M_t = S_t / n_t + damping * (trace(S_t / n_t) / (d + 1)) * I
    [g_W, g_b]  <-  [g_W, g_b] @ M_t^-1

For a least-squares head this is the Gauss-Newton step up to a scalar; for cross-entropy
it is Gauss-Newton with the softmax curvature replaced by a constant. Early on, with fewer
rows than features, the product stays in the span of the rows seen (like normalised LMS).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._checks import check_positive_int

__all__ = ["PRECONDITIONERS", "GramPreconditioner", "check_precondition"]

PRECONDITIONERS: tuple[str, ...] = ("gram",)


def check_precondition(precondition: str | None) -> str | None:
    """Return ``precondition`` if it is ``None`` or one of :data:`PRECONDITIONERS`, else raise."""
    if precondition is not None and precondition not in PRECONDITIONERS:
        raise ValueError(
            f"precondition={precondition!r} is not supported; pass None (plain gradient) or "
            f"one of {', '.join(repr(p) for p in PRECONDITIONERS)}"
        )
    return precondition


class GramPreconditioner(nn.Module):
    """Running float64 Gram matrix of ``[x, 1]`` and the right-preconditioner built from it.

    Buffers (saved in ``state_dict``, so checkpoint/resume keeps the statistics): ``gram``
    (d+1, d+1) float64 and ``count``. ``window`` (in rows) optionally forgets old rows with
    weight ``exp(-B / window)`` per batch, for inputs that drift (an unfrozen backbone).
    """

    def __init__(
        self, num_features: int, *, damping: float = 1e-3, window: float | None = None, device=None
    ) -> None:
        super().__init__()
        check_positive_int("num_features", num_features)
        if not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping <= 0:
            raise ValueError(f"precondition_damping={damping!r} must be a finite float > 0 (e.g. 1e-3)")
        if window is not None and not (isinstance(window, (int, float)) and window > 0):
            raise ValueError(f"precondition_window={window!r} must be a positive number of rows or None")
        self.num_features = num_features
        self.damping = float(damping)
        self.window = window
        f64 = {"dtype": torch.float64, "device": device}
        self.gram: Tensor
        self.count: Tensor
        self.register_buffer("gram", torch.zeros(num_features + 1, num_features + 1, **f64))
        self.register_buffer("count", torch.zeros((), **f64))

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, damping={self.damping}, window={self.window}"

    @torch.no_grad()
    def update(self, inputs: Tensor) -> None:
        """``gram += [x, 1]^T [x, 1]; count += rows`` for ``inputs`` (rows, num_features)."""
        x = inputs.detach()
        if x.dim() != 2 or x.shape[1] != self.num_features:
            raise ValueError(f"inputs must have shape (rows, {self.num_features}), got {tuple(x.shape)}")
        if self.window is not None:
            decay = math.exp(-x.shape[0] / self.window)
            self.gram.mul_(decay)
            self.count.mul_(decay)
        d = self.num_features
        # fp32 GEMM per batch, accumulated in float64 (the same trade-off as ridge.GramAccumulator)
        xf = x if x.dtype == torch.float64 else x.float()
        total = xf.sum(0).to(self.gram.dtype)
        self.gram[:d, :d].add_((xf.T @ xf).to(self.gram.dtype))
        self.gram[:d, d].add_(total)
        self.gram[d, :d].add_(total)
        self.gram[d, d].add_(x.shape[0])
        self.count.add_(x.shape[0])

    def matrix(self) -> Tensor:
        """``M = S/n + damping * mean(diag(S/n)) * I`` (float64); the identity before any row."""
        size = self.num_features + 1
        eye = torch.eye(size, dtype=torch.float64, device=self.gram.device)
        n = self.count.clamp_min(1e-300)
        second = self.gram / n
        scale = (second.diagonal().mean() * self.damping).clamp_min(1e-12)
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

    def reset(self) -> None:
        """Forget every row seen so far."""
        self.gram.zero_()
        self.count.zero_()
