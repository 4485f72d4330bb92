"""``DADTrainer(backend=...)`` on CPU: validation, the fused step's PyTorch twins vs eager, lean import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error


class Net(td.DADModel):
    def __init__(self, activation: str = "relu") -> None:
        super().__init__()
        self.a = td.DADLinear(23, 19, num_classes=5, activation=activation)
        self.b = td.DADLinear(19, 13, num_classes=5, activation=activation)
        self.classifier = torch.nn.Linear(13, 5)


def test_unknown_backend_raises_naming_it():
    with pytest.raises(ValueError, match="backend='gpu'"):
        td.DADTrainer(Net(), backend="gpu")


def test_cuda_graph_on_cpu_and_unsupported_models_raise():
    with pytest.raises(ValueError, match="cuda-graph.*CUDA"):
        td.DADTrainer(Net(), device="cpu", backend="cuda-graph")
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        td.DADTrainer(Net(), backend="fused", optimizer="sgd")
    with pytest.raises(ValueError, match="master weights in torch.float64"):
        td.DADTrainer(Net().double(), backend="fused")


def test_fused_backend_with_nonfinite_guard_warns_and_runs_eager():
    with pytest.warns(UserWarning, match="on_nonfinite='raise'.*eager"):
        trainer = td.DADTrainer(Net(), backend="fused")  # CPU: value checks on, guard "raise"
    # the runner is picked once: the guarded eager loop, and no engine is built beside it
    assert trainer.engine is None and not trainer.uses_engine


def test_auto_on_cpu_is_eager():
    assert td.DADTrainer(Net(), backend="auto").engine is None


class _IdentityReducer:
    """A one-process gradient reducer: exercises the engine's all-reduce path (every local head
    and the classifier in one fused AdamW, each layer's update one layer late) on CPU."""

    def launch(self, grads):  # type: ignore[no-untyped-def]
        return None, [g.clone() for g in grads]

    def __call__(self, grads):  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("chunked", [False, True, 2, "reducer"])
@pytest.mark.parametrize("amp,tol", [(None, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_cpu_step_matches_eager(amp, tol, chunked):
    from torch_dad.training import EngineOptions

    options = None
    if chunked is True:  # every layer's weight gradient and AdamW in row blocks (19 and 13 rows: ragged)
        options = EngineOptions(update_chunk_numel=1)
    elif chunked == 2:  # 2 blocks, the default above 2048 rows
        options = EngineOptions(update_chunk_numel=1, update_chunks=2)
    torch.manual_seed(0)
    ref, new = Net(), Net()
    new.load_state_dict(ref.state_dict())
    eager = td.DADTrainer(ref, backend="eager", amp_dtype=amp)
    # on CPU the non-finite guard defaults to "raise", which only the eager layer loop runs
    fused = td.DADTrainer(new, backend="fused", amp_dtype=amp, on_nonfinite="ignore", engine_options=options)
    if chunked == "reducer":
        eager.set_reducers(_IdentityReducer())
        fused.set_reducers(_IdentityReducer())
    assert fused.uses_engine
    for _ in range(4):
        x, y = torch.randn(37, 23), torch.randint(0, 5, (37,))
        l1, s1 = eager.step(x, y)
        l2, s2 = fused.step(x, y)
        assert relative_error(l2, l1) <= tol
        assert abs(float(s1) - float(s2)) <= tol
    for key, want in eager.state_dict()["model"].items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(fused.state_dict()["model"][key], want) <= 5 * tol, key
    with pytest.raises(ValueError, match="labels"):
        fused.step(torch.randn(4, 23), torch.tensor([0, 1, 2, 9]))
    assert fused.step_count == 4
    assert abs(fused.running_loss - eager.running_loss) <= tol


def test_update_chunks_default_depends_on_batch():
    from torch_dad.training import EngineOptions

    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore").engine
    small = EngineOptions().small_batch
    assert fused.options.update_chunks is None
    assert fused.update_chunks(1) == fused.update_chunks(small) == 4
    assert fused.update_chunks(small + 1) == 2
    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore", engine_options=EngineOptions(update_chunks=3)).engine
    assert fused.update_chunks(1) == fused.update_chunks(10**6) == 3


def test_stream_priorities_default_depends_on_layer_size():
    from torch_dad.training import EngineOptions

    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore").engine
    assert fused.options.stream_priorities is None and fused.stream_priorities()
    largest = max(layer.weight.numel() for layer in fused.model.dad_layers)
    # now one layer updates in row blocks
    options = EngineOptions(update_chunk_numel=largest)
    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore", engine_options=options).engine
    assert not fused.stream_priorities()
    options = EngineOptions(update_chunk_numel=largest, stream_priorities=True)
    fused = td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore", engine_options=options).engine
    assert fused.stream_priorities()


@pytest.mark.parametrize("kwargs,match", [
    ({"update_chunk_numel": 0}, "update_chunk_numel"), ({"update_chunks": 0}, "update_chunks"),
    ({"max_graphs": 1.5}, "max_graphs"),
])
def test_engine_options_reject_bad_values(kwargs, match):
    from torch_dad.training import EngineOptions

    with pytest.raises(ValueError, match=match):
        EngineOptions(**kwargs)


def test_engine_options_need_an_engine_and_the_right_type():
    with pytest.raises(ValueError, match="engine_options"):
        td.DADTrainer(Net(), backend="eager", engine_options=object())
    with pytest.raises(TypeError, match="EngineOptions"):
        td.DADTrainer(Net(), backend="fused", on_nonfinite="ignore", engine_options={"overlap": False})


@pytest.mark.slow
def test_import_does_not_import_triton_or_engine():
    code = "import sys, torch_dad; print('triton' in sys.modules, 'torch_dad.training.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
