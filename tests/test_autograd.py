"""DADAutogradLinear: local gradients vs autograd / the float64 oracle, update modes, labels, hazards."""

import warnings

import pytest
import torch
import torch.nn.functional as Fn
from torch.utils.checkpoint import checkpoint

import torch_dad as td
from torch_dad import functional
from torch_dad.nn.autograd import HIDDEN_LABEL_SMOOTHING, DADAutogradLinear, label_context

from .conftest import relative_error

F64 = torch.float64
ACTS = ("relu", "gelu", "tanh", "identity")
EARLY = [pytest.param(None, id="auto"), pytest.param(True, id="forward"), pytest.param(False, id="backward")]


def _act(z, act):
    return functional.activation_forward(z, act)


def _ref_linear(layer):
    """An nn.Linear holding a copy of ``layer``'s weights."""
    lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)
    lin.load_state_dict({k: v for k, v in layer.state_dict().items() if k in ("weight", "bias")})
    return lin


def _state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def _same_state(layer, before):
    after = layer.state_dict()
    return set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


# ---------------------------------------------------------------- roles
def test_role_inference_and_overrides():
    assert DADAutogradLinear(7, 5, num_classes=3).role == "hidden"
    assert DADAutogradLinear(7, 5, num_classes=3).activation == "relu"
    assert DADAutogradLinear(7, 3, num_classes=3).role == "head"
    assert DADAutogradLinear(7, 3).role == "head"
    assert DADAutogradLinear(7, 3, num_classes=3, activation="tanh").role == "hidden"
    hidden = DADAutogradLinear(7, 3, num_classes=3, role="hidden")
    assert (hidden.role, hidden.activation) == ("hidden", "relu")
    head = DADAutogradLinear(7, 3, num_classes=3, update="grad")
    assert {n for n, _ in head.named_parameters()} == {"weight", "bias"}
    assert head.head_weight is None and head.optim_state is None
    inplace_hidden = DADAutogradLinear(7, 5, num_classes=3)
    assert {n for n, _ in inplace_hidden.named_parameters()} == {"weight", "bias"}
    grad_hidden = DADAutogradLinear(7, 5, num_classes=3, update="grad")
    assert {n for n, _ in grad_hidden.named_parameters()} == {"weight", "bias", "head_weight", "head_bias"}


def _stack(first, last):
    torch.manual_seed(0)
    return torch.nn.Sequential(first, torch.nn.ReLU(), last), torch.randn(16, 7), torch.randint(0, 3, (16,))


def test_inferred_head_feeding_dad_layers_raises_before_updating():
    # DADAutogradLinear(7, 5) without num_classes is a head; here it is meant as a hidden layer
    model, x, y = _stack(DADAutogradLinear(7, 5), DADAutogradLinear(5, 3))
    before = _state(model[0])
    with pytest.raises(ValueError, match=r"DADAutogradLinear\(7, 5\) took role='head'.*Pass num_classes="):
        with label_context(model, y):
            Fn.cross_entropy(model(x), y).backward()
    assert _same_state(model[0], before)
    for explicit in ({"role": "head"}, {"num_classes": 3}):  # stated, not inferred: no error
        model, x, y = _stack(DADAutogradLinear(7, 5, **explicit), DADAutogradLinear(5, 3))
        with label_context(model, y):
            Fn.cross_entropy(model(x), y).backward()


