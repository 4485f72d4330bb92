"""Recipe options in the fused / graphed step against the eager step, and the dropout kernel against
its twin (GPU, or the Triton interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_kernels

pytestmark = requires_kernels

BACKENDS = ["fused"] + (["cuda-graph"] if DEVICE == "cuda" else [])
AMPS = [None] + ([torch.bfloat16] if DEVICE == "cuda" else [])
RECIPES = [
    ({"label_smoothing": 0.1}, 0.0), ({"activation": "leaky_relu"}, 0.0), ({"normalize": "layernorm"}, 0.0),
    ({"normalize": "batchnorm"}, 0.0), ({"local_loss": "predsim"}, 0.0), ({"local_loss": "drtp"}, 0.0),
    ({}, 0.3), ({"activation": "leaky_relu", "normalize": "batchnorm", "label_smoothing": 0.1}, 0.2),
]


class Net(td.DADModel):
    def __init__(self, mixed: bool, **kw):  # type: ignore[no-untyped-def]
        super().__init__()
        # with ``mixed`` the middle layer is plain (the local-error kernel) between two recipe layers
        middle = {} if mixed else kw
        self.layers = torch.nn.ModuleList([
            td.DADLinear(45, 33, num_classes=7, **kw), td.DADLinear(33, 19, num_classes=7, **middle),
            td.DADLinear(19, 21, num_classes=7, **kw),
        ])
        self.classifier = torch.nn.Linear(21, 7)


def _pair(backend, amp, kw, dropout, mixed=False):  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    ref, new = Net(mixed, **kw), Net(mixed, **kw)
    new.load_state_dict(ref.state_dict())
    common = {"device": DEVICE, "amp_dtype": amp, "dropout": dropout, "dropout_seed": 5, "on_nonfinite": "ignore"}
    fused = td.DADTrainer(new, backend=backend, **common)
    assert fused.uses_engine
    return td.DADTrainer(ref, backend="eager", **common), fused


def _assert_same_model(eager, fused, tol):  # type: ignore[no-untyped-def]
    for key, want in eager.state_dict()["model"].items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(fused.state_dict()["model"][key], want) <= 5 * tol, key


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", AMPS)
@pytest.mark.parametrize("kw, dropout", RECIPES)
@pytest.mark.parametrize("mixed", [False, True])
def test_recipe_step_matches_eager(backend, amp, kw, dropout, mixed):  # type: ignore[no-untyped-def]
    eager, fused = _pair(backend, amp, kw, dropout, mixed)
    tol = 1e-4 if amp is None else 3e-2
    for i in range(5):
        batch = 61 if i < 4 else 17  # a ragged last batch runs uncaptured
        x = torch.randn(batch, 45, device=DEVICE)
        y = torch.randint(0, 7, (batch,), device=DEVICE)
        l1, s1 = eager.step(x, y)
        l2, s2 = fused.step(x, y)
        assert relative_error(l2, l1) <= tol, i
        assert abs(float(s2) - float(s1)) <= tol * max(1.0, abs(float(s1)))
    _assert_same_model(eager, fused, tol)
    if backend == "cuda-graph":
        assert fused.engine.num_graphs == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphed_dropout_follows_a_resume_and_an_eager_step(backend):  # type: ignore[no-untyped-def]
    """The masks' step counter is a device tensor: a replay after ``load_state_dict`` (a new
    ``step_count``) or after steps the engine did not run draws the eager step's mask."""
    kw, dropout = RECIPES[-1]
    eager, fused = _pair(backend, None, kw, dropout)
    batches = [(torch.randn(61, 45, device=DEVICE), torch.randint(0, 7, (61,), device=DEVICE)) for _ in range(8)]
    for i, (x, y) in enumerate(batches):
        if i == 4:
            state = copy.deepcopy(eager.state_dict())
            fused.load_state_dict(state)
        if i == 6:  # one step through the eager loop of the same trainer (the guard routes it there)
            fused.on_nonfinite = "skip"
            fused.step(x, y)
            fused.on_nonfinite = "ignore"
        else:
            fused.step(x, y)
        eager.step(x, y)
    _assert_same_model(eager, fused, 1e-4)


@pytest.mark.parametrize("shape", [(1, 1), (61, 45), (3, 1029), (4097,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_kernel_matches_twin(shape, dtype):  # type: ignore[no-untyped-def]
    from torch_dad.ops.dropout import counter_dropout

    x = torch.randn(shape, device=DEVICE).to(dtype)
    # layer and seed 0 and 1 too: triton passes an int argument equal to 1 as a constexpr
    cases = [(step, 3, 2**40 + 9) for step in (0, 7, 2**33 + 1)] + [(5, layer, seed) for layer in (0, 1) for seed in (0, 1)]
    for step, layer, seed in cases:
        counter = torch.tensor(step, device=DEVICE)
        kernel = counter_dropout(x, 0.3, seed, counter, layer, backend="triton")
        twin = counter_dropout(x, 0.3, seed, counter, layer, backend="torch")
        assert kernel.dtype == dtype and torch.equal(kernel != 0, twin != 0), step
        if DEVICE == "cuda" or dtype == torch.float32:
            assert torch.equal(kernel, twin), step
        else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest
            assert torch.allclose(kernel.float(), twin.float(), rtol=2**-7, atol=0), step
