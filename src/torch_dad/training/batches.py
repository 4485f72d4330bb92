"""Batches for :class:`~torch_dad.DADTrainer`: iterating a dataset, and checking one batch onto the device."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import check_finite, check_inputs, check_labels
from ..functional import IGNORE_INDEX
from ..nn._local import LocalLayer
from ..nn.block import DADBlock
from ..nn.linear import DADLinear
from ..ops.linear_cross_entropy import check_token_labels, check_token_layout

__all__ = [
    "INPUT_KEYS", "LABEL_KEYS", "as_batch_pair", "check_token_model", "classification_metrics", "iterate_batches",
    "prepare_batch_tensors", "reiterable",
]

#: the keys of a dict batch (e.g. from a ``DataLoader`` over a HuggingFace dataset), in the order tried
INPUT_KEYS: tuple[str, ...] = ("x", "inputs", "input", "pixel_values")
LABEL_KEYS: tuple[str, ...] = ("labels", "label", "y")


def as_batch_pair(batch: Any) -> tuple[Any, Any]:
    """``(x, y)`` of one batch: a pair ``(x, y)``, or a mapping holding one of :data:`INPUT_KEYS`
    and one of :data:`LABEL_KEYS` (the first present of each)."""
    if isinstance(batch, Mapping):
        x_key = next((k for k in INPUT_KEYS if k in batch), None)
        y_key = next((k for k in LABEL_KEYS if k in batch), None)
        if x_key is None or y_key is None:
            raise ValueError(
                f"a dict batch needs an input key ({', '.join(map(repr, INPUT_KEYS))}) and a label key "
                f"({', '.join(map(repr, LABEL_KEYS))}); got keys {sorted(map(str, batch))}"
            )
        return batch[x_key], batch[y_key]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"each batch must be a pair (inputs, labels) or a dict with keys such as 'x'/'pixel_values' and 'labels', "
        f"got {type(batch).__name__}; pass an iterable of batches (e.g. a DataLoader) or a pair of tensors (X, Y)"
    )


def iterate_batches(
    data: Any, batch_size: int, shuffle: bool, generator: torch.Generator | None
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(x, y)`` batches of ``data``: a pair of tensors ``(X, Y)`` is cut into ``batch_size``
    rows (shuffled with ``generator``); any other iterable yields its batches through
    :func:`as_batch_pair` (pairs, or dicts with an input and a label key)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        inputs, labels = data
        n = inputs.shape[0]
        if labels.shape[0] != n:
            raise ValueError(f"inputs have {n} rows but labels have {labels.shape[0]}")
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            yield inputs[idx], labels[idx]
    elif isinstance(data, (Mapping, str, Tensor)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be a pair of tensors (X, Y) or an iterable of batches (e.g. a DataLoader), got "
            f"{type(data).__name__}" + ("; for a dict of tensors pass (d['x'], d['labels'])" if isinstance(data, Mapping) else "")
        )
    else:
        for batch in data:
            yield as_batch_pair(batch)


def prepare_batch_tensors(
    inputs: Tensor, labels: Tensor, first: LocalLayer, device: torch.device, num_classes: int, check_values: bool
) -> tuple[Tensor, Tensor]:
    """``(x, y)`` on ``device``, checked: ``x`` as the first layer takes it (rows in its dtype for a
    :class:`~torch_dad.DADLinear`; as given, floats in its dtype, otherwise), ``y`` int64 class ids."""
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
    if inputs.dim() == 0:
        raise ValueError("inputs must have a batch dimension, got a 0-dim tensor")
    if inputs.shape[0] == 0:
        raise ValueError("inputs are an empty batch; pass at least one row")
    if isinstance(first, DADLinear):
        x = _rows(inputs, first, device, check_values)
    else:
        first.check_input(inputs)
        x = inputs.to(device, non_blocking=True)
        if x.dtype.is_floating_point:
            x = x.to(first.master_dtype)
            if check_values:
                check_finite(x)
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class ids, got {type(labels).__name__}")
    y = labels.to(device, non_blocking=True)
    if isinstance(first, DADBlock) and first.token_level:
        _check_token_labels(y, x, num_classes, check_values)
    else:
        check_labels(y, x.shape[0], num_classes, check_values=check_values)
    return x, y.long()


def _check_token_labels(y: Tensor, x: Tensor, vocab: int, check_values: bool) -> None:
    """``y`` must be ``(batch, T)`` token ids (``T = x.shape[1]``) in ``[0, vocab)`` or ``-100``; the values
    are read only when ``check_values`` (a host sync on CUDA)."""
    if x.dim() < 2:
        raise ValueError(f"inputs have shape {tuple(x.shape)}; a token-level model takes (batch, T, ...) inputs")
    shape = tuple(x.shape[:2])
    if check_values:
        check_token_labels(y, shape, vocab, IGNORE_INDEX, name="labels")
    else:
        check_token_layout(y, shape, IGNORE_INDEX, "labels")


def check_token_model(layers: Sequence[LocalLayer], has_classifier: bool) -> None:
    """A model that takes token labels ``(batch, T)`` takes them in every layer and has no
    ``classifier``: its last block's token head is its output (the LM head). ``ValueError`` otherwise."""
    token = [isinstance(layer, DADBlock) and layer.token_level for layer in layers]
    if not any(token):
        return
    if not all(token):
        index = token.index(False)
        raise ValueError(
            f"DAD layer {index} ({type(layers[index]).__name__}) takes one label per row, but other layers have "
            "token-level local heads (labels (batch, T)); give every layer a DADBlock with a token local_head"
        )
    if has_classifier:
        raise ValueError(
            "model.classifier reads the last output flattened, one label per row; a model of token-level blocks "
            "has none: its last block's local head is the LM head (e.g. local_head='fused'). Remove model.classifier"
        )


