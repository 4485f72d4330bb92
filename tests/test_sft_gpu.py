"""``benchmarks/sft_gpu.py`` on CPU: the step profile of ``--profile-steps``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_gpu  # noqa: E402


def test_profile_steps_record_a_profile_and_leave_every_step_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    out = tmp_path / "run.json"
    monkeypatch.setattr(sys, "argv", ["sft_gpu.py", "--smoke", "--systems", "dad", "--modes", "full",
                                      "--profile-steps", "2", "--out", str(out)])
    sft_gpu.main()
    (row,) = json.loads(out.read_text())
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
    (row,) = json.loads(out.read_text())
    assert "profile" not in row and row["steps"] == 6


def test_throughput_from_step_end_times() -> None:
    assert sft_gpu.throughput([0.0, 1.0, 2.0, 4.0], 10) == {"tokens_per_s": 7.5, "step_ms_median": 1000.0}
    assert sft_gpu.throughput([3.0], 10) == {"tokens_per_s": None, "step_ms_median": None}
