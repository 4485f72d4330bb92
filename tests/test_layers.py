"""DADLinear / DADModel: the fast local step against the float64 oracle, buffers, state_dict."""

import pytest
import torch

import torch_dad as td
from torch_dad import functional
from torch_dad.optim import OptimizerConfig

from .conftest import relative_error

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}  # margin over the oracle's own error


@pytest.mark.parametrize("act", list(functional.ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_local_gradients_match_functional(act, bias, dtype):
    layer = td.DADLinear(37, 53, num_classes=7, bias=bias, activation=act, dtype=torch.float64)
    x = torch.randn(29, 37, dtype=torch.float64)
    y = torch.randint(0, 7, (29,))
    ref = functional.local_loss_and_gradients(x, layer.weight.detach(), layer.bias.detach() if bias else None,
                                     layer.head_weight, layer.head_bias, y, act)
    compute = None if dtype == torch.float64 else dtype
    result, grads = layer.local_gradients(x, y, compute_dtype=compute)
    # the oracle's own error when run in `dtype` bounds what any implementation can reach
    low = functional.local_loss_and_gradients(
        *(t.to(dtype) if t is not None else None for t in (x, layer.weight.detach(), layer.bias if bias else None,
                                                         layer.head_weight, layer.head_bias)), y, act)
    names = ["grad_weight"] + (["grad_bias"] if bias else []) + ["grad_head_weight", "grad_head_bias"]
    pairs = [(got, getattr(ref, n), getattr(low, n)) for got, n in zip(grads, names)]
    pairs += [(result.output, ref.output, low.output), (result.loss, ref.loss, low.loss)]
    for got, want, same_dtype in pairs:
        allowed = 2 * relative_error(same_dtype, want) + TOL[dtype]
        assert relative_error(got, want) <= allowed


def test_local_step_equals_torch_adamw():
    layer = td.DADLinear(13, 19, num_classes=5, dtype=torch.float64)
    x, y = torch.randn(31, 13, dtype=torch.float64), torch.randint(0, 5, (31,))
    ref_params = [t.detach().clone().requires_grad_(True) for t in layer.trained_tensors()]
    opt = torch.optim.AdamW(ref_params, lr=3e-3, weight_decay=0.05)
    config = OptimizerConfig(lr=3e-3, weight_decay=0.05)
    for _ in range(3):
        r = functional.local_loss_and_gradients(x, *[p.detach() for p in ref_params[:2]], *[p.detach() for p in ref_params[2:]], y, "relu")
        for p, g in zip(ref_params, (r.grad_weight, r.grad_bias, r.grad_head_weight, r.grad_head_bias)):
            p.grad = g
        opt.step()
        layer.local_step(x, y, config)
    for got, want in zip(layer.trained_tensors(), ref_params):
        assert relative_error(got.detach(), want.detach()) < 1e-10


def test_local_step_returns_pre_update_output():
    layer = td.DADLinear(8, 6, num_classes=3)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    expected = layer(x).detach()
    before = layer.weight.detach().clone()
    out = layer.local_step(x, y, OptimizerConfig(lr=1e-2)).output
    assert torch.allclose(out, expected)
    assert not torch.equal(before, layer.weight.detach())


def test_head_and_moments_are_buffers_not_parameters():
    layer = td.DADLinear(4, 3, num_classes=2)
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"weight", "bias"}
    keys = set(layer.state_dict())
    assert {"head_weight", "head_bias", "optim_state.step", "optim_state.exp_avg_0"} <= keys


def test_state_dict_roundtrip_and_nn_linear_weights():
    layer = td.DADLinear(4, 3, num_classes=2)
    layer.local_step(torch.randn(6, 4), torch.randint(0, 2, (6,)))
    other = td.DADLinear(4, 3, num_classes=2)
    other.load_state_dict(layer.state_dict())
    for k, v in layer.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    linear = torch.nn.Linear(4, 3)
    linear.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(2, 4)
    assert torch.allclose(torch.relu(linear(x)), layer(x))


@pytest.mark.parametrize("kwargs, match", [
    ({"activation": "swish"}, "activation"),
    ({"in_features": 0}, "in_features"),
    ({"num_classes": 1}, "num_classes"),
    ({"label_smoothing": 1.5}, "label_smoothing"),
])
def test_constructor_rejects_bad_arguments(kwargs, match):
    args = {"in_features": 4, "out_features": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        td.DADLinear(**args)


class Three(td.DADModel):
    def __init__(self, classifier=True):
        super().__init__()
        self.a = td.DADLinear(12, 9, num_classes=4)
        self.b = td.DADLinear(9, 7, num_classes=4, activation="tanh")
        if classifier:
            self.classifier = torch.nn.Linear(7, 4)


def test_model_forward_is_manual_composition():
    model = Three()
    x = torch.randn(5, 3, 4)  # flattened to (5, 12)
    manual = model.classifier(model.b(model.a(x.reshape(5, -1))))
    assert torch.allclose(model(x), manual)
    assert torch.allclose(model.forward_inference(x), manual)
    assert [type(layer) for layer in model.dad_layers] == [td.DADLinear, td.DADLinear]
    assert model.dad_layers[0] is model.a


def test_model_without_classifier_uses_last_local_head():
    model = Three(classifier=False)
    x = torch.randn(5, 12)
    assert torch.allclose(model(x), model.b.local_head(model.b(model.a(x))))


def test_trained_tensors_order_and_drtp_has_no_local_head():
    layer = td.DADLinear(4, 3, num_classes=2)
    assert [t.shape for t in layer.trained_tensors()] == [(3, 4), (3,), (2, 3), (2,)]
    assert layer.trained_tensors()[0] is layer.weight and layer.trained_tensors()[2] is layer.head_weight
    drtp = td.DADLinear(4, 3, num_classes=2, bias=False, local_loss="drtp")
    assert drtp.trained_tensors() == [drtp.weight]
    assert len(drtp.optim_state.moments("exp_avg")) == 1


def _state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def test_apply_local_update_applies_or_skips_or_raises():
    layer = td.DADLinear(5, 4, num_classes=3)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    result, grads = layer.local_gradients(x, y)
    before = _state(layer)
    bad = [g.clone() for g in grads]
    bad[1][0] = float("nan")  # d_z's NaN reaches the bias gradient
    assert layer.apply_local_update(bad, OptimizerConfig(), on_nonfinite="skip") is False
    with pytest.raises(FloatingPointError, match="on_nonfinite='skip'"):
        layer.apply_local_update(bad, OptimizerConfig(), on_nonfinite="raise")
    inf_loss = torch.tensor(float("inf"))
    assert layer.apply_local_update(grads, OptimizerConfig(), on_nonfinite="skip", loss=inf_loss) is False
    with pytest.raises(ValueError, match="on_nonfinite"):
        layer.apply_local_update(grads, OptimizerConfig(), on_nonfinite="warn")
    with pytest.raises(ValueError, match="trained_tensors"):
        layer.apply_local_update(grads[:2], OptimizerConfig())
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert layer.apply_local_update(grads, OptimizerConfig(lr=1e-2), on_nonfinite="skip", loss=result.loss) is True
    assert not torch.equal(before["weight"], layer.weight.detach())
    assert float(layer.optim_state.step) == 1


def test_local_step_is_local_gradients_then_apply_local_update():
    torch.manual_seed(0)
    a = td.DADLinear(6, 5, num_classes=3, dtype=torch.float64)
    b = td.DADLinear(6, 5, num_classes=3, dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    config = OptimizerConfig(lr=5e-3)
    a.local_step(x, y, config, lr=2e-3)
    _, grads = b.local_gradients(x, y)
    assert b.apply_local_update(grads, config, 2e-3)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    skipped = a.local_step(x.clone().fill_(float("nan")), y, config, on_nonfinite="skip")
    assert skipped.skipped


def test_from_linear_copies_weights_shape_device_dtype():
    linear = torch.nn.Linear(6, 5, dtype=torch.float64)
    layer = td.DADLinear.from_linear(linear, num_classes=3, activation="tanh")
    assert (layer.in_features, layer.out_features, layer.num_classes) == (6, 5, 3)
    assert layer.weight.dtype == torch.float64 and layer.weight.data_ptr() != linear.weight.data_ptr()
    x = torch.randn(2, 6, dtype=torch.float64)
    assert torch.equal(layer(x), torch.tanh(linear(x)))
    no_bias = td.DADLinear.from_linear(torch.nn.Linear(6, 5, bias=False), num_classes=3)
    assert no_bias.bias is None
    with pytest.raises(TypeError, match="nn.Linear"):
        td.DADLinear.from_linear(torch.nn.ReLU())
    with pytest.raises(TypeError, match="out_features"):
        td.DADLinear.from_linear(linear, out_features=4)


def test_require_layers_names_the_fix():
    model = Three()
    assert model.require_layers() == [model.a, model.b]
    with pytest.raises(ValueError, match="no DADLinear layers"):
        td.DADModel().require_layers()
