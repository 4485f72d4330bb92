"""The errors a new user meets first: a missing GPU, dict batches, and an all-or-nothing step on
non-finite gradients. Each error leaves the trainer's full state unchanged."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import torch_dad as td
from torch_dad._checks import check_device

from .test_bad_inputs import trainer_state


class Net(td.DADModel):
    def __init__(self):
        super().__init__()
        self.l1 = td.DADLinear(12, 16, num_classes=3)
        self.l2 = td.DADLinear(16, 8, num_classes=3)
        self.l3 = td.DADLinear(8, 8, num_classes=3)
        self.classifier = torch.nn.Linear(8, 3)


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda")])
def test_trainer_on_missing_gpu_says_what_was_asked_and_what_exists(device):
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        td.DADTrainer(model, device=device)
    message = str(err.value)
    assert f"device={str(device)!r} was requested but CUDA is not available" in message
    assert f"torch {torch.__version__}" in message
    assert message.endswith("use device='cpu'")
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert_same_state(before, model.state_dict())


def test_check_device_accepts_cpu_and_rejects_bad_values():
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="device='gpu0' is not a valid torch device string"):
        check_device("gpu0")
    with pytest.raises(TypeError, match="device must be a str, torch.device or None, got int"):
        check_device(0)


def dict_batches(x, y, size, input_key="pixel_values", label_key="label"):
    return [{input_key: x[i : i + size], label_key: y[i : i + size], "idx": i} for i in range(0, len(x), size)]


@pytest.mark.parametrize("input_key, label_key", [("x", "labels"), ("pixel_values", "label"), ("inputs", "y")])
def test_fit_evaluate_and_solve_accept_dict_batches_like_pairs(input_key, label_key):
    x, y = torch.randn(64, 3, 2, 2), torch.randint(0, 3, (64,))
    runs = []
    for as_dicts in (False, True):
        torch.manual_seed(0)
        trainer = td.DADTrainer(Net(), classifier_sample_size=0)
        pairs = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
        data = dict_batches(x, y, 16, input_key, label_key) if as_dicts else pairs
        history = trainer.fit(data, epochs=2, eval=data, progress=False)
        trainer.solve_head(lambda_reg=0.1, loader=data)
        runs.append((history, trainer.evaluate(data), trainer_state(trainer)))
    (h0, e0, s0), (h1, e1, s1) = runs
    assert [r["loss"] for r in h0] == [r["loss"] for r in h1]
    assert [r["accuracy"] for r in h0] == [r["accuracy"] for r in h1]
    assert e0 == e1
    assert_same_state(s0, s1)


def test_guarded_step_equals_unguarded_step():
    """The guard defers every update to the end of the step; layer k+1 consumes layer k's
    pre-update output in both loops, so the weights are bitwise the same (CPU workspaces too)."""
    x, y = torch.randn(32, 12), torch.randint(0, 3, (32,))
    states = []
    for policy in ("raise", "skip", "ignore"):
        torch.manual_seed(0)
        trainer = td.DADTrainer(Net(), on_nonfinite=policy, classifier_sample_size=8,
                                accumulate_classifier_statistics=True)
        for _ in range(4):
            logits, loss = trainer.step(x, y)
        states.append((trainer_state(trainer), logits, loss))
    for state, logits, loss in states[1:]:
        assert_same_state(states[0][0], state)
        assert torch.equal(states[0][1], logits) and torch.equal(states[0][2], loss)


def poisoned_trainer(policy):
    """A trained trainer whose top layer's local head has an Inf: layers 1 and 2 get finite
    gradients, layer 3 (and so the step) a non-finite one."""
    torch.manual_seed(0)
    trainer = td.DADTrainer(Net(), on_nonfinite=policy, accumulate_classifier_statistics=True)
    x, y = torch.randn(16, 12), torch.randint(0, 3, (16,))
    trainer.step(x, y)
    with torch.no_grad():
        trainer.model.l3.head_weight[0, 0] = float("inf")
    return trainer, x, y


def test_nonfinite_step_raises_and_updates_nothing():
    trainer, x, y = poisoned_trainer("raise")
    before = trainer_state(trainer)
    with pytest.raises(FloatingPointError) as err:
        trainer.step(x, y)
    message = str(err.value)
    assert message.startswith("non-finite local gradients in model.l3 at step 1 ")
    assert "nothing was updated in this step (no layer, no classifier)" in message
    assert "on_nonfinite='skip'" in message
    assert_same_state(before, trainer_state(trainer))
    assert trainer.skipped_updates == 1


def test_nonfinite_step_is_skipped_whole_and_counted_once():
    trainer, x, y = poisoned_trainer("skip")
    before = trainer_state(trainer)
    logits, loss = trainer.step(x, y)
    assert trainer.skipped_updates == 1
    after = trainer_state(trainer)
    assert int(after.pop("step_count")) == int(before.pop("step_count")) + 1
    assert_same_state(before, after)
    assert logits.shape == (16, 3) and torch.isfinite(logits).all()


def test_version_is_defined_once_and_sorts_after_the_unrelated_package():
    assert importlib.metadata.version("torch-dad") == td.__version__
    release = tuple(int(part) for part in td.__version__.split(".")[:3])
    assert release > (2026, 5, 24)


class CopyingReducer:
    """A one-process stand-in for the all-reduce: ``launch`` copies the gradients at once, as
    :class:`~torch_dad.training.distributed.AllReduceMean` does, and returns no pending work."""

    def launch(self, grads):
        return None, [g.clone() for g in grads]

    def __call__(self, grads):
        pass


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_guarded_step_with_a_reducer_equals_unguarded_and_stays_atomic(policy):
    x, y = torch.randn(32, 12), torch.randint(0, 3, (32,))
    states = []
    for guard in (policy, "ignore"):
        torch.manual_seed(0)
        trainer = td.DADTrainer(Net(), on_nonfinite=guard)
        trainer.set_reducers(CopyingReducer())
        for _ in range(3):
            trainer.step(x, y)
        states.append(trainer_state(trainer))
    assert_same_state(*states)
    trainer, x, y = poisoned_trainer(policy)
    trainer.set_reducers(CopyingReducer())
    before = trainer_state(trainer)
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="in model.l3 "):
            trainer.step(x, y)
    else:
        trainer.step(x, y)
        before["step_count"] += 1
    assert_same_state(before, trainer_state(trainer))
    assert trainer.skipped_updates == 1


class BlockNet(td.DADModel):
    """A DADBlock (64 features out, batch norm inside) first, or after a DADLinear."""

    def __init__(self, head_features, first):
        super().__init__()
        width = 12 if first else 16
        if not first:
            self.l1 = td.DADLinear(12, 16, num_classes=3)
        body = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())
        self.block = td.DADBlock(body, num_classes=3, head_features=head_features)
        self.classifier = torch.nn.Linear(64, 3)


@pytest.mark.parametrize("first", [True, False])
def test_wrong_head_features_names_the_block_width_before_any_change(first):
    torch.manual_seed(0)
    trainer = td.DADTrainer(BlockNet(32, first))
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    before = trainer_state(trainer)
    message = ("DADBlock: head_features=32, but the block's output has shape (batch, 64): 64 features along "
               "feature_dim=1; pass head_features=64, or a local_head= of your own")
    with pytest.raises(ValueError) as err:
        trainer.step(x, y)
    assert str(err.value) == message
    assert_same_state(before, trainer_state(trainer))
    assert all(m.training for m in trainer.model.modules())  # the check ran the block in eval mode, then put it back
    with pytest.raises(ValueError, match="head_features=32"):
        trainer.model.block(torch.randn(4, 12 if first else 16))
    torch.manual_seed(0)
    trainer = td.DADTrainer(BlockNet(64, first))
    trainer.step(x, y)  # the right width trains
    assert trainer.step_count == 1