def test_inferred_head_without_a_cross_entropy_gradient_warns_once():
    model, x, y = _stack(DADAutogradLinear(7, 5), torch.nn.Linear(5, 3))
    with pytest.warns(UserWarning, match=r"DADAutogradLinear\(7, 5\) took role='head'.*pass role='head'"):
        with label_context(model, y):
            Fn.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with label_context(model, y):
            Fn.cross_entropy(model(x), y).backward()  # once per layer
        head = DADAutogradLinear(7, 3)  # a real classifier: softmax-loss gradients sum to 0 per row
        for loss in (Fn.cross_entropy, lambda out, y: Fn.cross_entropy(out, y, label_smoothing=0.2) * 3):
            with label_context(head, y):
                loss(head(x), y).backward()
            head._head_checked = False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"role": "head", "activation": "relu", "num_classes": 3}, "activation"),
        ({"role": "head", "num_classes": 4}, "num_classes"),
        ({"role": "sideways"}, "role"),
        ({"update": "later"}, "update"),
        ({"num_classes": 1}, "num_classes"),
        ({"activation": "swish", "num_classes": 3}, "activation"),
        ({"activation": "relu"}, "num_classes"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"lr": -1.0}, "lr"),
        ({"check_values": "sometimes"}, "check_values"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DADAutogradLinear(7, 3, **kwargs)


def test_constructor_type_errors():
    with pytest.raises(TypeError, match="backprop_gradients"):
        DADAutogradLinear(7, 3, backprop_gradients="yes")
    with pytest.raises(TypeError, match="nn.Linear"):
        DADAutogradLinear.from_linear(torch.nn.Conv1d(3, 3, 1), 3)


# ---------------------------------------------------------------- acceptance: head role
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(29,), (5, 13)])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("early", EARLY)
def test_head_grad_equals_autograd_of_linear_and_cross_entropy(bias, shape, smoothing, early):
    classes = 7
    layer = DADAutogradLinear(
        37, classes, bias=bias, num_classes=classes, update="grad", dtype=F64, label_smoothing=smoothing
    )
    layer.early_gradients = early
    ref = _ref_linear(layer)
    x = torch.randn(*shape, 37, dtype=F64)
    y = torch.randint(0, classes, shape)
    y.view(-1)[::4] = -100  # token-style ignored positions
    Fn.cross_entropy(ref(x).reshape(-1, classes), y.reshape(-1), label_smoothing=smoothing).backward()
    layer.set_y_context(y)
    out = layer(x)
    assert relative_error(out.detach(), ref(x).detach()) < 1e-14  # raw logits: no activation on a head
    # the user's loss is the same CE; its upstream gradient is not what the layer learns from
    (Fn.cross_entropy(out.reshape(-1, classes), y.reshape(-1), label_smoothing=smoothing) * 1000).backward()
    assert relative_error(layer.weight.grad, ref.weight.grad) < 1e-10
    if bias:
        assert relative_error(layer.bias.grad, ref.bias.grad) < 1e-10
    want_loss = Fn.cross_entropy(out.detach().reshape(-1, classes), y.reshape(-1), label_smoothing=smoothing)
    assert relative_error(layer.last_local_loss, want_loss) < 1e-12


def test_head_inplace_equals_torch_adamw():
    layer = DADAutogradLinear(23, 6, lr=3e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-7, dtype=F64)
    ref = _ref_linear(layer)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-7)
    for _ in range(4):
        x, y = torch.randn(17, 23, dtype=F64), torch.randint(0, 6, (17,))
        opt.zero_grad()
        Fn.cross_entropy(ref(x), y).backward()
        opt.step()
        with label_context(layer, y):
            Fn.cross_entropy(layer(x), y).backward()
        assert layer.weight.grad is None  # in place: nothing for a user's optimizer
    assert relative_error(layer.weight.detach(), ref.weight.detach()) < 1e-10
    assert relative_error(layer.bias.detach(), ref.bias.detach()) < 1e-10
    assert float(layer.optim_state.step) == 4


# ---------------------------------------------------------------- hidden role vs the oracle
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("early", EARLY)
def test_hidden_grad_equals_functional_oracle(act, bias, early):
    layer = DADAutogradLinear(19, 27, bias=bias, num_classes=5, activation=act, update="grad", dtype=F64, role="hidden")
    layer.early_gradients = early
    x = torch.randn(3, 11, 19, dtype=F64)
    y = torch.randint(0, 5, (3, 11))
    y[0, :4] = -100
    keep = y.reshape(-1) != -100
    ref = functional.local_loss_and_gradients(
        x.reshape(-1, 19)[keep],
        layer.weight.detach(),
        layer.bias.detach() if bias else None,
        layer.head_weight.detach(),
        layer.head_bias.detach(),
        y.reshape(-1)[keep],
        act,
        label_smoothing=layer.label_smoothing,
    )
    assert layer.label_smoothing == HIDDEN_LABEL_SMOOTHING  # the hidden default
    with label_context(layer, y):
        out = layer(x)
    assert relative_error(out.detach().reshape(-1, 27)[keep], ref.output) < 1e-12
    out.sum().backward()
    pairs = [
        (layer.weight.grad, ref.grad_weight),
        (layer.head_weight.grad, ref.grad_head_weight),
        (layer.head_bias.grad, ref.grad_head_bias),
    ]
    if bias:
        pairs.append((layer.bias.grad, ref.grad_bias))
    for got, want in pairs:
        assert relative_error(got, want) < 1e-10
    assert relative_error(layer.last_local_loss, ref.loss) < 1e-12


