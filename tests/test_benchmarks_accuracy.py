"""``benchmarks/accuracy.py --menu``: the recipe menu, the search, and the like-for-like models and heads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_dad as td
from torch_dad import data

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _accuracy_common import lr_schedule, ridge_head  # noqa: E402
from _accuracy_menu import (  # noqa: E402
    AXES,
    DEFAULTS,
    MENU_PRESETS,
    best_of_studies,
    cell_menu,
    menu_main,
    parse_menu,
    recipe_name,
    search,
)
from _common import DADMLP, backprop_mlp, latest_results, read_runs  # noqa: E402


def test_parse_menu_presets_and_defaults() -> None:
    full = parse_menu("full")
    assert full["lr"] == [1e-3, 3e-4, 3e-3, 1e-4]
    assert full["norm"] == ["none", "layernorm", "batchnorm"]
    assert full["head"] == ["trained", "ridge"]
    assert all(parse_menu(name) for name in MENU_PRESETS)
    # an axis the spec leaves out keeps its default alone
    menu = parse_menu("lr=3e-3;norm=layernorm,none")
    assert menu["lr"] == [3e-3] and menu["norm"] == ["layernorm", "none"]
    assert {k: v for k, v in menu.items() if k not in ("lr", "norm")} == {
        k: [v] for k, v in DEFAULTS.items() if k not in ("lr", "norm")
    }


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("momentum=0.9", "key one of"),
        ("lr=", "key one of"),
        ("norm=groupnorm", "choose from"),
        ("lr=fast", "not a number"),
        ("lr=0", "out of range"),
        ("dropout=1.0", "out of range"),
        ("ls=-0.1", "out of range"),
        ("lr=1e-3,1e-3", "twice"),
    ],
)
def test_parse_menu_rejects_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_menu(spec)


def _fake_evaluate(score: dict[str, Any], calls: list[dict[str, Any]]):
    """Validation accuracy = sum of per-value bonuses; the ridge head adds ``score['ridge']``."""

    def evaluate(recipes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls.extend(recipes)
        out = []
        for r in recipes:
            val = 0.5 + sum(score.get((axis, r[axis]), 0.0) for axis in AXES)
            out.append({"heads": {"trained": {"val_acc": val}, "ridge": {"val_acc": val + score.get("ridge", 0.0)}}})
        return out

    return evaluate


def test_coordinate_search_sweeps_each_axis_from_the_start() -> None:
    menu = parse_menu("full")
    score = {("lr", 3e-3): 0.02, ("norm", "batchnorm"): 0.01, ("dropout", 0.1): -0.01, "ridge": 0.005}
    calls: list[dict[str, Any]] = []
    recipe, head = search(menu, "coordinate", _fake_evaluate(score, calls))
    assert recipe == {**{a: menu[a][0] for a in AXES}, "lr": 3e-3, "norm": "batchnorm"}
    assert head == "ridge"
    # every configuration is trained once: 4 lrs, then 2 new values per 3-valued axis (norm, schedule) and 1 per
    # 2-valued one (ls, dropout, act), then the other 3 lrs with the selected batchnorm
    assert len(calls) == len({str(sorted(c.items())) for c in calls}) == 4 + 2 + 1 + 1 + 2 + 1 + 3
    assert calls[0] == {a: menu[a][0] for a in AXES}


def test_search_keeps_the_start_on_ties_and_skips_failures() -> None:
    menu = parse_menu("lr=1e-3,3e-3;norm=none,layernorm")
    calls: list[dict[str, Any]] = []
    recipe, head = search(menu, "grid", _fake_evaluate({}, calls))
    assert len(calls) == 4 and recipe == {a: menu[a][0] for a in AXES} and head == "trained"

    def failing(recipes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"error": "boom"} for _ in recipes]

    with pytest.raises(RuntimeError, match="every run"):
        search(menu, "coordinate", failing)


def test_recipe_name_lists_what_differs_from_the_plain_recipe() -> None:
    plain = {a: parse_menu("")[a][0] for a in AXES}
    assert recipe_name(plain) == "lr 0.001"
    changed = {**plain, "norm": "layernorm", "ls": 0.1, "dropout": 0.1, "schedule": "cosine", "act": "leaky_relu"}
    assert recipe_name(changed, "ridge") == "lr 0.001, layernorm, ls 0.1, dropout 0.1, cosine, leaky_relu, ridge head"
    assert recipe_name({**plain, "schedule": "step"}) == "lr 0.001, step decay"


def test_menu_schedules_are_constant_cosine_and_local_loss_step_decay() -> None:
    assert parse_menu("full")["schedule"] == ["constant", "cosine", "step"]
    assert lr_schedule({"constant": True}, 1e-3, 200) is None
    step = lr_schedule({"step": True}, 1e-3, 200)  # milestones at 50/75/89/94 % of the steps, x0.25 each
    assert [step(t) for t in (0, 99, 100, 149, 150, 177, 178, 187, 188, 199)] == pytest.approx(
        [1e-3, 1e-3, 2.5e-4, 2.5e-4, 6.25e-5, 6.25e-5, 1.5625e-5, 1.5625e-5, 3.90625e-6, 3.90625e-6])
    cosine = lr_schedule({"cosine": True}, 1e-3, 200)
    assert cosine(199) < 1e-5 < cosine(100) < 1e-3


@pytest.mark.parametrize(
    ("activation", "normalize"), [("relu", None), ("leaky_relu", "layernorm"), ("relu", "batchnorm"), ("gelu", None)]
)
@pytest.mark.parametrize("train", [False, True])
def test_backprop_mlp_is_the_dad_mlp(activation: str, normalize: str | None, train: bool) -> None:
    """With DAD's weights copied in, the backprop MLP computes DADMLP's logits (float64; odd widths)."""
    torch.manual_seed(0)
    widths = [13, 7, 5]
    dad = DADMLP(widths, num_classes=3, activation=activation, normalize=normalize).double()
    bp = backprop_mlp(widths, 3, activation=activation, normalize=normalize, dropout=0.1).double()
    linears = [m for m in bp if isinstance(m, torch.nn.Linear)]
    norms = [m for m in bp if isinstance(m, torch.nn.BatchNorm1d)]
    with torch.no_grad():
        for i, layer in enumerate(dad.layers):
            linears[i].weight.copy_(layer.weight)
            linears[i].bias.copy_(layer.bias)
            if normalize == "batchnorm":
                layer.norm_weight.uniform_(0.5, 1.5)
                layer.norm_bias.uniform_(-0.5, 0.5)
                layer.running_mean.uniform_(-0.2, 0.2)
                layer.running_var.uniform_(0.5, 2.0)
                for name in ("weight", "bias", "running_mean", "running_var"):
                    getattr(norms[i], name).copy_(getattr(layer, "norm_" + name if "running" not in name else name))
        linears[-1].weight.copy_(dad.classifier.weight)
        linears[-1].bias.copy_(dad.classifier.bias)
    dad.train(train)
    bp.train(train)
    if train:  # dropout aside: the training-mode comparison is about batch statistics
        for m in bp:
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    x = torch.randn(11, 13, dtype=torch.float64)
    torch.testing.assert_close(bp(x), dad(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(bp[:-1](x), dad.features(x), rtol=1e-10, atol=1e-10)


def test_backprop_mlp_rejects_unknown_options() -> None:
    with pytest.raises(ValueError, match="activation"):
        backprop_mlp([4, 3], activation="swish")
    with pytest.raises(ValueError, match="normalize"):
        backprop_mlp([4, 3], normalize="groupnorm")


def test_ridge_head_is_solve_head() -> None:
    """The head scored for every system is what DADTrainer.solve_head("auto", loader=train) installs."""
    torch.manual_seed(0)
    (x, y), (xte, _) = data.synthetic(num_train=300, num_test=50, num_features=9, num_classes=5)
    model = DADMLP([9, 6], num_classes=5)
    trainer = td.DADTrainer(model, lr=1e-2)
    for xb, yb in data.batches(x, y, 64):
        trainer.step(xb, yb)
    head = ridge_head(model.features, 6, 5, x, y)
    expected = head(xte)
    trainer.solve_head("auto", loader=[(x[i : i + 100], y[i : i + 100]) for i in range(0, 300, 100)])
    # solve_head also scales the solved scores by one positive calibration factor (argmax unchanged)
    got = model(xte).detach()
    scale = float((got * expected).sum() / (expected * expected).sum())
    assert scale > 0
    torch.testing.assert_close(got, scale * expected, rtol=1e-4, atol=1e-4)


def _study_args(tmp_path: Path, **overrides: Any) -> argparse.Namespace:
    args = {
        "menu": "smoke",
        "smoke": False,
        "out": str(tmp_path / "study.json"),
        "plot_only": False,
        "merge": None,
        "systems": ["dad", "backprop"],
        "cells": ["synthetic-3"],
        "seeds": [0, 1],
        "resume": None,
        "workers": 1,
        "threads": 1,
        "device": "cpu",
        "tf32": False,
        "search": "coordinate",
    }
    return argparse.Namespace(**{**args, **overrides})


@pytest.fixture
def keep_threads():
    """The study sets torch's thread count for its in-process runs; later tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("keep_threads")
