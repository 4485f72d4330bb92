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
    "LOCAL_LOSSES",
    "PREDSIM_BETA",
    "check_local_loss",
    "similarity_matrix",
    "similarity_loss_and_gradient",
    "target_projection",
    "LocalRuleError",
    "local_rule_error",
    "NORMALIZATIONS",
    "layer_norm_forward",
    "layer_norm_backward",
    "LEAKY_RELU_SLOPE",
    "BATCH_NORM_EPS",
    "BATCH_NORM_MOMENTUM",
    "batch_norm_statistics",
    "batch_norm_forward",
    "batch_norm_backward",
    "POOLS",
    "ConvLocalGradients",
    "conv2d_reference",
    "pool2x2_reference",
    "conv_local_loss_and_gradients",
]

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "tanh", "identity", "leaky_relu")
LEAKY_RELU_SLOPE = 0.01  # torch.nn.LeakyReLU's default negative slope
IGNORE_INDEX = -100
LOCAL_LOSSES: tuple[str, ...] = ("ce", "predsim", "drtp")  # see local_rule_error
PREDSIM_BETA = 0.99  # Nokland & Eidnes (2019)'s weight of the similarity term
SIMILARITY_EPS = 1e-8
# DADLinear(normalize=...), see layer_norm_forward and batch_norm_forward
NORMALIZATIONS: tuple[str, ...] = ("layernorm", "batchnorm")
LAYER_NORM_EPS = 1e-5
BATCH_NORM_EPS = 1e-5  # torch.nn.BatchNorm1d's defaults
BATCH_NORM_MOMENTUM = 0.1
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
    """``act(z)`` for act in relu / gelu (exact, erf form) / tanh / identity / leaky_relu (slope 0.01)."""
    if activation == "relu":
        return torch.relu(z)
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(z, LEAKY_RELU_SLOPE)
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
    if activation == "leaky_relu":
        return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, LEAKY_RELU_SLOPE))
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
    ignore_index: int | None = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and its gradient w.r.t. ``logits`` (..., classes).

    ``loss = mean_i CE(logits_i, q_i)`` over rows with ``target != ignore_index``, where
    ``q = (1 - eps) * onehot(target) + eps / C``; ``d_logits = (softmax(logits) - q) / N``.
    Ignored rows get a zero gradient; with no labelled row the loss is 0 and the gradient 0.
    ``ignore_index=None`` declares every target a class id: no mask, ``N`` = the row count.

    ``d_logits`` has the logits' dtype; for fp16/bf16 logits the softmax and the loss are computed
    (and the loss returned) in float32. No dense one-hot is formed (at an LM head's vocabulary it
    would be as large as the logits in float32).
    """
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    num_classes = wide.shape[-1]
    log_probs = torch.log_softmax(wide, dim=-1)
    weight: Tensor | float
    if ignore_index is None:
        safe = target.unsqueeze(-1)
        weight = 1.0 / max(target.numel(), 1)
    else:
        valid = target != ignore_index
        safe = target.masked_fill(~valid, 0).unsqueeze(-1)
        weight = valid.to(wide.dtype) / valid.sum().clamp_min(1).to(wide.dtype)
    nll = -log_probs.gather(-1, safe).squeeze(-1)
    if label_smoothing:
        nll = nll * (1.0 - label_smoothing) - log_probs.mean(-1) * label_smoothing
    loss = (nll * weight).sum()
    # softmax in place over log_probs, which is not needed again (unless autograd saved it)
    d_logits = log_probs.exp() if log_probs.requires_grad else log_probs.exp_()
    if label_smoothing:
        d_logits.sub_(label_smoothing / num_classes)
    d_logits.scatter_add_(-1, safe, torch.full_like(d_logits[..., :1], -(1.0 - label_smoothing)))
    d_logits.mul_(weight.unsqueeze(-1) if isinstance(weight, Tensor) else weight)
    return loss, d_logits.to(logits.dtype)


@dataclass
class LocalGradients:
    """Everything one local step of a hidden DAD layer produces (see module docstring)."""

    loss: Tensor
    pre_activation: Tensor
    output: Tensor
    logits: Tensor | None  # None for the head-free "drtp" rule
    grad_weight: Tensor
    grad_bias: Tensor | None
    grad_head_weight: Tensor | None
    grad_head_bias: Tensor | None
    # normalize="batchnorm": the gradients of its affine weight and bias
    grad_norm_weight: Tensor | None = None
    grad_norm_bias: Tensor | None = None


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
    head_weight: Tensor | None,
    head_bias: Tensor | None,
    target: Tensor,
    activation: str = "relu",
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    local_loss: str = "ce",
    projection: Tensor | None = None,
    beta: float = PREDSIM_BETA,
    normalize: str | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
) -> LocalGradients:
    """Local loss of a hidden DAD layer and its closed-form gradients.

    ``z = a W^T + b; h = act(z); logits = h W_loc^T + b_loc; L = CE(logits, y)``;
    returns ``dL/dW, dL/db, dL/dW_loc, dL/db_loc`` as in the module docstring.
    ``inputs`` is (N, in_features) and ``target`` (N,) integer class ids.
    ``local_loss`` picks another rule from :data:`LOCAL_LOSSES` (see :func:`local_rule_error`);
    for the head-free ``"drtp"`` (``projection`` required) the head arguments may be ``None``
    and the head gradients and logits are ``None``. ``normalize="layernorm"`` computes
    ``h = act(LN(z))`` with a parameter-free LayerNorm (see :func:`layer_norm_forward`);
    ``normalize="batchnorm"`` computes ``h = act(BN(z))`` with the batch's statistics and the affine
    ``norm_weight``, ``norm_bias`` (``None``: 1 and 0; see :func:`batch_norm_forward`), whose
    gradients come back as ``grad_norm_weight``, ``grad_norm_bias``.
    """
    z = inputs @ weight.T
    if bias is not None:
        z = z + bias
    z_act, normed, inv_std = z, z, None
    if normalize == "layernorm":
        z_act, inv_std = layer_norm_forward(z)
        normed = z_act
    elif normalize == "batchnorm":
        z_act, normed, inv_std = batch_norm_forward(z, norm_weight, norm_bias, *batch_norm_statistics(z))
    h = activation_forward(z_act, activation)
    rule = local_rule_error(
        local_loss, h, target, head_weight, head_bias, projection=projection, beta=beta,
        label_smoothing=label_smoothing, ignore_index=ignore_index,
    )
    d_z = rule.grad_output * activation_derivative(z_act, h, activation)
    grad_norm_weight = grad_norm_bias = None
    if normalize == "layernorm" and inv_std is not None:
        d_z = layer_norm_backward(d_z, normed, inv_std)
    elif normalize == "batchnorm" and inv_std is not None:
        d_z, grad_norm_weight, grad_norm_bias = batch_norm_backward(d_z, normed, inv_std, norm_weight)
    return LocalGradients(
        loss=rule.loss,
        pre_activation=z,
        output=h,
        logits=rule.logits,
        grad_weight=d_z.T @ inputs,
        grad_bias=d_z.sum(0) if bias is not None else None,
        grad_head_weight=rule.grad_head_weight,
        grad_head_bias=rule.grad_head_bias,
        grad_norm_weight=grad_norm_weight,
        grad_norm_bias=grad_norm_bias,
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


# ---------------------------------------------------------------------------------------------
# Local-rule menu. Each rule is a loss on the layer output h (and, for some, a local head); it
# gives d_h = dL/dh, and the layer's own gradients follow as in local_loss_and_gradients:
# d_z = d_h * act'(z), g_W = d_z^T a, g_b = sum(d_z).
#
#   "ce":      L = CE(h W_loc^T + b_loc, y)                                  (the default)
#   "predsim": L = (1 - beta) CE(h W_loc^T + b_loc, y) + beta * mean_ij (S(h) - S(Y))_ij^2
#              Nokland & Eidnes (2019) "pred + sim"; S = cosine similarity of row-centred rows
#              (their "adjusted cosine" / correlation matrix), Y = onehot(y), beta = 0.99 as
#              in the paper. The similarity is taken on h itself (their "bio" variant: no
#              extra learned projection), so the rule adds no parameters beyond the CE head.
#   "drtp":    L = 1/(2N) sum_i ||h_i - P[y_i]||^2, P a fixed random (C, out) matrix
#              drawn once from a seed: a direct-random-target-projection rule with no
#              trainable head. DRTP's signal -P onehot(y) is the y-dependent part of d_h;
#              the +h term makes the loss bounded (pure DRTP, L = -<h, P y>, grows the
#              weights until weight decay stops them).
# ---------------------------------------------------------------------------------------------


def check_local_loss(local_loss: str) -> str:
    """Return ``local_loss`` if it is one of :data:`LOCAL_LOSSES`, else raise ``ValueError``."""
    if not isinstance(local_loss, str) or local_loss not in LOCAL_LOSSES:
        raise ValueError(
            f"local_loss={local_loss!r} is not supported; choose one of {', '.join(LOCAL_LOSSES)}"
        )
    return local_loss


def similarity_matrix(x: Tensor, eps: float = SIMILARITY_EPS) -> Tensor:
    """``S = u u^T`` with ``u_i = c_i / sqrt(||c_i||^2 + eps)``, ``c_i = x_i - mean(x_i)`` (per row)."""
    c = x - x.mean(1, keepdim=True)
    u = c / (c.pow(2).sum(1, keepdim=True) + eps).sqrt()
    return u @ u.T


def similarity_loss_and_gradient(
    h: Tensor, target: Tensor, num_classes: int, *, ignore_index: int = IGNORE_INDEX, eps: float = SIMILARITY_EPS
) -> tuple[Tensor, Tensor]:
    """``L = sum_ij m_ij (S(h) - S(onehot(y)))_ij^2 / N^2`` over labelled rows, and ``dL/dh``.

    ``m_ij = 1`` when both rows are labelled, ``N`` = labelled rows. Closed form:
    ``G = 2 m (S(h) - S(Y)) / N^2``; ``g_u = 2 G u``; ``g_c = g_u / n - c (c . g_u) / n^3``
    with ``n = sqrt(||c||^2 + eps)``; ``dL/dh = g_c - mean_row(g_c)``.
    """
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    mask = valid.to(h.dtype)
    pair = mask.unsqueeze(1) * mask.unsqueeze(0)
    count = mask.sum().clamp_min(1)
    onehot = torch.nn.functional.one_hot(safe, num_classes).to(h.dtype)
    c = h - h.mean(1, keepdim=True)
    norm = (c.pow(2).sum(1, keepdim=True) + eps).sqrt()
    u = c / norm
    diff = (u @ u.T - similarity_matrix(onehot, eps)) * pair
    loss = diff.pow(2).sum() / (count * count)
    g_u = (4.0 / (count * count)) * (diff @ u)  # diff is symmetric: dL/du = 2 (G + G^T) u / 2
    g_c = g_u / norm - c * ((c * g_u).sum(1, keepdim=True) / norm.pow(3))
    return loss, g_c - g_c.mean(1, keepdim=True)


def target_projection(out_features: int, num_classes: int, seed: int = 0, dtype: torch.dtype | None = None) -> Tensor:
    """The ``drtp`` rule's fixed targets ``P`` (num_classes, out_features): entries 0 or 1, p = 1/2.

    Non-negative because the layer output is usually a ReLU: a negative target is unreachable.
    Drawn on the CPU from ``torch.Generator().manual_seed(seed)`` so every device gets the same P.
    """
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (num_classes, out_features), generator=generator)
    return bits.to(dtype or torch.get_default_dtype())


@dataclass
class LocalRuleError:
    """A local rule's loss, ``d_h = dL/dh``, its logits (``None`` if head-free) and head gradients."""

    loss: Tensor
    grad_output: Tensor
    logits: Tensor | None
    grad_head_weight: Tensor | None
    grad_head_bias: Tensor | None


