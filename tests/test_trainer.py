"""DADTrainer: step semantics, closed-form head, fit/evaluate, checkpoints and bad input."""

import copy
import io

import pytest
import torch

import torch_dad as td
from torch_dad import data
from torch_dad import functional as F

from .conftest import relative_error


class Net(td.DADModel):
    def __init__(self, d=20, classes=4, classifier=True):
        super().__init__()
        self.l1 = td.DADLinear(d, 33, num_classes=classes)
        self.l2 = td.DADLinear(33, 17, num_classes=classes, activation="gelu")
        if classifier:
            self.classifier = torch.nn.Linear(17, classes)


def full_state(trainer):
    state = trainer.state_dict()
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"head.{k}": v for k, v in (state["classifier_state"] or {}).items()})
    flat.update({f"stats.{k}": v for k, v in (state["classifier_statistics"] or {}).items()})
    flat.update({f"sample.{k}": v for k, v in (state["classifier_sample"] or {}).items()})
    return {k: v.clone() for k, v in flat.items()}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_device_accepts_string_device_and_none():
    for device in ("cpu", torch.device("cpu"), None):
        assert td.DADTrainer(Net(), device=device).device == torch.device("cpu")
    with pytest.raises(TypeError, match="device"):
        td.DADTrainer(Net(), device=3.5)


def test_step_returns_detached_logits_and_loss_before_update():
    trainer = td.DADTrainer(Net(), lr=1e-2)
    x, y = torch.randn(9, 20), torch.randint(0, 4, (9,))
    expected = trainer.model(x).detach()
    logits, loss = trainer.step(x, y)
    assert loss.dim() == 0 and not loss.requires_grad and not logits.requires_grad
    assert torch.allclose(logits, expected, atol=1e-6)
    assert abs(float(loss) - float(torch.nn.functional.cross_entropy(expected, y))) < 1e-5
    assert trainer.step_count == 1


def test_step_equals_layerwise_functional_reference_float64():
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    trainer = td.DADTrainer(model, lr=1e-2, weight_decay=0.0, optimizer="sgd", momentum=0.0)
    x, y = torch.randn(11, 20, dtype=torch.float64), torch.randint(0, 4, (11,))
    trainer.step(x, y)
    # reference: plain SGD on each layer's own closed-form gradients, inputs from pre-update weights
    h = x
    for layer in reference.dad_layers:
        g = F.local_loss_and_gradients(h, layer.weight.detach(), layer.bias.detach(), layer.head_weight,
                                       layer.head_bias, y, layer.activation)
        h = g.output
        layer.weight.data -= 1e-2 * g.grad_weight
        layer.bias.data -= 1e-2 * g.grad_bias
    hg = F.head_loss_and_gradients(h, reference.classifier.weight.detach(), reference.classifier.bias.detach(), y)
    reference.classifier.weight.data -= 1e-2 * hg.grad_weight
    reference.classifier.bias.data -= 1e-2 * hg.grad_bias
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert relative_error(got.detach(), want.detach()) < 1e-12, name


def test_solve_head_from_loader_equals_functional_ridge():
    trainer = td.DADTrainer(Net().double())
    x, y = torch.randn(300, 20, dtype=torch.float64), torch.randint(0, 4, (300,))
    solution = trainer.solve_head(lambda_reg=0.3, loader=[(x[:128], y[:128]), (x[128:], y[128:])])
    with torch.no_grad():
        feats = trainer.model.features(x)
    w, b = F.ridge_solve(feats, torch.nn.functional.one_hot(y, 4).double(), 0.3)
    assert relative_error(solution.weight, w) < 1e-9 and relative_error(solution.bias, b) < 1e-9
    # the classifier holds that solve times one positive calibration scale, fitted on the loader's rows
    weight, bias = trainer.model.classifier.weight.detach(), trainer.model.classifier.bias.detach()
    scale = float((weight * w).sum() / (w * w).sum())
    assert scale > 0 and relative_error(weight, scale * w) < 1e-9 and relative_error(bias, scale * b) < 1e-9
    assert solution.lambda_reg == 0.3