def test_label_smoothing_defaults_by_role():
    # a hidden layer's local loss is smoothed; a head's gradient stays a plain cross-entropy's
    assert DADAutogradLinear(8, 6, num_classes=3).label_smoothing == HIDDEN_LABEL_SMOOTHING == 0.1
    assert DADAutogradLinear(8, 3).label_smoothing == 0.0
    assert DADAutogradLinear(8, 6, num_classes=3, label_smoothing=0.0).label_smoothing == 0.0
    assert DADAutogradLinear(8, 3, label_smoothing=0.2).label_smoothing == 0.2
    model = td.to_dad(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)), 3)
    assert [m.label_smoothing for m in model.modules() if isinstance(m, DADAutogradLinear)] == [0.1, 0.0]
    with pytest.raises(ValueError, match="label_smoothing"):
        DADAutogradLinear(8, 6, num_classes=3, label_smoothing=1.5)


def test_hidden_inplace_equals_torch_adamw_on_oracle_gradients():
    layer = DADAutogradLinear(13, 19, num_classes=5, activation="gelu", lr=2e-3, weight_decay=0.1, dtype=F64)
    params = [t.detach().clone().requires_grad_(True) for t in layer.trained_tensors()]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.1)
    for _ in range(3):
        x, y = torch.randn(31, 13, dtype=F64), torch.randint(0, 5, (31,))
        r = functional.local_loss_and_gradients(
            x, *[p.detach() for p in params], y, "gelu", label_smoothing=layer.label_smoothing
        )
        for p, g in zip(params, (r.grad_weight, r.grad_bias, r.grad_head_weight, r.grad_head_bias)):
            p.grad = g
        opt.step()
        with label_context(layer, y):
            layer(x).sum().backward()
    for got, want in zip(layer.trained_tensors(), params):
        assert relative_error(got.detach(), want.detach()) < 1e-10


def test_hidden_layer_matches_dadlinear_local_step():
    """Same math as DADLinear: one backward == one DADLinear.local_step with the same weights."""
    layer = DADAutogradLinear(21, 33, num_classes=4, dtype=F64)
    dad = td.DADLinear(21, 33, num_classes=4, dtype=F64, label_smoothing=layer.label_smoothing)
    layer.load_state_dict(dad.state_dict())
    x, y = torch.randn(40, 21, dtype=F64), torch.randint(0, 4, (40,))
    dad.local_step(x, y)
    with label_context(layer, y):
        layer(x).sum().backward()
    for got, want in zip(layer.trained_tensors(), dad.trained_tensors()):
        assert relative_error(got.detach(), want.detach()) < 1e-10


def test_auto_early_gradients_keep_no_logits_for_a_wide_head():
    """A vocab-sized head saves its gradient (V x D), not x and the logits (N x V)."""
    head = DADAutogradLinear(16, 500)
    x, y = torch.randn(3, 40, 16), torch.randint(0, 500, (3, 40))
    with label_context(head, y):
        out = head(x)
    shapes = {tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None}
    assert shapes == {(500, 16), (500,)}
    hidden = DADAutogradLinear(784, 512, num_classes=10)  # a 784-512 layer at batch 64 keeps activations
    with label_context(hidden, torch.randint(0, 10, (64,))):
        out = hidden(torch.randn(64, 784))
    shapes = {tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None}
    assert shapes == {(64, 784), (64, 512)}


