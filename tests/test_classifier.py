"""The classifier object: what it allocates by default, and its calibrated solve."""

import pytest
import torch
from torch import nn

import torch_dad as td
from tests.conftest import relative_error
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


class WideHead(td.DADModel):
    """A classifier on 300 features, more than the 64-row input sample it is solved from."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.l1 = td.DADLinear(20, 300, num_classes=4)
        self.classifier = nn.Linear(300, 4, bias=bias)


def _wide_trainer(bias: bool) -> tuple[td.DADTrainer, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A WideHead trained for a few steps, and its input sample's rows as one batch."""
    torch.manual_seed(0)
    x = torch.randn(64, 20)
    y = (x[:, :4].argmax(1) + (torch.rand(64) < 0.2).long()) % 4
    trainer = td.DADTrainer(WideHead(bias), lr=3e-3, classifier_sample_size=64)
    trainer.fit((x, y), epochs=2, batch_size=16, progress=False)
    sample = trainer.classifier_sample
    assert sample is not None and sample.size == 64
    return trainer, [(sample.inputs[:64].clone(), sample.labels[:64].clone())]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lambda_reg", ["auto", 0.5])
def test_solve_head_solves_a_small_sample_in_the_dual(monkeypatch, bias, lambda_reg):
    """64 rows, 300 features: no 300 x 300 Gram, and the primal's head on the same features to 1e-6."""
    from torch_dad import ridge

    trainer, rows = _wide_trainer(bias)
    with torch.no_grad():
        features = trainer.model.eval().features(rows[0][0]).double()
    primal = ridge.GramAccumulator(300, 4)
    primal.update(features, rows[0][1])
    want = primal.solve(lambda_reg)

    def no_gram(*args, **kwargs):
        raise AssertionError("the primal solve ran")

    monkeypatch.setattr(ridge, "solve_ridge_from_gram", no_gram)
    got = trainer.solve_head(lambda_reg)  # from the input sample, which it then resets
    assert trainer.classifier_sample.size == 0
    assert got.lambda_reg == pytest.approx(want.lambda_reg, rel=1e-12) and got.num_samples == 64
    assert relative_error(got.weight, want.weight) <= 1e-6
    assert relative_error(got.bias, want.bias) <= 1e-6
    # what the classifier holds: the solution times the calibration's one positive scale
    weight = trainer.model.classifier.weight.detach().double()
    scale = float(weight.norm() / got.weight.norm())
    assert scale > 0 and relative_error(weight, scale * got.weight) <= 1e-6
    assert (trainer.model.classifier.bias is None) == (not bias)


def test_a_statistics_reducer_sums_the_gram_of_a_small_sample():
    """Under a statistics reducer (data parallelism sums ``buffers()`` over ranks) the rows become the Gram
    first, and the primal solves: the same head as the dual's."""
    trainer, rows = _wide_trainer(True)
    dual = trainer.solve_head(0.5, loader=rows)
    seen = []

    def reducer(stats):
        seen.append([tuple(b.shape) for b in stats.buffers()])

    trainer.set_reducers(statistics_reducer=reducer)
    primal = trainer.solve_head(0.5, loader=rows)
    assert len(seen) == 1 and (300, 300) in seen[0]
    # the fold sums the rows' products in float32, as the streamed statistics do
    assert relative_error(primal.weight, dual.weight) <= 1e-4
