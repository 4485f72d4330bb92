"""Every ``backend`` name in the source comes from one vocabulary, :data:`torch_dad.backends.BACKENDS`."""

import ast
import importlib
from pathlib import Path

import pytest

import torch_dad as td
from torch_dad.backends import BACKENDS, RENAMED, check_backend

SOURCE = Path(td.__file__).resolve().parent


def _is_backend_name(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "backend" in name.lower()


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def backend_names_in_source() -> dict[str, set[str]]:
    """Each string a backend is compared with, passed as, or listed in a ``*BACKENDS*`` tuple: where it appears."""
    found: dict[str, set[str]] = {}
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Assign) and any(_is_backend_name(t) and "BACKENDS" in ast.unparse(t) for t in node.targets):
                names = _strings(node.value)
            elif isinstance(node, ast.Compare) and _is_backend_name(node.left):
                names = [s for comparator in node.comparators for s in _strings(comparator)]
            elif isinstance(node, ast.Call) and not ast.unparse(node.func).startswith("dist."):
                # torch.distributed's process-group backends (gloo, nccl) are its own vocabulary
                names = [s for k in node.keywords if k.arg == "backend" for s in _strings(k.value)]
            for name in names:
                found.setdefault(name, set()).add(f"{path.relative_to(SOURCE)}:{node.lineno}")
    return found


def test_every_backend_name_in_the_source_is_in_the_vocabulary():
    found = backend_names_in_source()
    assert {"torch", "triton", "auto"} <= set(found)  # the scan does see the names
    strays = {name: sorted(where) for name, where in found.items() if name not in BACKENDS}
    assert not strays, f"backend names outside torch_dad.backends.BACKENDS: {strays}"


def test_former_names_map_into_the_vocabulary():
    assert set(RENAMED.values()) <= set(BACKENDS)
    assert check_backend("eager", ("auto", "torch")) == "torch"
    assert check_backend("fused", ("triton",)) == "triton"
    with pytest.raises(ValueError, match="backend='cuda'"):
        check_backend("cuda", ("auto", "torch"))


@pytest.mark.parametrize("module", ["torch_dad.training.trainer", "torch_dad.nn.autograd", "torch_dad.ops.linear_cross_entropy"])
def test_each_component_accepts_a_subset(module):
    assert set(importlib.import_module(module).BACKENDS) <= set(BACKENDS)
