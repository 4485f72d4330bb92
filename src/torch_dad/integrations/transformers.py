"""HuggingFace ``transformers``: DAD classification heads that train inside the stock ``Trainer``.

``replace_head(model)`` swaps the classifier of an ``AutoModelForSequenceClassification`` for a
:class:`~torch_dad.DADAutogradLinear` initialised from the old weights and routes the ``labels``
keyword of every ``model(...)`` call to it, so ``Trainer`` runs with no changes.
``fit_head_closed_form(model, loader)`` instead solves the head by ridge regression in one
no-grad pass. Needs ``pip install torch-dad[hf]``; ``transformers`` itself is imported lazily.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import check_labels, check_num_classes
from ..nn.autograd import DADAutogradLinear
from ..ridge import GramAccumulator, RidgeSolution

__all__ = ["KNOWN_HEADS", "find_head", "fit_head_closed_form", "install_label_routing", "replace_head"]

# Where sequence-classification models keep their final projection. RoBERTa's
# `classifier` is a block (dense -> tanh -> out_proj), so its nested name is tried first.
KNOWN_HEADS: tuple[str, ...] = ("classifier.out_proj", "classifier", "score")
_HOOK_ATTR = "_torch_dad_label_hook"
_LABEL_PROBLEMS = (None, "single_label_classification")


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name]


def _num_labels(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, "num_labels", None)
    return value if isinstance(value, int) else None


def find_head(model: nn.Module, head_name: str | None = None) -> str:
    """Dotted name of the classification head: ``head_name`` if given, else the first of
    :data:`KNOWN_HEADS` that is an ``nn.Linear`` (or a DAD head) in ``model``.

    Raises ``ValueError`` listing the model's ``nn.Linear`` modules when none is found.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    names = [head_name] if head_name is not None else list(KNOWN_HEADS)
    for name in names:
        if isinstance(modules.get(name), (nn.Linear, DADAutogradLinear)):
            return name
    linears = _linear_names(model)
    num_labels = _num_labels(model)
    likely = [n for n in linears if num_labels is not None and modules[n].out_features == num_labels]  # type: ignore[union-attr]
    hint = f"; most likely (out_features == num_labels={num_labels}): {likely}" if likely else ""
    if head_name is not None:
        raise ValueError(
            f"head_name={head_name!r} is not an nn.Linear in {type(model).__name__}; "
            f"its nn.Linear modules are {linears}{hint}"
        )
    raise ValueError(
        f"could not find the classification head of {type(model).__name__}: none of {list(KNOWN_HEADS)} "
        f"is an nn.Linear. Pass head_name= one of its nn.Linear modules: {linears}{hint}"
    )


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _labels_from_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The ``labels`` argument of ``module.forward(*args, **kwargs)``, by keyword or position."""
    if "labels" in kwargs:
        return kwargs["labels"]
    if args:
        params = list(inspect.signature(module.forward).parameters)
        if "labels" in params:
            position = params.index("labels")
            if position < len(args):
                return args[position]
    return None


def _route_labels(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: ``set_y_context(labels)`` on every DAD layer of ``module``."""
    labels = _labels_from_call(module, args, kwargs)
    layers = [m for m in module.modules() if isinstance(m, DADAutogradLinear)]
    if (
        labels is None
        and module.training
        and torch.is_grad_enabled()
        and any(layer.weight.requires_grad for layer in layers)
    ):
        raise ValueError(
            f"{type(module).__name__} has a DAD head, which needs labels in training: call "
            "model(..., labels=labels) (with Trainer keep a 'labels' column in the dataset, or set "
            "TrainingArguments(label_names=[...])); for inference use model.eval() or torch.no_grad()"
        )
    for layer in layers:
        layer.set_y_context(labels)


