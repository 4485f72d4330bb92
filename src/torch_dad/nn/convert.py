"""``to_dad``: swap every ``nn.Linear`` of an existing model for a :class:`DADAutogradLinear` with its role.

The last ``nn.Linear`` (in ``model.modules()`` order) is the classifier and becomes a head
(``role="head"``: its local loss is the task loss, so its gradient is backprop's). Every other
one becomes a hidden layer with its own local head over ``num_classes``. A hidden layer's local
head reads the layer's activation, so an activation module that follows the layer in an
``nn.Sequential`` (``ReLU``, ``Tanh``, ``GELU``) moves into the layer and its slot becomes
``nn.Identity``: the model computes the same function.

The converted classifier trains on the cross-entropy of its own output, so a ``Softmax`` or
``LogSoftmax`` module after it (a second softmax under ``F.cross_entropy``) gets a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from .._checks import check_num_classes
from .autograd import DADAutogradLinear

__all__ = ["to_dad"]

# activation modules a converted layer can take over (exact GELU only: functional's is the erf form)
_ACTIVATIONS: dict[type[nn.Module], str] = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.GELU: "gelu"}
_OWN_ARGUMENTS = ("role", "num_classes", "activation", "in_features", "out_features", "bias")


def _activation_of(module: nn.Module | None) -> str | None:
    """The ``DADAutogradLinear`` activation equal to ``module`` (``None`` if there is none)."""
    name = _ACTIVATIONS.get(type(module)) if module is not None else None
    if isinstance(module, nn.GELU) and module.approximate != "none":
        return None
    return name


def _following(model: nn.Module) -> dict[int, list[tuple[nn.Sequential, int]]]:
    """``id(linear) -> [(sequential, index of the activation module after it)]`` for every
    ``nn.Linear`` of ``model`` that a supported activation module follows directly in every
    place it is registered (an ``nn.Sequential`` slot), with the same activation each time."""
    slots: dict[int, list[tuple[nn.Module, int]]] = {}
    for parent in model.modules():
        children = list(parent._modules.values())  # a layer registered twice has two slots
        for i, child in enumerate(children):
            if type(child) is nn.Linear:
                slots.setdefault(id(child), []).append((parent, i + 1))
    found: dict[int, list[tuple[nn.Sequential, int]]] = {}
    for key, places in slots.items():
        names = {
            _activation_of(list(p._modules.values())[i]) if isinstance(p, nn.Sequential) and i < len(p) else None
            for p, i in places
        }
        if len(names) == 1 and None not in names:
            found[key] = [(p, i) for p, i in places if isinstance(p, nn.Sequential)]
    return found


def _plan(
    model: nn.Module, num_classes: int, layer_kwargs: dict[str, Any]
) -> tuple[dict[int, DADAutogradLinear], list[tuple[nn.Sequential, int]]]:
    """``(id(linear) -> its replacement, the activation slots they take over)``; raises before any change."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears and any(isinstance(m, DADAutogradLinear) for m in model.modules()):
        raise ValueError(
            f"to_dad: the {type(model).__name__} is already converted (it holds DADAutogradLinear layers and no "
            "torch.nn.Linear); use it as it is, or call to_dad on a model with nn.Linear layers"
        )
    if not linears:
        raise ValueError(
            f"to_dad found no torch.nn.Linear in the {type(model).__name__} to convert; pass the model that holds "
            "the nn.Linear layers (nn.Linear subclasses are left as they are)"
        )
    classifier = linears[-1]
    if classifier.out_features != num_classes:
        raise ValueError(
            f"the last nn.Linear of the model, the classifier, has out_features={classifier.out_features} but "
            f"num_classes={num_classes}; pass num_classes={classifier.out_features} if it has that many classes, "
            "or end the model with an nn.Linear(..., num_classes)"
        )
    following = _following(model)
    plan: dict[int, DADAutogradLinear] = {}
    taken_over: list[tuple[nn.Sequential, int]] = []
    for linear in linears[:-1]:
        places = following.get(id(linear), [])
        activation = str(_activation_of(places[0][0][places[0][1]])) if places else "identity"
        taken_over += places
        kwargs = {**layer_kwargs, "role": "hidden", "num_classes": num_classes, "activation": activation}
        plan[id(linear)] = DADAutogradLinear.from_linear(linear, **kwargs)
    plan[id(classifier)] = DADAutogradLinear.from_linear(classifier, role="head", **layer_kwargs)
    return plan, taken_over


def _warn_on_final_softmax(model: nn.Module) -> None:
    """A ``UserWarning`` for each ``Softmax``/``LogSoftmax`` module after the classifier (the last ``nn.Linear``)."""
    names = {id(m): name for name, m in model.named_modules()}
    classifier = [m for m in model.modules() if type(m) is nn.Linear][-1]
    after = list(model.modules())
    for module in after[after.index(classifier) + 1 :]:
        if isinstance(module, (nn.Softmax, nn.LogSoftmax)):
            kind, name = type(module).__name__, names[id(module)]
            warnings.warn(
                f"to_dad: {name!r} ({kind}) comes after the classifier {names[id(classifier)]!r} (the last "
                "nn.Linear). The converted classifier trains on the cross-entropy of its own output, the logits, "
                "and F.cross_entropy on the model's output would apply a softmax a second time. Remove "
                f"{name!r} from the model and apply {kind.lower()} only where (log-)probabilities are needed.",
                UserWarning,
                stacklevel=3,
            )


def to_dad(model: nn.Module, num_classes: int, **layer_kwargs: Any) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`DADAutogradLinear`; return ``model``.

    ``DADAutogradLinear.from_linear(linear, ...)`` keeps each layer's weights, device, dtype and
    ``requires_grad``. The last ``nn.Linear`` (``model.modules()`` order) is the classifier: it
    must have ``out_features == num_classes`` and becomes ``role="head"``. The others become
    ``role="hidden"`` with a local head over ``num_classes`` and the activation of the
    ``ReLU``/``Tanh``/``GELU`` module that follows them in an ``nn.Sequential`` (that module is
    replaced by ``nn.Identity``), else ``"identity"`` (an activation applied in a custom
    ``forward`` stays there; the local head then reads the pre-activation). ``layer_kwargs``
    (``update``, ``lr``, ``backprop_gradients``, ...) go to every layer. Subclasses of
    ``nn.Linear`` are left alone. On any error the model is unchanged. A model that is already
    converted raises ``ValueError``; a ``Softmax``/``LogSoftmax`` module after the classifier warns.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise TypeError(
            "to_dad converts the nn.Linear layers inside a model; for one layer use "
            "DADAutogradLinear.from_linear(linear, num_classes=...)"
        )
    check_num_classes(num_classes)
    taken = sorted(k for k in layer_kwargs if k in _OWN_ARGUMENTS)
    if taken:
        raise TypeError(
            f"to_dad sets {', '.join(taken)} itself (from each nn.Linear and its place in the model); "
            "do not pass them, or build that DADAutogradLinear by hand"
        )
    plan, taken_over = _plan(model, num_classes, layer_kwargs)
    _warn_on_final_softmax(model)
    for parent in list(model.modules()):
        # _modules, not named_children(): a layer registered twice in one parent has two slots
        for name, child in list(parent._modules.items()):
            if id(child) in plan:
                setattr(parent, name, plan[id(child)])
    for sequential, index in taken_over:
        sequential[index] = nn.Identity()
    return model