def local_rule_error(
    local_loss: str,
    h: Tensor,
    target: Tensor,
    head_weight: Tensor | None,
    head_bias: Tensor | None,
    *,
    projection: Tensor | None = None,
    beta: float = PREDSIM_BETA,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> LocalRuleError:
    """Loss and ``dL/dh`` of one local rule on the layer output ``h`` (see the table above)."""
    check_local_loss(local_loss)
    if local_loss == "drtp":
        if projection is None:
            raise ValueError("local_loss='drtp' needs projection= (see target_projection)")
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target))
        mask = valid.to(h.dtype).unsqueeze(1)
        count = mask.sum().clamp_min(1)
        resid = (h - projection.to(h.dtype)[safe]) * mask
        loss = 0.5 * resid.pow(2).sum() / count
        return LocalRuleError(loss, resid / count, None, None, None)
    if head_weight is None or head_bias is None:
        raise ValueError(f"local_loss={local_loss!r} needs head_weight and head_bias")
    logits = h @ head_weight.T + head_bias
    loss, d_logits = cross_entropy_error(logits, target, label_smoothing=label_smoothing, ignore_index=ignore_index)
    if local_loss == "predsim":
        sim_loss, d_sim = similarity_loss_and_gradient(h, target, head_weight.shape[0], ignore_index=ignore_index)
        loss = (1.0 - beta) * loss + beta * sim_loss
        d_logits = d_logits * (1.0 - beta)
        d_h = d_logits @ head_weight + beta * d_sim
    else:
        d_h = d_logits @ head_weight
    return LocalRuleError(loss, d_h, logits, d_logits.T @ h, d_logits.sum(0))


