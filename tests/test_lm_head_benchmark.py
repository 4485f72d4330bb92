"""``benchmarks/lm_head.py``'s targets and trade-off plot, on the committed H200 record's weight-chunk runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import lm_head  # noqa: E402
from _common import read_runs  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "lm_head.json"


def weight_chunk_rows() -> list[dict]:
    """The rows of the record's ``--weight-chunks`` runs (one per shape)."""
    return [r for run in read_runs(RECORD) if run["config"].get("weight_chunks") for r in run["results"]]


def rows_of(shape: str) -> list[dict]:
    return [r for r in weight_chunk_rows() if r["shape"] == shape]


def test_targets_take_the_fused_peers_and_the_floor() -> None:
    rows = rows_of("llama3-8b")
    by_name = {r["system"]: r for r in rows}
    for tag in ("", "+dh"):
        peers = [by_name[f"{p}{tag}"] for p in ("liger-adamw", "cce-adamw")]
        allowed_ms, allowed_mib = lm_head.targets(rows, tag)
        expected_ms = max(0.85 * min(p["step_ms"] for p in peers), 1.15 * by_name[f"floor{tag}"]["step_ms"])
        assert allowed_ms == pytest.approx(expected_ms)
        assert allowed_mib == min(p["peak_mib"] for p in peers)
    # the unfused HF head is no fused peer: its 20 GiB peak must not set the memory target
    assert lm_head.targets(rows, "")[1] < by_name["hf-adamw"]["peak_mib"] / 1.5


def test_targets_need_a_peer_and_the_floor() -> None:
    rows = [r for r in rows_of("smollm2") if not r["system"].startswith(("liger", "cce"))]
    assert lm_head.targets(rows, "") is None


def test_plot_tradeoff_writes_one_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = lm_head.plot_tradeoff(weight_chunk_rows(), tmp_path / "tradeoff.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_system_runs_in_a_fresh_process() -> None:
    # what a GPU run does for every system: the child measures one and prints its row
    from _common import fresh_process_json

    script = ROOT / "benchmarks" / "lm_head.py"
    row = fresh_process_json([sys.executable, str(script), "--smoke", "--one", "smoke:dad-fused"])
    assert row["system"] == "dad-fused" and row["sweep"] == "tokens" and row["step_ms"] > 0
    with pytest.raises(RuntimeError, match="exited with"):
        fresh_process_json([sys.executable, str(script), "--smoke", "--one", "smoke:no-such-system"])
