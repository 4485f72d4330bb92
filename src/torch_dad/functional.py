"""Reference math of DAD target propagation: pure PyTorch, no autograd.

This module is the oracle. Every fast path (fused, compiled, graphed, Triton) is
tested against these functions in float64.

A DAD dense layer computes ``z = a @ W.T + b`` and ``h = act(z)``. It owns a local
head ``logits = h @ W_loc.T + b_loc`` whose loss is ``CE(logits, y)`` (batch mean).
Its gradients have a closed form (``N`` = number of labelled rows)::

    d_logits = (softmax(logits) - onehot(y)) / N
    g_W_loc  = d_logits.T @ h          g_b_loc = d_logits.sum(0)
    d_z      = (d_logits @ W_loc) * act'(z)
    g_W      = d_z.T @ a               g_b     = d_z.sum(0)

There is no ``dL/da`` for the layer below: that is the GEMM (and the saved
activations) decoupled training does not need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "IGNORE_INDEX",
    "LocalGradients",
    "HeadGradients",
    "activation_forward",
    "activation_derivative",
    "check_activation",
    "cross_entropy_error",
    "local_loss_and_gradients",
    "head_loss_and_gradients",
    "ridge_solve",
]

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "tanh", "identity")
IGNORE_INDEX = -100
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def check_activation(activation: str) -> str:
    """Return ``activation`` if it is one of :data:`ACTIVATIONS`, else raise ``ValueError``."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not supported; choose one of {', '.join(ACTIVATIONS)}"
        )
    return activation


def activation_forward(z: Tensor, activation: str) -> Tensor:
    """``act(z)`` for act in relu / gelu (exact, erf form) / tanh / identity."""
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z)
    if activation == "tanh":
        return torch.tanh(z)
    if activation == "identity":
        return z
    raise ValueError(check_activation(activation))


def activation_derivative(z: Tensor, h: Tensor, activation: str) -> Tensor:
    """``act'(z)`` elementwise; ``h = act(z)`` is reused where it is cheaper (tanh)."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        # d/dz [z * Phi(z)] = Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + torch.erf(z * _INV_SQRT2))
        pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
        return cdf + z * pdf
    if activation == "tanh":
        return 1.0 - h * h
    if activation == "identity":
        return torch.ones_like(z)
    raise ValueError(check_activation(activation))


def cross_entropy_error(
    logits: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and its gradient w.r.t. ``logits`` (rows, classes).

    ``loss = mean_i CE(logits_i, q_i)`` over rows with ``target != ignore_index``, where
    ``q = (1 - eps) * onehot(target) + eps / C``; ``d_logits = (softmax(logits) - q) / N``.
    Ignored rows get a zero gradient. With no labelled row the loss is 0 and the gradient 0.
    """
    num_classes = logits.shape[-1]
    valid = target != ignore_index
    count = valid.sum().clamp_min(1).to(logits.dtype)
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    log_probs = torch.log_softmax(logits, dim=-1)
    onehot = torch.nn.functional.one_hot(safe_target, num_classes).to(logits.dtype)
    if label_smoothing:
        onehot = onehot * (1.0 - label_smoothing) + label_smoothing / num_classes
    mask = valid.to(logits.dtype).unsqueeze(-1)
    loss = -(onehot * log_probs * mask).sum() / count
    d_logits = (log_probs.exp() - onehot) * (mask / count)
    return loss, d_logits


@dataclass
class LocalGradients:
    """Everything one local step of a hidden DAD layer produces (see module docstring)."""

    loss: Tensor
    pre_activation: Tensor
    output: Tensor
    logits: Tensor
    grad_weight: Tensor
    grad_bias: Tensor | None
    grad_head_weight: Tensor
    grad_head_bias: Tensor


@dataclass
class HeadGradients:
    """One step of an output head: ``logits = a @ W.T + b`` feeding the task loss directly."""

    loss: Tensor
    logits: Tensor
    grad_weight: Tensor
    grad_bias: Tensor | None


def local_loss_and_gradients(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    activation: str = "relu",
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> LocalGradients:
    """Local CE loss of a hidden DAD layer and its closed-form gradients.

    ``z = a W^T + b; h = act(z); logits = h W_loc^T + b_loc; L = CE(logits, y)``;
    returns ``dL/dW, dL/db, dL/dW_loc, dL/db_loc`` as in the module docstring.
    ``inputs`` is (N, in_features) and ``target`` (N,) integer class ids.
    """
    z = inputs @ weight.T
    if bias is not None:
        z = z + bias
    h = activation_forward(z, activation)
    logits = h @ head_weight.T + head_bias
    loss, d_logits = cross_entropy_error(
        logits, target, label_smoothing=label_smoothing, ignore_index=ignore_index
    )
    d_z = (d_logits @ head_weight) * activation_derivative(z, h, activation)
    return LocalGradients(
        loss=loss,
        pre_activation=z,
        output=h,
        logits=logits,
        grad_weight=d_z.T @ inputs,
        grad_bias=d_z.sum(0) if bias is not None else None,
        grad_head_weight=d_logits.T @ h,
        grad_head_bias=d_logits.sum(0),
    )


def head_loss_and_gradients(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> HeadGradients:
    """CE of an output head and its gradients, exactly backprop's for that layer.

    ``logits = a W^T + b; L = CE(logits, y); dL/dW = d_logits^T a; dL/db = sum(d_logits)``.
    """
    logits = inputs @ weight.T
    if bias is not None:
        logits = logits + bias
    loss, d_logits = cross_entropy_error(
        logits, target, label_smoothing=label_smoothing, ignore_index=ignore_index
    )
    return HeadGradients(
        loss=loss,
        logits=logits,
        grad_weight=d_logits.T @ inputs,
        grad_bias=d_logits.sum(0) if bias is not None else None,
    )


def ridge_solve(features: Tensor, targets: Tensor, lambda_reg: float) -> tuple[Tensor, Tensor]:
    """Ridge regression with an unpenalised intercept, in float64, from raw data.

    Minimises ``||H W^T + b - Y||^2 + lambda ||W||^2``; returns ``(W, b)`` with ``W`` of
    shape (targets, features). Reference for :mod:`torch_dad.ridge`'s streaming solver:
    ``W^T = (Hc^T Hc + lambda I)^-1 Hc^T Yc`` on centred ``Hc, Yc``; ``b = mean(Y) - W mean(H)``.
    """
    h = features.to(torch.float64)
    y = targets.to(torch.float64)
    h_mean, y_mean = h.mean(0), y.mean(0)
    hc, yc = h - h_mean, y - y_mean
    gram = hc.T @ hc + lambda_reg * torch.eye(h.shape[1], dtype=torch.float64, device=h.device)
    w_t = torch.linalg.solve(gram, hc.T @ yc)
    return w_t.T.contiguous(), y_mean - h_mean @ w_t
