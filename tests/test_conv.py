"""DADConv2d and DADBlock: closed-form conv gradients against the float64 oracle and torch autograd,
block-local autograd, and conv / residual-block models through the trainer, the fused engine,
solve_head, state_dict and checkpoints."""

from __future__ import annotations

import functools

import pytest
import torch

import torch_dad as td
from torch_dad import functional
from torch_dad.training import engine

from .conftest import relative_error

CLASSES = 4
# bf16 rounds the input, weights and every intermediate (8 bits of mantissa)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}


def _conv_layer(dtype=torch.float64, **kwargs):
    options = {"stride": 2, "padding": 1, "num_classes": CLASSES, "dtype": dtype, **kwargs}
    return td.DADConv2d(3, 7, 3, **options)


def _batchnorm_layer(**kwargs):
    """A float64 conv layer with batch norm, its affine terms away from the 1 / 0 initialisation."""
    layer = _conv_layer(normalize="batchnorm", **kwargs)
    with torch.no_grad():
        layer.norm_weight.uniform_(0.5, 1.5)
        layer.norm_bias.normal_()
    return layer


def _oracle(layer, x, y):
    """The float64 reference on the layer's own tensors."""
    wide = [t.detach().double() for t in (layer.weight, layer.head_weight, layer.head_bias)]
    bias = layer.bias.detach().double() if layer.bias is not None else None
    norm = [t.detach().double() if t is not None else None for t in (layer.norm_weight, layer.norm_bias)]
    ref = functional.conv_local_loss_and_gradients(
        x.double(),
        wide[0],
        bias,
        wide[1],
        wide[2],
        y,
        stride=layer.stride,
        padding=layer.padding,
        groups=layer.groups,
        activation=layer.activation,
        grid=layer.local_head_grid,
        pool=layer.pool,
        label_smoothing=layer.label_smoothing,
        normalize=layer.normalize,
        norm_weight=norm[0],
        norm_bias=norm[1],
    )
    grads = (
        [ref.grad_weight] + ([ref.grad_bias] if bias is not None else []) + [ref.grad_head_weight, ref.grad_head_bias]
    )
    if layer.normalize == "batchnorm":
        grads += [ref.grad_norm_weight, ref.grad_norm_bias]
    return ref, grads