def test_study_reports_the_selected_recipe_on_every_seed(tmp_path: Path) -> None:
    out = menu_main(_study_args(tmp_path))
    records = latest_results(out)
    assert not out.with_suffix(".runs.jsonl").exists()  # the log is dropped once the results are written
    (run,) = read_runs(out)
    assert {"device", "torch", "commit", "date"} <= run["environment"].keys()
    runs = [r for r in records if r["kind"] == "menu_run"]
    summaries = [r for r in records if r["kind"] == "menu_summary"]
    assert [s["system"] for s in summaries] == ["dad", "backprop"]
    for s in summaries:
        chosen = [r for r in runs if r["system"] == s["system"] and r["recipe"] == s["recipe"]]
        assert sorted(r["seed"] for r in chosen) == [0, 1] and s["seeds"] == 2
        test = [r["heads"][s["head"]]["test_acc"] for r in chosen]
        assert s["test_acc_mean"] == pytest.approx(sum(test) / 2)
        # the selection is the best validation accuracy of the search seed over every run and head
        searched = [r for r in runs if r["system"] == s["system"] and r["seed"] == 0]
        assert s["val_acc_search_seed"] == max(v["val_acc"] for r in searched for v in r["heads"].values())
        assert s["searched_runs"] == len(searched)
    # resuming from the results trains nothing again and selects the same
    again = latest_results(menu_main(_study_args(tmp_path, out=str(tmp_path / "b.json"), resume=str(out))))
    for kind, before in (("menu_summary", summaries), ("menu_run", runs)):
        assert [r for r in again if r["kind"] == kind] == before