def layer_norm_forward(z: Tensor, eps: float = LAYER_NORM_EPS) -> tuple[Tensor, Tensor]:
    """Parameter-free LayerNorm over features: ``(z - mean) * inv_std`` and ``inv_std = 1/sqrt(var + eps)``."""
    mean = z.mean(1, keepdim=True)
    centred = z - mean
    inv_std = (centred.pow(2).mean(1, keepdim=True) + eps).rsqrt()
    return centred * inv_std, inv_std


def layer_norm_backward(grad: Tensor, normed: Tensor, inv_std: Tensor) -> Tensor:
    """``dL/dz`` from ``dL/dz_hat``: ``inv_std * (g - mean(g) - z_hat * mean(g * z_hat))`` per row."""
    return _normalization_backward(grad, normed, inv_std, 1)


def _normalization_backward(grad: Tensor, normed: Tensor, inv_std: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """``dL/dz`` of ``z_hat = (z - mean) * inv_std`` with mean and variance taken over ``dim``."""
    return inv_std * (grad - grad.mean(dim, keepdim=True) - normed * (grad * normed).mean(dim, keepdim=True))


def _batch_axes(z: Tensor) -> tuple[int, ...]:
    """The axes batch norm reduces over: every axis of ``z`` (B, C, ...) but the channel axis 1."""
    return (0, *range(2, z.dim()))


def _per_channel(t: Tensor, z: Tensor) -> Tensor:
    """``t`` (one value per channel) viewed as (C, 1, ..., 1), to broadcast over ``z`` (B, C, ...)."""
    return t.reshape(-1, *(1,) * (z.dim() - 2))


def batch_norm_statistics(z: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel batch ``mean`` and biased ``var`` of ``z`` (B, C, ...) over the batch and the spatial
    axes (every axis but 1), each shaped (1, C, 1, ..., 1): what training normalises by."""
    axes = _batch_axes(z)
    mean = z.mean(axes, keepdim=True)
    return mean, (z - mean).pow(2).mean(axes, keepdim=True)


def batch_norm_forward(
    z: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, eps: float = BATCH_NORM_EPS
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, z_hat, inv_std)``: ``z_hat = (z - mean) * inv_std``, ``inv_std = 1/sqrt(var + eps)``,
    ``out = z_hat * weight + bias`` (``None``: 1 and 0), per channel (axis 1 of ``z`` (B, C, ...)), as
    ``nn.BatchNorm1d``/``nn.BatchNorm2d``. Training passes the batch's :func:`batch_norm_statistics`,
    inference the running ones (any shape holding one value per channel)."""
    inv_std = (_per_channel(var, z) + eps).rsqrt()
    normed = (z - _per_channel(mean, z)) * inv_std
    out = normed if weight is None else normed * _per_channel(weight, z)
    return (out if bias is None else out + _per_channel(bias, z)), normed, inv_std


def batch_norm_backward(
    grad: Tensor, normed: Tensor, inv_std: Tensor, weight: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dz, dL/dweight, dL/dbias)`` of a training-mode :func:`batch_norm_forward` from ``g = dL/dout``,
    with ``sum_b``/``mean_b`` over the batch and spatial axes: ``dL/dweight = sum_b g z_hat``,
    ``dL/dbias = sum_b g`` and, with ``g_hat = g * weight``,
    ``dL/dz = inv_std * (g_hat - mean_b(g_hat) - z_hat * mean_b(g_hat * z_hat))`` per channel."""
    axes = _batch_axes(grad)
    g_hat = grad if weight is None else grad * _per_channel(weight, grad)
    return _normalization_backward(g_hat, normed, inv_std, axes), (grad * normed).sum(axes), grad.sum(axes)


# ---------------------------------------------------------------------------------------------
# A DAD convolution (torch_dad.DADConv2d). z = conv2d(a, W, b), h = act(z), and the layer output
# o = h, or its 2 x 2 max/avg pool with ``pool``: what the next layer reads and what the local head
# reads, through the grid x grid adaptive average pool P, flattened: logits = P(o) W_loc^T + b_loc.
# P, the average pool and (given the argmax) the max pool are linear, so the closed form is the
# dense one with these maps and the convolution in place of the matrix products:
#
#     d_logits = (softmax(logits) - onehot(y)) / N
#     g_W_loc  = d_logits.T @ P(o)       g_b_loc = d_logits.sum(0)
#     d_z      = pool^T(P^T(d_logits @ W_loc)) * act'(z)
#     g_W      = sum over rows and positions of d_z x (the input patch)      g_b = d_z summed
#
# With batch norm (normalize="batchnorm"), h = act(BN(z)) with per-channel statistics over the batch
# and the positions, as nn.BatchNorm2d, and d_z passes through batch_norm_backward first.
# ---------------------------------------------------------------------------------------------

#: DADConv2d(pool=...): a 2 x 2, stride 2 pooling of the output (floor mode, as nn.MaxPool2d(2))
POOLS: tuple[str, ...] = ("max", "avg")


def conv2d_reference(
    inputs: Tensor, weight: Tensor, bias: Tensor | None, stride: int, padding: int, groups: int = 1
) -> tuple[Tensor, Tensor]:
    """``(z, patches)``: ``z = conv2d(inputs, weight, bias, groups=groups)`` as matrix products over the
    unfolded input, one per group ``g`` of channels: ``z[n, g, o, p] = sum_k weight[g, o, k] patches[n, g, k, p]
    + bias[g, o]`` (``patches`` (N, groups, C_in/groups * k*k, P): unfold's channel-major rows, by group)."""
    out_channels, _, kh, kw = weight.shape
    patches = torch.nn.functional.unfold(inputs, (kh, kw), padding=padding, stride=stride)
    patches = patches.reshape(inputs.shape[0], groups, -1, patches.shape[-1])
    height = (inputs.shape[2] + 2 * padding - kh) // stride + 1
    width = (inputs.shape[3] + 2 * padding - kw) // stride + 1
    z = torch.einsum("gok,ngkp->ngop", weight.reshape(groups, out_channels // groups, -1), patches)
    z = z.reshape(inputs.shape[0], out_channels, -1)
    if bias is not None:
        z = z + bias[:, None]
    return z.reshape(inputs.shape[0], out_channels, height, width), patches


def _grid_pool_matrix(size: int, grid: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(grid, size): row ``i`` averages the window ``[floor(i*size/grid), ceil((i+1)*size/grid))``,
    the windows of ``adaptive_avg_pool2d`` along one axis."""
    matrix = torch.zeros(grid, size, dtype=dtype, device=device)
    for i in range(grid):
        lo, hi = (i * size) // grid, -((-(i + 1) * size) // grid)
        matrix[i, lo:hi] = 1.0 / (hi - lo)
    return matrix


def pool2x2_reference(h: Tensor, pool: str) -> tuple[Tensor, Tensor]:
    """``(out, share)``: 2 x 2, stride 2 max or average pooling of ``h`` (an odd last row/column is
    dropped) and, per element of ``h``, its share of its window's output: ``d_h = share * d_out``
    spread back over the window (1/4 each for avg; 1 at the window's first maximum for max)."""
    n, c, height, width = h.shape
    windows = h[:, :, : height // 2 * 2, : width // 2 * 2].reshape(n, c, height // 2, 2, width // 2, 2)
    windows = windows.permute(0, 1, 2, 4, 3, 5).reshape(n, c, height // 2, width // 2, 4)
    if pool == "max":
        out = windows.amax(-1)
        share = torch.nn.functional.one_hot(windows.argmax(-1), 4).to(h.dtype)
    else:
        out = windows.mean(-1)
        share = torch.full_like(windows, 0.25)
    share = share.reshape(n, c, height // 2, width // 2, 2, 2).permute(0, 1, 2, 4, 3, 5)
    full = torch.zeros_like(h)
    full[:, :, : height // 2 * 2, : width // 2 * 2] = share.reshape(n, c, height // 2 * 2, width // 2 * 2)
    return out, full


def _unpool2x2(d_out: Tensor, share: Tensor) -> Tensor:
    """``d_h`` from ``d_out``: each window's gradient times each element's ``share`` of it."""
    spread = d_out.repeat_interleave(2, 2).repeat_interleave(2, 3)
    full = torch.zeros_like(share)
    full[:, :, : spread.shape[2], : spread.shape[3]] = spread
    return full * share


@dataclass
class ConvLocalGradients:
    """One local step of a DAD convolution: loss, ``z``, ``h``, the layer output ``o`` (``h`` pooled
    if ``pool``), the local logits and the gradients of ``W, b, W_loc, b_loc``."""

    loss: Tensor
    pre_activation: Tensor
    hidden: Tensor
    output: Tensor
    logits: Tensor
    grad_weight: Tensor
    grad_bias: Tensor | None
    grad_head_weight: Tensor
    grad_head_bias: Tensor
    grad_norm_weight: Tensor | None = None
    grad_norm_bias: Tensor | None = None


def conv_local_loss_and_gradients(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    head_weight: Tensor,
    head_bias: Tensor,
    target: Tensor,
    *,
    stride: int = 1,
    padding: int = 0,
    groups: int = 1,
    activation: str = "relu",
    grid: int = 4,
    pool: str | None = None,
    label_smoothing: float = 0.0,
    normalize: str | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
) -> ConvLocalGradients:
    """Local loss of a DAD convolution and its closed-form gradients (see the table above), written
    with unfold and matrix products only. ``inputs`` (N, C_in, H, W), ``weight`` (C_out, C_in / groups, k, k),
    ``head_weight`` (C, C_out * grid * grid). ``normalize="batchnorm"`` computes ``h = act(BN(z))``
    with the batch's per-channel statistics and the affine ``norm_weight``, ``norm_bias`` (``None``: 1
    and 0), whose gradients come back as ``grad_norm_weight``, ``grad_norm_bias``."""
    z, patches = conv2d_reference(inputs, weight, bias, stride, padding, groups)
    z_act, norm = z, None
    if normalize == "batchnorm":
        z_act, normed, inv_std = batch_norm_forward(z, norm_weight, norm_bias, *batch_norm_statistics(z))
        norm = (normed, inv_std)
    h = activation_forward(z_act, activation)
    out, share = pool2x2_reference(h, pool) if pool is not None else (h, None)
    rows = _grid_pool_matrix(out.shape[2], grid, h.dtype, h.device)
    cols = _grid_pool_matrix(out.shape[3], grid, h.dtype, h.device)
    pooled = (rows @ out @ cols.T).flatten(1)  # (N, C_out * grid * grid), channel-major
    logits = pooled @ head_weight.T + head_bias
    loss, d_logits = cross_entropy_error(logits, target, label_smoothing=label_smoothing)
    d_pooled = (d_logits @ head_weight).reshape(out.shape[0], out.shape[1], grid, grid)
    d_out = rows.T @ d_pooled @ cols
    d_h = _unpool2x2(d_out, share) if share is not None else d_out
    d_z = d_h * activation_derivative(z_act, h, activation)
    grad_norm_weight = grad_norm_bias = None
    if norm is not None:
        d_z, grad_norm_weight, grad_norm_bias = batch_norm_backward(d_z, *norm, norm_weight)
    d_z = d_z.flatten(2)  # (N, C_out, positions)
    d_z_groups = d_z.reshape(d_z.shape[0], groups, -1, d_z.shape[-1])
    grad_weight = torch.einsum("ngop,ngkp->gok", d_z_groups, patches).reshape(weight.shape)
    return ConvLocalGradients(
        loss=loss,
        pre_activation=z,
        hidden=h,
        output=out,
        logits=logits,
        grad_weight=grad_weight,
        grad_bias=d_z.sum((0, 2)) if bias is not None else None,
        grad_head_weight=d_logits.T @ pooled,
        grad_head_bias=d_logits.sum(0),
        grad_norm_weight=grad_norm_weight,
        grad_norm_bias=grad_norm_bias,
    )
