"""Catalogue of bad inputs across the public API: each raises ValueError/TypeError whose message names the
argument, and leaves every parameter, optimizer moment and statistic unchanged (full state compared)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import torch_dad as td
from torch_dad.ridge import GramAccumulator
from torch_dad.training.input_sample import InputReservoir


class Net(td.DADModel):
    def __init__(self, classifier=True):
        super().__init__()
        self.l1 = td.DADLinear(12, 16, num_classes=3)
        self.l2 = td.DADLinear(16, 8, num_classes=3)
        if classifier:
            self.classifier = torch.nn.Linear(8, 3)


def trainer_state(trainer):
    state = trainer.state_dict()
    flat = {}
    for group in ("model", "classifier_state", "classifier_statistics", "classifier_sample"):
        for key, value in (state.get(group) or {}).items():
            if isinstance(value, torch.Tensor):
                flat[f"{group}.{key}"] = value.clone()
    flat["step_count"] = torch.tensor(state["step_count"])
    return flat


def trained_trainer(**kwargs):
    trainer = td.DADTrainer(Net(), **kwargs)
    trainer.step(torch.randn(6, 12), torch.randint(0, 3, (6,)))
    return trainer


X, Y = torch.randn(6, 12), torch.randint(0, 3, (6,))


def _autograd_layer():
    layer = td.DADAutogradLinear(12, 3, num_classes=3)
    layer.train()
    return layer


def _stale_context(layer):
    layer.set_y_context(torch.randint(0, 3, (4,)))
    return layer(torch.randn(6, 12)).sum().backward()


TRAINER_CASES = [
    ("step: 0-dim input", lambda t: t.step(torch.tensor(1.0), Y), ValueError, "batch dimension"),
    ("step: negative lr", lambda t: t.step(X, Y, lr=-1.0), ValueError, "lr="),
    ("step: fp16 on CPU", lambda t: t.step(X, Y, amp_dtype=torch.float16), ValueError, "amp_dtype"),
    ("step: int8 amp", lambda t: t.step(X, Y, amp_dtype=torch.int8), ValueError, "amp_dtype"),
    ("step: label too large", lambda t: t.step(X, torch.full_like(Y, 3)), ValueError, r"labels must lie in \[0, 3\)"),
    ("step: negative label", lambda t: t.step(X, -torch.ones_like(Y)), ValueError, r"labels must lie in \[0, 3\)"),
    ("step: float labels", lambda t: t.step(X, Y.float()), TypeError, "integer class ids"),
    ("step: 2-D labels", lambda t: t.step(X, Y.unsqueeze(1)), ValueError, "one class id per row"),
    ("step: label count", lambda t: t.step(X, Y[:5]), ValueError, "one class id per row"),
    ("step: input width", lambda t: t.step(torch.randn(6, 11), Y), ValueError, "in_features=12"),
    ("step: empty batch", lambda t: t.step(X[:0], Y[:0]), ValueError, "empty batch"),
    ("step: NaN input", lambda t: t.step(X.clone().fill_(float("nan")), Y), ValueError, "NaN or Inf"),
    ("step: Inf input", lambda t: t.step(torch.cat([X[:5], torch.full((1, 12), float("inf"))]), Y), ValueError, "NaN or Inf"),
    ("step: integer inputs", lambda t: t.step(X.long(), Y), TypeError, "convert them with .float()"),
    ("step: inputs not a tensor", lambda t: t.step(X.tolist(), Y), TypeError, "torch.Tensor"),
    ("step: bool labels", lambda t: t.step(X, Y > 0), TypeError, "integer class ids"),
    ("fit: epochs=0", lambda t: t.fit((X, Y), epochs=0, progress=False), ValueError, "epochs=0"),
    ("fit: label count", lambda t: t.fit((X, Y[:5]), epochs=1, progress=False), ValueError, "labels have 5"),
    ("solve_head: negative lambda", lambda t: t.solve_head(lambda_reg=-1.0), ValueError, "lambda_reg"),
    ("solve_head: unknown lambda", lambda t: t.solve_head(lambda_reg="best"), ValueError, "lambda_reg"),
    ("solve_head: bad loader labels", lambda t: t.solve_head(loader=[(X, Y + 5)]), ValueError, "labels must lie"),
    ("evaluate: no batches", lambda t: t.evaluate([]), ValueError, "no batches"),
    ("step: 1-D sample", lambda t: t.step(X[0], Y[:1]), ValueError, r"inputs have shape \(12,\);.*unsqueeze\(0\)"),
    ("step: 1-D batch of 20", lambda t: t.step(torch.randn(20), Y), ValueError, r"inputs have shape \(20,\); expected \(batch, 12\)"),
    ("step: 3-D wrong width", lambda t: t.step(torch.randn(6, 3, 5), Y), ValueError, r"inputs have shape \(6, 3, 5\)"),
    ("fit: dict batch without label key", lambda t: t.fit([{"x": X, "target": Y}], progress=False), ValueError,
     r"label key \('labels', 'label', 'y'\); got keys \['target', 'x'\]"),
    ("fit: batch of strings", lambda t: t.fit(["ab"], progress=False), TypeError, "pair \\(inputs, labels\\) or a dict"),
    ("fit: dict of tensors", lambda t: t.fit({"x": X, "labels": Y}, progress=False), TypeError, r"\(d\['x'\], d\['labels'\]\)"),
    ("evaluate: dict batch without input key", lambda t: t.evaluate([{"image": X, "label": Y}]), ValueError, "input key"),
]


@pytest.mark.parametrize("name, call, error, match", TRAINER_CASES, ids=[c[0] for c in TRAINER_CASES])
def test_trainer_bad_input_leaves_state_unchanged(name, call, error, match):
    trainer = trained_trainer()
    before = trainer_state(trainer)
    with pytest.raises(error, match=match):
        call(trainer)
    after = trainer_state(trainer)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_solve_head_before_any_data():
    trainer = td.DADTrainer(Net())
    before = trainer_state(trainer)
    with pytest.raises(ValueError, match="nothing to solve from yet: no rows were trained on"):
        trainer.solve_head()
    assert all(torch.equal(v, trainer_state(trainer)[k]) for k, v in before.items())


CONSTRUCTION_CASES = [
    ("trainer: unknown optimizer", lambda: td.DADTrainer(Net(), optimizer="lion"), ValueError, "optimizer='lion'"),
    ("trainer: unknown local_loss", lambda: td.DADTrainer(Net(), local_loss="hebb"), ValueError, "hebb"),
    ("trainer: negative classifier_sample_size", lambda: td.DADTrainer(Net(), classifier_sample_size=-1), ValueError, "classifier_sample_size"),
    ("trainer: unknown on_nonfinite", lambda: td.DADTrainer(Net(), on_nonfinite="warn"), ValueError, "on_nonfinite"),
    ("trainer: device type", lambda: td.DADTrainer(Net(), device=0.5), TypeError, "device"),
    ("trainer: dropout 1", lambda: td.DADTrainer(Net(), dropout=1.0), ValueError, "dropout"),
    ("trainer: not a DADModel", lambda: td.DADTrainer(torch.nn.Linear(2, 2)), TypeError, "DADModel"),
    ("trainer: model without layers", lambda: td.DADTrainer(td.DADModel()), ValueError, "no DADLinear"),
    ("layer: unknown activation", lambda: td.DADLinear(3, 4, activation="swish"), ValueError, "activation='swish'"),
    ("layer: zero width", lambda: td.DADLinear(3, 0), ValueError, "out_features"),
    ("layer: one class", lambda: td.DADLinear(3, 4, num_classes=1), ValueError, "num_classes"),
    ("ridge: one class", lambda: GramAccumulator(4, 1), ValueError, "num_classes"),
    ("sample: negative seed", lambda: InputReservoir(4, 3, seed=-1), ValueError, "seed=-1"),
    ("sample: seed past 63 bits", lambda: InputReservoir(4, 3, seed=2**63), ValueError, r"\[0, 2\*\*63\)"),
    ("autograd: unknown update", lambda: td.DADAutogradLinear(3, 2, num_classes=2, update="later"), ValueError, "update"),
    ("autograd: unknown activation", lambda: td.DADAutogradLinear(3, 4, num_classes=2, activation="swish"), ValueError, "activation"),
]


@pytest.mark.parametrize("name, call, error, match", CONSTRUCTION_CASES, ids=[c[0] for c in CONSTRUCTION_CASES])
def test_bad_construction_is_rejected(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_classifier_of_wrong_width_or_type():
    class Wide(Net):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(9, 3)

    with pytest.raises(ValueError, match="classifier takes 9 features"):
        td.DADTrainer(Wide())

    class NotLinear(Net):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Sequential(torch.nn.Linear(8, 3))

    with pytest.raises(TypeError, match="nn.Linear"):
        td.DADTrainer(NotLinear())


AUTOGRAD_CASES = [
    ("training forward without labels", lambda m: m(torch.randn(6, 12)).sum().backward(), ValueError, "set_y_context"),
    ("labels out of range", lambda m: (m.set_y_context(torch.full((6,), 7)), m(torch.randn(6, 12)).sum().backward()),
     ValueError, "labels"),
    ("float labels", lambda m: (m.set_y_context(torch.zeros(6)), m(torch.randn(6, 12)).sum().backward()), TypeError,
     "labels"),
    ("label context from an earlier batch of another size", _stale_context, ValueError, r"labels have shape \(4,\)"),
    ("input width", lambda m: (m.set_y_context(torch.zeros(6, dtype=torch.long)), m(torch.randn(6, 11))), ValueError,
     "in_features=12"),
]


@pytest.mark.parametrize("name, call, error, match", AUTOGRAD_CASES, ids=[c[0] for c in AUTOGRAD_CASES])
def test_autograd_bad_input_leaves_state_unchanged(name, call, error, match):
    layer = _autograd_layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(error, match=match):
        call(layer)
    after = layer.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_replace_head_on_unsupported_model_lists_candidates():
    from torch_dad.integrations.transformers import replace_head

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match="nn.Linear|head"):
        replace_head(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_check_labels_allows_ignore_index_only_when_given():
    from torch_dad._checks import check_labels

    labels = torch.tensor([0, 2, -100, 1])
    check_labels(labels, 4, 3, ignore_index=-100)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\) \(num_classes=3\); got values in \[-100, -100\]"):
        check_labels(labels, 4, 3)
    with pytest.raises(ValueError, match="or equal ignore_index=-1; got values in"):
        check_labels(labels, 4, 3, ignore_index=-1)
    check_labels(labels, 4, 3, check_values=False)  # shape and dtype only


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_fit_rejects_a_bad_batch_size_before_training(batch_size):
    trainer = td.DADTrainer(Net())
    before = trainer_state(trainer)
    data = (torch.randn(16, Net().l1.in_features), torch.randint(0, 2, (16,)))
    with pytest.raises(ValueError, match=r"^batch_size=.* must be a positive int"):
        trainer.fit(data, batch_size=batch_size, progress=False)
    assert trainer.step_count == 0
    assert all(torch.equal(v, trainer_state(trainer)[k]) for k, v in before.items())


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"local_streams": -1}, ValueError, r"EngineOptions\(local_streams=-1\): must be an int >= 0"),
        ({"local_streams": True}, ValueError, r"EngineOptions\(local_streams=True\): must be an int >= 0"),
        ({"overlap": 1}, TypeError, r"EngineOptions\(overlap=1\): must be True or False"),
        ({"max_graphs": 0}, ValueError, r"EngineOptions\(max_graphs=0\): must be a positive int"),
    ],
)
def test_engine_options_name_the_bad_field(options, error, message):
    from torch_dad.training import EngineOptions

    with pytest.raises(error, match=message):
        EngineOptions(**options)
