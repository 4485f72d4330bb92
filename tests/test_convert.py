"""``torch_dad.to_dad``: every ``nn.Linear`` of a model becomes a ``DADAutogradLinear`` with its role."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_dad as td
from torch_dad import DADAutogradLinear


def _mlp(activation=torch.nn.ReLU):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), activation(),
        torch.nn.Linear(16, 8), activation(),
        torch.nn.Linear(8, 4),
    )  # fmt: skip


def _snapshot(model):
    return [(type(m), {k: v.clone() for k, v in m.state_dict().items()}) for m in model.modules()]


def _same(model, before):
    after = _snapshot(model)
    return len(after) == len(before) and all(
        ta is tb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        for (ta, sa), (tb, sb) in zip(after, before)
    )


def test_roles_activations_and_weights():
    model = _mlp()
    x = torch.randn(5, 12)
    with torch.no_grad():
        expected = model(x)
    weights = [m.weight.detach().clone() for m in model if isinstance(m, torch.nn.Linear)]
    assert td.to_dad(model, num_classes=4) is model
    layers = [m for m in model if isinstance(m, DADAutogradLinear)]
    assert [(m.role, m.num_classes, m.activation) for m in layers] == [
        ("hidden", 4, "relu"),
        ("hidden", 4, "relu"),
        ("head", 4, "identity"),
    ]
    assert [type(m) for m in model][1::2] == [torch.nn.Identity, torch.nn.Identity]  # ReLU moved into the layer
    assert all(torch.equal(m.weight, w) for m, w in zip(layers, weights))
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)  # the same function


@pytest.mark.parametrize("activation, name", [(torch.nn.Tanh, "tanh"), (torch.nn.GELU, "gelu")])
def test_non_idempotent_activation_applied_once(activation, name):
    model = _mlp(activation)
    x = torch.randn(5, 12)
    with torch.no_grad():
        expected = model(x)
    td.to_dad(model, num_classes=4)
    assert model[0].activation == name and isinstance(model[1], torch.nn.Identity)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)


def test_custom_forward_keeps_its_activation():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(6, 9)
            self.out = torch.nn.Linear(9, 3)

        def forward(self, x):
            return self.out(torch.tanh(self.body(x)))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 6)
    with torch.no_grad():
        expected = net(x)
    td.to_dad(net, num_classes=3, update="grad", lr=5e-3)
    assert (net.body.role, net.body.activation, net.out.role) == ("hidden", "identity", "head")
    assert net.body.update == "grad" and net.out.update == "grad"
    with torch.no_grad():
        torch.testing.assert_close(net(x), expected)


def test_shared_and_frozen_linears():
    shared = torch.nn.Linear(8, 8)
    relu = torch.nn.ReLU()
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), relu, shared, relu, shared, relu, torch.nn.Linear(8, 3))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    td.to_dad(model, num_classes=3)
    assert model[2] is model[4] and model[2].role == "hidden"  # one layer, still shared
    assert [type(m) for m in model][1::2] == [torch.nn.Identity] * 3
    assert not model[0].weight.requires_grad and torch.equal(model[0].weight, frozen)


def test_last_linear_in_registration_order_is_the_classifier():
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model.add_module("extra", torch.nn.Linear(3, 8))
    before = _snapshot(model)
    with pytest.raises(ValueError, match="out_features=8 but num_classes=3"):
        td.to_dad(model, num_classes=3)
    assert _same(model, before)


def test_trains_in_an_unchanged_loop():
    model = _mlp()
    td.to_dad(model, num_classes=4)
    before = [m.weight.detach().clone() for m in model if isinstance(m, DADAutogradLinear)]
    x, y = torch.randn(32, 12), torch.randint(0, 4, (32,))
    with td.label_context(model, y):
        F.cross_entropy(model(x), y).backward()
    after = [m.weight for m in model if isinstance(m, DADAutogradLinear)]
    assert all(not torch.equal(a, b) for a, b in zip(after, before))  # every layer stepped


@pytest.mark.parametrize(
    "make, kwargs, error, match",
    [
        (_mlp, {"num_classes": 3}, ValueError, "out_features=4 but num_classes=3"),
        (_mlp, {"num_classes": 1}, ValueError, "num_classes"),
        (_mlp, {"num_classes": 4, "role": "hidden"}, TypeError, "role"),
        (_mlp, {"num_classes": 4, "activation": "relu"}, TypeError, "activation"),
        (_mlp, {"num_classes": 4, "update": "later"}, ValueError, "update"),
        (lambda: torch.nn.Sequential(torch.nn.ReLU()), {"num_classes": 4}, ValueError, "no torch.nn.Linear"),
        (lambda: torch.nn.Linear(3, 4), {"num_classes": 4}, TypeError, "from_linear"),
        (lambda: td.to_dad(_mlp(), num_classes=4), {"num_classes": 4}, ValueError,
         "the Sequential is already converted"),
    ],
)
def test_bad_input_leaves_the_model_unchanged(make, kwargs, error, match):
    model = make()
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        td.to_dad(model, **kwargs)
    assert _same(model, before)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        td.to_dad([torch.nn.Linear(3, 4)], num_classes=4)


@pytest.mark.parametrize("final", [torch.nn.Softmax, torch.nn.LogSoftmax])
def test_softmax_after_the_classifier_warns_naming_it(final):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()
            self.out = torch.nn.Sequential(torch.nn.Dropout(0.0), final(dim=1))

        def forward(self, x):
            return self.out(self.body(x))

    model = Net()
    with pytest.warns(UserWarning, match=rf"to_dad: 'out\.1' \({final.__name__}\) comes after the classifier "
                      r"'body\.4'.* a softmax a second time"):
        td.to_dad(model, num_classes=4)
    assert isinstance(model.body[4], DADAutogradLinear)  # converted all the same


def test_softmax_before_the_classifier_gives_no_warning():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Softmax(dim=1), torch.nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td.to_dad(model, num_classes=3)
