"""Local-rule menu (ce / predsim / drtp), LR schedule and dropout: float64 checks against autograd."""

import math

import pytest
import torch

import torch_dad as td
from torch_dad import functional
from torch_dad.data import synthetic
from torch_dad.training.schedules import multistep, warmup_cosine

from .conftest import relative_error

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _autograd_rule_loss(rule, x, w, b, hw, hb, proj, y, act, beta, smoothing, normalize=None):
    """Each rule's own local loss written with plain torch ops, for autograd."""
    z = x @ w.T + (b if b is not None else 0)
    if normalize == "layernorm":
        z = torch.nn.functional.layer_norm(z, (z.shape[1],), eps=1e-5)
    h = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "identity": lambda t: t,
         "leaky_relu": torch.nn.functional.leaky_relu}[act](z)
    valid = y != functional.IGNORE_INDEX
    hv, yv = h[valid], y[valid]
    if rule == "drtp":
        return 0.5 * (hv - proj[yv]).pow(2).sum() / max(int(valid.sum()), 1)
    ce = torch.nn.functional.cross_entropy(hv @ hw.T + hb, yv, label_smoothing=smoothing)
    if rule == "ce":
        return ce
    onehot = torch.nn.functional.one_hot(yv, hw.shape[0]).to(h.dtype)

    def sim(t):  # adjusted cosine similarity: centre each row, then cosine
        c = t - t.mean(1, keepdim=True)
        u = c / (c.pow(2).sum(1, keepdim=True) + functional.SIMILARITY_EPS).sqrt()
        return u @ u.T

    sim_loss = torch.nn.functional.mse_loss(sim(hv), sim(onehot), reduction="mean")
    return (1 - beta) * ce + beta * sim_loss