# ---------------------------------------------------------------- backprop_gradients
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("update", ["inplace", "grad"])
@pytest.mark.parametrize("early", EARLY)
def test_backprop_gradients_equal_autograd_with_pre_update_weights(act, update, early):
    role = "head" if act == "identity" else "hidden"
    layer = DADAutogradLinear(
        17,
        9,
        num_classes=9 if role == "head" else 4,
        activation=None if role == "head" else act,
        backprop_gradients=True,
        update=update,
        lr=0.1,
        dtype=F64,
        role=role,
    )
    layer.early_gradients = early
    ref = _ref_linear(layer)
    x = torch.randn(2, 15, 17, dtype=F64)
    y = torch.randint(0, layer.num_classes, (2, 15))
    upstream = torch.randn(2, 15, 9, dtype=F64)

    def loss_of(out):  # an arbitrary upstream loss, not the layer's own
        return (torch.sin(out) * upstream).sum() + out.pow(2).mean()

    x_ref = x.clone().requires_grad_(True)
    loss_of(_act(ref(x_ref), act)).backward()
    x_dad = x.clone().requires_grad_(True)
    before = layer.weight.detach().clone()
    with label_context(layer, y):
        out = layer(x_dad)
    assert relative_error(out.detach(), _act(ref(x), act).detach()) < 1e-12
    loss_of(out).backward()
    assert relative_error(x_dad.grad, x_ref.grad) < 1e-10
    if update == "inplace":  # the update did happen, after dL/dx was taken
        assert relative_error(layer.weight.detach(), before) > 1e-4
    else:  # and it is the oracle's local gradient
        if role == "head":
            want = functional.head_loss_and_gradients(x.reshape(-1, 17), ref.weight.detach(), ref.bias.detach(), y.reshape(-1))
        else:
            want = functional.local_loss_and_gradients(
                x.reshape(-1, 17),
                ref.weight.detach(),
                ref.bias.detach(),
                layer.head_weight.detach(),
                layer.head_bias.detach(),
                y.reshape(-1),
                act,
                label_smoothing=layer.label_smoothing,
            )
        assert relative_error(layer.weight.grad, want.grad_weight) < 1e-10


def test_default_stops_the_backward_chain():
    backbone = torch.nn.Linear(8, 8)
    layer = DADAutogradLinear(8, 3, num_classes=3)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    with label_context(layer, y):
        Fn.cross_entropy(layer(backbone(x)), y).backward()
    assert backbone.weight.grad is None


# ---------------------------------------------------------------- gradient accumulation
@pytest.mark.parametrize("role", ["head", "hidden"])
@pytest.mark.parametrize("early", EARLY)
def test_gradient_accumulation_sums_local_gradients(role, early):
    kw = {"num_classes": 5}  # the head: num_classes == out_features, and the .sum() loss is meant
    out_features = 11 if role == "hidden" else 5
    layer = DADAutogradLinear(14, out_features, update="grad", dtype=F64, **kw)
    layer.early_gradients = early
    batches = [(torch.randn(n, 14, dtype=F64), torch.randint(0, 5, (n,))) for n in (6, 9, 4)]
    singles = []
    for x, y in batches:  # one by one, from zero
        layer.zero_grad(set_to_none=True)
        with label_context(layer, y):
            layer(x).sum().backward()
        singles.append([p.grad.clone() for p in layer.parameters()])
    layer.zero_grad(set_to_none=True)
    for x, y in batches:  # N micro-batch backwards before one step
        with label_context(layer, y):
            layer(x).sum().backward()
    for i, p in enumerate(layer.parameters()):
        assert torch.equal(p.grad, singles[0][i] + singles[1][i] + singles[2][i])
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    before = layer.weight.detach().clone()
    opt.step()
    assert torch.equal(layer.weight.detach(), before - 0.5 * layer.weight.grad)


# ---------------------------------------------------------------- labels and errors
def test_training_forward_without_labels_raises_and_keeps_state():
    layer = DADAutogradLinear(6, 4, num_classes=3)
    before = _state(layer)
    with pytest.raises(ValueError, match="set_y_context"):
        layer(torch.randn(2, 6))
    assert _same_state(layer, before)


@pytest.mark.parametrize(
    "x_shape, labels, exc, match",
    [
        ((5, 6), torch.zeros(4, dtype=torch.long), ValueError, "leading dims"),
        ((2, 3, 6), torch.zeros(2, dtype=torch.long), ValueError, "leading dims"),
        ((5, 6), torch.tensor([0, 1, 3, 0, 1]), ValueError, "num_classes=3"),
        ((5, 6), torch.tensor([0, 1, -1, 0, 1]), ValueError, "ignore_index"),
        ((5, 6), torch.zeros(5), TypeError, "integer class ids"),
    ],
)
def test_bad_labels_raise_and_keep_state(x_shape, labels, exc, match):
    layer = DADAutogradLinear(6, 4, num_classes=3)
    layer.set_y_context(labels)
    before = _state(layer)
    with pytest.raises(exc, match=match):
        layer(torch.randn(*x_shape))
    assert _same_state(layer, before)
    assert layer.y_context is labels


def test_bad_inputs_and_label_types():
    layer = DADAutogradLinear(6, 3)
    with pytest.raises(TypeError, match="set_y_context|labels"):
        layer.set_y_context([0, 1])
    with pytest.raises(ValueError, match="in_features=6"):
        layer.eval()(torch.randn(2, 5))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(2, 6, dtype=F64))
    with pytest.raises(TypeError, match="labels"):
        with label_context(layer, "cats"):
            pass