def test_best_of_studies_keeps_each_run_once_and_the_better_selection() -> None:
    def run(lr: float, seed: int) -> dict[str, Any]:
        return {"kind": "menu_run", "cell": "c", "topology": "t", "system": "dad", "recipe": {"lr": lr}, "seed": seed}

    def summary(lr: float, val: float) -> dict[str, Any]:
        return {"kind": "menu_summary", "cell": "c", "system": "dad", "recipe": {"lr": lr}, "val_acc_search_seed": val}

    first = [{"kind": "menu_study"}, run(1e-3, 0), run(1e-3, 1), summary(1e-3, 0.91)]
    # resumed over a larger menu: it reuses a run, trains others and settles lower on its path
    second = [{"kind": "menu_study"}, run(1e-3, 0), run(1e-4, 0), run(1e-4, 1), summary(1e-4, 0.90)]
    merged = best_of_studies(first + second)
    assert sum(r["kind"] == "menu_study" for r in merged) == 2
    assert sorted((r["recipe"]["lr"], r["seed"]) for r in merged if r["kind"] == "menu_run") == [
        (1e-4, 0), (1e-4, 1), (1e-3, 0), (1e-3, 1)
    ]
    assert [r["recipe"]["lr"] for r in merged if r["kind"] == "menu_summary"] == [1e-3]
    assert [r["recipe"]["lr"] for r in best_of_studies(first + [summary(1e-4, 0.92)]) if r["kind"] == "menu_summary"] == [1e-4]


@pytest.mark.parametrize("normalize", [None, "batchnorm"])
def test_conv_cells_train_the_same_net_and_search_what_its_layers_have(normalize: str | None) -> None:
    from conv import DADVGG, backprop_vgg

    # the DAD net and its backprop twin have the same trained tensors outside the local heads (buffers)
    dad, backprop = DADVGG(1, 28, 32, 10, 4, 0.1, "leaky_relu", normalize), backprop_vgg(1, 28, 32, 10, "leaky_relu", normalize, 0.1)
    assert sorted(p.shape for p in dad.parameters()) == sorted(p.shape for p in backprop.parameters())
    assert dad(torch.randn(3, 1, 28, 28)).shape == backprop(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    full = parse_menu("full")
    assert cell_menu(full, "fmnist-vgg-10")["norm"] == ["none", "batchnorm"]
    assert cell_menu(full, "fmnist-vgg-10")["lr"] == full["lr"] and cell_menu(full, "fmnist-3") == full


@pytest.mark.usefixtures("keep_threads")
def test_conv_cell_study_runs_both_systems(tmp_path: Path) -> None:
    records = latest_results(menu_main(_study_args(tmp_path, cells=["synthetic-vgg-1"])))
    summaries = [r for r in records if r["kind"] == "menu_summary"]
    assert [(s["system"], s["topology"]) for s in summaries] == [("dad", "vgg8b/32"), ("backprop", "vgg8b/32")]
    assert all("error" not in r for r in records if r["kind"] == "menu_run")
    # every run names what ran its steps; off CUDA both systems step op by op
    assert {r["step"] for r in records if r["kind"] == "menu_run"} == {"eager"}


def test_graphed_backprop_off_cuda_is_adamw_with_smoothing():
    """The benchmarks' backprop baseline, op by op off CUDA: the same updates as a plain AdamW loop on
    ``cross_entropy(label_smoothing=)``, following the lr it is given at each step."""
    from _gpu_common import GraphedBackprop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    twin.load_state_dict(model.state_dict())
    system = GraphedBackprop(model, (6,), 4, torch.device("cpu"), lr=1e-2, weight_decay=0.01, smoothing=0.1)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for lr in (1e-2, 1e-2, 3e-3, 5e-2):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        system.step(x, y, lr)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y, label_smoothing=0.1).backward()
        opt.step()
    for a, b in zip(system.model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
