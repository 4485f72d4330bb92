"""``benchmarks/sft_gpu.py`` on CPU: the step profile of ``--profile-steps``, and what a failed run records."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_gpu  # noqa: E402
from _common import latest_results  # noqa: E402


def test_profile_steps_record_a_profile_and_leave_every_step_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    out = tmp_path / "run.json"
    monkeypatch.setattr(sys, "argv", ["sft_gpu.py", "--smoke", "--systems", "dad", "--modes", "full",
                                      "--profile-steps", "2", "--out", str(out)])
    sft_gpu.main()
    (row,) = latest_results(out)
    profile = row["profile"]
    assert profile["steps"] == 2 and profile["wall_ms_per_step"] > 0
    assert profile["kernel_launches_per_step"] == 0  # no CUDA on this machine
    assert any(op["op"] == "aten::mm" and op["calls_per_step"] > 0 for op in profile["top_host_ops"])
    assert row["steps"] == 6 and row["tokens_per_s"] > 0  # 2 warm-up + 2 profiled + 2 timed


def test_without_profile_steps_there_is_no_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    out = tmp_path / "run.json"
    monkeypatch.setattr(sys, "argv", ["sft_gpu.py", "--smoke", "--systems", "stock", "--modes", "full",
                                      "--out", str(out)])
    sft_gpu.main()
    (row,) = latest_results(out)
    assert "profile" not in row and row["steps"] == 6 and row["gradient_accumulation_steps"] == 1


def test_full_determinism_turns_on_deterministic_kernels_and_is_recorded(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    environ, rows = dict(os.environ), []
    try:
        for k in range(2):
            out = tmp_path / f"run{k}.json"
            monkeypatch.setattr(sys, "argv", ["sft_gpu.py", "--smoke", "--systems", "stock", "--modes", "full",
                                              "--full-determinism", "--out", str(out)])
            sft_gpu.main()
            rows += latest_results(out)
            # --smoke trains in this process: transformers switched the flag on here
            assert torch.are_deterministic_algorithms_enabled()
    finally:  # the flag and transformers' environment variables must not reach the other tests
        torch.use_deterministic_algorithms(False)
        os.environ.clear()
        os.environ.update(environ)
    assert [r["full_determinism"] for r in rows] == [True, True]
    assert rows[0]["losses"] == rows[1]["losses"]


def test_every_system_trains_one_micro_batch_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsloth's patched SFTConfig defaults gradient_accumulation_steps to 2 (twice the rows a step); the shared
    config sets 1 explicitly, so tokens/s counts the same work for every system."""
    trl = pytest.importorskip("trl")
    stock = trl.SFTConfig

    class UnslothLikeConfig(stock):  # type: ignore[misc, valid-type]
        def __init__(self, *args, gradient_accumulation_steps=2, **kwargs):
            super().__init__(*args, gradient_accumulation_steps=gradient_accumulation_steps, **kwargs)

    monkeypatch.setattr(trl, "SFTConfig", UnslothLikeConfig)
    args = argparse.Namespace(steps=2, batch=2, lr=1e-3, max_grad_norm=0.0, seq_len=8, full_determinism=False)
    assert UnslothLikeConfig(output_dir=str(tmp_path), use_cpu=True).gradient_accumulation_steps == 2
    for system in sft_gpu.SYSTEMS:
        assert sft_gpu.sft_config(system, args, torch.device("cpu"), str(tmp_path)).gradient_accumulation_steps == 1


def test_throughput_from_step_end_times() -> None:
    assert sft_gpu.throughput([0.0, 1.0, 2.0, 4.0], 10) == {"tokens_per_s": 7.5, "step_ms_median": 1000.0}
    assert sft_gpu.throughput([3.0], 10) == {"tokens_per_s": None, "step_ms_median": None}


def _grid_with(train_one: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str,
               repeats: int, out: Path | None = None) -> list[dict[str, object]]:
    """``run_grid`` over stock and dad at one shape and ``mode``, in process, each run being ``train_one``."""
    tokens = tmp_path / "tokens.pt"
    torch.save({"input_ids": torch.zeros(4, dtype=torch.int32)}, tokens)
    monkeypatch.setattr(sft_gpu, "train_one", train_one)
    monkeypatch.setattr(sft_gpu, "environment", lambda: {})
    args = argparse.Namespace(smoke=False, shapes=["smollm2-135m"], modes=[mode], systems=["stock", "dad"],
                              in_process=True, tokens=tokens, repeats=repeats, out=out)
    return sft_gpu.run_grid(args, torch.device("cpu"))