def test_ignore_index_is_configurable_and_all_ignored_is_a_no_op_gradient():
    layer = DADAutogradLinear(6, 3, num_classes=3, update="grad", ignore_index=7, dtype=F64)
    ref = _ref_linear(layer)
    x, y = torch.randn(8, 6, dtype=F64), torch.tensor([0, 7, 2, 7, 1, 0, 7, 2])
    Fn.cross_entropy(ref(x), y, ignore_index=7).backward()
    with label_context(layer, y):
        layer(x).sum().backward()
    assert relative_error(layer.weight.grad, ref.weight.grad) < 1e-10
    layer.zero_grad()
    with label_context(layer, torch.full((8,), 7)):
        layer(x).sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))


def test_label_context_sets_every_module_and_restores():
    model = torch.nn.Sequential(
        DADAutogradLinear(6, 8, num_classes=3), torch.nn.ReLU(), torch.nn.Sequential(DADAutogradLinear(8, 3, num_classes=3))
    )
    old = torch.tensor([1, 1])
    model[0].set_y_context(old)
    y = torch.randint(0, 3, (4,))
    with label_context(model, y):
        assert model[0].y_context is y and model[2][0].y_context is y
        model(torch.randn(4, 6)).sum().backward()
    assert model[0].y_context is old and model[2][0].y_context is None
    assert float(model[0].optim_state.step) == 1 and float(model[2][0].optim_state.step) == 1


# ---------------------------------------------------------------- eval / no_grad / frozen
def test_eval_and_no_grad_need_no_labels_and_change_nothing():
    layer = DADAutogradLinear(6, 8, num_classes=3, activation="tanh")
    x = torch.randn(4, 6)
    want = torch.tanh(Fn.linear(x, layer.weight, layer.bias))
    before = _state(layer)
    with torch.no_grad():
        assert torch.allclose(layer(x), want)
    layer.eval()
    assert torch.allclose(layer(x), want)
    layer(x).sum().backward()  # eval + grad: an ordinary linear layer, no local update
    assert _same_state(layer, before)
    assert float(layer.optim_state.step) == 0


def test_frozen_layer_needs_no_labels_and_does_not_update():
    layer = DADAutogradLinear(6, 3, backprop_gradients=True).requires_grad_(False)
    before = _state(layer)
    x = torch.randn(4, 6, requires_grad=True)
    ref = torch.autograd.grad(Fn.linear(x, layer.weight, layer.bias).pow(2).sum(), x)[0]
    layer(x).pow(2).sum().backward()
    assert _same_state(layer, before)
    assert torch.allclose(x.grad, ref)


# ---------------------------------------------------------------- state dicts
def test_loads_nn_linear_state_dict_and_keeps_local_state():
    layer = DADAutogradLinear(6, 8, num_classes=3)
    with label_context(layer, torch.randint(0, 3, (5,))):
        layer(torch.randn(5, 6)).sum().backward()
    local = {k: v.clone() for k, v in layer.state_dict().items() if k not in ("weight", "bias")}
    lin = torch.nn.Linear(6, 8)
    assert not layer.load_state_dict(lin.state_dict()).missing_keys
    assert torch.equal(layer.weight, lin.weight) and torch.equal(layer.bias, lin.bias)
    for k, v in local.items():
        assert torch.equal(layer.state_dict()[k], v), k
    # nested, strict, as when loading a checkpoint saved with an nn.Linear in this place
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), DADAutogradLinear(6, 8, num_classes=3))
    saved = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 8)).state_dict()
    model.load_state_dict(saved)
    assert torch.equal(model[1].weight, saved["1.weight"])
    # a genuinely incomplete dict still fails under strict
    with pytest.raises(RuntimeError, match="weight"):
        layer.load_state_dict({"bias": lin.bias.detach()})


def test_state_dict_roundtrip_between_dad_layers():
    a = DADAutogradLinear(6, 8, num_classes=3)
    with label_context(a, torch.randint(0, 3, (5,))):
        a(torch.randn(5, 6)).sum().backward()
    b = DADAutogradLinear(6, 8, num_classes=3)
    b.load_state_dict(a.state_dict())
    assert _same_state(b, a.state_dict())