@pytest.mark.parametrize("sample_size", [0, 256])
def test_solve_head_uses_statistics_accumulated_by_step(sample_size):
    (xtr, ytr), (xte, yte) = data.synthetic(num_train=4096, num_features=20, seed=3)
    trainer = td.DADTrainer(Net(), lr=3e-3, classifier_sample_size=sample_size)
    assert trainer.accumulate_classifier_statistics == (sample_size == 0)
    for x, y in data.batches(xtr, ytr, 128):
        trainer.step(x, y)
    if sample_size:
        assert trainer.classifier_sample.size == sample_size
    else:
        assert trainer.classifier_statistics.num_samples > 0
    solution = trainer.solve_head()
    assert solution.gcv is not None and solution.lambda_reg > 0
    if sample_size:  # the sampled mode allocates no Gram statistics at all
        assert trainer.classifier_statistics is None and trainer.classifier_sample.size == 0
    else:
        assert trainer.classifier_statistics.num_samples == 0 and trainer.classifier_sample is None
    assert trainer.evaluate((xte, yte))["accuracy"] > 0.9
    with pytest.raises(ValueError, match="nothing to solve from yet"):
        trainer.solve_head()


def test_solve_head_without_classifier_is_a_clear_error():
    trainer = td.DADTrainer(Net(classifier=False))
    with pytest.raises(ValueError, match="classifier"):
        trainer.solve_head()


def test_fit_and_evaluate_learn_a_synthetic_task():
    (xtr, ytr), (xte, yte) = data.synthetic(num_train=2048, num_features=20, seed=1)
    trainer = td.DADTrainer(Net(), lr=3e-3)
    history = trainer.fit((xtr, ytr), epochs=3, eval=(xte, yte), batch_size=64, progress=False)
    assert len(history) == 3 and all(r["img_per_s"] > 0 for r in history)
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["accuracy"] > 0.9
    local = trainer.evaluate((xte, yte), use_local_head=True)
    assert local["accuracy"] > 0.9


