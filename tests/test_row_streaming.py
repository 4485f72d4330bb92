"""Row-streamed local steps of ``DADLinear``: the same output, loss and gradients as the whole batch at once, the
output written over a dead input, and what that leaves alive during a trainer's step."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import torch_dad as td
from torch_dad import functional
from torch_dad.nn import linear as linear_module
from torch_dad.nn.linear import DADLinear, stream_rows


@pytest.fixture
def streamed(monkeypatch):
    """Every local step streams, in blocks of ``rows`` rows (set through the returned function)."""

    def set_block(rows: int, cols: int, itemsize: int = 8) -> None:
        monkeypatch.setattr(linear_module, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(linear_module, "STREAM_BLOCK_BYTES", rows * cols * itemsize)

    return set_block


def test_stream_rows_rule():
    assert stream_rows(16384, 4096, 2) == 1024          # 128 MiB of bf16 output: blocks of 8 MiB
    assert stream_rows(8192, 4096, 2) is None           # 64 MiB: one block
    assert stream_rows(16384, 4096, 4) == 512
    assert stream_rows(10, 2**22, 4) == 1               # a row larger than a block: one row at a time


@pytest.mark.parametrize("activation", ["relu", "tanh", "gelu", "leaky_relu"])
@pytest.mark.parametrize("bias, normalize, smoothing", [(True, None, 0.0), (False, None, 0.1), (True, "layernorm", 0.0)])
def test_streamed_step_equals_the_float64_reference(streamed, activation, bias, normalize, smoothing):
    torch.manual_seed(0)
    n, d_in, d_out, classes = 37, 13, 11, 5
    layer = DADLinear(d_in, d_out, classes, bias=bias, activation=activation, normalize=normalize,
                      label_smoothing=smoothing, dtype=torch.float64)
    x, y = torch.randn(n, d_in, dtype=torch.float64), torch.randint(0, classes, (n,))
    streamed(8, d_out)  # 5 blocks, the last of 5 rows
    result, grads = layer.local_gradients(x, y)
    ref = functional.local_loss_and_gradients(x, layer.weight, layer.bias, layer.head_weight, layer.head_bias, y,
                                              activation, label_smoothing=smoothing, normalize=normalize)
    expected = [ref.grad_weight, *([ref.grad_bias] if bias else []), ref.grad_head_weight, ref.grad_head_bias]
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.output, ref.output, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.logits, ref.logits, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.loss, ref.loss, rtol=1e-12, atol=0)


def test_streamed_output_is_written_over_a_dead_input(streamed):
    torch.manual_seed(1)
    layer = DADLinear(16, 16, 4, dtype=torch.float64)
    x, y = torch.randn(21, 16, dtype=torch.float64), torch.randint(0, 4, (21,))
    whole, whole_grads = layer.local_gradients(x, y)
    streamed(4, 16)
    kept, kept_grads = layer.local_gradients(x, y)  # reuse_input=False: x stays as it was
    assert kept.output.data_ptr() != x.data_ptr()
    overwritten = x.clone()
    result, grads = layer.local_gradients(overwritten, y, reuse_input=True)
    assert result.output.data_ptr() == overwritten.data_ptr()
    for out, g in ((kept.output, kept_grads), (result.output, grads)):
        torch.testing.assert_close(out, whole.output, rtol=1e-12, atol=1e-14)
        for a, b in zip(g, whole_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # another width, or another dtype, gets a new output
    wider = DADLinear(16, 24, 4, dtype=torch.float64)
    assert wider.local_gradients(x.clone(), y, reuse_input=True)[0].output.shape == (21, 24)
    half = layer.local_gradients(x.clone(), y, torch.float32, reuse_input=True)[0].output
    assert half.dtype == torch.float32


def test_batch_norm_and_other_rules_never_stream(streamed):
    # batch statistics and predsim's batch x batch similarity need every row at once
    streamed(4, 8)
    torch.manual_seed(2)
    x, y = torch.randn(19, 8, dtype=torch.float64), torch.randint(0, 3, (19,))
    for kwargs in ({"normalize": "batchnorm"}, {"local_loss": "predsim"}):
        layer = DADLinear(8, 8, 3, dtype=torch.float64, **kwargs)
        result = layer.local_gradients(x.clone(), y, reuse_input=True)[0]
        ref = functional.local_loss_and_gradients(
            x, layer.weight, layer.bias, layer.head_weight, layer.head_bias, y, local_loss=layer.local_loss,
            normalize=layer.normalize, norm_weight=getattr(layer, "norm_weight", None),
            norm_bias=getattr(layer, "norm_bias", None))
        torch.testing.assert_close(result.loss, ref.loss, rtol=1e-12, atol=0)


class _MLP(td.DADModel):
    def __init__(self, widths, classes):
        super().__init__()
        self.layers = nn.ModuleList(DADLinear(a, b, classes, dtype=torch.float64) for a, b in zip(widths, widths[1:]))
        self.classifier = nn.Linear(widths[-1], classes, dtype=torch.float64)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_trainer_steps_are_the_same_streamed(monkeypatch, dropout):
    torch.manual_seed(3)
    models = [_MLP([12, 16, 16, 16, 9], 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(50, 12, dtype=torch.float64), torch.randint(0, 4, (50,))
    for index, model in enumerate(models):
        if index == 1:
            monkeypatch.setattr(linear_module, "STREAM_MIN_BYTES", 0)
            monkeypatch.setattr(linear_module, "STREAM_BLOCK_BYTES", 7 * 16 * 8)
        trainer = td.DADTrainer(model, torch.device("cpu"), backend="torch", dropout=dropout)
        for _ in range(3):
            trainer.step(x.clone(), y)
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


class _LiveBytes(TorchDispatchMode):
    """The most bytes of storage that the ops run under it made and Python still held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.holders: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views, in-place and out= ops hand back storage that existed before the op
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().data_ptr() in given | {0}:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self.sizes:
                self.sizes[key], self.holders[key] = storage.nbytes(), 0
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self.holders[key] += 1
            weakref.finalize(tensor, self._release, key)
        return out