def test_from_linear_keeps_pretrained_weights():
    lin = torch.nn.Linear(10, 4, dtype=F64)
    layer = DADAutogradLinear.from_linear(lin, 4, update="grad")
    assert layer.role == "head" and layer.weight.dtype == F64
    x = torch.randn(3, 10, dtype=F64)
    assert torch.equal(layer.eval()(x), lin(x))
    with pytest.raises(TypeError, match="in_features"):
        DADAutogradLinear.from_linear(lin, 4, in_features=3)


# ---------------------------------------------------------------- hazards
def _block(layer_kwargs, seed=0, early=None):
    torch.manual_seed(seed)
    backbone = torch.nn.Linear(12, 10, dtype=F64)
    layer = DADAutogradLinear(10, 6, num_classes=3, backprop_gradients=True, dtype=F64, **layer_kwargs)
    layer.early_gradients = early
    return backbone, layer


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("early", EARLY)
def test_checkpoint_gives_the_same_update_and_input_gradients(reentrant, early):
    x, y = torch.randn(7, 12, dtype=F64), torch.randint(0, 3, (7,))
    results = []
    for use_checkpoint in (False, True):
        backbone, layer = _block({}, early=early)
        head = torch.nn.Linear(6, 3, dtype=F64)
        block = torch.nn.Sequential(backbone, torch.nn.Tanh(), layer)

        xin = x.clone().requires_grad_(True)
        with label_context(layer, y):
            h = checkpoint(block, xin, use_reentrant=reentrant) if use_checkpoint else block(xin)
        # the labels are cleared before backward: the recomputation must not need them
        Fn.cross_entropy(head(h), y).backward()
        results.append((layer.weight.detach().clone(), backbone.weight.grad.clone(), xin.grad.clone()))
        assert float(layer.optim_state.step) == 1
    for plain, ckpt in zip(*results):
        assert relative_error(ckpt, plain) < 1e-12


@pytest.mark.parametrize("early", EARLY)
def test_second_backward_through_one_graph(early):
    # update="inplace": a second backward would re-apply a stale update -> clear error, state kept
    _, layer = _block({}, early=early)
    x, y = torch.randn(7, 10, dtype=F64), torch.randint(0, 3, (7,))
    with label_context(layer, y):
        loss = layer(x).pow(2).sum()
    loss.backward(retain_graph=True)
    after_first = _state(layer)
    with pytest.raises(RuntimeError, match="fresh forward"):
        loss.backward()
    assert _same_state(layer, after_first)
    # two forwards of the layer before one backward: also refused
    with label_context(layer, y):
        loss = layer(x).sum() + layer(x).sum()
    with pytest.raises(RuntimeError, match="update='grad'"):
        loss.backward()
    # update="grad": exactly what autograd does for nn.Linear, the gradients add up
    _, layer = _block({"update": "grad"}, early=early)
    with label_context(layer, y):
        loss = layer(x).pow(2).sum()
    loss.backward(retain_graph=True)
    once = layer.weight.grad.clone()
    loss.backward()
    assert torch.equal(layer.weight.grad, 2 * once)


def test_double_backward_is_refused():
    _, layer = _block({"update": "grad"})
    x = torch.randn(7, 10, dtype=F64, requires_grad=True)
    with label_context(layer, torch.randint(0, 3, (7,))):
        out = layer(x)
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|differentiable"):
        gx.sum().backward()


def test_weights_changed_between_forward_and_backward_raise():
    _, layer = _block({"update": "grad"})
    with label_context(layer, torch.randint(0, 3, (7,))):
        out = layer(torch.randn(7, 10, dtype=F64))
    with torch.no_grad():
        layer.weight.mul_(0.5)  # e.g. optimizer.step() before loss.backward()
    with pytest.raises(RuntimeError, match="between its forward and its backward"):
        out.sum().backward()


