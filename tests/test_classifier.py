"""The classifier object: what it allocates by default, and its calibrated solve."""

import pytest
import torch
from torch import nn

import torch_dad as td
from torch_dad.ridge import logit_scale


class WideConv(td.DADModel):
    """A classifier on 64 x 14 x 14 = 12,544 features, as the residual and VGG benchmark nets have."""

    def __init__(self):
        super().__init__()
        self.conv = td.DADConv2d(1, 64, 3, stride=2, padding=1, num_classes=10)
        self.classifier = nn.Linear(64 * 14 * 14, 10)


def state_bytes(trainer):
    return sum(t.numel() * t.element_size() for t in trainer.state_tensors()) + sum(
        t.numel() * t.element_size() for t in (trainer.classifier_sample.inputs, trainer.classifier_sample.labels)
    )


@pytest.mark.slow  # a 1.26 GB Gram matrix when asked for
def test_default_trainer_allocates_no_gram_matrix_for_a_wide_classifier():
    torch.manual_seed(0)
    trainer = td.DADTrainer(WideConv())
    assert trainer.classifier_statistics is None
    for _ in range(3):
        trainer.step(torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
    assert trainer.classifier_statistics is None
    assert state_bytes(trainer) < 100 * 2**20  # the Gram would be 12,544^2 x 8 bytes = 1.26 GB
    asked = td.DADTrainer(WideConv(), classifier_sample_size=0)
    assert asked.classifier_statistics is not None and asked.classifier_statistics.gram.shape[-1] >= 12544


def test_solve_is_calibrated_without_changing_predictions():
    torch.manual_seed(0)
    x = torch.randn(512, 20)
    y = (x[:, :4].argmax(1) + (torch.rand(512) < 0.1).long()) % 4

    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(20, 32, num_classes=4)
            self.classifier = nn.Linear(32, 4)

    trainer = td.DADTrainer(Net(), lr=3e-3)
    trainer.fit((x, y), epochs=3, batch_size=64, progress=False)
    solution = trainer.solve_head(lambda_reg=0.1)
    with torch.no_grad():
        feats = trainer.model.features(x).double()
        raw = feats @ solution.weight.T.double() + solution.bias.double()
    calibrated = trainer.model(x).double()
    assert torch.equal(raw.argmax(1), calibrated.argmax(1))
    raw_loss = nn.functional.cross_entropy(raw, y)
    assert nn.functional.cross_entropy(calibrated, y) < raw_loss
    # the solve reset the sample: a re-iterable loader is calibrated on, a one-shot iterator cannot be
    for loader, calibrates in (([(x, y)], True), (iter([(x, y)]), False)):
        solution = trainer.solve_head(lambda_reg=0.1, loader=loader)
        with torch.no_grad():
            raw = trainer.model.features(x).double() @ solution.weight.T.double() + solution.bias.double()
            calibrated = trainer.model(x).double()
        assert torch.equal(raw.argmax(1), calibrated.argmax(1))
        if calibrates:
            assert nn.functional.cross_entropy(calibrated, y) < nn.functional.cross_entropy(raw, y)
        else:
            assert torch.allclose(calibrated, raw, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logit_scale_minimises_cross_entropy(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(300, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (300,), generator=g)
    labels[:200] = logits[:200].argmax(1)
    scale = logit_scale(logits, labels)
    grid = torch.linspace(0.01, 20, 4000, dtype=torch.float64)
    losses = torch.stack([nn.functional.cross_entropy(s * logits, labels) for s in grid])
    best = float(grid[losses.argmin()])
    assert abs(scale - best) < 0.01
    assert nn.functional.cross_entropy(scale * logits, labels) <= nn.functional.cross_entropy(logits, labels)


def test_logit_scale_checks_its_inputs():
    with pytest.raises(ValueError, match="must be"):
        logit_scale(torch.zeros(3), torch.zeros(3, dtype=torch.long))
