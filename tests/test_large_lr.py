"""``optim.warn_if_large_lr``: one UserWarning for an AdamW learning rate above 1."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_dad import optim
from torch_dad.optim import OptimizerConfig, warn_if_large_lr

MESSAGE = (
    "lr=1e+06 with AdamW: each AdamW step moves every weight by about lr, so weights of order 1 are swamped by "
    "steps of 1e+06; AdamW learning rates are usually 1e-4 to 1e-2 (the default is 1e-3). This warning is shown once."
)


@pytest.fixture(autouse=True)
def not_yet_warned(monkeypatch):
    monkeypatch.setattr(optim, "_large_lr_warned", False)


def test_large_adamw_lr_warns_once_at_the_callers_line():
    with pytest.warns(UserWarning) as record:
        assert warn_if_large_lr(OptimizerConfig(lr=1e6))
    assert [str(w.message) for w in record] == [MESSAGE]
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_large_lr(OptimizerConfig(lr=1e6))  # once per process
        assert not warn_if_large_lr(OptimizerConfig(), lr=50.0)


def test_a_steps_lr_override_is_checked():
    with pytest.warns(UserWarning, match=r"^lr=50 with AdamW"):
        assert warn_if_large_lr(OptimizerConfig(lr=1e-3), lr=50.0)


@pytest.mark.parametrize(
    "config, lr",
    [
        (OptimizerConfig(lr=1.0), None),  # the bound itself
        (OptimizerConfig(lr=3e-4), None),
        (OptimizerConfig(lr=1e6), 1e-3),  # the step's lr replaces the config's
        (OptimizerConfig(name="sgd", lr=10.0), None),  # SGD steps scale with the gradient
        (OptimizerConfig(lr=1e-3), torch.tensor(1e6)),  # a device lr is not read
    ],
)
def test_no_warning(config, lr):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_large_lr(config, lr)


def test_the_trainer_warns_at_construction_and_for_a_steps_lr():
    import torch_dad as td

    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(6, 8, num_classes=3)
            self.classifier = torch.nn.Linear(8, 3)

    with pytest.warns(UserWarning, match=r"^lr=1e\+06 with AdamW") as record:
        td.DADTrainer(Net(), lr=1e6)
    assert record[0].filename == __file__
    optim._large_lr_warned = False
    trainer = td.DADTrainer(Net())
    with pytest.warns(UserWarning, match=r"^lr=50 with AdamW") as record:
        trainer.step(torch.randn(4, 6), torch.tensor([0, 1, 2, 0]), lr=50.0)
    assert record[0].filename == __file__