def install_label_routing(model: nn.Module) -> None:
    """Make ``model(..., labels=y)`` call ``set_y_context(y)`` on each of its DAD layers first.

    A forward pre-hook with keyword arguments on ``model``; no wrapper class, so ``Trainer``,
    ``save_pretrained`` and PEFT see the original model. Installing twice is a no-op.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _HOOK_ATTR, None) is None:
        handle = model.register_forward_pre_hook(_route_labels, with_kwargs=True)
        object.__setattr__(model, _HOOK_ATTR, handle)


def replace_head(
    model: nn.Module,
    *,
    head_name: str | None = None,
    num_labels: int | None = None,
    update: str = "grad",
    precondition: str | None = None,
    backprop_gradients: bool = False,
    **layer_kwargs: Any,
) -> DADAutogradLinear:
    """Swap ``model``'s classification head for a DAD head with the same weights; return it.

    ``head = DADAutogradLinear.from_linear(old, num_classes=num_labels, role="head", ...)``,
    then :func:`install_label_routing`. ``update="grad"`` (the default) writes the head's
    gradient into ``.grad``, so ``Trainer``'s optimizer, LR schedule, gradient accumulation,
    clipping, checkpointing and DDP apply unchanged; ``precondition="gram"`` makes it the
    stochastic Newton step ``B / (C + (d+1)/2) (g + rho W) @ M^-1`` (running Gram ``M`` of the head's inputs,
    summed softmax curvature ``C``; see :mod:`torch_dad.nn.precondition`), whose norm at lr 1 is
    O(1): pair it with plain SGD at lr 1 (``TrainingArguments(optim="sgd", learning_rate=1.0)``;
    the default clipping at 1.0 may stay), or use ``update="inplace"``, whose SGD step defaults to
    ``lr=1.0`` here.
    Other keywords go to :class:`~torch_dad.DADAutogradLinear`.
    """
    name = find_head(model, head_name)
    old = model.get_submodule(name)
    if isinstance(old, DADAutogradLinear):
        raise ValueError(f"{name!r} is already a DAD head ({old!r}); replace_head once per model")
    assert isinstance(old, nn.Linear)
    config_labels = _num_labels(model)
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    if problem not in _LABEL_PROBLEMS:
        raise ValueError(
            f"config.problem_type={problem!r}: a DAD head learns single-label classification "
            "(cross-entropy on integer labels); regression and multi-label heads are not supported"
        )
    if num_labels is None:
        num_labels = old.out_features
    check_num_classes(num_labels, "num_labels")
    if num_labels != old.out_features or (config_labels is not None and num_labels != config_labels):
        raise ValueError(
            f"num_labels={num_labels} but the model's head {name!r} has {old.out_features} outputs "
            f"(config.num_labels={config_labels}); load the model with "
            f"from_pretrained(..., num_labels={num_labels}) so the head and the loss agree"
        )
    if "num_classes" in layer_kwargs and layer_kwargs["num_classes"] != num_labels:
        raise ValueError(
            f"num_classes={layer_kwargs['num_classes']} differs from num_labels={num_labels}; "
            "a DAD head's classes are the model's labels"
        )
    layer_kwargs.pop("num_classes", None)
    if precondition is not None and update == "inplace":
        layer_kwargs.setdefault("lr", 1.0)  # an in-place preconditioned step is SGD at lr ~1
        # its L2 term is already in the step (rho in torch_dad.nn.precondition): no decay on top
        layer_kwargs.setdefault("weight_decay", 0.0)
    head = DADAutogradLinear.from_linear(
        old,
        num_labels,
        role="head",
        update=update,
        backprop_gradients=backprop_gradients,
        precondition=precondition,
        **layer_kwargs,
    )
    # the new head is what trains, even if the old one was frozen (e.g. by get_peft_model)
    head.requires_grad_(True)
    head.train(old.training)
    _set_module(model, name, head)
    install_label_routing(model)
    return head


def _split_batch(batch: Any) -> tuple[dict[str, Any], Tensor]:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"fit_head_closed_form expects batches that are dicts of model inputs with 'labels' "
            f"(what a Trainer data collator yields), got {type(batch).__name__}"
        )
    inputs = dict(batch)
    labels = inputs.pop("labels", None)
    if labels is None:
        labels = inputs.pop("label", None)
    if not isinstance(labels, Tensor):
        raise ValueError(
            f"a batch has no 'labels' tensor (keys: {sorted(batch)}); the closed-form head needs the labels"
        )
    return inputs, labels


@torch.no_grad()
def fit_head_closed_form(
    model: nn.Module,
    dataloader: Iterable[Any],
    lambda_reg: float | str = "auto",
    *,
    head_name: str | None = None,
    device: torch.device | str | None = None,
) -> RidgeSolution:
    """Solve the classification head by ridge regression on one-hot labels in one no-grad pass.

    With ``H`` the head's inputs over ``dataloader`` (model in ``eval()``: no dropout) and ``Y``
    one-hot labels: ``W^T = (Hc^T Hc + lambda I)^-1 Hc^T Yc``, ``b = mean(Y) - W mean(H)``
    (:class:`torch_dad.GramAccumulator`, float64; ``"auto"`` picks lambda by GCV), copied into the
    head (an ``nn.Linear`` or a DAD head). The model's weights change only if the solve succeeds.
    """
    name = find_head(model, head_name)
    head = model.get_submodule(name)
    assert isinstance(head, (nn.Linear, DADAutogradLinear))
    num_classes = head.out_features
    if num_classes < 2:
        raise ValueError(f"the head {name!r} has {num_classes} output; the closed form needs >= 2 classes")
    if head.bias is None:
        raise ValueError(f"the head {name!r} has no bias; the ridge intercept needs one")
    run_device = torch.device(device) if device is not None else head.weight.device
    stats = GramAccumulator(head.in_features, num_classes, device=run_device)
    captured: list[Tensor] = []

    def grab(_module: nn.Module, args: tuple[Any, ...]) -> None:
        captured.append(args[0])

    handle = head.register_forward_pre_hook(grab)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        for batch in dataloader:
            inputs, labels = _split_batch(batch)
            inputs = {k: v.to(run_device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
            labels = labels.to(run_device)
            captured.clear()
            model(**inputs)
            if len(captured) != 1:
                raise ValueError(
                    f"the head {name!r} ran {len(captured)} times in one forward; pass head_name= the final "
                    "classification layer"
                )
            features = captured[0].reshape(-1, head.in_features)
            check_labels(labels.reshape(-1), features.shape[0], num_classes)
            stats.update(features, labels.reshape(-1).long())
        if stats.num_samples == 0:
            raise ValueError("dataloader yielded no batches; pass the training data loader")
        solution = stats.solve(lambda_reg)
    finally:
        handle.remove()
        for module, mode in modes.items():
            module.training = mode
    head.weight.copy_(solution.weight.to(head.weight.dtype))
    head.bias.copy_(solution.bias.to(head.bias.dtype))  # type: ignore[union-attr]
    return solution