def test_bf16_autocast_keeps_fp32_masters():
    trainer = td.DADTrainer(Net(), amp_dtype=torch.bfloat16)
    logits, loss = trainer.step(torch.randn(8, 20), torch.randint(0, 4, (8,)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        trainer.step(torch.randn(8, 20), torch.randint(0, 4, (8,)), amp_dtype=torch.float16)


def _run(trainer, batches):
    for x, y in batches:
        trainer.step(x, y)


def test_resume_is_bitwise_identical():
    (xtr, ytr), _ = data.synthetic(num_train=640, num_features=20, seed=5)
    batches = list(data.batches(xtr, ytr, 64, seed=2))
    torch.manual_seed(0)
    straight = td.DADTrainer(Net())
    _run(straight, batches)
    torch.manual_seed(0)
    first = td.DADTrainer(Net())
    _run(first, batches[:4])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(99)  # a different init, fully overwritten by the checkpoint
    resumed = td.DADTrainer(Net())
    resumed.load_state_dict(torch.load(buffer))
    _run(resumed, batches[4:])
    assert resumed.step_count == straight.step_count
    assert_same_state(full_state(resumed), full_state(straight))


BAD_STEP_INPUTS = [
    ("label too large", lambda x, y: (x, torch.full_like(y, 4)), ValueError, r"\[0, 4\)"),
    ("negative label", lambda x, y: (x, -torch.ones_like(y)), ValueError, r"\[0, 4\)"),
    ("float labels", lambda x, y: (x, y.float()), TypeError, "integer class ids"),
    ("label count", lambda x, y: (x, y[:-1]), ValueError, "one class id per row"),
    ("input width", lambda x, y: (x[:, :-1], y), ValueError, "in_features=20"),
    ("empty batch", lambda x, y: (x[:0], y[:0]), ValueError, "empty batch"),
    ("nan input", lambda x, y: (x.index_fill(0, torch.tensor([1]), float("nan")), y), ValueError, "NaN or Inf"),
    ("inf input", lambda x, y: (x.index_fill(1, torch.tensor([2]), float("inf")), y), ValueError, "NaN or Inf"),
    ("integer inputs", lambda x, y: (x.long(), y), TypeError, "float"),
    ("labels not a tensor", lambda x, y: (x, y.tolist()), TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("name, corrupt, error, match", BAD_STEP_INPUTS, ids=[c[0] for c in BAD_STEP_INPUTS])
def test_bad_step_input_raises_and_changes_nothing(name, corrupt, error, match):
    trainer = td.DADTrainer(Net())
    x, y = torch.randn(6, 20), torch.randint(0, 4, (6,))
    trainer.step(x, y)
    before = full_state(trainer)
    steps = trainer.step_count
    bad_x, bad_y = corrupt(x, y)
    with pytest.raises(error, match=match):
        trainer.step(bad_x, bad_y)
    assert trainer.step_count == steps
    assert_same_state(full_state(trainer), before)


@pytest.mark.parametrize("kwargs, match", [
    ({"optimizer": "adagrad"}, "optimizer='adagrad'"),
    ({"lr": -1.0}, "lr"),
    ({"amp_dtype": torch.int8}, "amp_dtype"),
    ({"check_values": "sometimes"}, "check_values"),
])
def test_trainer_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        td.DADTrainer(Net(), **kwargs)


def test_trainer_rejects_non_dad_model():
    with pytest.raises(TypeError, match="DADModel"):
        td.DADTrainer(torch.nn.Linear(3, 2))


def test_huge_lr_is_detected_and_never_leaves_nan_weights():
    x, y = torch.randn(16, 20) * 50, torch.randint(0, 4, (16,))
    raising = td.DADTrainer(Net(), lr=1e30)
    with pytest.raises(FloatingPointError, match="non-finite"):
        for _ in range(20):
            raising.step(x, y)
    assert all(torch.isfinite(t).all() for t in raising.model.state_dict().values())
    skipping = td.DADTrainer(Net(), lr=1e30, on_nonfinite="skip")
    for _ in range(20):
        skipping.step(x, y)
    assert skipping.skipped_updates > 0
    assert all(torch.isfinite(t).all() for t in skipping.model.state_dict().values())


def test_input_sample_is_uniform_and_solve_uses_fresh_features():
    trainer = td.DADTrainer(Net(d=3, classes=4, classifier=True), classifier_sample_size=64)
    # feed the row index as the single feature: the kept rows must span the whole stream
    for start in range(0, 2048, 32):
        rows = torch.arange(start, start + 32, dtype=torch.float32)
        trainer.step(torch.stack([rows, rows.sin(), rows.cos()], 1) / 2048, rows.long() % 4)
    sample = trainer.classifier_sample
    assert sample.size == 64
    kept = sample.inputs[:64, 0] * 2048
    assert len(set(kept.tolist())) == 64
    assert float(kept.min()) < 512 and float(kept.max()) > 1536  # not just the last rows
    # the solve equals a ridge solve on the sample's features computed now
    with torch.no_grad():
        feats = trainer.model.features(sample.inputs[:64])
    labels = sample.labels[:64].clone()
    solution = trainer.solve_head(lambda_reg=0.5)
    w, b = F.ridge_solve(feats, torch.nn.functional.one_hot(labels, 4).double(), 0.5)
    assert relative_error(solution.weight, w) < 1e-4
    # the classifier holds the solve times one positive calibration scale
    weight = trainer.model.classifier.weight.detach().double()
    scale = float((weight * w).sum() / (w * w).sum())
    assert scale > 0 and relative_error(weight, scale * w) < 1e-4
    assert trainer.classifier_sample.size == 0  # reset after a solve


def test_input_reservoir_equals_sequential_algorithm_r():
    """Batched add() keeps exactly the rows the one-row-at-a-time rule keeps with the same draws,
    including a slot drawn twice within one batch (the later row wins)."""
    from torch_dad.training.input_sample import InputReservoir

    capacity, width = 5, 3
    sample = InputReservoir(capacity, width, seed=7)
    reference_rng = torch.Generator().manual_seed(7)
    ref_inputs, ref_labels, seen = torch.zeros(capacity, width), torch.zeros(capacity, dtype=torch.long), 0
    stream = torch.Generator().manual_seed(1)
    for batch in (3, 4, 9, 1, 16, 7):
        x = torch.randn(batch, width, generator=stream)
        y = torch.randint(0, 10, (batch,), generator=stream)
        sample.add(x, y)
        direct = max(0, min(batch, capacity - seen))
        ref_inputs[seen : seen + direct], ref_labels[seen : seen + direct] = x[:direct], y[:direct]
        rest = batch - direct
        if rest:
            counts = torch.arange(seen + direct + 1, seen + batch + 1, dtype=torch.float64)
            draws = (torch.rand(rest, generator=reference_rng, dtype=torch.float64) * counts).long()
            for i, slot in enumerate(draws.tolist()):
                if slot < capacity:
                    ref_inputs[slot], ref_labels[slot] = x[direct + i], y[direct + i]
        seen += batch
    assert sample.size == capacity and int(sample.seen) == seen
    assert torch.equal(sample.inputs[:capacity], ref_inputs) and torch.equal(sample.labels[:capacity], ref_labels)


def test_input_reservoir_state_dict_carries_its_seed_and_stream():
    """state_dict() holds the Philox seed of the device path and the CPU generator's state: a sample loaded
    into one built with another seed takes both over and draws what the saved one would have drawn next;
    a checkpoint without the seed entry (before 2026-11-30) keeps the constructor's seed."""
    from torch_dad.training.input_sample import InputReservoir

    saved = InputReservoir(4, 3, seed=5)
    stream = torch.Generator().manual_seed(0)
    for _ in range(3):
        saved.add(torch.randn(6, 3, generator=stream), torch.randint(0, 5, (6,), generator=stream))
    state = {k: v.clone() for k, v in saved.state_dict().items()}  # the buffers themselves move on
    assert int(state["_seed"]) == 5
    loaded = InputReservoir(4, 3, seed=0)
    loaded.load_state_dict(state)
    assert loaded.seed == 5 and loaded.size == saved.size == 4
    x, y = torch.randn(50, 3, generator=stream), torch.randint(0, 5, (50,), generator=stream)
    saved.add(x, y)
    loaded.add(x, y)
    assert torch.equal(saved.inputs, loaded.inputs) and torch.equal(saved.labels, loaded.labels)
    old = {k: v for k, v in state.items() if k != "_seed"}
    legacy = InputReservoir(4, 3, seed=9)
    legacy.load_state_dict(old)
    assert legacy.seed == 9 and int(legacy.seen) == 18


def test_input_reservoir_device_path_equals_sequential_algorithm_r():
    """add_on_device (the CUDA graph's path, here on CPU tensors with the PyTorch twin of its copy
    kernel) keeps exactly the rows the one-row-at-a-time rule keeps with the same uniform draws."""
    from torch_dad.training.input_sample import InputReservoir

    capacity, width = 6, 4
    sample = InputReservoir(capacity, width)
    ref_inputs, ref_labels, seen = torch.zeros(capacity, width), torch.zeros(capacity, dtype=torch.long), 0
    stream = torch.Generator().manual_seed(2)
    torch.manual_seed(5)
    for batch in (4, 5, 9, 1, 30, 7):
        x = torch.randn(batch, width, generator=stream)
        y = torch.randint(0, 10, (batch,), generator=stream)
        state = torch.get_rng_state()
        sample.add_on_device(x, y)
        sample.count_rows(batch)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        draws = torch.rand(batch, dtype=torch.float64)  # the draws add_on_device made
        assert torch.equal(torch.get_rng_state(), after)
        for i in range(batch):
            count = seen + i + 1
            slot = count - 1 if count <= capacity else int(draws[i] * count)
            if slot < capacity:
                ref_inputs[slot], ref_labels[slot] = x[i], y[i]
        seen += batch
    assert sample.size == capacity and int(sample.seen) == seen
    assert torch.equal(sample.inputs[:capacity], ref_inputs) and torch.equal(sample.labels[:capacity], ref_labels)
