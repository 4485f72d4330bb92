"""Recipe options: leaky ReLU, batch norm, label smoothing, local rules and counter-based dropout,
on the layer (against autograd and the float64 oracle) and in the fused step on CPU (against eager)."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_dad as td
from torch_dad import functional
from torch_dad.ops.dropout import counter_dropout, philox4x32
from torch_dad.ops.normalization import normalization_backward, normalization_forward

from .conftest import relative_error

NORMS = [None, "layernorm", "batchnorm"]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}
ACT_FNS = {
    "relu": torch.relu, "gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "identity": lambda t: t,
    "leaky_relu": torch.nn.functional.leaky_relu,
}


def _layer(act="relu", normalize=None, bias=True, dtype=torch.float64, **kw):  # type: ignore[no-untyped-def]
    layer = td.DADLinear(23, 19, num_classes=7, bias=bias, activation=act, normalize=normalize, dtype=dtype, **kw)
    if normalize == "batchnorm":  # away from the 1 / 0 initialisation, so the affine terms matter
        with torch.no_grad():
            layer.norm_weight.uniform_(0.5, 1.5)
            layer.norm_bias.normal_()
    return layer


def _autograd_grads(layer, x, y):  # type: ignore[no-untyped-def]
    """The layer's local CE loss in plain torch ops (``nn.functional.batch_norm``), and autograd's
    gradients for every tensor of ``trained_tensors()``."""
    tensors = [t.detach().clone().requires_grad_(True) for t in layer.trained_tensors()]
    named = dict(zip(["weight"] + (["bias"] if layer.bias is not None else []) + ["hw", "hb"], tensors))
    z = x @ named["weight"].T + (named["bias"] if "bias" in named else 0)
    if layer.normalize == "layernorm":
        z = torch.nn.functional.layer_norm(z, (z.shape[1],), eps=1e-5)
    elif layer.normalize == "batchnorm":
        z = torch.nn.functional.batch_norm(z, None, None, tensors[-2], tensors[-1], training=True, eps=1e-5)
    h = ACT_FNS[layer.activation](z)
    loss = torch.nn.functional.cross_entropy(h @ named["hw"].T + named["hb"], y, label_smoothing=layer.label_smoothing)
    return loss.detach(), torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("act", list(functional.ACTIVATIONS))
@pytest.mark.parametrize("normalize", NORMS)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_gradients_match_autograd_float64(act, normalize, bias):
    torch.manual_seed(5)
    layer = _layer(act, normalize, bias, label_smoothing=0.1)
    x, y = torch.randn(37, 23, dtype=torch.float64), torch.randint(0, 7, (37,))
    result, grads = layer.local_gradients(x, y)
    loss, auto = _autograd_grads(layer, x, y)
    assert abs(float(result.loss) - float(loss)) < 1e-12
    assert len(grads) == len(auto) == len(layer.trained_tensors())
    for i, (mine, want) in enumerate(zip(grads, auto)):
        if bias and normalize == "batchnorm" and i == 1:
            # the bias cancels under batch norm: autograd gives rounding noise, the layer exactly 0
            assert float(want.abs().max()) < 1e-12 and not bool(mine.any())
        else:
            assert relative_error(mine, want) < 1e-10, i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["leaky_relu", "tanh"])
def test_batchnorm_fast_path_matches_float64_oracle(dtype, act):
    torch.manual_seed(6)
    layer = _layer(act, "batchnorm", dtype=torch.float32)
    x, y = torch.randn(37, 23), torch.randint(0, 7, (37,))
    _, grads = layer.local_gradients(x, y, compute_dtype=dtype)
    want = functional.local_loss_and_gradients(
        x.double(), layer.weight.double(), layer.bias.double(), layer.head_weight.double(),
        layer.head_bias.double(), y, act, normalize="batchnorm", norm_weight=layer.norm_weight.double(),
        norm_bias=layer.norm_bias.double(),
    )
    pairs = [(grads[0], want.grad_weight), (grads[2], want.grad_head_weight), (grads[3], want.grad_head_bias),
             (grads[4], want.grad_norm_weight), (grads[5], want.grad_norm_bias)]
    for mine, ref in pairs:
        assert mine.dtype == torch.float32
        assert relative_error(mine, ref) < 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (37, 23), (129, 517)])
@pytest.mark.parametrize("kind", ["batchnorm", "layernorm"])
def test_fused_step_normalization_matches_float64_oracle(kind, shape, dtype):
    """The fused step's one-kernel normalisation (fp32 masters, ``dtype`` activations) against the
    float64 formulas of ``functional``, forward, backward and the running statistics."""
    torch.manual_seed(7)
    z = torch.randn(*shape, dtype=torch.float64) * 3 + 1
    grad = torch.randn(*shape, dtype=torch.float64)
    channels = shape[1]
    affine = (torch.rand(channels, dtype=torch.float64) + 0.5, torch.randn(channels, dtype=torch.float64))
    stats = (torch.zeros(channels), torch.ones(channels))
    if kind == "batchnorm":
        out, saved = normalization_forward(kind, z.to(dtype), *(t.float() for t in affine), *stats)
        want, normed, inv_std = functional.batch_norm_forward(z, *affine, *functional.batch_norm_statistics(z))
        d_z, affine_grads = normalization_backward(grad.to(dtype), saved, affine[0].float())
        want_d_z, *want_affine = functional.batch_norm_backward(grad, normed, inv_std, affine[0])
        reference = torch.nn.BatchNorm1d(channels, dtype=torch.float64).train()
        reference(z)
        assert relative_error(stats[0], reference.running_mean) < 10 * TOL[dtype]
        assert relative_error(stats[1], reference.running_var) < 10 * TOL[dtype]
    else:
        out, saved = normalization_forward(kind, z.to(dtype))
        want, inv_std = functional.layer_norm_forward(z)
        d_z, affine_grads = normalization_backward(grad.to(dtype), saved)
        want_d_z, want_affine = functional.layer_norm_backward(grad, want, inv_std), []
    assert out.dtype == d_z.dtype == dtype
    assert relative_error(out, want) < 10 * TOL[dtype]
    assert relative_error(d_z, want_d_z) < 10 * TOL[dtype]
    assert len(affine_grads) == len(want_affine)
    for mine, ref in zip(affine_grads, want_affine):
        assert mine.dtype == torch.float32 and relative_error(mine, ref) < 10 * TOL[dtype]


def test_fused_step_normalization_names_a_bad_kind_or_argument():
    z = torch.randn(4, 3)
    with pytest.raises(ValueError, match="normalize='groupnorm'"):
        normalization_forward("groupnorm", z)
    with pytest.raises(ValueError, match="layernorm' has no affine"):
        normalization_forward("layernorm", z, torch.ones(3))


def test_running_statistics_follow_batchnorm1d_and_serve_eval():
    torch.manual_seed(7)
    layer = _layer("relu", "batchnorm")
    reference = torch.nn.BatchNorm1d(19, dtype=torch.float64)
    assert {"running_mean", "running_var", "norm_weight", "norm_bias"} <= set(layer.state_dict())
    assert {name for name, _ in layer.named_buffers()} >= {"running_mean", "running_var"}
    for _ in range(3):
        x, y = torch.randn(37, 23, dtype=torch.float64), torch.randint(0, 7, (37,))
        reference.train()(torch.nn.functional.linear(x, layer.weight, layer.bias).detach())
        layer.local_step(x, y)
    assert torch.allclose(layer.running_mean, reference.running_mean, atol=1e-12)
    assert torch.allclose(layer.running_var, reference.running_var, atol=1e-12)
    x = torch.randn(5, 23, dtype=torch.float64)
    z = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        reference.weight.copy_(layer.norm_weight)
        reference.bias.copy_(layer.norm_bias)
        want_eval = torch.relu(reference.eval()(z))
        want_train = torch.relu(reference.train()(z))
    assert torch.allclose(layer.eval()(x), want_eval, atol=1e-12)
    assert torch.allclose(layer.train()(x), want_train, atol=1e-12)  # batch statistics in training
    copy_ = _layer("relu", "batchnorm")
    copy_.load_state_dict(layer.state_dict())
    assert torch.equal(copy_.running_var, layer.running_var)


def test_running_statistics_wait_for_the_update_and_skip_with_it():
    layer = _layer("relu", "batchnorm")
    x, y = torch.randn(37, 23, dtype=torch.float64), torch.randint(0, 7, (37,))
    layer.local_gradients(x, y)
    layer(x)  # a plain forward in training mode neither updates nor replaces the pending statistics
    assert not bool(layer.running_mean.any())
    result, grads = layer.local_gradients(x, y)
    grads[-1][0] = float("nan")  # as a NaN in the layer's error would reach it
    assert not layer.apply_local_update(grads, td.OptimizerConfig(), on_nonfinite="skip")
    assert not bool(layer.running_mean.any()) and bool((layer.running_var == 1).all())
    layer.local_step(x, y)
    assert bool(layer.running_mean.any())


@pytest.mark.parametrize("kwargs, match", [
    ({"activation": "leaky"}, r"activation='leaky'.*relu, gelu, tanh, identity, leaky_relu"),
    ({"normalize": "bn"}, r"normalize='bn'.*layernorm, batchnorm"),
])
def test_bad_names_raise_naming_the_argument_and_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        td.DADLinear(4, 5, num_classes=3, **kwargs)


def test_batchnorm_refuses_a_single_row_and_changes_nothing():
    layer = _layer("relu", "batchnorm")
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(ValueError, match="at least 2 rows"):
        layer.local_step(torch.randn(1, 23, dtype=torch.float64), torch.tensor([1]))
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


# --------------------------------------------------------------------------------- dropout
def test_philox_twin_matches_the_random123_answers():
    def words(counter, key):  # type: ignore[no-untyped-def]
        return [int(w) for w in philox4x32(key, *(torch.tensor([c]) for c in counter))]

    assert words([0, 0, 0, 0], 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    counter = [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]
    assert words(counter, 0x299F31D0A4093822) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_counter_dropout_is_a_pure_function_of_its_counters():
    x = torch.randn(301, 67)
    out = counter_dropout(x, 0.3, 11, 5, 2)
    assert torch.equal(out, counter_dropout(x, 0.3, 11, torch.tensor(5), 2))
    kept = out != 0
    assert torch.allclose(out[kept], x[kept] / 0.7)
    assert abs(float(kept.float().mean()) - 0.7) < 5 * (0.21 / x.numel()) ** 0.5
    for other in ((12, 5, 2), (11, 6, 2), (11, 5, 3), (11, 5 + 2**32, 2)):
        assert not torch.equal(counter_dropout(x, 0.3, *other) != 0, kept), other
    # element e's decision does not depend on the tensor's shape
    assert torch.equal(counter_dropout(x.reshape(-1), 0.3, 11, 5, 2), out.reshape(-1))
    assert torch.equal(counter_dropout(x, 0.0, 11, 5, 2), x)
    half = counter_dropout(x.bfloat16(), 0.3, 11, 5, 2)
    assert half.dtype == torch.bfloat16 and torch.equal(half != 0, kept | (x.bfloat16() == 0))


@pytest.mark.parametrize("kwargs, match", [
    ({"p": 1.0}, "p="), ({"seed": -1}, "seed="), ({"step": 1.5}, "step="), ({"layer": -2}, "layer="),
    ({"step": torch.tensor([1])}, "step"),
])
def test_counter_dropout_rejects_bad_arguments(kwargs, match):
    args = {"p": 0.5, "seed": 0, "step": 0, "layer": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        counter_dropout(torch.randn(3, 4), **args)


class Net(td.DADModel):
    def __init__(self, **kw):  # type: ignore[no-untyped-def]
        super().__init__()
        self.a = td.DADLinear(23, 19, num_classes=7, **kw)
        self.b = td.DADLinear(19, 17, num_classes=7, **kw)
        self.classifier = torch.nn.Linear(17, 7)


def test_trainer_dropout_seed_is_checked_and_saved():
    with pytest.raises(ValueError, match="dropout_seed"):
        td.DADTrainer(Net(), dropout=0.1, dropout_seed=-1)
    trainer = td.DADTrainer(Net(), dropout=0.1, dropout_seed=99)
    state = trainer.state_dict()
    assert state["dropout_seed"] == 99
    other = td.DADTrainer(Net(), dropout=0.1)
    other.load_state_dict(state)
    assert other.dropout_seed == 99


def test_dropout_resumes_from_step_count_alone():
    torch.manual_seed(8)
    batches = [(torch.randn(37, 23), torch.randint(0, 7, (37,))) for _ in range(4)]
    first = td.DADTrainer(Net(), dropout=0.4, dropout_seed=3, classifier_sample_size=0)
    for x, y in batches[:2]:
        first.step(x, y)
    state = copy.deepcopy(first.state_dict())
    for x, y in batches[2:]:
        first.step(x, y)
    second = td.DADTrainer(Net(), dropout=0.4, classifier_sample_size=0)
    second.load_state_dict(state)
    for x, y in batches[2:]:
        second.step(x, y)
    for key, value in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[key], value), key


def test_eager_step_matches_float64_oracle_on_dropped_inputs():
    """One SGD step (lr 1, no momentum or decay: the update is the gradient) of the eager trainer,
    against the oracle fed the counter-dropped output of the layer below."""
    torch.manual_seed(9)
    model = Net(activation="leaky_relu", normalize="batchnorm", label_smoothing=0.1)
    start = copy.deepcopy(model)
    trainer = td.DADTrainer(model, optimizer="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, dropout=0.25,
                            dropout_seed=4)
    x, y = torch.randn(37, 23), torch.randint(0, 7, (37,))
    trainer.step(x, y)
    a = x.double()
    for index, (before, after) in enumerate(zip(start.dad_layers, model.dad_layers)):
        want = functional.local_loss_and_gradients(
            a, before.weight.double(), before.bias.double(), before.head_weight.double(), before.head_bias.double(),
            y, "leaky_relu", label_smoothing=0.1, normalize="batchnorm", norm_weight=before.norm_weight.double(),
            norm_bias=before.norm_bias.double(),
        )
        assert relative_error(before.weight - after.weight, want.grad_weight) < 1e-4
        assert relative_error(before.norm_weight - after.norm_weight, want.grad_norm_weight) < 1e-4
        assert relative_error(before.head_weight - after.head_weight, want.grad_head_weight) < 1e-4
        a = counter_dropout(want.output, 0.25, 4, 0, index)


# --------------------------------------------------------------------------------- the fused step on CPU
RECIPES = [
    ({"label_smoothing": 0.1}, 0.0), ({"activation": "leaky_relu"}, 0.0), ({"normalize": "layernorm"}, 0.0),
    ({"normalize": "batchnorm"}, 0.0), ({"local_loss": "predsim"}, 0.0), ({"local_loss": "drtp"}, 0.0),
    ({"activation": "gelu"}, 0.0), ({}, 0.3),
    ({"activation": "leaky_relu", "normalize": "batchnorm", "label_smoothing": 0.1}, 0.2),
    ({"local_loss": "predsim", "normalize": "layernorm", "activation": "tanh"}, 0.1),
]


def _recipe_pair(kw, dropout, amp, reducer=False):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    ref, new = Net(**kw), Net(**kw)
    new.load_state_dict(ref.state_dict())
    common = {"amp_dtype": amp, "dropout": dropout, "dropout_seed": 17, "on_nonfinite": "ignore"}
    eager, fused = td.DADTrainer(ref, backend="eager", **common), td.DADTrainer(new, backend="fused", **common)
    if reducer:
        from tests.test_backend import _IdentityReducer

        eager.set_reducers(_IdentityReducer())
        fused.set_reducers(_IdentityReducer())
    assert fused.uses_engine
    return eager, fused


@pytest.mark.parametrize("kw, dropout", RECIPES)
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_fused_cpu_step_matches_eager_for_every_recipe(kw, dropout, amp):
    eager, fused = _recipe_pair(kw, dropout, amp)
    tol = 1e-5 if amp is None else 3e-2
    outputs = [(eager.step(x, y), fused.step(x, y)) for x, y in _batches(4)]
    assert max(relative_error(mine[0], want[0]) for want, mine in outputs) <= tol
    assert max(abs(float(mine[1]) - float(want[1])) for want, mine in outputs) <= tol
    _assert_same_model(eager, fused, 5 * tol)


def _batches(count):  # type: ignore[no-untyped-def]
    return [(torch.randn(37, 23), torch.randint(0, 7, (37,))) for _ in range(count)]


def _assert_same_model(eager, fused, tol):  # type: ignore[no-untyped-def]
    for key, want in eager.state_dict()["model"].items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(fused.state_dict()["model"][key], want) <= tol, key


@pytest.mark.parametrize("kw, dropout", [RECIPES[3], RECIPES[8]])
def test_fused_cpu_step_with_a_reducer_and_a_resume(kw, dropout):
    eager, fused = _recipe_pair(kw, dropout, None, reducer=True)
    for step, (x, y) in enumerate(_batches(4)):
        if step == 2:  # a resumed fused trainer continues the dropout stream from step_count
            state = copy.deepcopy(fused.state_dict())
            fused = _recipe_pair(kw, dropout, None, reducer=True)[1]
            fused.load_state_dict(state)
        eager.step(x, y)
        fused.step(x, y)
    _assert_same_model(eager, fused, 5e-5)


# --------------------------------------------------------------------------------- the classifier's smoothing
def test_classifier_label_smoothing_is_backprops_smoothed_output_loss():
    """One SGD step (lr 1) of the classifier equals autograd of nn.CrossEntropyLoss(label_smoothing=0.1) on
    its input, in float64; the local layers are unaffected by the option."""
    torch.manual_seed(10)
    model = Net(dtype=torch.float64)
    model.classifier = torch.nn.Linear(17, 7, dtype=torch.float64)
    plain = copy.deepcopy(model)
    x, y = torch.randn(37, 23, dtype=torch.float64), torch.randint(0, 7, (37,))
    features = model.features(x).detach()
    reference = copy.deepcopy(model.classifier)
    torch.nn.CrossEntropyLoss(label_smoothing=0.1)(reference(features), y).backward()
    sgd = {"optimizer": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0}
    before = model.classifier.weight.detach().clone()
    td.DADTrainer(model, classifier_label_smoothing=0.1, **sgd).step(x, y)
    td.DADTrainer(plain, **sgd).step(x, y)
    assert relative_error(before - model.classifier.weight, reference.weight.grad) < 1e-10
    assert torch.equal(model.b.weight, plain.b.weight)  # the local layers: their own label_smoothing
    assert not torch.equal(model.classifier.weight, plain.classifier.weight)


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_fused_cpu_step_matches_eager_with_classifier_label_smoothing(amp):
    torch.manual_seed(0)
    ref, new = Net(), Net()
    new.load_state_dict(ref.state_dict())
    common = {"amp_dtype": amp, "classifier_label_smoothing": 0.2, "on_nonfinite": "ignore"}
    eager, fused = td.DADTrainer(ref, backend="eager", **common), td.DADTrainer(new, backend="fused", **common)
    tol = 1e-5 if amp is None else 3e-2
    for x, y in _batches(4):
        want, got = eager.step(x, y), fused.step(x, y)
        assert abs(float(got[1]) - float(want[1])) <= tol
    _assert_same_model(eager, fused, 5 * tol)


def test_bad_classifier_label_smoothing_names_the_argument():
    with pytest.raises(ValueError, match="classifier_label_smoothing"):
        td.DADTrainer(Net(), classifier_label_smoothing=1.0)


@pytest.mark.parametrize("backend", ["eager", "fused"])
@pytest.mark.parametrize("normalize", NORMS)
def test_step_returns_detached_outputs_and_leaves_no_grad(backend, normalize):  # type: ignore[no-untyped-def]
    # the fused step once recorded an autograd graph behind every tensor after a batch norm (its affine
    # parameters are nn.Parameters): step() promises detached outputs on every path
    class Net(td.DADModel):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = td.DADLinear(20, 32, num_classes=4, normalize=normalize)
            self.l2 = td.DADLinear(32, 16, num_classes=4, normalize=normalize)
            self.classifier = torch.nn.Linear(16, 4)

    torch.manual_seed(0)
    trainer = td.DADTrainer(Net(), backend=backend, on_nonfinite="ignore")
    assert trainer.uses_engine == (backend == "fused")
    logits, loss = trainer.step(torch.randn(8, 20), torch.randint(0, 4, (8,)))
    assert not logits.requires_grad and not loss.requires_grad
    assert all(p.grad is None for p in trainer.model.parameters())