def test_a_failed_run_keeps_its_traceback_and_the_models_dtypes(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A system whose training raises leaves a row with the error, the end of its traceback and the model's
    parameter dtypes per module, and the grid goes on."""
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(4, 2),
                                 "layers": torch.nn.ModuleList([torch.nn.ModuleDict(
                                     {"norm": torch.nn.LayerNorm(2), "q_proj": torch.nn.Linear(2, 2)})])})
    model["layers"][0]["q_proj"].to(torch.bfloat16)
    assert sft_gpu.param_dtypes_by_module(model) == {
        "embed_tokens": ["torch.float32"], "norm": ["torch.float32"], "q_proj": ["torch.bfloat16"]}

    def failing(system: str, *args: object) -> dict[str, object]:
        try:
            raise RuntimeError("expected mat1 and mat2 to have the same dtype")
        except RuntimeError as exc:
            facts = sft_gpu.model_facts(model, system, torch.device("cpu"))
            raise sft_gpu.TrainingFailed(exc, "Traceback: in failing", facts) from exc

    rows = _grid_with(failing, monkeypatch, tmp_path, mode="full", repeats=1)
    assert [r["system"] for r in rows] == ["stock", "dad"]
    for row in rows:
        assert row["error"] == "RuntimeError: expected mat1 and mat2 to have the same dtype"
        assert row["traceback"] == "Traceback: in failing"
        assert row["param_dtypes_by_module"]["q_proj"] == ["torch.bfloat16"]


def test_repeats_run_round_robin_and_the_table_gives_their_median(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    rates = iter([10.0, 40.0, 30.0, 20.0, 20.0, 50.0])

    def trained(system: str, shape: str, mode: str, *_: object) -> dict[str, object]:
        return {"system": system, "shape": shape, "mode": mode, "steps": 2, "tokens_per_s": next(rates),
                "step_ms_median": 1e3 / 8, "peak_mib": 1.0, "losses": [2.0, 1.0], "loss_steps": [1, 2], "wall_s": 1.0}

    rows = _grid_with(trained, monkeypatch, tmp_path, mode="lora", repeats=3)
    assert [(r["system"], r["repeat"]) for r in rows] == [(s, k) for k in range(3) for s in ("stock", "dad")]
    merged = {r["system"]: r for r in sft_gpu.median_of_repeats(rows)}
    assert merged["stock"]["tokens_per_s"] == 20.0 and merged["stock"]["tokens_per_s_runs"] == [10.0, 30.0, 20.0]
    assert merged["dad"]["tokens_per_s"] == 40.0 and merged["dad"]["repeats"] == 3
    assert "| 20 (10-30, 3 runs) |" in sft_gpu.summary_table(rows)


def test_out_holds_every_finished_run_while_the_grid_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A grid killed by a time limit keeps the trainings it finished: ``--out`` is rewritten after every one."""
    out = tmp_path / "part.json"
    seen: list[list[str]] = []

    def trained(system: str, shape: str, mode: str, *_: object) -> dict[str, object]:
        seen.append([r["system"] for r in latest_results(out)] if out.exists() else [])
        return {"system": system, "shape": shape, "mode": mode, "tokens_per_s": 1.0, "peak_mib": 1.0, "wall_s": 1.0,
                "losses": [1.0], "loss_steps": [1]}

    rows = _grid_with(trained, monkeypatch, tmp_path, mode="full", repeats=2, out=out)
    assert seen == [[], ["stock"], ["stock", "dad"], ["stock", "dad", "stock"]]
    assert latest_results(out) == rows


def test_the_loss_gap_is_the_largest_over_every_pair_of_runs() -> None:
    def run(system: str, losses: list[float]) -> dict[str, object]:
        return {"system": system, "shape": "s", "mode": "full", "loss_steps": [1, 2], "losses": losses}

    records = [run("stock", [2.0, 1.0]), run("dad", [2.0, 1.01]), run("stock", [2.0, 0.98]), run("dad", [2.0, 1.0])]
    # dad's first run against stock's second: |1.01 - 0.98| / 0.98
    assert sft_gpu.largest_loss_gap(records, records[1], "stock") == pytest.approx(0.03 / 0.98)
    assert sft_gpu.largest_loss_gap(records, records[0], "stock") == pytest.approx(0.02 / 0.98)  # stock against itself
    assert sft_gpu.largest_loss_gap(records[:2], records[0], "stock") is None


def test_plot_draws_a_record_beside_it_and_prints_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    rows = [{"system": system, "shape": "smollm2-135m", "mode": "lora", "steps": 2, "tokens_per_s": rate,
             "step_ms_median": 1.0, "peak_mib": 3.0, "losses": [2.0, 1.0], "loss_steps": [1, 2]}
            for system, rate in (("stock", 10.0), ("dad", 12.0), ("stock", 14.0), ("dad", 11.0))]
    records = tmp_path / "runs.json"
    records.write_text(json.dumps(rows))
    monkeypatch.setattr(sys, "argv", ["sft_gpu.py", "--plot", str(records)])
    sft_gpu.main()
    assert (tmp_path / "runs.png").stat().st_size > 0
    assert "| 12 (10-14, 2 runs) |" in capsys.readouterr().out


def test_repeats_below_one_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["sft_gpu.py", "--repeats", "0"])
    with pytest.raises(SystemExit):
        sft_gpu.parse_args()
    assert "--repeats 0: train each system at least once" in capsys.readouterr().err


def test_cuda_kernel_times_groups_the_cuda_events_by_kernel() -> None:
    from types import SimpleNamespace

    from _common import cuda_kernel_times

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cuda, name="gemm", device_time=3.0),
              SimpleNamespace(device_type=cpu, name="aten::mm", device_time=0.0),
              SimpleNamespace(device_type=cuda, name="gemm", device_time=5.0),
              SimpleNamespace(device_type=cuda, name="copy", device_time=1.0)]
    assert cuda_kernel_times(SimpleNamespace(events=lambda: events)) == {"gemm": [3.0, 5.0], "copy": [1.0]}