def _autograd(layer, x, y):
    """The same loss through torch's conv2d / pooling and autograd, in float64."""
    params = [t.detach().double().requires_grad_() for t in layer.trained_tensors()]
    weight, *rest = params
    bias = rest.pop(0) if layer.bias is not None else None
    head_weight, head_bias, *norm = rest
    z = torch.nn.functional.conv2d(x, weight, bias, layer.stride, layer.padding, 1, layer.groups)
    if norm:
        z = torch.nn.functional.batch_norm(z, None, None, *norm, training=True, eps=1e-5)
    h = functional.activation_forward(z, layer.activation)
    if layer.pool == "max":
        h = torch.nn.functional.max_pool2d(h, 2)
    elif layer.pool == "avg":
        h = torch.nn.functional.avg_pool2d(h, 2)
    pooled = torch.nn.functional.adaptive_avg_pool2d(h, layer.local_head_grid).flatten(1)
    loss = torch.nn.functional.cross_entropy(pooled @ head_weight.T + head_bias, y)
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("pool", [None, "max", "avg"])
@pytest.mark.parametrize("activation", functional.ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_gradients_match_oracle_and_autograd(pool, activation, bias):
    # odd shapes: B=5, C_in=3, C_out=7, 9 x 9 input, kernel 3, stride 2, padding 1 -> 5 x 5 (pooled 2 x 2)
    layer = _conv_layer(pool=pool, activation=activation, bias=bias)
    x, y = torch.randn(5, 3, 9, 9, dtype=torch.float64), torch.randint(0, CLASSES, (5,))
    result, grads = layer.local_gradients(x, y)
    ref, want = _oracle(layer, x, y)
    assert len(grads) == len(layer.trained_tensors()) == len(want)
    for got, expected, auto in zip(grads, want, _autograd(layer, x, y)):
        assert got.shape == expected.shape
        assert relative_error(expected, auto) <= 1e-12  # the oracle is the gradient of the loss
        assert relative_error(got, expected) <= TOLERANCE[torch.float64]
    assert abs(float(result.loss) - float(ref.loss)) <= 1e-12
    assert relative_error(result.output, ref.output) <= 1e-12
    assert relative_error(result.logits, ref.logits) <= 1e-12
    assert torch.allclose(layer(x), ref.output)  # forward is the training output
    assert torch.allclose(layer.local_head(layer(x)), ref.logits)


@pytest.mark.parametrize("grid", [1, 3, 6])  # 6 > the 5 x 5 output: adaptive pooling repeats cells
def test_conv_head_grid_and_label_smoothing(grid):
    layer = _conv_layer(local_head_grid=grid, label_smoothing=0.1)
    assert layer.head_weight.shape == (CLASSES, 7 * grid * grid)
    x, y = torch.randn(4, 3, 9, 9, dtype=torch.float64), torch.randint(0, CLASSES, (4,))
    _, grads = layer.local_gradients(x, y)
    for got, expected in zip(grads, _oracle(layer, x, y)[1]):
        assert relative_error(got, expected) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_gradients_in_low_precision(dtype):
    torch.manual_seed(0)
    layer = _conv_layer(dtype=torch.float32, pool="max")
    x, y = torch.randn(6, 3, 9, 9), torch.randint(0, CLASSES, (6,))
    result, grads = layer.local_gradients(x, y, compute_dtype=dtype)
    assert all(g.dtype == torch.float32 for g in grads)  # master precision
    _, want = _oracle(layer, x, y)
    for got, expected in zip(grads, want):
        assert relative_error(got, expected) <= TOLERANCE[dtype]
    assert result.output.dtype == dtype


def test_conv_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match="pool='min' is not supported"):
        td.DADConv2d(3, 4, 3, pool="min")
    with pytest.raises(ValueError, match="padding=-1"):
        td.DADConv2d(3, 4, 3, padding=-1)
    with pytest.raises(ValueError, match="kernel_size=0"):
        td.DADConv2d(3, 4, 0)
    with pytest.raises(ValueError, match="activation='swish'"):
        td.DADConv2d(3, 4, 3, activation="swish")
    with pytest.raises(ValueError, match="groups=2 must divide in_channels=3"):
        td.DADConv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="groups=0"):
        td.DADConv2d(3, 4, 3, groups=0)
    layer = td.DADConv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"expected \(batch, 3, height, width\)"):
        layer.check_input(torch.randn(2, 1, 9, 9))
    with pytest.raises(TypeError, match="float"):
        layer.check_input(torch.zeros(2, 3, 9, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="local_loss='predsim' is not supported; choose one of 'ce'"):
        layer.set_local_loss("predsim")


@pytest.mark.parametrize("in_channels, out_channels, groups", [(6, 9, 3), (4, 4, 4), (4, 8, 2)])
@pytest.mark.parametrize("normalize", [None, "batchnorm"])
def test_grouped_conv_gradients_match_oracle_and_autograd(in_channels, out_channels, groups, normalize):
    # grouped and depthwise convolutions, stride 2, padding 1, on odd 9 x 9 inputs
    torch.manual_seed(2)
    layer = td.DADConv2d(
        in_channels, out_channels, 3, stride=2, padding=1, num_classes=CLASSES, groups=groups, pool="max",
        normalize=normalize, dtype=torch.float64,
    )
    assert layer.weight.shape == (out_channels, in_channels // groups, 3, 3)
    x, y = torch.randn(5, in_channels, 9, 9, dtype=torch.float64), torch.randint(0, CLASSES, (5,))
    result, grads = layer.local_gradients(x, y)
    ref, want = _oracle(layer, x, y)
    for i, (got, expected, auto) in enumerate(zip(grads, want, _autograd(layer, x, y))):
        if normalize and i == 1:  # the bias cancels under batch norm (see above)
            assert not bool(got.any())
            continue
        assert relative_error(expected, auto) <= 1e-12
        assert relative_error(got, expected) <= TOLERANCE[torch.float64]
    assert relative_error(result.output, ref.output) <= 1e-12
    assert torch.allclose(layer(x), ref.output)


# -------------------------------------------------------------------------------- batch norm
def _step(layer, x, y):
    """One local step: the gradients, then the update (which folds in the batch statistics)."""
    _, grads = layer.local_gradients(x, y)
    return layer.apply_local_update(grads, td.OptimizerConfig(lr=1e-2))


@pytest.mark.parametrize("pool", [None, "max", "avg"])
@pytest.mark.parametrize("activation", functional.ACTIVATIONS)
def test_conv_batchnorm_gradients_match_oracle_and_autograd(pool, activation):
    # odd shapes as above; the 5 x 5 x 5 values per channel of the training batch make the statistics
    layer = _batchnorm_layer(pool=pool, activation=activation)
    x, y = torch.randn(5, 3, 9, 9, dtype=torch.float64), torch.randint(0, CLASSES, (5,))
    result, grads = layer.local_gradients(x, y)
    ref, want = _oracle(layer, x, y)
    assert len(grads) == len(layer.trained_tensors()) == len(want) == 6
    for i, (got, expected, auto) in enumerate(zip(grads, want, _autograd(layer, x, y))):
        assert got.shape == expected.shape
        if i == 1:  # the conv bias: the mean subtraction cancels it, and the layer returns exactly 0
            assert float(auto.abs().max()) <= 1e-12 and float(expected.abs().max()) <= 1e-12
            assert not bool(got.any())
            continue
        assert relative_error(expected, auto) <= 1e-12
        assert relative_error(got, expected) <= TOLERANCE[torch.float64]
    assert abs(float(result.loss) - float(ref.loss)) <= 1e-12
    assert relative_error(result.output, ref.output) <= 1e-12
    assert relative_error(result.logits, ref.logits) <= 1e-12
    assert torch.allclose(layer(x), ref.output)  # training-mode forward: the batch's statistics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_batchnorm_gradients_in_low_precision(dtype):
    torch.manual_seed(0)
    layer = _batchnorm_layer(pool="avg").float()
    x, y = torch.randn(6, 3, 9, 9), torch.randint(0, CLASSES, (6,))
    _, grads = layer.local_gradients(x, y, compute_dtype=dtype)
    assert all(g.dtype == torch.float32 for g in grads)
    for i, (got, expected) in enumerate(zip(grads, _oracle(layer, x, y)[1])):
        if i != 1:  # the bias gradient is 0 (above)
            assert relative_error(got, expected) <= TOLERANCE[dtype], i


def test_conv_running_statistics_follow_batchnorm2d_and_serve_eval():
    torch.manual_seed(0)
    layer = _batchnorm_layer(pool="max")
    reference = torch.nn.BatchNorm2d(7, dtype=torch.float64)
    for _ in range(3):
        x, y = torch.randn(5, 3, 9, 9, dtype=torch.float64), torch.randint(0, CLASSES, (5,))
        reference(torch.nn.functional.conv2d(x, layer.weight, layer.bias, 2, 1))  # the weights the step reads
        assert _step(layer, x, y)
    assert relative_error(layer.running_mean, reference.running_mean) <= 1e-12
    assert relative_error(layer.running_var, reference.running_var) <= 1e-12
    x = torch.randn(4, 3, 9, 9, dtype=torch.float64)
    z = torch.nn.functional.conv2d(x, layer.weight, layer.bias, 2, 1)
    with torch.no_grad():
        reference.weight.copy_(layer.norm_weight)
        reference.bias.copy_(layer.norm_bias)
        want_eval = torch.nn.functional.max_pool2d(torch.relu(reference.eval()(z)), 2)
        want_train = torch.nn.functional.max_pool2d(torch.relu(reference.train()(z)), 2)
    with torch.no_grad():
        assert relative_error(layer.eval()(x), want_eval) <= 1e-12
        assert relative_error(layer.train()(x), want_train) <= 1e-12
    state = layer.state_dict()
    assert {"running_mean", "running_var", "norm_weight", "norm_bias"} <= set(state)
    copy_ = _conv_layer(normalize="batchnorm", pool="max")
    copy_.load_state_dict(state)
    assert torch.equal(copy_.running_var, layer.running_var) and torch.equal(copy_.eval()(x), layer.eval()(x))


def test_conv_running_statistics_wait_for_the_update_and_skip_with_it():
    layer = _batchnorm_layer()
    x, y = torch.randn(5, 3, 9, 9, dtype=torch.float64), torch.randint(0, CLASSES, (5,))
    layer.local_gradients(x, y)
    layer(x)  # a plain training-mode forward neither updates nor replaces the pending statistics
    assert not bool(layer.running_mean.any()) and bool((layer.running_var == 1).all())
    _, grads = layer.local_gradients(x, y)
    grads[-1][0] = float("nan")  # as a NaN in the layer's error would reach it
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    assert not layer.apply_local_update(grads, td.OptimizerConfig(), on_nonfinite="skip")
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    assert _step(layer, x, y)
    assert bool(layer.running_mean.any()) and not bool((layer.running_var == 1).all())


def test_conv_batchnorm_refuses_a_single_row_and_bad_names():
    layer = _batchnorm_layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=r"at least 2 rows per training batch, got 1; use larger batches"):
        _step(layer, torch.randn(1, 3, 9, 9, dtype=torch.float64), torch.tensor([1]))
    with pytest.raises(ValueError, match="at least 2 rows"):
        layer(torch.randn(1, 3, 9, 9, dtype=torch.float64))
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    assert layer.eval()(torch.randn(1, 3, 9, 9, dtype=torch.float64)).shape == (1, 7, 5, 5)  # eval: running ones
    with pytest.raises(ValueError, match=r"normalize='layernorm' is not supported; choose one of 'batchnorm'"):
        td.DADConv2d(3, 4, 3, normalize="layernorm")
    assert "normalize='batchnorm'" in repr(layer)


# ------------------------------------------------------------------------------------ blocks
class Residual(torch.nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.a = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.b = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.b(torch.relu(self.a(x))))


def test_block_gradients_are_autograd_inside_the_block():
    block = td.DADBlock(Residual(5), num_classes=CLASSES, head_features=5).double()
    assert isinstance(block.head, td.nn.MeanPoolHead)
    assert len(block.trained_tensors()) == 6  # a.weight, a.bias, b.weight, b.bias, head weight, head bias
    x, y = torch.randn(3, 5, 7, 7, dtype=torch.float64), torch.randint(0, CLASSES, (3,))
    with torch.no_grad():  # as the trainer calls it
        result, grads = block.local_gradients(x, y)
    params = [p.detach().clone().requires_grad_() for p in block.trained_tensors()]
    wa, ba, wb, bb, hw, hb = params
    h = torch.relu(
        x + torch.nn.functional.conv2d(torch.relu(torch.nn.functional.conv2d(x, wa, ba, padding=1)), wb, bb, padding=1)
    )
    logits = h.mean((2, 3)) @ hw.T + hb
    want = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y), params)
    for got, expected in zip(grads, want):
        assert relative_error(got, expected) <= 1e-12
    assert not result.output.requires_grad and torch.allclose(result.output, h.detach())
    assert torch.allclose(result.logits, logits.detach())