def _step_peak(widths, batch, backend, classes=10):
    torch.manual_seed(4)
    model = _MLP(widths, classes).float()
    # no input sample: its reservoir (static state) would be allocated in the first step measured here;
    # on_nonfinite="ignore" (the CUDA default) applies each layer's update at once, as on a GPU
    trainer = td.DADTrainer(model, torch.device("cpu"), backend=backend, accumulate_classifier_statistics=False,
                            classifier_sample_size=0, on_nonfinite="ignore")
    x, y = torch.randn(batch, widths[0]), torch.randint(0, classes, (batch,))
    tracker = _LiveBytes()
    with tracker:  # from the first step: the CPU runners keep per-layer workspaces from there on
        for _ in range(2):
            trainer.step(x, y)
    return tracker.peak


@pytest.mark.parametrize("backend", ["torch", "triton"])  # the eager loop; the engine op by op (its CPU twins)
def test_streamed_step_holds_one_activation(monkeypatch, backend):
    # 4 layers of 256 at 4096 rows, float32: one activation is 4 MiB, a weight gradient 0.25 MiB
    widths, batch = [256] * 5, 4096
    activation = batch * 256 * 4
    whole = _step_peak(widths, batch, backend)
    block, weight_gradient, logits = activation // 16, 256 * 256 * 4, batch * 10 * 4
    monkeypatch.setattr(linear_module, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(linear_module, "STREAM_BLOCK_BYTES", block)  # as 8 MiB blocks of a 128 MiB activation
    rows = _step_peak(widths, batch, backend)
    # the whole batch holds a layer's input, its output and its error at once (on a CPU also workspaces);
    # streamed, one activation, one weight gradient, a few blocks' temporaries and the local logits
    assert whole >= 3 * activation
    assert rows <= activation + weight_gradient + 5 * block + 2 * logits, (rows / activation, whole / activation)
