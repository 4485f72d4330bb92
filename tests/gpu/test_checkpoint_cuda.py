"""``fit(checkpoint_dir=..., resume=True)`` on CUDA: interrupted, resumed in a new trainer, finished, and compared
with a run never interrupted.

Same step count, same data order, same classifier-sample rows and every integer tensor (counters, labels,
generator states) exactly. Float tensors (weights, moments, local heads) within a relative error of 1e-5: on CUDA
the fused local-error kernel adds its gradient sums with atomics, whose order varies from run to run, so the last
bits of a float32 sum can differ between any two runs, interrupted or not (README, Errors and guarantees).
"""

from __future__ import annotations

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error
from tests.gpu.conftest import requires_cuda
from torch_dad import data
from torch_dad.training import checkpoint

pytest.importorskip("safetensors")
pytestmark = requires_cuda

EPOCHS, BATCH, EVERY = 3, 64, 5
(X, Y), TEST = data.synthetic(num_train=1000, num_features=48, num_classes=5, seed=11)  # 16 batches an epoch


class Net(td.DADModel):
    def __init__(self):
        super().__init__()
        self.l1 = td.DADLinear(48, 96, num_classes=5)
        self.l2 = td.DADLinear(96, 64, num_classes=5, activation="tanh")
        self.classifier = torch.nn.Linear(64, 5)


class Interrupt(Exception):
    pass


def make_trainer(backend):
    torch.manual_seed(0)
    trainer = td.DADTrainer(Net(), device="cuda", backend=backend, classifier_sample_size=300)
    seen = trainer.seen_batches = {}  # type: ignore[attr-defined]
    step = trainer.step

    def recording_step(inputs, labels, **kwargs):  # type: ignore[no-untyped-def]
        result = step(inputs, labels, **kwargs)
        seen[trainer.step_count] = (inputs[:, 0].clone(), labels.clone())
        return result

    trainer.step = recording_step  # type: ignore[method-assign]
    return trainer


def schedule_until(stop):  # type: ignore[no-untyped-def]
    def schedule(step):  # type: ignore[no-untyped-def]
        if stop is not None and step + 1 == stop:
            raise Interrupt
        return 1e-3

    return schedule


def run(trainer, folder=None, stop=None, resume=False):  # type: ignore[no-untyped-def]
    options = {"checkpoint_dir": folder, "checkpoint_every": EVERY, "resume": resume} if folder else {}
    return trainer.fit(
        (X, Y), epochs=EPOCHS, eval=TEST, batch_size=BATCH, progress=False, schedule=schedule_until(stop), **options
    )


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.parametrize("stop", [12, 17, 40])  # mid-epoch, first batch of epoch 2, mid-epoch 3
def test_fit_resumed_on_cuda_matches_the_uninterrupted_run(tmp_path, backend, stop):
    straight = make_trainer(backend)
    records = run(straight)
    interrupted = make_trainer(backend)
    with pytest.raises(Interrupt):
        run(interrupted, tmp_path, stop)
    resumed = make_trainer(backend)
    resumed_records = run(resumed, tmp_path, resume=True)

    assert resumed.step_count == straight.step_count == EPOCHS * 16
    first = min(resumed.seen_batches)  # the step after the checkpoint it resumed from
    assert first == max((stop - 1) // EVERY * EVERY, (stop - 1) // 16 * 16) + 1
    for step, (column, labels) in resumed.seen_batches.items():
        assert torch.equal(column, straight.seen_batches[step][0]) and torch.equal(
            labels, straight.seen_batches[step][1]
        )
    _, a = checkpoint.flatten(resumed.state_dict())
    _, b = checkpoint.flatten(straight.state_dict())
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype.is_floating_point:
            assert relative_error(a[key], b[key]) <= 1e-5, key
        else:
            assert torch.equal(a[key], b[key]), key
    sample = resumed.classifier_sample
    assert torch.equal(sample.inputs, straight.classifier_sample.inputs)  # the same rows, not just close
    assert torch.equal(sample.labels, straight.classifier_sample.labels)
    assert [r["epoch"] for r in resumed_records] == [r["epoch"] for r in records]
    for mine, theirs in zip(resumed_records, records):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * abs(theirs["loss"])