def _rows(inputs: Tensor, first: DADLinear, device: torch.device, check_values: bool) -> Tensor:
    """``inputs`` on ``device`` as (batch, in_features) rows in the first layer's dtype, checked."""
    if inputs.dim() < 2 or inputs[0].numel() != first.in_features:
        single = " (one sample? add a batch dimension: inputs.unsqueeze(0))" if inputs.numel() == first.in_features else ""
        raise ValueError(
            f"inputs have shape {tuple(inputs.shape)}; expected (batch, {first.in_features}), or (batch, ...) with "
            f"{first.in_features} values per row, to match in_features={first.in_features}{single}"
        )
    x = inputs.to(device, non_blocking=True).reshape(inputs.shape[0], -1)
    if not x.dtype.is_floating_point:
        raise TypeError(f"inputs have dtype {inputs.dtype}; convert them with .float()")
    if x.dtype != first.weight.dtype:
        x = x.to(first.weight.dtype)
    check_inputs(x, first.in_features, check_values=check_values)
    return x


def reiterable(data: Any) -> bool:
    """Whether ``data`` can be read twice (e.g. a list, a pair of tensors or a ``DataLoader``; not a generator)."""
    return data is not None and iter(data) is not data


@torch.no_grad()
def classification_metrics(pairs: Iterable[tuple[Tensor, Tensor]], device: torch.device) -> dict[str, float]:
    """Accuracy, mean cross-entropy and the number of samples over ``(logits, labels)`` pairs.

    Token labels ``(batch, T)`` with logits ``(batch, T, vocab)`` count per labelled position (``-100``
    is ignored): token accuracy, the mean cross-entropy per token, and ``samples`` the number of tokens.
    """
    correct = torch.zeros((), device=device, dtype=torch.long)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    total = torch.zeros((), device=device, dtype=torch.long)
    for logits, labels in pairs:
        if labels.dim() > 1:  # one prediction per position
            logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = labels != IGNORE_INDEX
        correct += ((logits.argmax(1) == labels) & valid).sum()
        loss_sum += torch.nn.functional.cross_entropy(
            logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX
        ).double()
        total += valid.sum()
    count = int(total)
    if count == 0:
        raise ValueError("evaluate() got no batches (or no labelled position)")
    return {"accuracy": int(correct) / count, "loss": float(loss_sum) / count, "samples": float(count)}