def _calls_once_with_the_output(layer, x, y):  # type: ignore[no-untyped-def]
    """``local_gradients`` with an ``output_ready`` that counts its calls: one, and the results equal those of a
    call without it."""
    seen = []
    with torch.no_grad():
        plain, plain_grads = layer.local_gradients(x, y)
        result, grads = layer.local_gradients(x, y, output_ready=lambda: seen.append(len(seen)))
    assert seen == [0]
    assert torch.equal(result.output, plain.output) and torch.equal(result.loss, plain.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


@pytest.mark.parametrize("kind", ["conv", "block", "token block"])
def test_local_gradients_announce_their_output_once(kind):
    """The engine's cue to start the next layer beside this one's gradients (``output_ready``)."""
    torch.manual_seed(0)
    x, y = torch.randn(3, 5, 8, 8, dtype=torch.float64), torch.randint(0, CLASSES, (3,))
    if kind == "conv":
        layer = td.DADConv2d(5, 4, 3, padding=1, num_classes=CLASSES, pool="max").double()
    elif kind == "block":
        layer = td.DADBlock(Residual(5), num_classes=CLASSES, head_features=5).double()
    else:
        layer = td.DADBlock(torch.nn.Linear(6, 6), num_classes=CLASSES, head_features=6, local_head="full").double()
        x, y = torch.randn(3, 4, 6, dtype=torch.float64), torch.randint(0, CLASSES, (3, 4))
    _calls_once_with_the_output(layer, x, y)


def test_block_transformer_layer_and_bad_arguments():
    encoder = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    block = td.DADBlock(encoder, num_classes=CLASSES, head_features=8, feature_dim=-1)
    x, y = torch.randn(3, 5, 8), torch.randint(0, CLASSES, (3,))
    before = [t.clone() for t in block.trained_tensors()]
    result, grads = block.local_gradients(x, y)
    assert result.output.shape == (3, 5, 8) and result.logits.shape == (3, CLASSES)
    assert all(torch.isfinite(g).all() for g in grads)
    block.apply_local_update(grads, td.OptimizerConfig(lr=1e-2))
    assert all(not torch.equal(a, b) for a, b in zip(before, block.trained_tensors()))
    with pytest.raises(TypeError, match="local_head= .* or head_features="):
        td.DADBlock(encoder, num_classes=CLASSES)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        td.DADBlock("encoder", num_classes=CLASSES, head_features=8)  # type: ignore[arg-type]
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        td.DADBlock(frozen, local_head=torch.nn.Identity(), num_classes=3)


# ------------------------------------------------------------------------------------ models
class SmallVGG(td.DADModel):
    """conv(pool) - conv(pool) - dense - classifier on 1 x 12 x 12 images, the convolutions batch-normalised
    with ``normalize="batchnorm"``."""

    def __init__(self, classifier=True, normalize=None):
        super().__init__()
        options = {"padding": 1, "num_classes": CLASSES, "normalize": normalize}
        self.c1 = td.DADConv2d(1, 6, 3, pool="max", **options)
        self.c2 = td.DADConv2d(6, 8, 3, pool="avg", activation="tanh", **options)
        self.fc = td.DADLinear(8 * 3 * 3, 16, num_classes=CLASSES)
        if classifier:
            self.classifier = torch.nn.Linear(16, CLASSES)


class ResNetLike(td.DADModel):
    """conv stem - residual block - classifier on the flattened block output."""

    def __init__(self):
        super().__init__()
        self.stem = td.DADConv2d(1, 6, 3, padding=1, stride=2, num_classes=CLASSES)
        self.block = td.DADBlock(Residual(6), num_classes=CLASSES, head_features=6)
        self.classifier = torch.nn.Linear(6 * 6 * 6, CLASSES)


MODELS = {"vgg": SmallVGG, "vgg-bn": functools.partial(SmallVGG, normalize="batchnorm"), "resnet": ResNetLike}


def _images(n=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    x = torch.randn(n, 1, 12, 12, generator=generator) * 0.5
    x[:, 0, :6, :6] += y[:, None, None].float()  # learnable: the class brightens one corner
    return x, y


def _trainer(name, backend="eager", **kwargs):
    torch.manual_seed(0)
    options = {"lr": 1e-2, "on_nonfinite": "ignore" if backend == "fused" else "raise", **kwargs}
    return td.DADTrainer(MODELS[name](), backend=backend, **options)


def test_local_layers_in_registration_order():
    model = ResNetLike()
    assert [type(m) for m in model.local_layers] == [td.DADConv2d, td.DADBlock]
    assert model.dad_layers == model.local_layers  # the old name still works
    assert model(torch.randn(2, 1, 12, 12)).shape == (2, CLASSES)
    no_head = SmallVGG(classifier=False)
    x = torch.randn(2, 1, 12, 12)
    assert torch.equal(no_head(x), no_head.fc.local_head(no_head.fc(no_head.c2(no_head.c1(x)))))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fit_evaluate_solve_head(name):
    trainer = _trainer(name)
    x, y = _images()
    records = trainer.fit((x, y), epochs=3, batch_size=8, eval=(x, y), progress=False)
    assert records[-1]["loss"] < records[0]["loss"]
    assert trainer.classifier_sample is not None and trainer.classifier_sample.inputs.shape[1:] == (1, 12, 12)
    solution = trainer.solve_head(lambda_reg=1e-2)
    assert solution.weight.shape == (CLASSES, trainer.model.get_classifier().in_features)
    accuracy = trainer.evaluate((x, y))["accuracy"]
    assert accuracy >= 0.6, accuracy  # chance is 0.25
    assert trainer.evaluate((x, y), use_local_head=True)["samples"] == 40


class _IdentityReducer:
    """A one-process gradient reducer: runs the engine's data-parallel path (all-reduce, then the
    batched AdamW) on CPU."""

    def launch(self, grads):  # type: ignore[no-untyped-def]
        return None, [g.clone() for g in grads]

    def __call__(self, grads):  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("pool", [None, "max", "avg"])
def test_a_channels_last_conv_layer_keeps_the_layout_and_the_values(pool):
    """Input and weights channels-last (``model.to(memory_format=torch.channels_last)``): the output the next
    layer reads stays channels-last, and output, loss and gradients are those of the contiguous layer."""
    torch.manual_seed(0)
    layer = td.DADConv2d(3, 8, 3, padding=1, num_classes=4, pool=pool, normalize="batchnorm")
    channels_last = td.DADConv2d(3, 8, 3, padding=1, num_classes=4, pool=pool, normalize="batchnorm")
    channels_last.load_state_dict(layer.state_dict())
    channels_last = channels_last.to(memory_format=torch.channels_last)
    x, y = torch.randn(4, 3, 10, 10), torch.tensor([0, 1, 2, 3])
    x_cl = x.to(memory_format=torch.channels_last)
    assert channels_last(x_cl).is_contiguous(memory_format=torch.channels_last)
    assert relative_error(channels_last(x_cl), layer(x)) <= 1e-5
    (result, grads), (result_cl, grads_cl) = layer.local_gradients(x, y), channels_last.local_gradients(x_cl, y)
    assert result_cl.output.is_contiguous(memory_format=torch.channels_last)
    assert relative_error(result_cl.loss, result.loss) <= 1e-5
    for g, g_cl in zip(grads, grads_cl):
        assert g_cl.shape == g.shape and relative_error(g_cl, g) <= 1e-4


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("amp,tol", [(None, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("reducer,held_bytes", [(False, None), (False, 0), (True, None)])
def test_fused_engine_equals_eager(name, amp, tol, reducer, held_bytes, monkeypatch):
    if held_bytes is not None:  # every local layer's AdamW launched as soon as its gradients exist
        monkeypatch.setattr(engine, "HELD_GRADIENT_BYTES", held_bytes)
    x, y = _images()
    eager = _trainer(name, on_nonfinite="ignore", amp_dtype=amp)
    fused = _trainer(name, backend="fused", amp_dtype=amp)
    assert fused.uses_engine
    if reducer:
        fused.set_reducers(_IdentityReducer())
        eager.set_reducers(_IdentityReducer())
    for start in range(0, 40, 8):
        _, loss_e = eager.step(x[start : start + 8], y[start : start + 8])
        _, loss_f = fused.step(x[start : start + 8], y[start : start + 8])
        assert relative_error(loss_f, loss_e) <= tol
    for (key, a), b in zip(eager.model.state_dict().items(), fused.model.state_dict().values()):
        if amp is None and not key.startswith(("classifier", "fc.")):
            # the conv and block layers run the same local_gradients and the same fused AdamW kernel
            assert torch.equal(a, b), key
        # the dense layer's and the classifier's fused kernels round differently
        assert relative_error(b, a) <= 5 * tol, key
    if name == "vgg-bn":  # the running statistics advanced with each update, in both
        assert bool(fused.model.c2.running_mean.any()) and bool(eager.model.c2.running_mean.any())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_state_dict_and_checkpoint_round_trip(name, tmp_path):
    x, y = _images()
    trainer = _trainer(name)
    trainer.fit((x, y), epochs=1, batch_size=8, progress=False)
    trainer.save_checkpoint(tmp_path / "model.safetensors")
    fresh = _trainer(name)
    assert fresh.classifier_sample is None  # made at the first batch, or from the checkpoint
    fresh.load_checkpoint(tmp_path / "model.safetensors")
    for (key, a), b in zip(trainer.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), key
    assert torch.equal(fresh.classifier_sample.inputs, trainer.classifier_sample.inputs)
    # both continue identically
    assert torch.equal(trainer.step(x[:8], y[:8])[1], fresh.step(x[:8], y[:8])[1])
    other = td.DADTrainer(SmallVGG() if name == "resnet" else ResNetLike())
    with pytest.raises(ValueError, match="does not match this trainer"):
        other.load_checkpoint(tmp_path / "model.safetensors")
    assert other.classifier_sample is None  # unchanged by the failed load


def test_fit_checkpoint_resume_is_bitwise(tmp_path):
    x, y = _images()
    whole = _trainer("vgg")
    whole.fit((x, y), epochs=2, batch_size=8, progress=False, checkpoint_dir=tmp_path, checkpoint_every=3, keep_last=10)
    for path in tmp_path.glob("checkpoint-*.safetensors"):
        if int(path.stem.split("-")[1]) > 6:
            path.unlink()  # as if killed at step 7 of 10, in the second epoch
    resumed = _trainer("vgg")
    resumed.fit((x, y), epochs=2, batch_size=8, progress=False, checkpoint_dir=tmp_path, resume=True)
    assert resumed.step_count == whole.step_count == 10
    for (key, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", ["vgg", "vgg-bn"])  # with batch norm: running statistics unchanged too
def test_nonfinite_guard_leaves_a_conv_model_unchanged(name):
    trainer = _trainer(name, on_nonfinite="skip")
    x, y = _images()
    trainer.step(x[:8], y[:8])
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with torch.no_grad():
        trainer.model.c2.head_weight.fill_(float("inf"))  # the second layer's gradients turn NaN
    after_poison = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step(x[8:16], y[8:16])
    assert trainer.skipped_updates == 1
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, after_poison[key]), key
    assert not torch.equal(before["c2.head_weight"], after_poison["c2.head_weight"])


def test_trainer_input_checks_for_conv_models():
    trainer = _trainer("vgg")
    y = torch.zeros(4, dtype=torch.long)
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"expected \(batch, 1, height, width\)"):
        trainer.step(torch.randn(4, 144), y)
    with pytest.raises(ValueError, match="NaN or Inf"):
        trainer.step(torch.full((4, 1, 12, 12), float("nan")), y)
    with pytest.raises(ValueError, match="local_loss='predsim'"):
        td.DADTrainer(SmallVGG(), local_loss="predsim")
    assert all(torch.equal(v, state[k]) for k, v in trainer.model.state_dict().items())
    # an MLP still takes image batches, flattened per row
    mlp = td.DADTrainer(_Mlp())
    mlp.step(torch.randn(4, 1, 12, 12), y)
    with pytest.raises(ValueError, match=r"expected \(batch, 144\), or \(batch, \.\.\.\) with 144 values per row"):
        mlp.step(torch.randn(4, 1, 11, 11), y)


class _Mlp(td.DADModel):
    def __init__(self):
        super().__init__()
        self.l1 = td.DADLinear(144, 16, num_classes=CLASSES)
        self.classifier = torch.nn.Linear(16, CLASSES)


def test_readme_conv_block_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "conv-and-blocks.md").read_text()
    block = re.search(r"```python\n(.*?class Net.*?)```", text, re.S).group(1)
    namespace: dict = {"td": td, "torch": torch, "MyResidualBlock": Residual,  # the reader's block and data
                       "x_train": torch.rand(64, 784), "y_train": torch.randint(0, 10, (64,))}
    exec(compile(block, "README-conv", "exec"), namespace)
    trainer = td.DADTrainer(namespace["Net"]())
    _, loss = trainer.step(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    assert torch.isfinite(loss) and trainer.step_count == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, grid", [((3, 5, 28, 28), 4), ((2, 3, 14, 14), 4), ((2, 3, 7, 9), 4), ((2, 3, 3, 3), 4), ((1, 2, 1, 1), 4),
                    ((2, 2, 9, 5), 3)],
)
def test_grid_pool_matches_adaptive_average_pool_and_its_adjoint(shape, grid, dtype):  # type: ignore[no-untyped-def]
    """The local head's pooling (two products with 0/1 window matrices) against the float64
    ``adaptive_avg_pool2d`` and its autograd adjoint, up to and past the grid (windows overlap)."""
    from torch_dad.ops.pooling import grid_pool, grid_pool_backward

    generator = torch.Generator().manual_seed(0)
    x64 = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    want = torch.nn.functional.adaptive_avg_pool2d(x64, grid)
    d_pooled = torch.randn(want.shape, generator=generator, dtype=torch.float64)
    (want_dx,) = torch.autograd.grad(want, x64, d_pooled)
    x = x64.detach().to(dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    for layout in (torch.contiguous_format, torch.channels_last):  # channels-last: read and written in place
        x = x.contiguous(memory_format=layout)
        got = grid_pool(x, grid)
        got_dx = grid_pool_backward(d_pooled.to(dtype), x, grid)
        assert got.dtype == dtype and got_dx.shape == x.shape
        assert got_dx.is_contiguous(memory_format=layout)
        assert relative_error(got.double(), want.detach()) <= tol
        assert relative_error(got_dx.double(), want_dx) <= tol