@pytest.mark.parametrize("rule", list(functional.LOCAL_LOSSES))
@pytest.mark.parametrize("act", list(functional.ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("normalize", [None, "layernorm"])
def test_rule_gradients_match_autograd_float64(rule, act, bias, normalize):
    n, d_in, d_out, classes = 23, 17, 29, 6
    x = torch.randn(n, d_in, dtype=torch.float64)
    y = torch.randint(0, classes, (n,))
    y[3] = functional.IGNORE_INDEX  # an unlabelled row must not contribute
    w = (torch.randn(d_out, d_in, dtype=torch.float64) * 0.3).requires_grad_(True)
    b = torch.randn(d_out, dtype=torch.float64).requires_grad_(True) if bias else None
    hw = torch.randn(classes, d_out, dtype=torch.float64).requires_grad_(True)
    hb = torch.randn(classes, dtype=torch.float64).requires_grad_(True)
    proj = functional.target_projection(d_out, classes, seed=3, dtype=torch.float64)
    beta, smoothing = (0.7, 0.1) if rule == "predsim" else (functional.PREDSIM_BETA, 0.0)
    loss = _autograd_rule_loss(rule, x, w, b, hw, hb, proj, y, act, beta, smoothing, normalize)
    wanted = [w] + ([b] if bias else []) + ([hw, hb] if rule != "drtp" else [])
    auto = torch.autograd.grad(loss, wanted)
    got = functional.local_loss_and_gradients(
        x, w.detach(), b.detach() if bias else None, hw.detach(), hb.detach(), y, act,
        local_loss=rule, projection=proj, beta=beta, label_smoothing=smoothing, normalize=normalize,
    )
    mine = [got.grad_weight] + ([got.grad_bias] if bias else [])
    mine += [got.grad_head_weight, got.grad_head_bias] if rule != "drtp" else []
    if rule == "drtp":
        assert got.grad_head_weight is None and got.logits is None
    assert abs(float(got.loss) - float(loss.detach())) <= 1e-12 * max(1.0, abs(float(loss.detach())))
    for g_mine, g_auto in zip(mine, auto):
        assert relative_error(g_mine, g_auto) < 1e-10


def test_similarity_matrix_is_correlation():
    x = torch.randn(11, 7, dtype=torch.float64)
    s = functional.similarity_matrix(x, eps=0.0)
    want = torch.corrcoef(x)  # Pearson correlation of rows == cosine of row-centred rows
    assert relative_error(s, want) < 1e-12
    onehot = torch.nn.functional.one_hot(torch.tensor([0, 1, 0, 2]), 3).double()
    s_y = functional.similarity_matrix(onehot, eps=0.0)
    assert torch.allclose(s_y[0, 2], torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(s_y[0, 1], torch.tensor(-0.5, dtype=torch.float64))  # -1/(C-1)


@pytest.mark.parametrize("rule, normalize", [("predsim", None), ("drtp", None), ("ce", "layernorm"),
                                             ("predsim", "layernorm"), ("drtp", "layernorm")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_layer_fast_path_matches_functional(rule, normalize, dtype):
    layer = td.DADLinear(31, 43, num_classes=5, local_loss=rule, dtype=torch.float64, projection_seed=7,
                         normalize=normalize)
    x, y = torch.randn(19, 31, dtype=torch.float64), torch.randint(0, 5, (19,))
    hw = layer.head_weight if rule != "drtp" else None
    hb = layer.head_bias if rule != "drtp" else None
    kw = {"local_loss": rule, "projection": layer.target_projection, "normalize": normalize}
    ref = functional.local_loss_and_gradients(x, layer.weight.detach(), layer.bias.detach(), hw, hb, y, "relu", **kw)
    low = functional.local_loss_and_gradients(
        *(t.to(dtype) if t is not None else None for t in (x, layer.weight.detach(), layer.bias.detach(), hw, hb)),
        y, "relu", local_loss=rule, normalize=normalize,
        projection=layer.target_projection.to(dtype) if rule == "drtp" else None,
    )
    result, grads = layer.local_gradients(x, y, compute_dtype=None if dtype == torch.float64 else dtype)
    names = ["grad_weight", "grad_bias"] + (["grad_head_weight", "grad_head_bias"] if rule != "drtp" else [])
    assert len(grads) == len(names)
    for got, name in zip(grads, names):
        allowed = 2 * relative_error(getattr(low, name), getattr(ref, name)) + TOL[dtype]
        assert relative_error(got, getattr(ref, name)) <= allowed, name
    assert relative_error(result.output, ref.output) <= 2 * relative_error(low.output, ref.output) + TOL[dtype]
    # forward() (inference) is the same layer function as the training step's output
    assert relative_error(layer(x), ref.output) < 1e-12


def test_drtp_is_head_free_and_projection_is_a_seeded_buffer():
    a = td.DADLinear(12, 20, num_classes=4, local_loss="drtp", projection_seed=5)
    b = td.DADLinear(12, 20, num_classes=4, local_loss="drtp", projection_seed=5)
    c = td.DADLinear(12, 20, num_classes=4, local_loss="drtp", projection_seed=6)
    assert a.head_weight is None and a.head_bias is None
    state = a.state_dict()
    assert "target_projection" in state and "head_weight" not in state
    assert torch.equal(a.target_projection, b.target_projection)
    assert not torch.equal(a.target_projection, c.target_projection)
    assert {n for n, _ in a.named_parameters()} == {"weight", "bias"}
    before = a.target_projection.clone()
    a.local_step(torch.randn(9, 12), torch.randint(0, 4, (9,)), td.OptimizerConfig(lr=1e-2))
    assert torch.equal(a.target_projection, before)  # fixed: never trained
    # local head = nearest fixed target: argmax equals argmin of the distance
    h = torch.rand(8, 20)
    dist = torch.cdist(h, a.target_projection)
    assert torch.equal(a.local_head(h).argmax(1), dist.argmin(1))


def test_set_local_loss_switches_buffers_and_state():
    layer = td.DADLinear(6, 8, num_classes=3)
    weight = layer.weight.detach().clone()
    layer.set_local_loss("drtp")
    assert layer.head_weight is None and layer.target_projection.shape == (3, 8)
    assert len(layer.optim_state.moments("exp_avg")) == 2
    layer.set_local_loss("predsim")
    assert layer.target_projection is None and layer.head_weight.shape == (3, 8)
    assert len(layer.optim_state.moments("exp_avg")) == 4
    assert torch.equal(layer.weight, weight)


@pytest.mark.parametrize("kwargs, match", [
    ({"local_loss": "sim"}, "local_loss"),
    ({"predsim_beta": 1.5}, "predsim_beta"),
    ({"projection_seed": -1}, "projection_seed"),
    ({"normalize": "groupnorm"}, "normalize"),
])
def test_layer_rejects_bad_rule_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        td.DADLinear(4, 5, num_classes=3, **kwargs)


def _model(rule="ce"):
    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(10, 16, num_classes=3, local_loss=rule)
            self.l2 = td.DADLinear(16, 12, num_classes=3, local_loss=rule)
            self.classifier = torch.nn.Linear(12, 3)

    return Net()


def test_trainer_local_loss_overrides_every_layer_and_none_keeps_them():
    model = _model("predsim")
    td.DADTrainer(model)
    assert [layer.local_loss for layer in model.dad_layers] == ["predsim", "predsim"]
    td.DADTrainer(model, local_loss="drtp")
    assert [layer.local_loss for layer in model.dad_layers] == ["drtp", "drtp"]


@pytest.mark.parametrize("kwargs, match", [({"local_loss": "hinge"}, "local_loss"), ({"dropout": 1.0}, "dropout")])
def test_trainer_bad_options_raise_and_leave_model_unchanged(kwargs, match):
    model = _model("ce")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        td.DADTrainer(model, **kwargs)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("rule", list(functional.LOCAL_LOSSES))
def test_every_rule_learns_a_separable_task(rule):
    (xtr, ytr), (xte, yte) = synthetic(num_train=1024, num_test=512, num_features=10, num_classes=3, seed=1)
    torch.manual_seed(0)
    trainer = td.DADTrainer(_model(), local_loss=rule, lr=3e-3)
    trainer.fit((xtr, ytr), epochs=8, batch_size=64, progress=False)
    # drtp's features chase fixed targets, so judge it by its own readout (nearest target)
    metrics = trainer.evaluate((xte, yte), use_local_head=rule == "drtp")
    assert metrics["accuracy"] > 0.85  # chance is 1/3
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]


def test_warmup_cosine_formula_and_errors():
    lr = warmup_cosine(1e-3, total_steps=110, warmup_steps=10, min_lr=1e-5)
    assert lr(0) == pytest.approx(1e-4) and lr(9) == pytest.approx(1e-3)
    for t in (10, 37, 60, 109):
        p = (t - 10) / 100
        assert lr(t) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * p)))
    assert lr(110) == pytest.approx(1e-5) and lr(500) == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine(1e-3, total_steps=5, warmup_steps=6)
    with pytest.raises(ValueError, match="base_lr"):
        warmup_cosine(-1.0, total_steps=5)


def test_multistep_formula_and_errors():
    lr = multistep(1e-3, [3, 5], gamma=0.5)
    assert [lr(t) for t in range(7)] == pytest.approx([1e-3, 1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4])
    assert multistep(2.0, [])(100) == 2.0
    for kwargs, match in (({"milestones": [5, 3]}, "milestones"), ({"milestones": [1.5]}, "milestones"),
                          ({"milestones": [-1]}, "milestones"), ({"milestones": "12"}, "milestones"),
                          ({"milestones": [1], "gamma": -0.1}, "gamma"), ({"milestones": [1], "base_lr": float("inf")},
                                                                          "base_lr")):
        with pytest.raises(ValueError, match=match):
            multistep(**{"base_lr": 1e-3, **kwargs})


def test_fit_uses_the_schedule_per_step():
    x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    model = _model()
    trainer = td.DADTrainer(model, weight_decay=0.1)
    before = {k: v.clone() for k, v in model.named_parameters()}
    seen = []
    trainer.fit((x, y), epochs=2, batch_size=16, progress=False, schedule=lambda t: seen.append(t) or 0.0)
    assert seen == list(range(8))
    # lr 0 every step: AdamW moves nothing (decay is lr * wd * p)
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    with pytest.raises(TypeError, match="schedule"):
        trainer.fit((x, y), epochs=1, progress=False, schedule=1e-3)


def test_dropout_only_in_training_steps():
    torch.manual_seed(0)
    x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    ta, tb = td.DADTrainer(a, dropout=0.5), td.DADTrainer(b)
    assert torch.equal(a(x), b(x))  # inference ignores dropout
    ta.step(x, y)
    tb.step(x, y)
    # the first layer sees the same input either way; the second sees dropped features
    assert torch.equal(a.l1.weight, b.l1.weight)
    assert not torch.equal(a.l2.weight, b.l2.weight)


def test_mnist_npz_override(tmp_path, monkeypatch):
    from torch_dad import data

    rng = torch.Generator().manual_seed(0)
    arrays = {
        "x_train": torch.randint(0, 256, (7, 28, 28), generator=rng, dtype=torch.uint8).numpy(),
        "y_train": torch.randint(0, 10, (7,), generator=rng, dtype=torch.uint8).numpy(),
        "x_test": torch.randint(0, 256, (3, 28, 28), generator=rng, dtype=torch.uint8).numpy(),
        "y_test": torch.randint(0, 10, (3,), generator=rng, dtype=torch.uint8).numpy(),
    }
    import numpy as np

    path = tmp_path / "mnist.npz"
    np.savez(path, **arrays)
    (xtr, ytr), (xte, yte) = data.mnist(normalize=False, path=path)
    assert torch.equal(xtr, torch.from_numpy(arrays["x_train"]).reshape(7, -1).float() / 255)
    assert ytr.dtype == torch.int64 and torch.equal(yte, torch.from_numpy(arrays["y_test"]).long())
    monkeypatch.setenv("TORCH_DAD_MNIST", str(path))
    (xn, _), _ = data.mnist()
    assert abs(float(xn.mean())) < 1e-5  # standardised with the training set's statistics
    with pytest.raises(FileNotFoundError, match="npz"):
        data.mnist(path=tmp_path / "missing.npz")


@pytest.mark.parametrize("rule", ["predsim", "drtp"])
def test_trainer_checkpoint_round_trip_per_rule(rule):
    x, y = torch.randn(24, 10), torch.randint(0, 3, (24,))
    a = td.DADTrainer(_model(), local_loss=rule)
    a.step(x, y)
    b = td.DADTrainer(_model(), local_loss=rule)
    b.load_state_dict(a.state_dict())
    a.step(x, y)
    b.step(x, y)  # resumed training continues bit for bit
    for (name, t_a), (_, t_b) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(t_a, t_b), name
    with pytest.raises(RuntimeError):  # a ce model cannot silently load a drtp checkpoint (different buffers)
        td.DADTrainer(_model("ce")).model.load_state_dict(td.DADTrainer(_model(), local_loss="drtp").model.state_dict())


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_row_updates_with_a_device_multiplier_are_one_update_of_the_scaled_gradient(name):
    # apply_rows_ over row ranges, each gradient times a 0-dim tensor read where it lies, equals one apply_ of
    # the whole gradient times that number (the CPU path; the Triton kernel's is tests/gpu/test_kernels.py)
    from torch_dad.optim import LocalOptimizerState

    g = torch.Generator().manual_seed(3)
    shapes = [(23, 5), (23,)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    config = td.OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1)
    want, got = [p.clone() for p in params], [p.clone() for p in params]
    ref, state = LocalOptimizerState(shapes), LocalOptimizerState(shapes)
    ref.apply_(want, [gr * 0.25 for gr in grads], config)
    for start in range(0, 23, 10):
        stop = min(start + 10, 23)
        state.apply_rows_(got, [gr[start:stop] for gr in grads], config, start, stop, advance_step=start == 0,
                          grad_multiplier=torch.tensor(0.25))
    for a, b in zip(got, want):
        assert relative_error(a, b) <= 1e-6
    assert float(state.step) == float(ref.step) == 1.0