@pytest.mark.parametrize("update", ["inplace", "grad"])
def test_grad_scaler_does_not_scale_the_local_update(update):
    """Local update independent of the loss scale; dL/dx carries the scale like backprop's."""
    x, y = torch.randn(9, 12), torch.randint(0, 3, (9,))
    runs = []
    for scale in (None, 1024.0):
        torch.manual_seed(0)
        backbone = torch.nn.Linear(12, 10)
        layer = DADAutogradLinear(10, 3, backprop_gradients=True, update=update, lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale is not None)
        layer.grad_scaler = scaler
        opt = torch.optim.SGD([*backbone.parameters(), *(layer.parameters() if update == "grad" else [])], lr=0.1)
        with label_context(layer, y):
            loss = Fn.cross_entropy(layer(backbone(x)), y)
        scaler.scale(loss).backward()
        raw = backbone.weight.grad.clone()
        scaler.unscale_(opt)
        runs.append((raw, backbone.weight.grad.clone(), layer.weight.grad, layer.weight.detach().clone()))
        scaler.step(opt)
    (raw0, unscaled0, lgrad0, w0), (raw1, unscaled1, lgrad1, w1) = runs
    assert relative_error(raw1, 1024.0 * raw0) < 1e-6  # dL/dx is scaled, consistent with the scaler
    assert relative_error(unscaled1, unscaled0) < 1e-6
    if update == "inplace":
        assert lgrad0 is None and lgrad1 is None
        assert relative_error(w1, w0) < 1e-6  # the in-place update saw no scale
    else:
        assert relative_error(lgrad1, lgrad0) < 1e-6  # .grad was scaled, then unscaled by the scaler


def test_float16_grad_mode_without_scaler_warns_once():
    layer = DADAutogradLinear(10, 3, update="grad", dtype=torch.float16)
    x, y = torch.randn(4, 10, dtype=torch.float16), torch.randint(0, 3, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with label_context(layer, y):
                layer(x).float().sum().backward()
    assert sum("grad_scaler" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_head_gradients_match_the_oracle(dtype):
    layer = DADAutogradLinear(48, 10, update="grad")
    x, y = torch.randn(3, 21, 48), torch.randint(0, 10, (3, 21))
    with torch.autocast("cpu", dtype=dtype):
        with label_context(layer, y):
            out = layer(x)
        assert out.dtype == dtype
        Fn.cross_entropy(out.float().reshape(-1, 10), y.reshape(-1)).backward()
    assert layer.weight.grad.dtype == torch.float32
    w, b = layer.weight.detach(), layer.bias.detach()
    ref = functional.head_loss_and_gradients(x.reshape(-1, 48).double(), w.double(), b.double(), y.reshape(-1))
    # reference error of the same math in `dtype`, plus a per-dtype margin
    low = functional.head_loss_and_gradients(x.reshape(-1, 48).to(dtype), w.to(dtype), b.to(dtype), y.reshape(-1))
    allowed = 2 * relative_error(low.grad_weight, ref.grad_weight) + {torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert relative_error(layer.weight.grad, ref.grad_weight) <= allowed


# ---------------------------------------------------------------- CUDA (runs only where a GPU exists)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("early", EARLY)
def test_cuda_head_matches_oracle_and_torch_adamw(amp, early):
    dev, dtype = torch.device("cuda"), amp or torch.float32
    grad_layer = DADAutogradLinear(96, 1001, update="grad", device=dev)
    layer = DADAutogradLinear(96, 1001, lr=1e-3, device=dev)
    layer.load_state_dict(grad_layer.state_dict())
    grad_layer.early_gradients = layer.early_gradients = early
    x, y = torch.randn(4, 37, 96, device=dev), torch.randint(0, 1001, (4, 37), device=dev)
    y[:, -3:] = -100
    w0, b0 = grad_layer.weight.detach().double(), grad_layer.bias.detach().double()
    oracle = functional.head_loss_and_gradients(x.reshape(-1, 96).double(), w0, b0, y.reshape(-1))
    low = functional.head_loss_and_gradients(x.reshape(-1, 96).to(dtype), w0.to(dtype), b0.to(dtype), y.reshape(-1))
    for dad in (grad_layer, layer):
        with torch.autocast("cuda", dtype=dtype, enabled=amp is not None):
            with label_context(dad, y):
                Fn.cross_entropy(dad(x).float().reshape(-1, 1001), y.reshape(-1)).backward()
    margin = {None: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[amp]
    allowed = 2 * relative_error(low.grad_weight, oracle.grad_weight) + margin
    assert relative_error(grad_layer.weight.grad, oracle.grad_weight) <= allowed
    # the in-place layer took torch's fused AdamW step on that same gradient
    opt = torch.optim.AdamW(grad_layer.parameters(), lr=1e-3, fused=True)
    opt.step()
    assert relative_error(layer.weight.detach(), grad_layer.weight.detach()) < 1e-6
    assert relative_error(layer.bias.detach(), grad_layer.bias.detach()) < 1e-6
