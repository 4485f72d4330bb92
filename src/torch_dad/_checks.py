"""Argument checks shared by every public entry point.

Each check returns the (normalised) value or raises ``TypeError``/``ValueError`` naming the
argument and the fix, before anything has changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "HALF_DTYPES",
    "check_bool",
    "check_choice",
    "check_device",
    "check_finite",
    "check_fraction",
    "check_inputs",
    "check_int",
    "check_labels",
    "check_num_classes",
    "check_positive_int",
    "gradients_are_finite",
]

#: the half-precision compute dtypes; their softmax and reductions run in float32
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


def check_int(name: str, value: object) -> int:
    """``value`` if it is an ``int`` (not a ``bool``), else ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an ``int >= 1`` (not a ``bool``), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def check_num_classes(value: object, name: str = "num_classes") -> int:
    """``value`` if it is an ``int >= 2`` (a classifier needs two classes), else ``ValueError``."""
    check_positive_int(name, value)
    assert isinstance(value, int)
    if value < 2:
        raise ValueError(f"{name}={value} must be >= 2")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_fraction(name: str, value: object, *, closed: bool = False, hint: str = "") -> float:
    """``float(value)`` if it is a number in ``[0, 1)`` (``[0, 1]`` when ``closed``), else ``ValueError``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    inside = number and (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0)  # type: ignore[operator]
    if not inside:
        interval = "[0, 1]" if closed else "[0, 1)"
        raise ValueError(f"{name}={value!r} must be a float in {interval}{hint}")
    return float(value)  # type: ignore[arg-type]


def check_choice(name: str, value: object, choices: Sequence[str], hint: str = "") -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` listing them."""
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} is not supported; choose one of {listed}{hint}")
    return value


def check_device(device: object) -> torch.device:
    """``torch.device(device)`` if it names a device this process can use, else ``ValueError``/``TypeError``.

    Checked before anything moves, so a missing GPU is reported as what was asked for and what
    is available rather than as torch's assertion from deep inside ``.to()``.
    """
    if isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device={device!r} is not a valid torch device string ({err}); use e.g. 'cpu' or 'cuda'") from None
    elif isinstance(device, torch.device):
        resolved = device
    else:
        raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")
    if resolved.type == "cuda":
        _check_cuda_device(device, resolved)
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={str(device)!r} was requested but MPS is not available (torch {torch.__version__}); use device='cpu'")
    return resolved


def _check_cuda_device(device: object, resolved: torch.device) -> None:
    """Raise ``ValueError`` unless CUDA is available and ``resolved.index`` (if any) is a visible GPU."""
    if not torch.cuda.is_available():
        build = "a build without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build, no GPU visible"
        raise ValueError(
            f"device={str(device)!r} was requested but CUDA is not available (torch {torch.__version__}, {build}); "
            "use device='cpu'"
        )
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(
            f"device={str(device)!r} was requested but only {count} CUDA device(s) are visible "
            f"(cuda:0 to cuda:{count - 1}); pick one of those"
        )


def check_labels(
    target: Tensor,
    batch: int,
    num_classes: int,
    *,
    check_values: bool = True,
    ignore_index: int | None = None,
) -> None:
    """Raise unless ``target`` is (batch,) integer class ids in ``[0, num_classes)``.

    With ``ignore_index`` entries equal to it are allowed too. ``check_values`` reads the
    values (one host sync on CUDA); shape and dtype are always checked.
    """
    if not isinstance(target, Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class ids, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"labels have dtype {target.dtype}; pass integer class ids (e.g. labels.long())")
    if target.dim() != 1 or target.shape[0] != batch:
        raise ValueError(
            f"labels have shape {tuple(target.shape)} but the batch has {batch} rows; "
            f"pass one class id per row, shape ({batch},)"
        )
    if not (check_values and target.numel()):
        return
    bad = (target < 0) | (target >= num_classes)
    if ignore_index is not None:
        bad &= target != ignore_index
    if bool(bad.any()):
        wrong = target[bad]
        allowed = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ValueError(
            f"labels must lie in [0, {num_classes}) (num_classes={num_classes}){allowed}; "
            f"got values in [{int(wrong.min())}, {int(wrong.max())}]"
        )


def check_inputs(inputs: Tensor, in_features: int, *, check_values: bool = True, name: str = "inputs") -> None:
    """Raise unless ``inputs`` is a non-empty floating (batch, in_features) tensor (finite if checked)."""
    if not isinstance(inputs, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inputs).__name__}")
    if not inputs.dtype.is_floating_point:
        raise TypeError(f"{name} have dtype {inputs.dtype}; convert them with .float()")
    if inputs.dim() != 2 or inputs.shape[1] != in_features:
        raise ValueError(
            f"{name} have shape {tuple(inputs.shape)}; expected (batch, {in_features}) "
            f"to match in_features={in_features}"
        )
    if inputs.shape[0] == 0:
        raise ValueError(f"{name} are an empty batch; pass at least one row")
    if check_values:
        check_finite(inputs, name)


def check_finite(inputs: Tensor, name: str = "inputs") -> None:
    """Raise ``ValueError`` if ``inputs`` (a floating tensor of any shape) holds a NaN or Inf."""
    # a NaN/Inf anywhere makes the sum non-finite: one reduction, cheaper than isfinite().all() (docs/design-cpu-step.md)
    if not bool(torch.isfinite(inputs.sum())) and not bool(torch.isfinite(inputs).all()):
        raise ValueError(f"{name} contain NaN or Inf; clean the data before training")


def gradients_are_finite(grads: Sequence[Tensor]) -> bool:
    """``all(isfinite(g).all() for g in grads)``, via one sum per gradient (NaN/Inf propagate)."""
    total = torch.stack([g.float().sum() for g in grads]).sum()
    if bool(torch.isfinite(total)):
        return True
    # a finite but huge gradient can overflow the sum: confirm elementwise before failing
    return all(bool(torch.isfinite(g).all()) for g in grads)
